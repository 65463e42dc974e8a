"""`PageAllocator`: KV-cache pages, their reference counts and the full-page prefix cache (no JAX).

1. The cache holds `num_pages` pages of `page_size` token slots. Page 0 is the null page: it is
   never handed out, so the runner can pad page tables (and route padding tokens' cache writes)
   to it. The usable pages are 1 .. num_pages-1.
2. `allocate(n)` hands out n pages with reference count 1, taken from the free list first and
   then by evicting the least-recently-used cached page. `free(pages)` drops one reference each.
3. Prefix cache: a page whose page_size tokens are all computed gets a chain hash
   h_i = H(h_{i-1}, tokens of page i) (h_{-1} = 0, or a hash of the request's `cache_salt`:
   `salt_root`), so a hash names the page's whole prefix (and salt).
   `register_full_pages` records hash -> page. A cached page whose last reference is dropped is
   not freed but becomes *evictable* (an LRU); it still counts as free capacity.
4. `match_prefix(token_ids)` walks the chain of a new sequence and takes a reference on every
   leading page already in the cache (reviving evictable ones), stopping at the first miss.
5. KV events (`jaxinfer/engine/kv_events.py`): when `events` is a list, every page the cache
   stores appends `(hash, parent hash, its tokens)` and every hash it drops (eviction,
   `forget`) appends the hash; the engine core takes them after each step.

NOTE: every usable page is in exactly one state: free (refcount 0, no hash), evictable (refcount
0, hashed, in the LRU) or referenced (refcount > 0, hashed or not). `check_invariants` checks it.
NOTE: a hash maps to at most one page. When two sequences compute the same page concurrently the
first registration wins and the other copy stays an ordinary (uncached) page.
"""

from __future__ import annotations

import array
import collections
import hashlib
import sys
from collections.abc import Sequence

NULL_PAGE = 0


class OutOfPagesError(RuntimeError):
    """More pages were asked for than are free or evictable."""


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    """Stable 128-bit hash of (parent hash, page tokens): identical across processes and runs.

    The hashed bytes are the parent as 16 little-endian bytes, then each token as a little-endian
    int64 (packed by `array`, one C call: a page crossing is on the decode step's host path)."""
    packed = array.array("q", tokens)
    if _BIG_ENDIAN:
        packed.byteswap()
    return int.from_bytes(
        hashlib.blake2b(parent.to_bytes(16, "little") + packed.tobytes(), digest_size=16).digest(),
        "little",
    )


_BIG_ENDIAN = sys.byteorder == "big"


def salt_root(cache_salt: str | None, lora_int_id: int = 0) -> int:
    """The chain's parent of a request's first page: 0 without a salt, else a 128-bit hash of
    the salt, so pages cached under one salt are found only by requests with that salt; a LoRA
    adapter (`lora_int_id` > 0) salts it too: two adapters (or one and the base) never share."""
    if not cache_salt and not lora_int_id:
        return 0
    key = b"cache_salt\0" + (cache_salt or "").encode()
    if lora_int_id:
        key += b"\0lora\0" + str(lora_int_id).encode()
    digest = hashlib.blake2b(key, digest_size=16).digest()
    return int.from_bytes(digest, "little")


class PageAllocator:
    """Reference-counted pages with an LRU prefix cache of full pages.

    `page_hashes` arguments are per-sequence chain state: `page_hashes[i]` is the chain hash of
    page i of the sequence's *current* page table, for the leading pages already matched or
    offered to the cache. The methods extend it in place; clear it when the page table is freed.
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refcount = [0] * num_pages
        self._free: collections.deque[int] = collections.deque(range(1, num_pages))
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._hash_to_page: dict[int, int] = {}
        self._page_to_hash: dict[int, int] = {}
        self.events: list | None = None  # KV events to publish (None: not recorded)

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages `allocate` can hand out now: free plus evictable cached pages."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        return len(self._page_to_hash)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.num_free_pages:
            raise OutOfPagesError(f"asked for {n} pages, only {self.num_free_pages} free")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                h = self._page_to_hash.pop(page)
                del self._hash_to_page[h]
                if self.events is not None:
                    self.events.append(h)
            self._refcount[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Drop one reference on each page.

        NOTE: pages are released last-to-first, so a sequence's tail pages are evicted before
        its head pages (heads are the ones other prompts are likely to share).
        """
        for page in reversed(pages):
            if not 0 < page < self.num_pages or self._refcount[page] <= 0:
                raise ValueError(f"free of page {page} which is not allocated")
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                if page in self._page_to_hash:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def match_prefix(
        self, token_ids: Sequence[int], page_hashes: list[int] | None = None, root: int = 0
    ) -> list[int]:
        """Take a reference on the longest run of cached leading full pages of `token_ids`
        (`root`: the first page's parent, `salt_root` of the request's cache salt).

        NOTE: never covers the whole sequence: at most (len-1)//page_size pages, so at least one
        token is left to compute and the last position's logits exist.
        """
        if page_hashes is None:
            page_hashes = []
        elif page_hashes:
            raise ValueError("match_prefix needs an empty page table (page_hashes is not empty)")
        if not self.enable_prefix_caching:
            return []
        pages: list[int] = []
        parent = root
        ps = self.page_size
        for i in range((len(token_ids) - 1) // ps):
            h = chain_hash(parent, token_ids[i * ps : (i + 1) * ps])
            page = self._hash_to_page.get(h)
            if page is None:
                break
            pages.append(page)
            page_hashes.append(h)
            parent = h
        for page in pages:
            if self._refcount[page] == 0:
                del self._evictable[page]
            self._refcount[page] += 1
        return pages

    def register_full_pages(
        self,
        request_token_ids: Sequence[int],
        page_ids: Sequence[int],
        num_computed_tokens: int,
        page_hashes: list[int] | None = None,
        root: int = 0,
    ) -> None:
        """Offer to the cache every page of `page_ids` that is full and computed (idempotent;
        `root`: the first page's parent, as in `match_prefix`).

        Only pages past `len(page_hashes)` are hashed, so with persistent chain state each page
        is hashed once; with `page_hashes=None` the chain is recomputed from page 0.
        """
        if not self.enable_prefix_caching:
            return
        if page_hashes is None:
            page_hashes = []
        if num_computed_tokens > len(request_token_ids):
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} > {len(request_token_ids)} tokens"
            )
        num_full = num_computed_tokens // self.page_size
        if num_full > len(page_ids):
            raise ValueError(
                f"{num_full} full pages computed but the page table has {len(page_ids)}"
            )
        ps = self.page_size
        for i in range(len(page_hashes), num_full):
            parent = page_hashes[i - 1] if i else root
            h = chain_hash(parent, request_token_ids[i * ps : (i + 1) * ps])
            page_hashes.append(h)
            page = page_ids[i]
            if self._refcount[page] <= 0:
                raise ValueError(f"register of page {page} which is not allocated")
            old = self._page_to_hash.get(page)
            if old is not None:
                if old != h:
                    raise ValueError(f"page {page} is cached with other tokens")
                continue
            if h not in self._hash_to_page:
                self._hash_to_page[h] = page
                self._page_to_hash[page] = h
                if self.events is not None:
                    self.events.append((h, parent, request_token_ids[i * ps : (i + 1) * ps]))

    def forget(self, pages: Sequence[int]) -> None:
        """Drop these pages from the prefix cache (their K/V may be wrong: a failed step wrote
        them). Referenced pages stay allocated, unhashed; evictable ones become free."""
        for page in pages:
            h = self._page_to_hash.pop(page, None)
            if h is None:
                continue
            del self._hash_to_page[h]
            if self.events is not None:
                self.events.append(h)
            if page in self._evictable:
                del self._evictable[page]
                self._free.append(page)

    def check_invariants(self) -> None:
        """Raise AssertionError if any page's bookkeeping is inconsistent (used by tests)."""

        def fail(msg: str) -> None:
            raise AssertionError(f"PageAllocator invariant broken: {msg}")

        free = set(self._free)
        if len(free) != len(self._free):
            fail("duplicate page in the free list")
        if NULL_PAGE in free or NULL_PAGE in self._evictable or self._refcount[NULL_PAGE]:
            fail("the null page is in use")
        for page in range(1, self.num_pages):
            ref = self._refcount[page]
            states = (page in free) + (page in self._evictable) + (ref > 0)
            if ref < 0 or states != 1:
                fail(
                    f"page {page}: refcount {ref}, free {page in free}, "
                    f"evictable {page in self._evictable}"
                )
            if page in free and page in self._page_to_hash:
                fail(f"free page {page} is still hashed")
            if page in self._evictable and page not in self._page_to_hash:
                fail(f"evictable page {page} has no hash")
        if len(self._hash_to_page) != len(self._page_to_hash):
            fail("hash maps differ in size")
        for h, page in self._hash_to_page.items():
            if self._page_to_hash.get(page) != h:
                fail(f"hash -> page {page} -> other hash")
