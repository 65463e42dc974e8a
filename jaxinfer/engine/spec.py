"""Speculative decoding around the scheduler: proposing drafts, fitting them, verifying them.

Drafting happens outside `Scheduler.schedule` (vLLM v1 style: propose after sampling, schedule
the stored drafts next step):
1. `propose`: once a step's tokens are known (its `Scheduler.update` applied) and the back-off
   rule lets the next step speculate, the engine core asks the proposer once for every running
   request that may speculate: its tokens are all known (no pending one), it decodes one token
   next, and it has no penalties or structured output. Each asks for at most K drafts, capped so
   that accepting all of them plus the bonus token stays within max_tokens and max_model_len
   (`cap`); the drafts are stored on the request (`Request.spec_token_ids`). Nothing here
   allocates target pages: a draft model keeps its K/V in a page pool of its own
   (`jaxinfer.spec_decode.draft`).
2. `fit` (called by `schedule` for each running request it visits): the stored drafts that fit
   the step - at most the token budget minus the one token each running request after it keeps,
   and none if the pages for the decode token and the drafts are not free (drafts never preempt
   anyone) - ride as extra query tokens of the request's decode
   (`ScheduledRequest.num_spec_tokens`), the scheduler allocating their pages with the decode
   token's. Drafts are consumed: a request not scheduled this step proposes anew next time.
3. `accept` (called by `Scheduler.update`): the runner's accepted prefix of a request's drafts,
   checked, then the bonus token are appended under the stop rules; the request's
   `num_computed_tokens` rolls back to the accepted drafts (the rejected tokens' K/V stays in its
   pages and is overwritten by its next step) and `SpecStats` counts the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jaxinfer.engine.page_allocator import PageAllocator
from jaxinfer.engine.request import Request
from jaxinfer.engine.types import RequestUpdate, RunnerOutput, ScheduledRequest, SpecStats

if TYPE_CHECKING:
    from jaxinfer.engine.scheduler import Scheduler


def cap(req: Request, k: int, max_model_len: int) -> int:
    """Drafts a running request may verify next step before the token budget (0: none): it
    decodes one known token, and accepting k drafts + the bonus token fits its limits."""
    if (
        req.num_pending_tokens
        or req.num_computed_tokens != req.num_tokens - 1
        or not req.may_speculate
    ):
        return 0
    return max(
        0,
        min(
            k,
            req.sampling.max_tokens - req.num_output_tokens - 1,
            max_model_len - req.num_tokens - 1,
        ),
    )


def propose(proposer: Any, scheduler: Scheduler) -> None:
    """Stores the next step's drafts on every running request (see the module docstring, step
    1); does nothing while the back-off rule keeps the next step from speculating."""
    if proposer is None or not scheduler.speculating():
        return
    k, max_model_len = scheduler.num_speculative_tokens, scheduler.max_model_len
    batch = []
    for req in scheduler.running:
        req.spec_token_ids = []
        n = cap(req, k, max_model_len)
        if n:
            batch.append((req, n))
    if not batch:
        return
    proposals = proposer.propose_batch(batch)
    if len(proposals) != len(batch):
        raise RuntimeError(
            f"proposer returned {len(proposals)} proposals for {len(batch)} requests"
        )
    for (req, n), drafts in zip(batch, proposals):
        drafts = list(drafts)[:n]
        if any(not isinstance(t, int) or t < 0 for t in drafts):
            raise RuntimeError(f"request {req.request_id!r}: proposer returned bad ids {drafts}")
        req.spec_token_ids = drafts


def fit(req: Request, n: int, budget: int, scheduler: Scheduler, alloc: PageAllocator) -> list[int]:
    """The stored drafts a running request about to compute `n` tokens verifies this step (and
    clears them): within the token `budget` it may use while the requests after it keep one
    each, and none unless `alloc` has the pages they need with the `n` tokens free (drafts never
    preempt anyone)."""
    drafts, req.spec_token_ids = req.spec_token_ids, []
    if n != 1 or not drafts:
        return []
    k = cap(req, scheduler.num_speculative_tokens, scheduler.max_model_len)
    drafts = drafts[: max(0, min(budget - 1, k))]
    end = req.num_computed_tokens + n + len(drafts)
    if -(-end // alloc.page_size) - len(req.page_ids) > alloc.num_free_pages:
        return []
    return drafts


def accept(
    s: ScheduledRequest,
    out: RunnerOutput,
    token: int,
    computed: int,
    alloc: PageAllocator,
    stats: SpecStats,
    finish: Callable[..., None],
) -> RequestUpdate:
    """`Scheduler.update` of a decode with drafts: its accepted drafts (a checked prefix of them)
    and the sampled `token` are appended token by token under the stop rules (`finish` ends the
    request); `computed` is the request's known tokens, to which its `num_computed_tokens` rolls
    back plus the accepted drafts (the rejected ones' K/V stays in its pages, overwritten by its
    next step). Pages the accepted drafts filled enter the prefix cache."""
    req = s.request
    accepted = out.accepted_draft_ids.get(req.request_id, [])
    drafts = s.token_ids[len(s.token_ids) - s.num_spec_tokens :]
    if accepted != drafts[: len(accepted)]:
        raise RuntimeError(
            f"request {req.request_id!r}: accepted {accepted} is not a prefix of the proposed "
            f"{drafts}"
        )
    req.num_computed_tokens = computed + len(accepted)
    stats.num_spec_steps += 1
    stats.num_draft_tokens += s.num_spec_tokens
    stats.num_accepted_tokens += len(accepted)
    req.num_pending_tokens -= 1
    new, reason = req.append_outputs(accepted + [token])
    if reason is not None:
        finish(req, *reason)
        return RequestUpdate(req, new, True)
    done = req.num_computed_tokens  # verified tokens only reach the prefix cache
    if (
        accepted
        and alloc.enable_prefix_caching
        and done >= (len(req.page_hashes) + 1) * alloc.page_size
    ):
        alloc.register_full_pages(
            req.known_tokens, req.page_ids, done, req.page_hashes, req.cache_root
        )
    return RequestUpdate(req, new, False)
