"""LLMEngine: the glue between the host scheduler, the device runner and the tokenizer.

1. `add_request` validates and tokenizes on the caller's thread, then queues the request(s)
   (n > 1 samples become n child requests that share the prompt's cached pages).
2. `step()` drains queued adds/aborts, then does schedule → execute → update. With
   `EngineConfig.async_scheduling` (the default on one process) it schedules and launches step
   N+1 first and only then waits for step N and applies its update, so the host's scheduling,
   input building and dispatch overlap the device's work (vLLM v1's async scheduling): each
   `step()` returns the deltas of the step launched by the previous call.
3. The step's updates become `RequestDelta`s: new token ids, new text from each request's
   incremental detokenizer (stop strings matched on that text, held back until they can no longer
   start a match), logprobs, and on the last delta the finish reason and usage.

`add_request` and `abort` may be called from other threads (the gRPC server does); everything
else runs on the thread that calls `step()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax

from jaxinfer import attention
from jaxinfer import sharding as shd
from jaxinfer.config import EngineConfig
from jaxinfer.engine.page_allocator import PageAllocator
from jaxinfer.engine.request import Request
from jaxinfer.engine.runner import Launched, ModelRunner, TokenLogprobs
from jaxinfer.engine.scheduler import RunnerOutput, Scheduler
from jaxinfer.loader import LoadedModel
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclasses.dataclass
class RequestDelta:
    """What one step added to one sample of one request."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the first delta, when asked
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    usage: Usage | None = None


@dataclasses.dataclass
class _Sample:
    """Engine-side state of one child request (one sample)."""

    parent: str
    index: int
    request: Request
    detok: IncrementalDetokenizer
    stop: list[str]
    text: str = ""  # emitted so far
    pending: str = ""  # detokenized but held back (could be the start of a stop string)
    prompt_lps: dict[int, TokenLogprobs] = dataclasses.field(default_factory=dict)
    sent_prompt_lps: bool = False


def default_kv_cache_memory() -> int:
    """Bytes for the KV cache when the user gives neither num_pages nor kv_cache_memory."""
    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(0.85 * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
    try:  # CPU: a quarter of the available host memory, at most 4 GiB
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 4 << 30
    return min(avail // 4, 4 << 30)


class LLMEngine:
    def __init__(self, model: LoadedModel, config: EngineConfig | None = None, *,
                 attention_backend: str | None = None, linear_backend: str | None = None) -> None:
        self.model, self.tokenizer, self.cfg = model, model.tokenizer, model.cfg
        config = config or EngineConfig(dtype=model.dtype)
        max_model_len = config.max_model_len or self.cfg.max_position_embeddings
        if max_model_len > self.cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={self.cfg.max_position_embeddings}")
        sizes = shd.check_mesh(self.cfg, config.mesh, num_devices=len(jax.devices()),
                               max_num_seqs=config.max_num_seqs, num_pages=config.num_pages)
        self.mesh = shd.make_mesh(config.mesh or None)
        data, shards = sizes[shd.DATA], shd.Parallel(**sizes).dense
        # Bytes one page takes on one device (its share of the KV heads).
        kv_heads = shd.kv_cache_heads(self.cfg.num_kv_heads, shards) // shards
        row_bytes = attention.kv_cache_bytes_per_row(
            self.cfg.head_dim, 4 if config.dtype == "float32" else 2, config.kv_cache_dtype)
        page_bytes = config.page_size * 2 * kv_heads * row_bytes * self.cfg.num_layers
        pages_for_all = (config.max_num_seqs // data) * -(-max_model_len // config.page_size) + 1
        num_pages = config.num_pages
        if num_pages is None:  # per device = per replica, then the total over replicas
            budget = config.kv_cache_memory or default_kv_cache_memory()
            num_pages = min(budget // page_bytes, pages_for_all)
            if num_pages < 2:
                raise ValueError(f"kv_cache_memory={budget} bytes holds fewer than 2 pages of "
                                 f"{page_bytes} bytes; give more memory or a smaller page_size")
            num_pages *= data
        self.config = dataclasses.replace(config, num_pages=int(num_pages), max_model_len=max_model_len)
        self.max_model_len = max_model_len
        self.allocators = [PageAllocator(self.config.num_pages // data, config.page_size,
                                         config.enable_prefix_caching) for _ in range(data)]
        self.allocator = self.allocators[0]
        self.scheduler = Scheduler(self.allocators, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_model_len=max_model_len,
                                   long_prefill_token_threshold=config.long_prefill_token_threshold)
        self.runner = ModelRunner(self.cfg, model.params, page_size=config.page_size,
                                  num_pages=self.config.num_pages, max_model_len=max_model_len,
                                  max_num_seqs=config.max_num_seqs,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  dtype=config.dtype, attention_backend=attention_backend,
                                  linear_backend=linear_backend, mesh=self.mesh,
                                  kv_cache_dtype=config.kv_cache_dtype)
        self._in_flight: Launched | None = None  # async scheduling: the step still running
        self._ready: list[RequestDelta] = []  # deltas of a step finished while the next one failed
        # Child request ids a failed `step()` lost (set when it raises; the server fails them).
        self.failed_request_ids: list[str] = []
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._samples: dict[str, _Sample] = {}  # child request id -> state
        self._children: dict[str, list[str]] = {}  # parent id -> child ids
        self._aborted: list[str] = []
        self._ids = itertools.count()
        # Parent and child ids of every request added and not yet finished (caller threads add).
        self._live_ids: set[str] = set()
        self._live_ids_lock = threading.Lock()
        usable = sum(a.num_usable_pages for a in self.allocators)
        held = self.runner.bytes_per_device()
        replicated = "" if shd.kv_heads_split(self.cfg.num_kv_heads, shards) else (
            f"; KV replicated: {self.cfg.num_kv_heads} KV heads < {shards} attention shards, each "
            f"shard keeps a copy of the one its query heads need")
        logger.info(
            "KV cache (%s): %d pages x %d tokens = %d tokens (%.1f MiB); max_model_len %d -> up to %.1f "
            "concurrent full-length requests; max_num_seqs %d, max_num_batched_tokens %d; mesh %s: "
            "%d data replica(s) of %d pages, per device %.1f MiB params + %.1f MiB KV%s",
            self._kv_storage(row_bytes), usable, config.page_size, usable * config.page_size,
            self.runner.kv_cache_bytes / 2**20,
            max_model_len, usable * config.page_size / max_model_len, config.max_num_seqs,
            config.max_num_batched_tokens, config.mesh or "single device", data,
            self.allocator.num_pages, held["params"] / 2**20, held["kv_cache"] / 2**20, replicated)

    def _kv_storage(self, row_bytes: int) -> str:
        """How the cache is stored, and for fp8 the token capacity gained over the model dtype."""
        if self.config.kv_cache_dtype != "fp8":
            return self.config.dtype
        dtype_row = self.cfg.head_dim * (4 if self.config.dtype == "float32" else 2)
        return (f"fp8 e4m3 + one exponent byte per {self.cfg.head_dim}-value row: "
                f"{dtype_row / row_bytes:.2f}x the tokens of {self.config.dtype} in the same memory")

    def capacity(self) -> dict[str, int]:
        usable = sum(a.num_usable_pages for a in self.allocators)
        return {"num_pages": usable, "page_size": self.config.page_size,
                "max_tokens": usable * self.config.page_size, "max_model_len": self.max_model_len}

    def add_request(self, prompt: str | list[int], sampling: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0) -> str:
        """Validates, tokenizes and queues a request; returns its id. Bad input raises ValueError."""
        sampling = sampling or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        self.validate_prompt(ids, sampling)
        children = []
        for i in range(sampling.n):
            child_sp = sampling
            if sampling.n > 1 and sampling.seed is not None:
                child_sp = dataclasses.replace(sampling, seed=(sampling.seed + 7919 * i) % 2**63)
            cid = request_id if sampling.n == 1 else f"{request_id}#{i}"
            req = Request(cid, list(ids), child_sp, eos_token_ids=tuple(self.tokenizer.eos_token_ids),
                          priority=priority)
            children.append(_Sample(request_id, i, req, self.tokenizer.detokenizer(ids),
                                    list(sampling.stop or [])))
        keys = {request_id, *(c.request.request_id for c in children)}
        with self._live_ids_lock:
            if keys & self._live_ids:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._live_ids |= keys
        self._inbox.put(("add", request_id, children))
        return request_id

    def validate_prompt(self, ids: list[int], sampling: SamplingParams) -> None:
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.cfg.vocab_size})")
        if len(ids) + sampling.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_tokens={sampling.max_tokens} exceeds "
                f"max_model_len={self.max_model_len}")
        # The last sampled token is never computed: at most len + max_tokens - 1 tokens hold K/V.
        pages = -(-(len(ids) + sampling.max_tokens - 1) // self.config.page_size)
        if pages > self.allocator.num_usable_pages:
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_tokens={sampling.max_tokens} needs {pages} "
                f"KV-cache pages, the cache has {self.allocator.num_usable_pages}")

    def abort(self, request_id: str) -> None:
        """Aborts every sample of a request (thread-safe; takes effect at the next step)."""
        self._inbox.put(("abort", request_id, None))

    def has_unfinished(self) -> bool:
        return (bool(self._samples) or not self._inbox.empty() or bool(self._aborted)
                or self._in_flight is not None or bool(self._ready))

    @property
    def async_scheduling(self) -> bool:
        # NOTE: a multi-host leader broadcasts each `runner.run` to its followers: synchronous.
        return self.config.async_scheduling and getattr(self.runner, "channel", None) is None

    def step(self) -> list[RequestDelta]:
        """One engine step. If it raises, `failed_request_ids` names the requests it lost (the
        caller should abort them); every other request carries on."""
        self.failed_request_ids = []
        self._drain_inbox()
        sched = self.scheduler.schedule()
        if not self.async_scheduling:
            with self._failing(sched.scheduled):
                out = self.runner.execute(sched)
            return self._deltas(self.scheduler.update(sched, out), out)
        previous, self._in_flight = self._in_flight, None
        ready, self._ready = self._ready, []
        try:
            with self._failing(sched.scheduled):
                self._in_flight = self.runner.launch(sched)
        except Exception:
            lost, self._ready = self.failed_request_ids, ready
            if previous is not None:  # not lost: its deltas come with the next call
                try:
                    self._ready += self._finish(previous)
                except Exception:  # noqa: BLE001 - the launch's exception is the one raised
                    logger.exception("the step before the failed one failed too")
                    lost = lost + self.failed_request_ids
            self.failed_request_ids = lost
            raise
        if previous is None:
            return ready + self._deltas([], RunnerOutput(sampled_token_ids={}))
        return ready + self._finish(previous)

    def _finish(self, launched: Launched) -> list[RequestDelta]:
        """Waits for a launched step and applies it (a failure also loses the step after it,
        which ran on its outputs)."""
        after, self._in_flight = self._in_flight, None
        with self._failing(launched.sched.scheduled + (after.sched.scheduled if after else [])):
            out = self.runner.collect(launched)
        self._in_flight = after
        return self._deltas(self.scheduler.update(launched.sched, out), out)

    @contextlib.contextmanager
    def _failing(self, scheduled: list[Any]) -> Iterator[None]:
        """On an exception: these requests are lost, and pages they were to write leave the
        prefix cache (a failed step may not have written K/V that other prompts would reuse)."""
        try:
            yield
        except Exception:
            self.scheduler.forget_pages(scheduled)
            self.failed_request_ids = [s.request.request_id for s in scheduled]
            raise

    def stream(self) -> Iterator[RequestDelta]:
        """Steps until every request has finished, yielding deltas as they come."""
        while self.has_unfinished():
            yield from self.step()

    def _drain_inbox(self) -> None:
        while not self._inbox.empty():
            kind, rid, children = self._inbox.get()
            if kind == "add":
                self._children[rid] = [c.request.request_id for c in children]
                for child in children:
                    self._samples[child.request.request_id] = child
                    self.scheduler.add_request(child.request)
            else:
                for cid in self._children.get(rid, []):
                    if cid in self._samples and self.scheduler.abort(cid):
                        self._aborted.append(cid)

    def _deltas(self, updates: list[Any], out: Any) -> list[RequestDelta]:
        deltas = []
        for cid in self._aborted:
            deltas.append(self._final(self._samples[cid], [], "", None, "abort"))
        self._aborted = []
        # NOTE: every prefill chunk brings prompt logprobs, but only the last one samples (and
        # so has an update): gather them from the runner output, not from the updates.
        for cid, entries in out.prompt_logprobs.items():
            if cid in self._samples:
                self._samples[cid].prompt_lps.update(entries)
        for upd in updates:
            req = upd.request
            s = self._samples.get(req.request_id)
            if s is None:
                continue
            lp = out.logprobs.get(req.request_id)
            new_text, stopped = self._detokenize(s, upd.new_token_ids, upd.finished)
            if stopped and not upd.finished:
                self.scheduler.finish(req.request_id, "stop", stopped)
            finished = upd.finished or stopped is not None
            reason = "stop" if stopped is not None else req.finish_reason
            delta = self._final(s, upd.new_token_ids, new_text, lp, reason) if finished else \
                RequestDelta(s.parent, s.index, list(upd.new_token_ids), new_text)
            if lp is not None:
                delta.logprobs = [lp]
            if req.sampling.prompt_logprobs is not None and not s.sent_prompt_lps and upd.new_token_ids:
                delta.prompt_logprobs = [None] + [s.prompt_lps.get(p) for p in range(1, req.num_prompt_tokens)]
                s.sent_prompt_lps = True
            deltas.append(delta)
        return deltas

    def _final(self, s: _Sample, new_ids: list[int], new_text: str, lp: Any, reason: str) -> RequestDelta:
        req = s.request
        del self._samples[req.request_id]
        siblings = self._children.get(s.parent, [])
        if not any(c in self._samples for c in siblings):
            self._children.pop(s.parent, None)
            with self._live_ids_lock:
                self._live_ids.difference_update([s.parent, *siblings])
        usage = Usage(req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens)
        return RequestDelta(s.parent, s.index, list(new_ids), new_text, finished=True,
                            finish_reason=reason, usage=usage)

    def _detokenize(self, s: _Sample, new_ids: list[int], finishing: bool) -> tuple[str, str | None]:
        """Returns (text to emit now, the stop string that matched or None)."""
        for tok in new_ids:
            s.pending += s.detok.add(tok)
        if finishing:
            s.pending += s.detok.flush()
        if s.stop:
            combined = s.text + s.pending
            start = max(0, len(s.text) - max(len(x) for x in s.stop) + 1)
            hits = [(combined.find(x, start), x) for x in s.stop]
            hits = [(i, x) for i, x in hits if i >= 0]
            if hits:
                i, stop = min(hits)
                new = combined[len(s.text):i]
                s.text, s.pending = combined[:i], ""
                return new, stop
            if not finishing:
                hold = max(len(x) for x in s.stop) - 1
                cut = max(len(combined) - hold, len(s.text))
                new = combined[len(s.text):cut]
                s.text, s.pending = combined[:cut], combined[cut:]
                return new, None
        new, s.pending = s.pending, ""
        s.text += new
        return new, None


def wait_all(engine: LLMEngine, timeout: float | None = None) -> list[RequestDelta]:
    """Runs the engine until idle, collecting every delta (a convenience for scripts and tests)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    deltas = []
    while engine.has_unfinished():
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError("engine did not finish in time")
        deltas.extend(engine.step())
    return deltas
