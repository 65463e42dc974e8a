"""LLMEngine: the in-process engine, an `EngineCore` (scheduler + runner) under an
`OutputProcessor` (detokenizer + stop strings).

1. `add_request` validates and tokenizes on the caller's thread, then queues the request(s)
   (n > 1 samples become n child requests that share the prompt's cached pages).
2. `step()` drains queued adds/aborts, runs one `EngineCore.step()` (schedule -> launch/execute
   -> update; with async scheduling the outputs are those of the step launched by the previous
   call) and turns its token outputs into `RequestDelta`s: new ids, new text, logprobs, and on the
   last delta the finish reason and usage. A stop string found in the text finishes the sample
   in the core at once.

`add_request` and `abort` may be called from other threads; everything else runs on the thread
that calls `step()`. A serving front end runs the same two halves in two processes
(`jaxinfer.engine.core_client`).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from typing import Any

from jaxinfer.config import EngineConfig
from jaxinfer.engine.core import EngineCore, default_kv_cache_memory
from jaxinfer.engine.limits import EngineLimits, check_prompt
from jaxinfer.engine.output import OutputProcessor, RequestDelta, Usage
from jaxinfer.engine.types import (
    EngineCapacity,
    EngineStats,
    split_samples,
)
from jaxinfer.lora.adapter import read_config
from jaxinfer.lora.request import LoRARequest
from jaxinfer.model_info import LoadedModel
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.vision.encoder import load_encoder
from jaxinfer.vision.inputs import ImageInput

__all__ = [
    "LLMEngine",
    "RequestDelta",
    "Usage",
    "default_kv_cache_memory",
    "wait_all",
]


class LLMEngine:
    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig | None = None,
        *,
        attention_backend: str | None = None,
        linear_backend: str | None = None,
        runner: Any = None,
        draft: LoadedModel | None = None,
    ) -> None:
        """`draft`: the draft model of speculative_config method "draft_model" (default: loaded
        from `speculative_config.model`)."""
        self.model, self.tokenizer, self.cfg = model, model.tokenizer, model.cfg
        self.core = EngineCore(
            model.cfg,
            model.params,
            config or EngineConfig(dtype=model.dtype),
            attention_backend=attention_backend,
            linear_backend=linear_backend,
            runner=runner,
            draft=draft,
            tokenizer=model.tokenizer,
            vision=None if runner is not None else load_encoder(model),
        )
        self.config, self.max_model_len = self.core.config, self.core.max_model_len
        self.mesh = self.core.mesh
        self.outputs = OutputProcessor(self.tokenizer)
        # Child request ids a failed `step()` lost (set when it raises; the server fails them).
        self.failed_request_ids: list[str] = []
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        # Parent ids of every request added and not yet finished (caller threads add).
        self._live_ids: set[str] = set()
        self._live_ids_lock = threading.Lock()
        self._children: dict[str, list[str]] = {}  # parent id -> [parent id, child ids...]

    @property
    def runner(self) -> Any:
        return self.core.runner

    @runner.setter
    def runner(self, runner: Any) -> None:
        self.core.runner = runner

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def allocators(self) -> list[Any]:
        return self.core.allocators

    @property
    def allocator(self) -> Any:
        return self.core.allocators[0]

    @property
    def limits(self) -> EngineLimits:
        return self.core.limits

    def capacity(self) -> EngineCapacity:
        return self.core.capacity()

    def stats(self) -> EngineStats:
        return self.core.stats()

    def warmup(self) -> int:
        return self.core.warmup()

    def add_request(
        self,
        prompt: str | list[int],
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        mm_inputs: tuple[ImageInput, ...] = (),
    ) -> str:
        """Validates, tokenizes and queues a request; returns its id. Bad input raises ValueError.
        `lora_request` runs it with that adapter (an engine with `enable_lora`); `mm_inputs`
        are its images over the prompt ids (`jaxinfer.vision.processor.with_images`)."""
        if lora_request is not None:
            self._check_lora(lora_request)
        sampling = sampling or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if self.tokenizer is None and (isinstance(prompt, str) or sampling.stop):
            raise ValueError(
                "the model was loaded with skip_tokenizer_init=True: pass the prompt "
                "as token ids and stop on token ids (stop_token_ids), not strings"
            )
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        ids = sampling.prepare_prompt(ids, self.tokenizer)
        self.validate_prompt(ids, sampling)
        children = split_samples(
            request_id,
            ids,
            sampling,
            eos_token_ids=self.model.eos_token_ids,
            priority=priority,
            lora_request=lora_request,
            mm_inputs=tuple(mm_inputs),
        )
        with self._live_ids_lock:
            keys = {request_id, *(c.request_id for c in children[0])}
            if keys & self._live_ids:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._live_ids |= keys
        self._inbox.put(("add", request_id, children))
        return request_id

    def _check_lora(self, lora: LoRARequest) -> None:
        """An adapter request this engine can run: LoRA on, a readable adapter of a fitting rank."""
        config = self.core.config
        if not config.enable_lora:
            raise ValueError("lora_request needs an engine with enable_lora=True")
        read_config(lora.lora_path, config.max_lora_rank)

    def validate_prompt(self, ids: list[int], sampling: SamplingParams) -> None:
        check_prompt(ids, sampling, self.core.limits)

    def abort(self, request_id: str) -> None:
        """Aborts every sample of a request (thread-safe; takes effect at the next step)."""
        self._inbox.put(("abort", request_id, None))

    def has_unfinished(self) -> bool:
        return self.outputs.num_open > 0 or not self._inbox.empty() or self.core.has_unfinished()

    @property
    def async_scheduling(self) -> bool:
        return self.core.async_scheduling

    def step(self) -> list[RequestDelta]:
        """One engine step. If it raises, `failed_request_ids` names the requests it lost (the
        caller should abort them); every other request carries on."""
        self.failed_request_ids = []
        self._drain_inbox()
        self.core.admit_proven(wait=True)  # offline: grammars are awaited, each to its deadline
        rejected = self.core.take_rejected()
        if rejected:
            self.failed_request_ids = [rid for rid, _ in rejected]
            raise ValueError("; ".join(why for _, why in rejected))
        try:
            outputs = self.core.step()
        except Exception:
            self.failed_request_ids = self.core.failed_request_ids
            raise
        deltas, stopped = self.outputs.process(outputs)
        for cid, stop in stopped:
            self.core.finish(cid, "stop", stop)
        self._retire(deltas)
        return deltas

    def _retire(self, deltas: list[RequestDelta]) -> None:
        done = [d.request_id for d in deltas if d.finished]
        if done:
            with self._live_ids_lock:
                for rid in done:
                    if not self.outputs.has_parent(rid):
                        self._live_ids.difference_update(self._children.pop(rid, [rid]))

    def stream(self) -> Any:
        """Steps until every request has finished, yielding deltas as they come."""
        while self.has_unfinished():
            yield from self.step()

    def _drain_inbox(self) -> None:
        while not self._inbox.empty():
            kind, rid, children = self._inbox.get()
            if kind == "add":
                core_reqs, specs = children
                self._children[rid] = [rid, *(c.request_id for c in core_reqs)]
                self.outputs.add(rid, specs)
                for c in core_reqs:
                    self.core.add(c)
            else:
                for cid in self._children.get(rid, [])[1:]:
                    self.core.abort(cid)


def wait_all(engine: LLMEngine, timeout: float | None = None) -> list[RequestDelta]:
    """Runs the engine until idle, collecting every delta (a convenience for scripts and tests)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    deltas = []
    while engine.has_unfinished():
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError("engine did not finish in time")
        deltas.extend(engine.step())
    return deltas
