"""Per-step token masks of the engine core: structured output's grammars plus vLLM's
`allowed_token_ids` and `bad_words`, all through the sampler's one token-bitmask argument.

1. `TokenMasks(vocab_size, grammars)` lives in the engine core (`grammars`: the
   `StructuredOutputs` of a core with a tokenizer, else None). `add(request_id, sampling,
   payload)` registers a request: a grammar is proven off the step thread first (True: wait for
   `admit`), token lists are ready at once (False: schedule it now).
2. `allowed_token_ids` becomes one bitmask row, built once per request. `bad_words` arrive as
   token-id sequences (`SamplingParams.bad_words_token_ids`, tokenized by the front end as vLLM
   does: the word and the word after a space); a one-token word is always banned, a longer one
   bans its last token whenever the output ends with the rest of it (the tail kept by `advance`).
3. `fill(request_ids)` ANDs the grammar's row (all ones without one), the allowed row and the
   bad-word bans of each request: the sampler's `token_bitmask`, so a request with token lists
   rides the same split step as a grammar (async scheduling kept; no recompiles: the bitmask is
   a fixed `i32[S, ceil(V / 32)]` argument every sampler program already takes).

NOTE: a mask depends only on the output tokens accepted so far (the tail), so preemption and
prefix-cache hits need nothing, as for grammars.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.structured import bitmask_width


class TokenMasks:
    """The masked requests of an engine core (see the module docstring)."""

    def __init__(self, vocab_size: int, grammars: Any = None) -> None:
        self.vocab_size, self.grammars = vocab_size, grammars
        self.width = bitmask_width(vocab_size)
        self._allowed: dict[str, np.ndarray] = {}  # request id -> u32[width] allowed bits
        self._bad: dict[str, list[list[int]]] = {}  # request id -> banned id sequences
        self._tail: dict[str, list[int]] = {}  # request id -> its last output tokens
        self._lists: set[str] = set()  # requests with a token list

    @property
    def active(self) -> bool:
        return bool(self._lists) or (self.grammars is not None and self.grammars.active)

    @property
    def proving(self) -> bool:
        return self.grammars is not None and self.grammars.proving

    def has(self, request_id: str) -> bool:
        return request_id in self._lists or (
            self.grammars is not None and self.grammars.has(request_id)
        )

    def prepare(self) -> None:
        if self.grammars is not None:
            self.grammars.prepare()

    def add(self, request_id: str, sampling: SamplingParams, payload: Any = None) -> bool:
        """Registers a request's masks; True when its grammar is being proven (`admit` hands
        `payload` over later), False when it may be scheduled now."""
        if sampling.allowed_token_ids is not None:
            bits = np.zeros(self.width * 32, np.uint8)
            bits[np.asarray(sampling.allowed_token_ids, np.int64)] = 1
            self._allowed[request_id] = np.packbits(bits, bitorder="little").view(np.uint32)
        if sampling.bad_words_token_ids:
            self._bad[request_id] = [list(ids) for ids in sampling.bad_words_token_ids]
            self._tail[request_id] = []
        if request_id in self._allowed or request_id in self._bad:
            self._lists.add(request_id)
        if sampling.structured_outputs is None:
            return False
        if self.grammars is None:
            self.remove(request_id)
            raise ValueError("structured_outputs needs the engine core to have the tokenizer")
        self.grammars.add(request_id, sampling.structured_outputs, payload)
        return True

    def admit(self, *, wait: bool = False) -> list[Any]:
        return [] if self.grammars is None else self.grammars.admit(wait=wait)

    def take_rejected(self) -> list[tuple[str, str]]:
        rejected = [] if self.grammars is None else self.grammars.take_rejected()
        for rid, _ in rejected:
            self._drop_lists(rid)
        return rejected

    def _drop_lists(self, request_id: str) -> None:
        self._lists.discard(request_id)
        self._allowed.pop(request_id, None)
        self._bad.pop(request_id, None)
        self._tail.pop(request_id, None)

    def remove(self, request_id: str) -> bool:
        """Drops a request's masks; True if its grammar was still being proven."""
        self._drop_lists(request_id)
        return self.grammars is not None and self.grammars.remove(request_id)

    def advance(self, request_id: str, token_ids: list[int]) -> None:
        """Feeds the tokens the sampler chose (grammar matchers, bad-word tails)."""
        if self.grammars is not None:
            self.grammars.advance(request_id, token_ids)
        bad = self._bad.get(request_id)
        if bad is not None:
            keep = max(len(ids) for ids in bad) - 1
            tail = self._tail[request_id] + list(token_ids)
            self._tail[request_id] = tail[-keep:] if keep else []

    def fill(self, request_ids: list[str]) -> np.ndarray:
        """i32[len(request_ids), width] the next-token bitmask of each request."""
        if self.grammars is not None:
            bitmask = self.grammars.fill(request_ids)
        else:
            bitmask = np.full((len(request_ids), self.width), -1, np.int32)
        words = bitmask.view(np.uint32)
        for i, rid in enumerate(request_ids):
            if rid not in self._lists:
                continue
            allowed = self._allowed.get(rid)
            if allowed is not None:
                words[i] &= allowed
            for ids in self._bad.get(rid, ()):
                tail = self._tail[rid]
                prefix = ids[:-1]
                if not prefix or (len(tail) >= len(prefix) and tail[-len(prefix) :] == prefix):
                    t = ids[-1]
                    words[i, t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
        return bitmask
