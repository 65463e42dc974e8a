"""`EngineCore`: scheduler + runner + device, token ids in and token ids out (no text).

This is the half of the engine that a serving front end runs in its own process
(`jaxinfer.engine.core_client`); `LLMEngine` runs it in-process under the same output processor.

1. `add(CoreRequest)` hands a tokenized, validated child request (one sample) to the scheduler (with
   a grammar: once proven cheap off the step thread, `take_rejected` names those refused);
   `abort(id)` and `finish(id, "stop", stop_string)` end one (the front end finishes requests whose
   stop strings it matched in the detokenized text); `remove_lora(id)` unloads an adapter.
2. `step()` is [propose ->] schedule -> launch/execute -> update. With
   `EngineConfig.async_scheduling` (the default on one process) it schedules and launches step N+1
   first and only then waits for step N and applies its update (vLLM v1's async scheduling): each
   call returns the outputs of the step launched by the previous call. Speculative decoding
   (`EngineConfig.speculative_config`) needs every token of a request on the host to propose the
   next ones, so while the scheduler's back-off rule lets it speculate, a step first waits for the
   one in flight (its update applied), then asks the proposer once for every request that may
   speculate (`jaxinfer.engine.spec.propose`: drafts stored on the requests, never inside
   `Scheduler.schedule`), then schedules; a step that verifies drafts runs synchronously (its
   outputs come with the same call); above the back-off batch size the engine is asynchronous again.
   A step sampling structured-output rows stays asynchronous: its forward is launched, the step
   before lands (advancing the grammars' matchers), the masks are filled while the device runs
   the forward, then the sampler (`ModelRunner.launch(defer_sampling=True)` / `sample`).
3. The step's `RequestUpdate`s become `TokenOutput`s (`jaxinfer.engine.token_outputs`: new ids,
   logprobs, finish reason, usage counters): plain data (`jaxinfer.engine.types`).
4. A failing step raises after naming the requests it lost in `failed_request_ids` (and in
   `failed_marks` how far each was to compute); the pages they were to write leave the prefix cache.
   `LLMEngine` fails exactly those; the core loop isolates the culprit instead
   (`jaxinfer.engine.isolation`) through `recover` (every running request preempted: it recomputes),
   `check` (re-validation), `restrict` (admit only these; steps synchronous) and `progress`.

`stats()`, `warmup()` and the injectable `runner` are the public surface serving uses; nothing
outside this module reads the scheduler's or the allocators' fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator
from typing import Any

import jax

from jaxinfer import compile_cache, structured
from jaxinfer import sharding as shd
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine import spec as spec_decoding
from jaxinfer.engine import token_outputs
from jaxinfer.engine.capacity import log_capacity
from jaxinfer.engine.limits import EngineLimits, check_prompt
from jaxinfer.engine.page_allocator import PageAllocator
from jaxinfer.engine.request import Request
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.types import (
    CoreRequest,
    EngineCapacity,
    EngineInfo,
    EngineStats,
    Launched,
    RequestUpdate,
    Runner,
    RunnerOutput,
    TokenOutput,
)
from jaxinfer.lora.slots import LoRASlots, lora_options
from jaxinfer.models import family_of
from jaxinfer.spec_decode.proposer import make_proposer
from jaxinfer.token_masks import TokenMasks

logger = logging.getLogger(__name__)


def default_kv_cache_memory() -> int:
    """Bytes for the KV cache when the user gives neither num_pages nor kv_cache_memory, rounded
    down (`compile_cache.stable_bytes`: a restart sizes it alike and reuses the compiled programs)."""
    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        free = int(0.85 * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
        return compile_cache.stable_bytes(free, step=1 << 30)
    try:  # CPU: a quarter of the available host memory, at most 4 GiB
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 4 << 30
    return compile_cache.stable_bytes(min(avail // 4, 4 << 30))


class EngineCore:
    """Scheduler + runner over one model's params.

    Args:
      cfg: the model's architecture numbers.
      params: the params tree (None with an injected `runner`, e.g. a fake one).
      config: engine knobs; `num_pages` None sizes the cache from `kv_cache_memory` / the device.
      runner: use this runner instead of building a `ModelRunner` (tests, host benchmarks).
      draft: the draft model (a `LoadedModel`) of `speculative_config` method "draft_model",
        instead of loading `speculative_config.model`.
      tokenizer: the model's tokenizer, for structured output's grammars (None: requests with
        `structured_outputs` are refused).
      vision: the model's image encoder (`jaxinfer.vision.load_encoder`; None: text only).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params: Any,
        config: EngineConfig,
        *,
        attention_backend: str | None = None,
        linear_backend: str | None = None,
        runner: Runner | None = None,
        draft: Any = None,
        tokenizer: Any = None,
        vision: Any = None,
    ) -> None:
        self.cfg = cfg
        so = None if tokenizer is None else structured.StructuredOutputs(tokenizer, cfg.vocab_size)
        self.structured = TokenMasks(cfg.vocab_size, so)  # grammars + allowed / bad token lists
        max_model_len = config.max_model_len or cfg.max_position_embeddings
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's "
                f"max_position_embeddings={cfg.max_position_embeddings}"
            )
        sizes = shd.check_mesh(
            cfg,
            config.mesh,
            num_devices=len(jax.devices()),
            max_num_seqs=config.max_num_seqs,
            num_pages=config.num_pages,
        )
        self.mesh = shd.make_mesh(config.mesh or None)
        data, shards = sizes[shd.DATA], shd.Parallel(**sizes).dense
        # Bytes a page takes on one device: its KV heads' rows in the backend's layout (or MLA's).
        itemsize = 4 if config.dtype == "float32" else 2
        family = family_of(cfg)
        kv_layout = (config.kv_cache_dtype, attention_backend, config.page_size)
        token_bytes = family.kv_cache_bytes_per_token(
            cfg, shd.Parallel(**sizes), itemsize, *kv_layout
        )
        page_bytes = config.page_size * token_bytes
        pages_for_all = (config.max_num_seqs // data) * -(-max_model_len // config.page_size) + 1
        num_pages = config.num_pages
        if num_pages is None:  # per device = per replica, then the total over replicas
            budget = config.kv_cache_memory or default_kv_cache_memory()
            num_pages = min(budget // page_bytes, pages_for_all)
            if num_pages < 2:
                raise ValueError(
                    f"kv_cache_memory={budget} bytes holds fewer than 2 pages of "
                    f"{page_bytes} bytes; give more memory or a smaller page_size"
                )
            num_pages *= data
        self.config = dataclasses.replace(
            config, num_pages=int(num_pages), max_model_len=max_model_len
        )
        self.max_model_len = max_model_len
        pages, caching = self.config.num_pages // data, config.enable_prefix_caching
        self.allocators = [PageAllocator(pages, config.page_size, caching) for _ in range(data)]
        spec = config.speculative_config
        spec_seqs = min(spec.disable_by_batch_size, config.max_num_seqs) if spec else 0
        if spec is not None and (data > 1 or sizes[shd.PIPELINE] > 1):
            raise ValueError(
                f"speculative_config: not supported with mesh data={data} / "
                f"pipeline={sizes[shd.PIPELINE]} (one replica, no stages)"
            )
        self.proposer = make_proposer(
            spec,
            cfg,
            self.config,
            draft,
            attention_backend=attention_backend,
            linear_backend=linear_backend,
        )
        self.scheduler = Scheduler(
            self.allocators,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_num_encoder_input_tokens=config.max_num_encoder_input_tokens,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            spec_max_requests=spec_seqs,
            lora_slots=LoRASlots(config.max_loras) if config.enable_lora else None,
            num_scheduler_steps=config.num_scheduler_steps,
        )
        if runner is None:
            runner = ModelRunner(
                cfg,
                params,
                page_size=config.page_size,
                num_pages=self.config.num_pages,
                max_model_len=max_model_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                token_buckets=config.token_buckets,
                dtype=config.dtype,
                attention_backend=attention_backend,
                linear_backend=linear_backend,
                mesh=self.mesh,
                num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                spec_max_seqs=spec_seqs,
                kv_cache_dtype=config.kv_cache_dtype,
                lora=lora_options(config),
                vision=vision,
                num_scheduler_steps=config.num_scheduler_steps,
            )
        steps = getattr(runner, "num_scheduler_steps", 1)
        if config.num_scheduler_steps > 1 and steps != config.num_scheduler_steps:
            raise ValueError(
                f"num_scheduler_steps={config.num_scheduler_steps}: this runner "
                f"({type(runner).__name__}) runs {steps} step(s) a program"
            )
        self.runner: Runner = runner
        self._in_flight: Launched | None = None  # async scheduling: the step still running
        self._ready: list[TokenOutput] = []  # outputs of a step finished while the next one failed
        self._aborted: list[Request] = []
        self._requests: dict[str, Request] = {}  # every child request added and not yet reported
        # What a failed `step()` lost (the caller fails them) and the position each was to reach.
        self.failed_request_ids: list[str] = []
        self.failed_marks: dict[str, int] = {}
        self._isolating = False  # `restrict`: steps run synchronously, admission filtered
        self._last_sched: Any = None  # the last step's schedule (`recover` re-reports its ids)
        self.num_steps = 0
        self.num_generated = 0
        if params is not None:
            gain = (
                family.kv_cache_bytes_per_token(cfg, shd.Parallel(**sizes), itemsize) / token_bytes
            )
            log_capacity(self, data, shards, gain)

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(
            self.cfg.vocab_size,
            self.max_model_len,
            self.config.page_size,
            self.allocators[0].num_usable_pages,
        )

    def capacity(self) -> EngineCapacity:
        usable = sum(a.num_usable_pages for a in self.allocators)
        return EngineCapacity(
            usable, self.config.page_size, usable * self.config.page_size, self.max_model_len
        )

    def stats(self) -> EngineStats:
        """Load numbers over every data replica (what serving reports and logs)."""
        usable = sum(a.num_usable_pages for a in self.allocators)
        spec = self.scheduler.spec_stats
        return EngineStats(
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            pages_total=usable,
            pages_used=usable - sum(a.num_free_pages for a in self.allocators),
            compiled_programs=int(self.runner.num_compiled),
            steps=self.num_steps,
            generated=self.num_generated,
            spec_steps=spec.num_spec_steps,
            spec_draft_tokens=spec.num_draft_tokens,
            spec_accepted_tokens=spec.num_accepted_tokens,
            preemptions=self.scheduler.num_preemptions,
            lora=self.scheduler.lora_info(),
        )

    def info(self) -> EngineInfo:
        """Static facts a front end reports."""
        devices = jax.devices()
        return EngineInfo(
            capacity=self.capacity(),
            limits=self.limits,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            page_size=self.config.page_size,
            dtype=self.config.dtype,
            quantization=self.config.quantization,
            kv_cache_dtype=self.config.kv_cache_dtype,
            attention_backend=str(self.runner.attention_backend),
            linear_backend=str(self.runner.linear_backend),
            mesh_shape={str(k): int(v) for k, v in self.mesh.shape.items()}
            if self.config.mesh
            else {},
            devices=f"{devices[0].platform} x{len(devices)} ({devices[0].device_kind})",
        )

    def warmup(self) -> int:
        """Compiles every program a request can need (and builds the structured-output
        tokenizer); returns how many programs exist."""
        if self.structured is not None:
            self.structured.prepare()
        n = int(self.runner.warmup(structured=self.split_sampling))
        if self.proposer is not None:  # a draft model's own programs
            n += int(self.proposer.warmup())
        return n

    def add(self, req: CoreRequest) -> None:
        """Queues one child request (validated by the caller; its grammar is proven first)."""
        if req.request_id in self._requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        check_prompt(req.prompt_token_ids, req.sampling, self.limits, grammar=False)
        if req.mm_inputs and getattr(self.runner, "images", None) is None:
            raise ValueError(f"request {req.request_id!r} has images; this model takes none")
        request = Request(
            req.request_id, list(req.prompt_token_ids), req.sampling,
            eos_token_ids=tuple(req.eos_token_ids), priority=req.priority,
            cache_salt=req.cache_salt, lora_request=req.lora_request, mm_inputs=req.mm_inputs,
        )  # fmt: skip
        if not self.structured.add(req.request_id, req.sampling, request):  # a grammar: proven
            self.scheduler.add_request(request)  # off the step thread first, then `admit_proven`
        self._requests[req.request_id] = request

    def take_rejected(self) -> list[tuple[str, str]]:
        """(request id, why, naming the field) of each request refused since the last call: its
        grammar failed its proof (never scheduled) or erred mid-generation (aborted now)."""
        rejected = self.structured.take_rejected() if self.structured is not None else []
        for rid, _ in rejected:
            if self.scheduler.abort(rid):
                self._aborted.append(self._requests[rid])
            else:  # never scheduled: nothing to report
                self._requests.pop(rid, None)
        return rejected

    def admit_proven(self, *, wait: bool = False) -> None:
        """Schedules the requests whose grammar is proven (`wait`: for every proof to end)."""
        if self.structured is not None and self.structured.proving:
            for request in self.structured.admit(wait=wait):
                self.scheduler.add_request(request)

    def abort(self, request_id: str) -> None:
        """Aborts one child request; the next `step()` reports it finished with "abort"."""
        req, so = self._requests.get(request_id), self.structured
        if req is not None and (  # NOTE: one whose grammar is being proven is not scheduled yet
            self.scheduler.abort(request_id) or (so is not None and so.remove(request_id))
        ):
            self._aborted.append(req)

    def finish(self, request_id: str, reason: str, stop_reason: int | str | None = None) -> None:
        """Ends a request for a reason found outside the core (a stop string); not reported."""
        if self._requests.pop(request_id, None) is not None:
            self.scheduler.finish(request_id, reason, stop_reason)
            if self.structured is not None:
                self.structured.remove(request_id)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Frees an unloaded adapter's slot now (True) or once no running request pins it."""
        return self.scheduler.remove_lora(lora_int_id)

    def recover(self) -> list[str]:
        """After a failed step: preempts every running request (pages freed, runner rows dropped;
        each recomputes when it resumes). Outputs of steps that did land come with the next call."""
        self._in_flight = None  # NOTE: None after any failure already (see `step`)
        return self.scheduler.preempt_all(self._last_sched)

    def check(self, request_id: str) -> str | None:
        """Re-validates an unfinished request: why it fails the limits (None: passes, or gone)."""
        req = self.scheduler.get_request(request_id)
        try:
            if req is not None:
                check_prompt(req.prompt_token_ids, req.sampling, self.limits, grammar=False)
        except ValueError as e:
            return str(e)
        return None

    def restrict(self, request_ids: set[str] | None) -> None:
        """Admits only these waiting requests (None: anyone) and steps synchronously meanwhile
        (a step that returns has run). Running requests are not touched: `recover` first."""
        self.scheduler.only = request_ids
        self._isolating = request_ids is not None

    def progress(self, request_id: str) -> int | None:
        """Tokens an unfinished request has computed (None: finished or unknown)."""
        req = self.scheduler.get_request(request_id)
        return None if req is None else req.num_computed_tokens

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_unfinished()
            or bool(self._aborted)
            or self._in_flight is not None
            or bool(self._ready)
            or (self.structured is not None and self.structured.proving)
        )

    @property
    def async_scheduling(self) -> bool:
        # NOTE: a multi-host leader broadcasts each step to its followers: synchronous.
        return (
            self.config.async_scheduling
            and not self.runner.synchronous_only
            and not self._isolating
        )

    @property
    def split_sampling(self) -> bool:
        """Steps sampling structured-output rows run the forward first and the sampler once their
        masks are filled (`ModelRunner.sample`); without it (a mesh, a multi-host leader, a
        runner that cannot) they step synchronously with the masks filled before the launch."""
        return (
            self.structured is not None
            and self.runner.split_sampling
            and not self.runner.synchronous_only
        )

    def step(self) -> list[TokenOutput]:
        """One engine step. If it raises, `failed_request_ids` names the requests it lost.

        NOTE: a step that samples structured-output rows launches its forward, then (while the
        device runs it) lands the step before, advances the matchers by its tokens, fills the
        masks and launches the sampler: async scheduling stays on. While requests speculate,
        steps are synchronous (proposals are made from known tokens): a step still in flight is
        first landed, as it is for structured output when the runner cannot split a step.
        """
        self.failed_request_ids, self.failed_marks = [], {}
        self.admit_proven()
        ready, self._ready = self._ready, []
        split = self.split_sampling
        if self._in_flight is not None and (
            self.scheduler.speculating()
            or (not split and self.structured is not None and self.structured.active)
        ):
            previous, self._in_flight = self._in_flight, None
            try:
                ready += self._finish_launched(previous)
            except Exception:
                self._ready = ready  # not lost: they come with the next call
                raise
        spec_decoding.propose(self.proposer, self.scheduler)
        sched = self._last_sched = self.scheduler.schedule()
        self.num_steps += bool(sched.scheduled)
        constrained = self._constrained(sched)
        split = split and constrained and not sched.num_spec_tokens
        if not self.async_scheduling or sched.num_spec_tokens or (constrained and not split):
            return self._step_now(sched, ready, split, constrained)
        return self._step_ahead(sched, ready, split)

    def _step_now(
        self, sched: Any, ready: list[TokenOutput], split: bool, constrained: bool
    ) -> list[TokenOutput]:
        """`sched` run to its end before `step` returns (synchronous scheduling, speculation,
        structured output the runner cannot split), after the outputs already `ready`."""
        try:
            with self._failing(sched):
                if split:
                    launched = self.runner.launch(sched, defer_sampling=True)
                    self._fill_bitmask(sched)  # NOTE: overlaps the forward on the device
                    self.runner.sample(launched)
                    out = self.runner.collect(launched)
                else:
                    if constrained:
                        self._fill_bitmask(sched)
                    out = self.runner.execute(sched)
        except Exception:
            self._ready = ready
            raise
        return ready + self._outputs(self.scheduler.update(sched, out), out)

    def _step_ahead(self, sched: Any, ready: list[TokenOutput], split: bool) -> list[TokenOutput]:
        """Async scheduling: launches `sched`, then lands the step launched before it (`split`:
        `sched`'s forward only; its sampler follows once the masks are filled)."""
        previous, self._in_flight = self._in_flight, None
        try:
            with self._failing(sched):
                self._in_flight = (
                    self.runner.launch(sched, defer_sampling=True)
                    if split
                    else self.runner.launch(sched)
                )
        except Exception:
            lost, self._ready = self.failed_request_ids, ready
            if previous is not None:  # not lost: its outputs come with the next call
                try:
                    self._ready += self._finish_launched(previous)
                except Exception:  # noqa: BLE001 - the launch's exception is the one raised
                    logger.exception("the step before the failed one failed too")
                    lost = lost + self.failed_request_ids
            self.failed_request_ids = lost
            raise
        if split:
            try:
                return ready + self._sample_launched(previous)
            except Exception:
                self._ready = ready + self._ready  # not lost: they come with the next call
                raise
        if previous is None:
            return ready + self._outputs([], RunnerOutput(sampled_token_ids={}))
        return ready + self._finish_launched(previous)

    def _sample_launched(self, previous: Launched | None) -> list[TokenOutput]:
        """The host half of a split step whose forward is in flight: lands the step before it
        (its tokens advance the matchers), fills the masks, launches the sampler."""
        launched = self._in_flight
        # NOTE: if the step before fails, this one (which took its tokens) is lost with it.
        landed = [] if previous is None else self._finish_launched(previous)
        try:
            with self._failing(launched.sched):
                self._fill_bitmask(launched.sched)
                self.runner.sample(launched)
        except Exception:
            self._in_flight, self._ready = None, landed  # not lost: they come with the next call
            raise
        if previous is None:
            landed += self._outputs([], RunnerOutput(sampled_token_ids={}))
        return landed

    def _constrained(self, sched: Any) -> bool:
        """Some row this step samples belongs to a structured-output request."""
        so = self.structured
        return (
            so is not None
            and so.active
            and any(s.sample and so.has(s.request.request_id) for s in sched.scheduled)
        )

    def _fill_bitmask(self, sched: Any) -> None:
        """The allowed-token bitmask of every constrained request this step samples."""
        assert self.structured is not None
        ids = [
            s.request.request_id
            for s in sched.scheduled
            if s.sample and self.structured.has(s.request.request_id)
        ]
        if ids:
            sched.bitmask_rows = {rid: k for k, rid in enumerate(ids)}
            sched.token_bitmask = self.structured.fill(ids)

    def _finish_launched(self, launched: Launched) -> list[TokenOutput]:
        """Waits for a launched step and applies it (a failure also loses the step after it,
        which ran on its outputs)."""
        after, self._in_flight = self._in_flight, None
        with self._failing(launched.sched, *([after.sched] if after else [])):
            out = self.runner.collect(launched)
        self._in_flight = after
        return self._outputs(self.scheduler.update(launched.sched, out), out)

    @contextlib.contextmanager
    def _failing(self, *scheds: Any) -> Iterator[None]:
        """On an exception: the requests of these steps are lost (the caller aborts them), and
        pages they were to write leave the prefix cache (a failed step may not have written K/V
        others would reuse)."""
        try:
            yield
        except Exception:
            scheduled = [s for sched in scheds for s in sched.scheduled]
            self.scheduler.forget_pages(scheduled)
            self.failed_request_ids = list(dict.fromkeys(s.request.request_id for s in scheduled))
            marks = self.failed_marks
            for sched in scheds:
                for s in sched.scheduled:  # a multi-step step computes num_steps - 1 more
                    end = s.start_pos + len(s.token_ids) - s.num_spec_tokens + sched.num_steps - 1
                    marks[s.request.request_id] = max(marks.get(s.request.request_id, 0), end)
            raise

    def _outputs(self, updates: list[RequestUpdate], out: RunnerOutput) -> list[TokenOutput]:
        aborted, self._aborted = self._aborted, []
        outputs, generated = token_outputs.build(
            updates, out, aborted, self._requests, self.structured
        )
        self.num_generated += generated
        return outputs
