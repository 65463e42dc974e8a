"""PageAllocator: refcounts, the null page, the hash-chained prefix cache and its LRU (pure Python)."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from jaxinfer.engine.page_allocator import (
    NULL_PAGE,
    OutOfPagesError,
    PageAllocator,
    chain_hash,
    salt_root,
)


def test_allocate_free_refcount() -> None:
    a = PageAllocator(num_pages=5, page_size=4)
    assert a.num_usable_pages == a.num_free_pages == 4
    pages = a.allocate(3)
    assert len(set(pages)) == 3 and NULL_PAGE not in pages
    assert [a.refcount(p) for p in pages] == [1, 1, 1]
    assert a.num_free_pages == 1
    a.free(pages[:1])
    assert a.refcount(pages[0]) == 0 and a.num_free_pages == 2
    with pytest.raises(OutOfPagesError):
        a.allocate(3)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(pages[:1])
    with pytest.raises(ValueError, match="not allocated"):
        a.free([NULL_PAGE])
    a.free(pages[1:])
    assert a.num_free_pages == 4 and a.allocate(0) == []
    a.check_invariants()


def test_null_page_is_never_handed_out() -> None:
    a = PageAllocator(num_pages=9, page_size=1)
    assert sorted(a.allocate(8)) == list(range(1, 9))
    assert a.num_free_pages == 0


def test_bad_construction() -> None:
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(num_pages=1, page_size=4)
    with pytest.raises(ValueError, match="page_size"):
        PageAllocator(num_pages=4, page_size=0)


def _cached_sequence(a: PageAllocator, tokens: list[int]) -> list[int]:
    """Allocate and compute `tokens` as one sequence, register its full pages; keep the refs."""
    pages = a.allocate(-(-len(tokens) // a.page_size))
    a.register_full_pages(tokens, pages, len(tokens))
    return pages


def test_prefix_match_takes_references_and_never_covers_everything() -> None:
    a = PageAllocator(num_pages=10, page_size=4)
    toks = list(range(100, 110))  # 2 full pages + 2 tokens
    pages = _cached_sequence(a, toks)
    assert a.num_cached_pages == 2
    assert a.match_prefix(toks) == pages[:2]
    assert [a.refcount(p) for p in pages] == [2, 2, 1]
    assert a.match_prefix(toks[:9]) == pages[:2]
    # 8 tokens are exactly 2 full pages, but one token must stay to compute: only 1 page.
    assert a.match_prefix(toks[:8]) == pages[:1]
    assert a.match_prefix(toks[:4]) == []
    # the chain: page 1's tokens behind a different page 0 do not match
    assert a.match_prefix([0, 0, 0, 0] + toks[4:]) == []
    a.check_invariants()


def test_evictable_pages_and_lru_order() -> None:
    a = PageAllocator(num_pages=7, page_size=2)  # 6 usable pages
    seq_a, seq_b = [1, 2, 3, 4, 5], [7, 8, 9, 10, 11]
    pages_a, pages_b = _cached_sequence(a, seq_a), _cached_sequence(a, seq_b)
    a.free(pages_a)
    a.free(pages_b)
    assert a.num_free_pages == 6 and a.num_cached_pages == 4
    # touch A again: its pages become the most recently used
    a.free(a.match_prefix(seq_a))
    a.check_invariants()
    # uncached free pages go first, then cached ones least recently used first, tails first
    assert sorted(a.allocate(2)) == sorted([pages_a[2], pages_b[2]])
    assert a.allocate(1) == [pages_b[1]]
    assert a.num_cached_pages == 3 and a.match_prefix(seq_b) == [pages_b[0]]
    a.free([pages_b[0]])  # B's head is now the most recent
    assert a.allocate(3) == [pages_a[1], pages_a[0], pages_b[0]]
    assert a.num_cached_pages == 0 and a.num_free_pages == 0
    a.check_invariants()


def test_duplicate_content_keeps_the_first_registration() -> None:
    a = PageAllocator(num_pages=9, page_size=2)
    toks = [5, 6, 7, 8, 9]
    first = _cached_sequence(a, toks)
    second = _cached_sequence(a, toks)
    assert a.num_cached_pages == 2
    a.free(second)
    assert a.num_free_pages == 8 - 3  # second's pages went straight back to the free list
    assert a.match_prefix(toks) == first[:2]
    a.check_invariants()


def test_register_is_idempotent_and_incremental() -> None:
    a = PageAllocator(num_pages=9, page_size=2)
    toks = list(range(7))
    pages = a.allocate(4)
    hashes: list[int] = []
    for computed in range(len(toks) + 1):
        a.register_full_pages(toks, pages, computed, hashes)
        a.register_full_pages(toks, pages, computed)
        assert len(hashes) == computed // 2 == a.num_cached_pages
    with pytest.raises(ValueError, match="other tokens"):
        a.register_full_pages([9] * 7, pages, 7)
    with pytest.raises(ValueError, match="page table"):
        a.register_full_pages(toks, pages[:1], 6)
    a.check_invariants()


def test_prefix_caching_disabled() -> None:
    a = PageAllocator(num_pages=5, page_size=2, enable_prefix_caching=False)
    pages = _cached_sequence(a, [1, 2, 3, 4, 5])
    assert a.num_cached_pages == 0 and a.match_prefix([1, 2, 3, 4, 5]) == []
    a.free(pages)
    assert a.num_free_pages == 4
    a.check_invariants()


def test_random_operations_keep_invariants() -> None:
    rng = random.Random(0)
    ps = 3
    a = PageAllocator(num_pages=24, page_size=ps)
    content: dict[int, tuple[int, ...]] = {}  # what each computed full page holds
    seqs: list[dict] = []  # live sequences: tokens, pages, computed, hashes
    hits = evictions = 0

    def check() -> None:
        a.check_invariants()
        refs = [0] * a.num_pages
        for s in seqs:
            for p in s["pages"]:
                refs[p] += 1
        assert refs == [a.refcount(p) for p in range(a.num_pages)]

    for _ in range(3000):
        op = rng.random()
        if op < 0.3 or not seqs:
            # a new sequence drawn from a tiny alphabet so that prefixes repeat
            toks = [rng.randrange(2) for _ in range(rng.randint(1, 14))]
            hashes: list[int] = []
            pages = a.match_prefix(toks, hashes)
            assert len(pages) * ps < len(toks)
            hits += len(pages)
            for i, p in enumerate(pages):
                assert content[p] == tuple(toks[i * ps : (i + 1) * ps])
            seqs.append(
                {"tokens": toks, "pages": pages, "computed": len(pages) * ps, "hashes": hashes}
            )
        elif op < 0.75:
            s = rng.choice(seqs)
            if s["computed"] == len(s["tokens"]):
                s["tokens"].append(rng.randrange(2))
            target = rng.randint(s["computed"] + 1, len(s["tokens"]))
            need = -(-target // ps) - len(s["pages"])
            if need > a.num_free_pages:
                continue
            cached = a.num_cached_pages
            s["pages"] += a.allocate(max(need, 0))
            evictions += cached - a.num_cached_pages
            for pos in range(s["computed"], target):
                if pos % ps == ps - 1:
                    page = s["pages"][pos // ps]
                    content[page] = tuple(s["tokens"][pos - ps + 1 : pos + 1])
            s["computed"] = target
            a.register_full_pages(s["tokens"], s["pages"], target, s["hashes"])
        else:
            s = seqs.pop(rng.randrange(len(seqs)))
            a.free(s["pages"])
        check()
    while seqs:
        a.free(seqs.pop()["pages"])
    check()
    assert a.num_free_pages == a.num_usable_pages
    assert hits > 500 and evictions > 100, (hits, evictions)


def test_chain_hash_bytes_are_fixed() -> None:
    """The hashed bytes: parent as 16 little-endian bytes, then each token as a little-endian
    int64 (BLAKE2b, 16-byte digest): the same on every machine and across versions."""
    parent, tokens = (1 << 127) + 12345, [0, 1, 49151, 2**40, 7]
    want = hashlib.blake2b(
        parent.to_bytes(16, "little") + struct.pack("<5q", *tokens), digest_size=16
    ).digest()
    assert chain_hash(parent, tokens) == int.from_bytes(want, "little")
    assert chain_hash(0, []) == int.from_bytes(
        hashlib.blake2b(bytes(16), digest_size=16).digest(), "little"
    )


def test_cache_salt_pages_are_found_only_under_the_same_salt() -> None:
    alloc = PageAllocator(16, 4)
    tokens = list(range(1, 14))  # 3 full pages + 1 token
    pages = alloc.allocate(4)
    alloc.register_full_pages(tokens, pages, 12, root=salt_root("tenant-a"))
    assert salt_root(None) == salt_root("") == 0 and salt_root("a") != salt_root("b")
    assert alloc.match_prefix(tokens, root=salt_root("tenant-b")) == []
    assert alloc.match_prefix(tokens) == []  # unsalted requests miss salted pages too
    assert alloc.match_prefix(tokens, root=salt_root("tenant-a")) == pages[:3]
