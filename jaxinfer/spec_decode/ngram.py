"""`NgramProposer`: prompt-lookup proposals from the request's own tokens (host only, no JAX).

1. Take the last n tokens of the sequence (prompt + known outputs), n from `prompt_lookup_max`
   down to `prompt_lookup_min`.
2. Find the most recent earlier occurrence of that n-gram (one vectorized comparison of every
   n-token window); the tokens that followed it are the proposal, at most k of them.
3. No occurrence at any n: no proposal (the request decodes one token this step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min={prompt_lookup_min} <= "
                f"prompt_lookup_max={prompt_lookup_max}"
            )
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier match of the sequence's suffix."""
        total = len(token_ids)
        if k < 1 or total < self.min_n + 1:
            return []
        ids = np.asarray(token_ids, np.int64)  # i64[L]
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. L-n-1: each ends before the suffix's last token, so a match
            # has at least one token after it.
            windows = sliding_window_view(ids[:-1], n)  # i64[L - n, n]
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return ids[start : start + k].tolist()
        return []

    def warmup(self) -> int:
        """Programs compiled (none: host only)."""
        return 0

    def propose_batch(self, batch: Sequence[tuple[Any, int]]) -> list[list[int]]:
        """The engine core's call: (request, k) pairs -> each request's proposal (at most k)."""
        return [self.propose(req.all_token_ids, k) for req, k in batch]
