"""`Scheduler`: continuous batching on the host (vLLM v1 style; no JAX).

Each engine step is `out = scheduler.schedule()` -> `runner.execute(out)` -> `scheduler.update(out,
runner_output)`. There are no prefill/decode phases: every request has `num_computed_tokens`
catching up to `num_tokens`, and one loop decides how many of its tokens to compute this step.

1. Budgets: at most `max_num_batched_tokens` tokens and `max_num_seqs` running requests per step.
2. Running requests first, in (priority, arrival) order: each gets min(tokens left to compute,
   token budget) tokens (capped by `long_prefill_token_threshold`), i.e. 1 for a decode and the
   next chunk for a request still mid-prefill. Pages are allocated to cover them; if there are
   too few, the last running request (lowest priority, newest) is preempted - pages freed,
   `num_computed_tokens` reset to 0, outputs kept, put at the front of the waiting queue - and
   the allocation retried. If the request itself is the last one, it is preempted and the loop
   stops. A resumed request recomputes prompt + outputs as one long prefill, then continues.
3. Then, if nothing was preempted, waiting requests (preempted ones first, then by (priority,
   arrival)) are admitted while budgets and pages allow: a prefix-cache match skips the cached
   leading pages (resumes included; `num_cached_tokens` records the first admission's hit; not
   for requests that must see every token computed: `prompt_logprobs`, and penalties, whose
   token counts the runner builds from the tokens it computes), the rest is chunked to the token
   budget, pages are allocated. The first request that does not fit stops admission (strict
   order, no preemption to admit). Images (`vision.inputs.fit_images`, steps 2 and 3): a chunk
   ends before an image that does not fit whole, or whose encoder tokens exceed what is left of
   `max_num_encoder_input_tokens` this step (its tokens attend to each other: one step).
4. `scheduled` lists decodes first, then prefill chunks. Each entry is a diff for the runner's
   persistent batch: a request that (re)joins (`is_new`) carries its whole page table, a running
   one only the pages allocated for this step; finished and preempted ids say which rows to drop.
5. Data parallelism: with one `PageAllocator` per data replica, every replica has its own page
   pool and its own budgets (`max_num_seqs / replicas` sequences, `max_num_batched_tokens`
   tokens: the runner pads every replica's step to the same bucket). A request is admitted to
   the least-loaded replica (fewest running sequences, then most free pages) and stays there
   until it finishes or is preempted; prefix-cache hits come only from that replica's pool, and
   preemption picks its victim within the replica.
6. Scheduling a request's tokens advances its `num_computed_tokens` at once, and a chunk that
   samples adds a pending token (`Request.num_pending_tokens`): the next `schedule` may run
   before this step's `update` (async scheduling, see `LLMEngine`), and then schedules the
   pending token as the request's next decode (its id fed on the device by the runner). A
   request whose pending token is certain to be its last (max_tokens, max_model_len) is not
   scheduled again; one that stops on EOS / a stop id wastes that one speculative step.
   Pages filled with known tokens enter the prefix cache when scheduled.
7. Speculative decoding (see `jaxinfer.engine.spec`): the scheduler never calls a proposer.
   The engine core stores each request's drafts on it (`Request.spec_token_ids`) after a step's
   `update`; `schedule` gives a decoding request the drafts that fit (`spec.fit`: the token
   budget, max_tokens, max_model_len, and free pages - drafts never preempt anyone, they are
   dropped), allocates their pages with its decode token's, and they ride as extra query tokens
   of the step; `update` rolls back to the accepted prefix (`spec.accept`). Back-off rule
   (`speculating`): a step speculates only while running + waiting requests <=
   `spec_max_requests` (`disable_by_batch_size`); requests with penalties never do (their token
   counts are built from the computed tokens). No page holding an unverified token is ever
   offered to the prefix cache.
8. `update` (`jaxinfer.engine.step_update`) registers pages a pending token filled, appends
   sampled tokens and applies the stop rules (`Request.stop_reason_of`: stop_token_ids / EOS,
   then max_tokens, then max_model_len).
   Finished requests free their pages at once and are reported in the next
   `SchedulerOutput.finished`. A request finished, aborted or preempted while a step holding it
   was still in flight is skipped by that step's `update` (its speculative K/V write lands in
   pages no live token reads).

9. Fault isolation (`jaxinfer.engine.isolation`): `preempt_all` preempts every running request
   (reported in the next `SchedulerOutput.preempted`, so the runner drops their rows) and `only`,
   when set, admits only the waiting requests it names (the others wait their turn).
10. Multi-step scheduling (`jaxinfer.engine.multi_step`, `num_scheduler_steps` N > 1): when
   every running request is a plain decode and nobody waits, each gets pages and N pending
   tokens for N steps that one program runs (`SchedulerOutput.num_steps`); `update` appends
   their N ids under the stop rules.

NOTE: `add_request` (`Request.prepare`) rejects a request whose K/V could never fit in the whole
cache, so the oldest running request can always make progress and preemption cannot livelock.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import time
from collections.abc import Iterator, Sequence

from jaxinfer.engine import multi_step, spec, step_update
from jaxinfer.engine.page_allocator import PageAllocator
from jaxinfer.engine.request import FINISH_REASONS, PENDING_TOKEN, Request, RequestStatus
from jaxinfer.engine.types import (
    RequestUpdate,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    SpecStats,
    new_tuple,
)
from jaxinfer.lora.slots import LoRASlots
from jaxinfer.vision.inputs import check_image_budget, fit_images


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(slots=True)
class _Plan:
    """What one `schedule` builds up: decodes first, then prefill chunks (step 4), the ids it
    preempted, and the encoder tokens left to this step's images."""

    decodes: list[ScheduledRequest]
    chunks: list[ScheduledRequest]
    preempted: list[str]
    enc_left: int


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator | list[PageAllocator],
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        long_prefill_token_threshold: int | None = None,
        num_speculative_tokens: int = 0,
        spec_max_requests: int = 0,
        lora_slots: LoRASlots | None = None,
        max_num_encoder_input_tokens: int | None = None,
        num_scheduler_steps: int = 1,
    ):
        """`num_speculative_tokens` K > 0 turns speculative decoding on: each decode verifies up
        to K stored drafts while at most `spec_max_requests` requests are running or waiting
        (see the module docstring, step 7). `num_scheduler_steps` N > 1: steps of decodes alone
        run up to N steps in one program (step 10)."""
        threshold = long_prefill_token_threshold
        for name, v in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
            ("long_prefill_token_threshold", 1 if threshold is None else threshold),
            ("max_num_encoder_input_tokens", max_num_encoder_input_tokens or 1),
            ("num_scheduler_steps", num_scheduler_steps),
        ):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        self.allocators = list(allocator) if isinstance(allocator, (list, tuple)) else [allocator]
        self.allocator = self.allocators[0]
        if max_num_seqs % len(self.allocators):
            raise ValueError(
                f"max_num_seqs={max_num_seqs} is not a multiple of the "
                f"{len(self.allocators)} data replicas"
            )
        self._seqs_per_replica = max_num_seqs // len(self.allocators)
        self._replica: dict[str, int] = {}  # running request id -> its replica
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = threshold
        self._max_chunk = threshold or max_num_batched_tokens
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._order: dict[str, tuple[int, float, int]] = {}  # id -> (priority, arrival, seq)
        self._seq = itertools.count()
        self._running: list[Request] = []  # sorted by _order
        self._waiting: list[Request] = []  # sorted by _order
        self._preempted: collections.deque[Request] = collections.deque()  # resume first
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []  # preempted outside `schedule` (`preempt_all`)
        self.num_preemptions = 0  # since start, every replica (vllm:num_preemptions)
        # Admission filter while the engine core isolates a failure (None: admit anyone).
        self.only: set[str] | None = None
        if num_speculative_tokens < 0 or (num_speculative_tokens and spec_max_requests < 1):
            raise ValueError(
                f"speculation needs num_speculative_tokens={num_speculative_tokens} >= 0 "
                f"and spec_max_requests={spec_max_requests} >= 1"
            )
        if num_speculative_tokens and num_scheduler_steps > 1:
            raise ValueError(
                f"num_scheduler_steps={num_scheduler_steps} does not combine with speculative "
                f"decoding (num_speculative_tokens={num_speculative_tokens})"
            )
        self.num_scheduler_steps = num_scheduler_steps
        self.num_speculative_tokens = num_speculative_tokens
        self.spec_max_requests = spec_max_requests
        self.spec_stats = SpecStats()
        self.lora_slots = lora_slots  # enable_lora: a request runs once its adapter has a slot
        self.max_num_encoder_input_tokens = max_num_encoder_input_tokens or max_num_batched_tokens

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._preempted)

    @property
    def running(self) -> list[Request]:
        """The running requests in (priority, arrival) order (read only)."""
        return self._running

    def lora_info(self) -> list | None:
        """[max_loras, running adapters, waiting adapters] with the names comma-joined (vLLM's
        `vllm:lora_requests_info` labels; a list: what msgpack gives back); None without LoRA."""
        if self.lora_slots is None:
            return None

        def names(reqs: list[Request]) -> str:
            loras = (r.lora_request for r in reqs if r.lora_request is not None)
            return ",".join(dict.fromkeys(lora.lora_name for lora in loras))

        waiting = names(list(self._preempted) + self._waiting)
        return [self.lora_slots.max_loras, names(self._running), waiting]

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unloads an adapter (`LoRASlots.forget`): True when its slot is free now, False when
        running requests keep it until they end (or LoRA is off)."""
        return self.lora_slots is not None and self.lora_slots.forget(lora_int_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def speculating(self) -> bool:
        """The back-off rule: the next `schedule` may verify drafts (speculation is on and at
        most `spec_max_requests` requests are running or waiting)."""
        return self.num_speculative_tokens > 0 and 0 < len(self._requests) <= self.spec_max_requests

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(request_id)

    def add_request(self, req: Request) -> None:
        rid = req.request_id
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already scheduled")
        if req.lora_request is not None and self.lora_slots is None:
            raise ValueError(f"request {rid!r}: lora_request needs an engine with enable_lora=True")
        req.prepare(self.max_model_len, self.allocator.page_size, self.allocator.num_usable_pages)
        check_image_budget(req.mm_inputs, self)  # each image computed (and encoded) in one step
        self._requests[rid] = req
        self._order[rid] = (req.priority, req.arrival_time, next(self._seq))
        bisect.insort(self._waiting, req, key=self._key)

    def abort(self, request_id: str) -> bool:
        """Abort an unfinished request, freeing its pages at once. False if unknown/finished."""
        if request_id not in self._requests:
            return False
        self._finish(self._requests[request_id], "abort")
        return True

    def finish(self, request_id: str, reason: str, stop_reason: int | str | None = None) -> bool:
        """Finish a request from outside (a stop string matched: reason "stop"), freeing its pages.

        Returns False, changing nothing, for an unknown or already finished request.
        NOTE: a request can finish in `update` (e.g. by length) on the very token that completes
        a stop string; the engine then relabels the `Request` itself - it is a plain object.
        """
        if reason not in FINISH_REASONS:
            raise ValueError(
                f"finish reason must be one of {sorted(FINISH_REASONS)}, got {reason!r}"
            )
        if request_id not in self._requests:
            return False
        self._finish(self._requests[request_id], reason, stop_reason)
        return True

    def schedule(self) -> SchedulerOutput:
        """The next step (module docstring, steps 1-4, 10): the running requests' tokens, then
        (unless that preempted someone) the waiting requests admitted."""
        budgets = [self.max_num_batched_tokens] * len(self.allocators)  # tokens per replica
        burst = multi_step.num_steps(self)  # steps of this schedule's program (step 10)
        plan = _Plan([], [], [], self.max_num_encoder_input_tokens)
        self._schedule_running(budgets, burst, plan)
        if not plan.preempted:
            self._admit(budgets, plan)
        finished, self._finished_ids = self._finished_ids, []
        preempted = plan.preempted
        if self._preempted_ids:
            preempted, self._preempted_ids = self._preempted_ids + preempted, []
        used = sum(self.max_num_batched_tokens - b for b in budgets)
        if burst > 1 and plan.chunks:  # NOTE: `multi_step.num_steps` admitted only decodes
            raise RuntimeError(f"a {burst}-step schedule holds prefill chunks")
        return SchedulerOutput(
            scheduled=plan.decodes + plan.chunks,
            num_batched_tokens=used,
            preempted=preempted,
            finished=finished,
            lora_loads=self.lora_slots.take_loads() if self.lora_slots else [],
            lora_removes=self.lora_slots.take_removes() if self.lora_slots else [],
            num_steps=burst if plan.decodes else 1,
        )

    def _schedule_running(self, budgets: list[int], burst: int, plan: _Plan) -> None:
        """Step 2: each running request's next tokens within its replica's budget (`burst`
        steps' worth for a steady decode), preempting from the back when pages run out."""
        decodes, chunks, preempted = plan.decodes, plan.chunks, plan.preempted
        stopped: set[int] = set()
        page_size, max_chunk = self.allocator.page_size, self._max_chunk
        running, replica_of = self._running, self._replica
        speculate = self.speculating()

        # NOTE: the hot loop of a decode-heavy server (one pass per running request per step):
        # Request's properties are inlined here, and a steady decode (one token past the prompt,
        # no drafts, at most a new page that is free) is scheduled right here without
        # `_schedule_tokens`.
        one_replica = len(self.allocators) == 1
        caching = [a.enable_prefix_caching for a in self.allocators]
        steady = not speculate  # drafts never ride on a steady decode
        i = 0
        while i < len(running):
            req = running[i]
            r = 0 if one_replica else replica_of[req.request_id]
            budget = budgets[r]
            if budget <= 0 or (stopped and r in stopped):
                i += 1
                continue
            outputs, pending, start = (
                req.output_token_ids,
                req.num_pending_tokens,
                req.num_computed_tokens,
            )
            num_prompt, num_out = len(req.prompt_token_ids), len(outputs)
            known = num_prompt + num_out
            total = known + pending
            if pending and num_out + pending >= req.length_limit:
                i += 1  # its pending token finishes it by length: nothing more to schedule
                continue
            pages = req.page_ids
            new: Sequence[int] | None = None
            if steady and start + 1 == total and start >= num_prompt:
                # a steady decode: its one token is the last output (or the pending one), in
                # its last page or in a new one (a page crossing, every page_size steps) if free
                # (multi-step: the tokens of all `burst` steps)
                end = total + burst - 1
                if end <= len(pages) * page_size:
                    new = ()
                elif (need := _cdiv(end, page_size) - len(pages)) <= self.allocators[
                    r
                ].num_free_pages:
                    new = self.allocators[r].allocate(need)
                    pages.extend(new)
            if new is not None:
                decodes.append(
                    new_tuple(
                        ScheduledRequest,
                        (
                            req,
                            [outputs[-1] if start < known else PENDING_TOKEN],
                            start,
                            new,
                            True,
                            r,
                            False,
                            pages,
                            0,
                        ),
                    )
                )
                req.num_computed_tokens = end
                req.num_pending_tokens = pending + burst
                if caching[r] and known >= (len(req.page_hashes) + 1) * page_size:
                    self.allocators[r].register_full_pages(
                        req.known_tokens, pages, known, req.page_hashes, req.cache_root
                    )
                budgets[r] = budget - 1
                i += 1
                continue
            n = min(total - start, budget, max_chunk)
            n, enc = fit_images(req.mm_inputs, start, n, plan.enc_left)  # an image in one chunk
            if not n:
                i += 1
                continue
            plan.enc_left -= enc
            # drafts that fit the budget the requests after it leave, and free pages
            left = budget - (len(running) - i - 1)
            drafts = spec.fit(req, n, left, self, self.allocators[r]) if speculate else []
            need = -(-(start + n + len(drafts)) // page_size) - len(pages)
            if need > 0:
                alloc = self.allocators[r]
                while need > alloc.num_free_pages:
                    victim = [q for q in running if replica_of[q.request_id] == r][-1]
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is req:
                        break
                if req.status is not RequestStatus.RUNNING:
                    stopped.add(r)  # it preempted itself: its replica schedules nothing more
                    continue
            self._schedule_tokens(req, r, n, need, decodes, chunks, False, drafts)
            budgets[r] = budget - n - len(drafts)
            i += 1

    def _admit(self, budgets: list[int], plan: _Plan) -> None:
        """Step 3: waiting requests (preempted ones first) join while budgets and pages allow;
        the first that does not fit stops admission."""
        page_size, only = self.allocator.page_size, self.only
        while self._preempted or self._waiting:
            r = self._least_loaded(budgets)
            if r is None:
                break
            alloc = self.allocators[r]
            if only is None and self.lora_slots is None:
                req = self._preempted[0] if self._preempted else self._waiting[0]
            else:  # NOTE: skips requests whose adapter finds no free slot: they wait
                req = next((q for q in self._queued() if self._admissible(q, only)), None)
                if req is None:
                    break
            cached: list[int] = []
            if alloc.enable_prefix_caching and req.may_use_prefix_cache:
                cached = alloc.match_prefix(req.all_token_ids, req.page_hashes, req.cache_root)
            start = len(cached) * page_size
            n = min(req.num_tokens - start, budgets[r], self._max_chunk)
            n, enc = fit_images(req.mm_inputs, start, n, plan.enc_left)
            need = _cdiv(start + n, page_size) - len(cached)
            if need > alloc.num_free_pages or not n:
                alloc.free(cached)
                req.page_hashes.clear()
                self._unpin_lora(req)
                break
            if req.num_preemptions:
                self._preempted.remove(req)  # NOTE: the first one, unless `only` skipped some
            else:
                self._waiting.remove(req)
                req.num_cached_tokens, req.scheduled_time = start, time.monotonic()
            req.page_ids = cached
            req.num_computed_tokens = start
            req.status = RequestStatus.RUNNING
            self._replica[req.request_id] = r
            bisect.insort(self._running, req, key=self._key)
            self._schedule_tokens(req, r, n, need, plan.decodes, plan.chunks, True)
            budgets[r] -= n
            plan.enc_left -= enc

    def _admissible(self, req: Request, only: set[str] | None) -> bool:
        """Whether a queued request may be admitted now; pins its adapter's slot if it has one."""
        if only is not None and req.request_id not in only:
            return False
        if req.lora_request is None or self.lora_slots is None:
            return True
        slot = self.lora_slots.acquire(req.lora_request)
        req.lora_slot = slot or 0
        return slot is not None

    def _unpin_lora(self, req: Request) -> None:
        if req.lora_slot:
            self.lora_slots.release(req.lora_slot)
            req.lora_slot = 0

    def _least_loaded(self, budgets: list[int]) -> int | None:
        """The replica a new request goes to: token budget and a sequence slot left, then the
        fewest running sequences, then the most free pages (None: no replica can take one)."""
        load = [0] * len(self.allocators)
        for rid in self._replica:
            load[self._replica[rid]] += 1
        open_ = [r for r, n in enumerate(load) if budgets[r] > 0 and n < self._seqs_per_replica]
        if not open_:
            return None
        return min(open_, key=lambda r: (load[r], -self.allocators[r].num_free_pages, r))

    def update(self, sched: SchedulerOutput, out: RunnerOutput) -> list[RequestUpdate]:
        """Apply one step's runner output (step 8: `step_update.apply`; a multi-step one's:
        `multi_step.update`). Requests aborted/finished since `schedule` are skipped."""
        if sched.num_steps > 1:
            return multi_step.update(sched, out, self.allocators, self._finish)
        return step_update.apply(sched, out, self.allocators, self.spec_stats, self._finish)

    def _key(self, req: Request) -> tuple[int, float, int]:
        return self._order[req.request_id]

    def _schedule_tokens(
        self,
        req: Request,
        r: int,
        n: int,
        need: int,
        decodes: list[ScheduledRequest],
        chunks: list[ScheduledRequest],
        is_new: bool,
        drafts: list[int] | None = None,
    ) -> None:
        """Schedules `n` tokens of `req` (then `drafts`, a decode's extra query tokens)."""
        if n < 1:
            raise RuntimeError(f"request {req.request_id!r} has no token to compute")
        alloc = self.allocators[r]
        if need > 0:
            req.page_ids.extend(alloc.allocate(need))
        start = req.num_computed_tokens
        num_prompt = len(req.prompt_token_ids)
        known = num_prompt + len(req.output_token_ids)
        end = start + n
        sample = end == known + req.num_pending_tokens
        if n == 1 and start >= num_prompt:  # a decode: its one token is an output (or pending)
            tokens = [req.output_token_ids[start - num_prompt] if start < known else PENDING_TOKEN]
        else:
            tokens = req.token_slice(start, end)
        if is_new:
            new_pages: Sequence[int] = list(req.page_ids)
        else:
            new_pages = req.page_ids[-need:] if need > 0 else ()
        k = len(drafts) if drafts else 0
        (decodes if sample and n == 1 and start >= num_prompt else chunks).append(
            ScheduledRequest(
                req,
                tokens + drafts if k else tokens,
                start,
                new_pages,
                sample,
                r,
                is_new,
                req.page_ids,
                k,
            )
        )
        req.num_computed_tokens = end + k  # `update` rolls back to the accepted drafts
        req.num_pending_tokens += sample
        # NOTE: offered before the step runs (its K/V is written before any later step reads it),
        # so the next schedule can already share these pages; pages a failed step should have
        # written are taken back by `forget_pages`.
        computed = end if end < known else known
        if alloc.enable_prefix_caching and computed >= (len(req.page_hashes) + 1) * alloc.page_size:
            alloc.register_full_pages(
                req.known_tokens, req.page_ids, computed, req.page_hashes, req.cache_root
            )

    def forget_pages(self, scheduled: list[ScheduledRequest]) -> None:
        """A step holding these failed: none of their pages may serve a prefix-cache hit."""
        page_size = self.allocator.page_size
        for s in scheduled:
            end = s.start_pos + len(s.token_ids)
            self.allocators[s.replica].forget(s.page_table[: _cdiv(end, page_size)])

    def _queued(self) -> Iterator[Request]:
        """Waiting requests in admission order: preempted ones first."""
        return itertools.chain(self._preempted, self._waiting)

    def preempt_all(self, failed: SchedulerOutput | None = None) -> list[str]:
        """Preempts every running request (a failed step may have left their pages, counters and
        runner rows half-updated: each recomputes its prompt and outputs when it resumes, which
        is always correct); returns their ids, reported in the next schedule's `preempted`,
        with the `finished` and `preempted` ids of the `failed` step's schedule again (the runner
        may have raised before it dropped their rows; dropping a row twice is harmless)."""
        ids = [req.request_id for req in self._running]
        for req in reversed(self._running[:]):  # NOTE: appendleft: they resume in running order
            self._preempt(req)
        if failed is not None:
            self._finished_ids = failed.finished + self._finished_ids
            self._preempted_ids += failed.preempted
        self._preempted_ids += ids
        return ids

    def _release_pages(self, req: Request) -> None:
        self._unpin_lora(req)
        r = self._replica.pop(req.request_id, None)
        if r is not None:
            self.allocators[r].free(req.page_ids)
        req.page_ids = []
        req.spec_token_ids = []
        req.page_hashes.clear()
        req.num_computed_tokens = 0
        req.num_pending_tokens = 0  # a preempted request recomputes (and resamples) them

    def _preempt(self, req: Request) -> None:
        self._running.remove(req)
        self._release_pages(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted.appendleft(req)

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        if req.status is RequestStatus.RUNNING:
            self._running.remove(req)
        elif req in self._preempted:
            self._preempted.remove(req)
        else:
            self._waiting.remove(req)
        self._release_pages(req)
        req.status, req.finish_reason, req.stop_reason = FINISH_REASONS[reason], reason, stop_reason
        del self._requests[req.request_id]
        del self._order[req.request_id]
        self._finished_ids.append(req.request_id)
