"""A step's runner output applied to its requests (`Scheduler.update`, its module docstring's
step 8; no JAX). A multi-step step's is `jaxinfer.engine.multi_step.update`.

`apply(sched, out, allocators, spec_stats, finish)`, per scheduled request still running:
1. Pages the step's known tokens completed (a pending token's among them) enter the prefix cache.
2. A chunk that samples appends its sampled id (the pending token becomes known) and applies
   the stop rules (`Request.stop_reason_of`; `finish` ends the request); a decode with drafts
   goes to `spec.accept` (the accepted prefix, the rest rolled back); a chunk that does not
   sample appends nothing.
3. An update that does not follow its schedule (applied twice, or out of order) raises.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jaxinfer.engine import spec
from jaxinfer.engine.page_allocator import PageAllocator
from jaxinfer.engine.request import RequestStatus
from jaxinfer.engine.types import (
    RequestUpdate,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    SpecStats,
    new_tuple,
)


def apply(
    sched: SchedulerOutput,
    out: RunnerOutput,
    allocators: Sequence[PageAllocator],
    spec_stats: SpecStats,
    finish: Callable[..., None],
) -> list[RequestUpdate]:
    """The updates of one (single-step) step's requests (module docstring)."""
    updates: list[RequestUpdate] = []
    sampled, running = out.sampled_token_ids, RequestStatus.RUNNING
    caching = [a.enable_prefix_caching for a in allocators]
    page_size = allocators[0].page_size
    # NOTE: a hot loop: Request's properties are inlined, each ScheduledRequest is unpacked
    for s in sched.scheduled:
        req, token_ids, start, _, sample, replica, _, _, num_spec = s
        if req.status is not running:
            continue
        if num_spec or not sample:
            _apply_one(s, sampled, out, allocators[replica], spec_stats, finish, updates)
            continue
        # A sampling chunk without proposals (every row of a decode-heavy step).
        outputs = req.output_token_ids
        computed = start + len(token_ids)
        if computed > len(req.prompt_token_ids) + len(outputs) or req.num_pending_tokens < 1:
            out_of_order(s)
        if caching[replica] and computed >= (len(req.page_hashes) + 1) * page_size:
            # a page completed by a pending token
            allocators[replica].register_full_pages(
                req.known_tokens, req.page_ids, computed, req.page_hashes, req.cache_root
            )
        try:
            token = sampled[req.request_id]
        except KeyError:
            raise KeyError(f"runner returned no sampled token for {req.request_id!r}") from None
        req.num_pending_tokens -= 1
        outputs.append(token)
        if len(outputs) >= req.length_limit or token in req.stop_token_set:
            reason = req.stop_reason_of(token)  # None: min_tokens holds a stop back
            if reason is not None:
                finish(req, *reason)
                updates.append(RequestUpdate(req, [token], True))
                continue
        updates.append(new_tuple(RequestUpdate, (req, [token], False)))
    return updates


def out_of_order(s: ScheduledRequest) -> None:
    req = s.request
    raise RuntimeError(
        f"request {req.request_id!r}: update for tokens up to "
        f"{s.start_pos + len(s.token_ids) - s.num_spec_tokens} with {req.num_known_tokens} "
        f"known and {req.num_pending_tokens} pending (update applied twice or out of order?)"
    )


def _apply_one(
    s: ScheduledRequest,
    sampled: dict[str, int],
    out: RunnerOutput,
    alloc: PageAllocator,
    spec_stats: SpecStats,
    finish: Callable[..., None],
    updates: list[RequestUpdate],
) -> None:
    """`apply` of a chunk that does not sample, or of a decode with drafts."""
    req = s.request
    # every one of these tokens is known now (drafts are not the request's)
    computed = s.start_pos + len(s.token_ids) - s.num_spec_tokens
    if computed > req.num_known_tokens or (s.sample and req.num_pending_tokens < 1):
        out_of_order(s)
    if alloc.enable_prefix_caching and computed >= (len(req.page_hashes) + 1) * alloc.page_size:
        # a page completed by a pending token
        alloc.register_full_pages(
            req.known_tokens, req.page_ids, computed, req.page_hashes, req.cache_root
        )
    if s.sample:
        try:
            token = sampled[req.request_id]
        except KeyError:
            raise KeyError(f"runner returned no sampled token for {req.request_id!r}") from None
        updates.append(spec.accept(s, out, token, computed, alloc, spec_stats, finish))
