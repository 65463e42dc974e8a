"""Multi-step scheduling around the scheduler (`EngineConfig.num_scheduler_steps`; no JAX).

A decode step costs the host a fixed share (schedule, build the inputs, call the program, read
and apply its ids) however few tokens it computes: on a single stream that share is a fifth of
each token on a 2-core CPU (BENCHMARKS.md). With `num_scheduler_steps` N > 1, a step whose every
request is a plain decode runs up to N decode steps in one program (`programs.burst_program`:
each step feeds the ids it sampled to the next on the device), and the host pays its share once
for all of them, as vLLM's former multi-step scheduling did.

1. `num_steps(scheduler)` (called by `Scheduler.schedule` before it visits the running
   requests): N, capped so that no request passes its length limit, when nobody waits or was
   preempted (a burst would hold a new prompt back N steps), every running request is a decode
   of one known or pending token that may run in a burst (`Request.may_burst`: no token masks, no
   images), the token budget holds them all and the free pages hold every one's
   N tokens; else 1 (a plain step). The schedule then gives each decode pages for its N tokens
   and N pending tokens (`SchedulerOutput.num_steps`).
2. `update(sched, out, allocators, finish)` (`Scheduler.update` of such a step): each request's
   ids of the N steps are appended in order under the stop rules; a request that stops drops the ids
   after its stop (their K/V lands in pages it frees), and pages the known tokens filled enter
   the prefix cache.

Each id is the one a plain step would sample: the same sampling rows, the penalty state counts
every fed id, the random counter of a token is its position. Async scheduling works as for plain
steps (the next step is scheduled with the burst's N tokens pending); a request that stops early
wastes at most the rest of its burst and the next one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from jaxinfer.engine.page_allocator import PageAllocator
from jaxinfer.engine.request import RequestStatus
from jaxinfer.engine.types import RequestUpdate, RunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from jaxinfer.engine.scheduler import Scheduler


def num_steps(scheduler: Scheduler) -> int:
    """The steps the next schedule runs in one program (1: a plain step; module docstring, 1)."""
    n = scheduler.num_scheduler_steps
    running = scheduler.running
    if n < 2 or not running or scheduler.num_waiting or len(scheduler.allocators) > 1:
        return 1
    decodes = []
    for req in running:
        pending, num_out = req.num_pending_tokens, len(req.output_token_ids)
        if pending and num_out + pending >= req.length_limit:
            continue  # its pending token finishes it: not scheduled
        num_prompt = len(req.prompt_token_ids)
        total = num_prompt + num_out + pending
        start = req.num_computed_tokens
        if start + 1 != total or start < num_prompt or not req.may_burst:
            return 1
        n = min(n, req.length_limit - num_out - pending)
        decodes.append((req, total))
    if n < 2 or not decodes or len(decodes) > scheduler.max_num_batched_tokens:
        return 1
    alloc = scheduler.allocator
    size = alloc.page_size
    need = sum(max(0, -(-(total + n - 1) // size) - len(req.page_ids)) for req, total in decodes)
    return n if need <= alloc.num_free_pages else 1


def update(
    sched: SchedulerOutput,
    out: RunnerOutput,
    allocators: Sequence[PageAllocator],
    finish: Callable[..., None],
) -> list[RequestUpdate]:
    """`Scheduler.update` of a multi-step step (module docstring, 2); `finish` ends a request."""
    updates: list[RequestUpdate] = []
    steps, running = sched.num_steps, RequestStatus.RUNNING
    for s in sched.scheduled:
        req = s.request
        if req.status is not running:
            continue  # finished, aborted or preempted since: its ids are dropped
        if s.start_pos + 1 > req.num_known_tokens or req.num_pending_tokens < steps:
            raise RuntimeError(
                f"request {req.request_id!r}: update of a {steps}-step decode from position "
                f"{s.start_pos} with {req.num_known_tokens} known and {req.num_pending_tokens} "
                f"pending (update applied twice or out of order?)"
            )
        ids = out.step_token_ids.get(req.request_id)
        if ids is None or len(ids) != steps:
            raise RuntimeError(
                f"runner returned {ids!r} for {req.request_id!r}: {steps} ids expected "
                f"(one a step of the program)"
            )
        req.num_pending_tokens -= steps
        new, reason = req.append_outputs(ids)
        finished = reason is not None
        if finished:
            finish(req, *reason)
        alloc = allocators[s.replica]
        done = s.start_pos + steps  # tokens whose K/V the program wrote: all known now
        if (
            not finished
            and alloc.enable_prefix_caching
            and done >= (len(req.page_hashes) + 1) * alloc.page_size
        ):
            alloc.register_full_pages(
                req.known_tokens, req.page_ids, done, req.page_hashes, req.cache_root
            )
        updates.append(RequestUpdate(req, new, finished))
    return updates
