"""`DraftProposer`: a smaller model of the same vocabulary proposes K tokens, greedily.

It owns its params, a paged KV cache of its own (a `ModelRunner` over the draft model) and a
`PageAllocator` over that cache: a request's draft K/V lives in pages of the draft's own pool,
so proposing needs nothing of the target's page tables or allocator, and can run after a step's
tokens are known, before the next step is scheduled. The pool holds the target's page count plus
room for every sequence's K draft positions; should it run out (requests sharing prefix-cached
target pages hold separate draft pages), a request whose row cannot grow proposes nothing.

Flow of `propose_batch([(request, k), ...])`, called by the engine core once per step
(`jaxinfer.engine.spec.propose`) for every running request that may speculate next step:
  1. Bookkeeping: rows of requests that finished or were preempted since the last call are
     dropped and their pages freed (their draft K/V is recomputed from position 0 when they
     return).
  2. Each request's valid draft prefix is extended by the tokens it fed last time that the
     target then accepted (proposals that matched the request's real tokens); its row gets the
     pages its catch-up and the k - 1 fed proposals write.
  3. Catch-up + first proposal: one ragged draft step (several when the catch-up exceeds the
     token budget) computes every request's tokens from its valid prefix up to its last known
     token and greedily samples the first proposal.
  4. K - 1 decode steps batched over the requests that want more: each feeds its last proposal
     and samples the next.
Greedy proposals are point masses, so `rejection.accept`'s rule is the exact rejection-sampling
rule for any target sampling parameters; and the first j of k greedy proposals are the j
proposals, so the scheduler may keep a prefix of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxinfer.config import ModelConfig
from jaxinfer.engine.page_allocator import PageAllocator
from jaxinfer.engine.request import Request, RequestStatus
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.types import ScheduledRequest, SchedulerOutput
from jaxinfer.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@dataclasses.dataclass
class _DraftSeq:
    request: Request
    shadow: Request  # what the draft runner sees: same id and prompt, greedy
    page_ids: list[int]  # the row's pages in the draft's own pool
    pages_seen: int  # entries of page_ids the draft runner's row holds
    computed: int  # leading positions whose draft K/V hold the request's real tokens
    fed_from: int = 0  # position of the first proposal fed last time
    fed: list[int] = dataclasses.field(default_factory=list)  # proposals fed last time


def truncate(cfg: ModelConfig, params: Any, num_layers: int) -> tuple[ModelConfig, Any]:
    """The first `num_layers` decoder layers of a model (same embeddings, norm and head)."""
    if not 1 <= num_layers <= cfg.num_layers:
        raise ValueError(
            f"speculative_config.draft_num_layers={num_layers} must be in "
            f"[1, {cfg.num_layers}] (the draft model's layers)"
        )
    small = dataclasses.replace(
        cfg,
        num_layers=num_layers,
        layer_windows=cfg.layer_windows[:num_layers],
        moe_layers=cfg.moe_layers[:num_layers],
    )
    return small, dataclasses.replace(params, layers=tuple(params.layers[:num_layers]))


class DraftProposer:
    def __init__(
        self,
        cfg: ModelConfig,
        params: Any,
        *,
        num_speculative_tokens: int,
        page_size: int,
        num_pages: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        token_buckets: tuple[int, ...] | None = None,
        dtype: str = "float32",
        attention_backend: str | None = None,
        linear_backend: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.k = num_speculative_tokens
        self.budget = max_num_batched_tokens
        self.page_size = page_size
        # NOTE: a speculating request's draft row reaches at most K positions past the pages its
        # target holds (plus one page of rounding); rows hold more only for requests sharing
        # prefix-cached target pages or resumed mid-prefill (then a row may find no pages).
        pool = num_pages + max_num_seqs * (-(-num_speculative_tokens // page_size) + 1)
        self.allocator = PageAllocator(pool, page_size, enable_prefix_caching=False)
        self.runner = ModelRunner(
            cfg,
            params,
            page_size=page_size,
            num_pages=pool,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            token_buckets=token_buckets,
            dtype=dtype,
            attention_backend=attention_backend,
            linear_backend=linear_backend,
        )
        self._seqs: dict[str, _DraftSeq] = {}

    def warmup(self) -> int:
        return self.runner.warmup()

    def propose_batch(self, batch: Sequence[tuple[Request, int]]) -> list[list[int]]:
        """Up to k greedy draft tokens per (request, k) (see the module docstring)."""
        left = self._drop_stale({req.request_id: req for req, _ in batch})
        drafts: list[list[int]] = [[] for _ in batch]
        seqs: dict[int, _DraftSeq] = {}  # index in batch -> its row (rows that have pages)
        for i, (req, k) in enumerate(batch):
            seq = self._seq(req)
            tokens = seq.request.all_token_ids
            real = tokens[seq.fed_from : seq.fed_from + len(seq.fed)]
            agree = next(
                (j for j, (a, b) in enumerate(zip(seq.fed, real)) if a != b),
                min(len(seq.fed), len(real)),
            )
            if seq.fed and seq.computed == seq.fed_from:
                seq.computed += agree
            seq.fed = []
            seq.computed = min(seq.computed, len(tokens) - 1)
            # positions up to the last fed proposal: len(tokens) + k - 2
            need = -(-(len(tokens) + k - 1) // self.page_size) - len(seq.page_ids)
            if need > self.allocator.num_free_pages:
                self._release(req.request_id)
                left.append(req.request_id)
                continue
            if need > 0:
                seq.page_ids.extend(self.allocator.allocate(need))
            seqs[i] = seq
        for i, tok in self._catch_up(seqs, left).items():
            drafts[i].append(tok)
        for j in range(1, max(k for _, k in batch)):
            want = [i for i in seqs if len(drafts[i]) == j and batch[i][1] > j]
            if not want:
                break
            scheduled = []
            for i in want:
                seq = seqs[i]
                pos = len(seq.request.all_token_ids) + j - 1  # the proposal fed now
                scheduled.append(self._chunk(seq, [drafts[i][-1]], pos, True))
            out = self.runner.execute(SchedulerOutput(scheduled, len(scheduled), [], []))
            for i in want:
                drafts[i].append(out.sampled_token_ids[seqs[i].request.request_id])
        for i, seq in seqs.items():
            seq.fed_from = len(seq.request.all_token_ids)
            seq.fed = drafts[i][:-1]  # the last proposal is never fed (its K/V is not written)
        return drafts

    def _release(self, rid: str) -> None:
        """Drops a row, freeing its pages."""
        seq = self._seqs.pop(rid, None)
        if seq is not None:
            self.allocator.free(seq.page_ids)

    def _drop_stale(self, wanted: dict[str, Request]) -> list[str]:
        """Rows of requests that finished or were preempted (or whose id a new request took):
        dropped, their ids."""
        gone = [
            rid
            for rid, seq in self._seqs.items()
            if seq.request.status is not RequestStatus.RUNNING
            or wanted.get(rid, seq.request) is not seq.request
        ]
        for rid in gone:
            self._release(rid)
        return gone

    def _seq(self, req: Request) -> _DraftSeq:
        seq = self._seqs.get(req.request_id)
        if seq is None:
            shadow = Request(req.request_id, req.prompt_token_ids, _GREEDY)
            seq = self._seqs[req.request_id] = _DraftSeq(req, shadow, [], 0, 0)
        return seq

    def _chunk(
        self, seq: _DraftSeq, tokens: list[int], start: int, sample: bool
    ) -> ScheduledRequest:
        """One draft-runner chunk of `seq` (its row joins on the first chunk since it was made)."""
        is_new = seq.pages_seen == 0
        pages = seq.page_ids
        new_pages = list(pages) if is_new else list(pages[seq.pages_seen :])
        seq.pages_seen = len(pages)
        return ScheduledRequest(seq.shadow, tokens, start, new_pages, sample, 0, is_new, pages)

    def _catch_up(self, seqs: dict[int, _DraftSeq], gone: list[str]) -> dict[int, int]:
        """Computes every request's real tokens from its valid prefix to its last known token,
        in budget-sized ragged steps; returns index -> the first proposal."""
        first: dict[int, int] = {}
        todo = {i: seq.computed for i, seq in seqs.items()}
        finished = gone
        while todo:
            scheduled, budget, order = [], self.budget, []
            for i, start in list(todo.items()):
                if budget <= 0:
                    break
                seq = seqs[i]
                end = len(seq.request.all_token_ids)
                n = min(end - start, budget)
                tokens = seq.request.all_token_ids[start : start + n]
                scheduled.append(self._chunk(seq, tokens, start, start + n == end))
                order.append(i)
                budget -= n
                if start + n == end:
                    del todo[i]
                    seq.computed = end
                else:
                    todo[i] = start + n
            out = self.runner.execute(
                SchedulerOutput(scheduled, self.budget - budget, [], finished)
            )
            finished = []
            for i in order:
                rid = seqs[i].request.request_id
                if i not in todo and rid in out.sampled_token_ids:
                    first[i] = out.sampled_token_ids[rid]
        if finished:  # nothing was computed: still release the rows
            self.runner.execute(SchedulerOutput([], 0, [], finished))
        return first
