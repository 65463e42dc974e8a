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
   the step - at most the token budget minus the one token each running request after it keeps
   - ride as extra query tokens of the request's decode (`ScheduledRequest.num_spec_tokens`).
   The scheduler then allocates pages for the decode token and those drafts; if there are too
   few free pages it drops every draft rather than preempt anyone. Drafts are consumed: a
   request not scheduled this step proposes anew next time.
3. `verified`: the runner's accepted prefix of a request's drafts, checked; the request's
   `num_computed_tokens` rolls back to it (the rejected tokens' K/V stays in its pages and is
   overwritten by its next step) and `SpecStats` counts the step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxinfer.engine.request import Request
from jaxinfer.engine.types import RunnerOutput, ScheduledRequest, SpecStats

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


def fit(req: Request, n: int, budget: int, k: int, max_model_len: int) -> list[int]:
    """The stored drafts a running request about to compute `n` tokens verifies this step,
    given the token `budget` it may use while the requests after it keep one each; clears them."""
    drafts, req.spec_token_ids = req.spec_token_ids, []
    if n != 1 or not drafts:
        return []
    return drafts[: max(0, min(budget - 1, cap(req, k, max_model_len)))]


def verified(s: ScheduledRequest, out: RunnerOutput, computed: int, stats: SpecStats) -> list[int]:
    """The accepted drafts of `s` (a prefix of them); `computed` is the request's known tokens,
    to which its `num_computed_tokens` rolls back plus the accepted ones."""
    req = s.request
    accepted = out.accepted_draft_ids.get(req.request_id, [])
    drafts = s.token_ids[len(s.token_ids) - s.num_spec_tokens :]
    if accepted != drafts[: len(accepted)]:
        raise RuntimeError(
            f"request {req.request_id!r}: accepted {accepted} is not a prefix of the proposed "
            f"{drafts}"
        )
    # Roll back: K/V of the rejected drafts stays in the pages, overwritten later.
    req.num_computed_tokens = computed + len(accepted)
    stats.num_spec_steps += 1
    stats.num_draft_tokens += s.num_spec_tokens
    stats.num_accepted_tokens += len(accepted)
    return accepted
