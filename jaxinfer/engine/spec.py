"""The scheduler's speculative-decoding rules: room for proposals, filling it, verifying it.

1. `room`: a running request whose tokens are all known (no pending one) and that would decode
   one token may verify up to K proposed tokens - capped so that accepting all of them plus the
   bonus token stays within max_tokens and max_model_len, and so that the requests after it keep
   one token of the budget each (the scheduler allocates pages for them like any token, and
   reserves none rather than preempt anyone).
2. `fill_proposals`: after the running requests, one `proposer.propose_batch` call fills every
   reservation (a draft model writes its own K/V into those pages); the proposals become extra
   query tokens of the same step (`ScheduledRequest.num_spec_tokens`), and the unused room goes
   back to the budget of waiting requests.
3. `verified`: the runner's accepted prefix of a request's proposals, checked; the request's
   `num_computed_tokens` rolls back to it (the rejected tokens' K/V stays in its pages and is
   overwritten by its next step) and `SpecStats` counts the step.
"""

from __future__ import annotations

from typing import Any

from jaxinfer.engine.request import Request
from jaxinfer.engine.types import RunnerOutput, ScheduledRequest, SpecStats


def room(req: Request, n: int, budget: int, k: int, max_model_len: int) -> int:
    """Proposed tokens a running request about to compute `n` tokens may verify, given the
    token `budget` it may use while the requests after it keep one each (at most `k`)."""
    if (
        n != 1
        or req.num_pending_tokens
        or req.num_computed_tokens != req.num_tokens - 1
        or not req.may_speculate
    ):
        return 0
    return max(
        0,
        min(
            k,
            budget - 1,
            req.sampling.max_tokens - req.num_output_tokens - 1,
            max_model_len - req.num_tokens - 1,
        ),
    )


def fill_proposals(
    proposer: Any,
    reserved: list[tuple[list[ScheduledRequest], int, int]],  # (list, index of the decode, room)
) -> list[tuple[ScheduledRequest, int]]:
    """Asks the proposer once for every reservation, appends the proposals to the scheduled
    decodes (replacing them in their lists); returns (decode, unused reserved tokens) pairs."""
    if not reserved:
        return []
    proposals = proposer.propose_batch([(lst[j].request, k) for lst, j, k in reserved])
    if len(proposals) != len(reserved):
        raise RuntimeError(
            f"proposer returned {len(proposals)} proposals for {len(reserved)} requests"
        )
    unused = []
    for (lst, j, k), drafts in zip(reserved, proposals):
        s = lst[j]
        drafts = list(drafts)[:k]
        if any(not isinstance(t, int) or t < 0 for t in drafts):
            raise RuntimeError(
                f"request {s.request.request_id!r}: proposer returned bad ids {drafts}"
            )
        s = lst[j] = s._replace(token_ids=s.token_ids + drafts, num_spec_tokens=len(drafts))
        s.request.num_computed_tokens = s.start_pos + len(s.token_ids)  # update rolls back
        unused.append((s, k - len(drafts)))
    return unused


def verified(s: ScheduledRequest, out: RunnerOutput, computed: int, stats: SpecStats) -> list[int]:
    """The accepted proposals of `s` (a prefix of them); `computed` is the request's known
    tokens, to which its `num_computed_tokens` rolls back plus the accepted ones."""
    req = s.request
    accepted = out.accepted_draft_ids.get(req.request_id, [])
    drafts = s.token_ids[len(s.token_ids) - s.num_spec_tokens :]
    if accepted != drafts[: len(accepted)]:
        raise RuntimeError(
            f"request {req.request_id!r}: accepted {accepted} is not a prefix of the proposed "
            f"{drafts}"
        )
    # Roll back: K/V of the rejected proposals stays in the pages, overwritten later.
    req.num_computed_tokens = computed + len(accepted)
    stats.num_spec_steps += 1
    stats.num_draft_tokens += s.num_spec_tokens
    stats.num_accepted_tokens += len(accepted)
    return accepted
