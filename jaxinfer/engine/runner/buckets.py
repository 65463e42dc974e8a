"""The runner's shape policy: token, sequence, page and verify-row buckets, and the warmup plan.

Token counts, sequence counts, page-table widths and speculative verify rows are padded to a
small fixed set of sizes, so the set of compiled programs is known and `warmup` builds all of
them. Plain Python (no JAX).

1. Token buckets: 1, 2, 4, ... up to `max_num_batched_tokens` (the last bucket); the sequence
   bucket of a step follows from its token bucket (at most one sequence per token).
2. Page buckets: `pages_per_seq`, then quarters of it (`default_page_buckets`).
3. Verify-row widths of speculative steps: K, 2K, 4K, ... up to K x `spec_max_seqs`.
4. `warmup_plan()` lists every (token bucket, page bucket, prompt-logits variant, verify rows)
   program a request can need, in the order warmup compiles them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator


def default_page_buckets(pages_per_seq: int, *, floor: int = 64) -> tuple[int, ...]:
    """pages_per_seq, then quarters of it while they hold at least `floor` pages.

    A step's `page_indices` is `[S, bucket]`: with 128K tokens of context in 16-token pages a full
    table is 8192 ids per sequence (8 MiB to build and move per 256-sequence step), while short
    sequences need few. Quarters keep the compiled-program count small (x1 up to 255 pages,
    x2 up to 1023, ...); below `floor` pages a table costs too little to be worth a program.
    """
    buckets = [pages_per_seq]
    while buckets[-1] // 4 >= floor:
        buckets.append(buckets[-1] // 4)
    return tuple(sorted(buckets))


def default_token_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the token budget (which is always the last bucket)."""
    buckets = [1 << i for i in range(max(1, math.ceil(math.log2(max_num_batched_tokens))))]
    return tuple(
        sorted({b for b in buckets if b < max_num_batched_tokens} | {max_num_batched_tokens})
    )


class Buckets:
    """The bucket sets of one runner (see the module docstring)."""

    def __init__(
        self,
        *,
        max_num_batched_tokens: int,
        pages_per_seq: int,
        seqs_per_replica: int,
        token_buckets: tuple[int, ...] | None = None,
        page_buckets: tuple[int, ...] | None = None,
        pipeline: int = 1,
        num_speculative_tokens: int = 0,
        spec_max_seqs: int = 0,
    ) -> None:
        self.pages_per_seq, self.seqs_per_replica = pages_per_seq, seqs_per_replica
        self.token_buckets = token_buckets or default_token_buckets(max_num_batched_tokens)
        if self.token_buckets[-1] < max_num_batched_tokens:
            raise ValueError(
                f"largest token bucket {self.token_buckets[-1]} is below "
                f"max_num_batched_tokens={max_num_batched_tokens}"
            )
        self.page_buckets = tuple(sorted(set(page_buckets or default_page_buckets(pages_per_seq))))
        if self.page_buckets[-1] != pages_per_seq or self.page_buckets[0] < 1:
            raise ValueError(
                f"page_buckets={self.page_buckets} must be >= 1 and end at "
                f"max_model_len / page_size = {pages_per_seq}"
            )
        if pipeline > 1:
            # NOTE: a 1-token micro-batch takes the reference attention's single-token loop, which
            # reads the cache as a loop operand; the next tick's KV write into that cache then makes
            # XLA:CPU copy the whole cache. Micro-batches are padded to >= 2 tokens instead
            # (tests/test_pipeline.py guards the compiled programs).
            self.token_buckets = tuple(sorted({max(b, 2) for b in self.token_buckets}))
        self.num_speculative_tokens = num_speculative_tokens
        self.spec_max_seqs = max(1, spec_max_seqs)
        self.spec_widths: tuple[int, ...] = ()
        if num_speculative_tokens:
            widths, w = [], num_speculative_tokens
            while True:
                widths.append(w)
                if w >= num_speculative_tokens * max(1, spec_max_seqs):
                    break
                w *= 2
            self.spec_widths = tuple(widths)

    @property
    def decode_bucket(self) -> int:
        """The token bucket of a step in which every sequence of a replica decodes one token
        (the largest bucket a pure-decode step takes)."""
        return self.token_bucket(min(self.seqs_per_replica, self.token_buckets[-1]))

    def seq_bucket(self, num_tokens: int) -> int:
        return min(num_tokens, self.seqs_per_replica)

    def token_bucket(self, n: int) -> int:
        for b in self.token_buckets:
            if b >= n:
                return b
        raise ValueError(f"step of {n} tokens exceeds the largest bucket {self.token_buckets[-1]}")

    def spec_width(self, n: int) -> int:
        """Verify rows of a step that verifies `n` proposed tokens (0 for none)."""
        if n == 0:
            return 0
        for w in self.spec_widths:
            if w >= n:
                return w
        w = self.spec_widths[-1] if self.spec_widths else 1
        while w < n:  # more proposals than configured (a hand-built schedule): still correct
            w *= 2
        return w

    def page_bucket(self, n: int) -> int:
        for b in self.page_buckets:
            if b >= n:
                return b
        raise ValueError(
            f"a page table of {n} pages exceeds max_model_len / page_size = {self.pages_per_seq}"
        )

    def warmup_plan(self) -> Iterator[tuple[int, int, bool, int]]:
        """(token bucket, page bucket, all_logits, verify rows) of every program to compile."""
        largest = self.token_buckets[-1]
        for t_bucket in self.token_buckets:
            for p_bucket in self.page_buckets:
                for all_logits in (False, True):
                    yield t_bucket, p_bucket, all_logits, 0
            # Speculative steps of decoding requests only (a step that also prefills compiles
            # its program when it first runs): more proposals than the previous width, at
            # least one sequence per K of them, at most spec_max_seqs sequences.
            prev = 0
            for w in self.spec_widths:
                lo = prev + 1 + -(-(prev + 1) // self.num_speculative_tokens)
                hi = w + self.spec_max_seqs
                prev = w
                if (
                    not self.token_bucket(min(lo, largest))
                    <= t_bucket
                    <= self.token_bucket(min(hi, largest))
                ):
                    continue
                for p_bucket in self.page_buckets:
                    yield t_bucket, p_bucket, False, w
