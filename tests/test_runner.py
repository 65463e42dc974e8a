"""Runner tests for the host path (issue 14): the persistent input batch, page buckets, fetching only
what a step needs, and seeded sampling that does not depend on the batch.

1. A small random Llama (512-token vocabulary, so programs compile fast) driven by the real
   `Scheduler`: the runner's vectorized step arrays equal `build_step_arrays` built from scratch,
   rows join / advance / leave, and page buckets change no token.
2. The engine test model (SmolLM2's 49k vocabulary): 64 seeded requests give the same tokens alone,
   batched 64 at once, and joining a batch mid-way (prefill chunks beside decodes).
3. Warmup leaves nothing to compile, int4 weights (4-bit codes) included, whose programs must
   also keep JAX's C++ dispatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_utils import (
    collect,
    compile_events,
    generate,
    load_vocab,
    make_engine,
    random_prompt,
    run,
    tiny_model,
)
from jax._src import stages  # NOTE: `Compiled.call`, the Python path a program may take

from jaxinfer import quantization
from jaxinfer.config import ModelConfig
from jaxinfer.engine.page_allocator import PageAllocator
from jaxinfer.engine.request import Request
from jaxinfer.engine.runner import ModelRunner, default_page_buckets, warmup
from jaxinfer.engine.runner.program_table import ProgramTable
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.models import llama
from jaxinfer.params import init_random
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.step import build_step_arrays

SMALL = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    vocab_size=512,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
PAGE_SIZE, MAX_MODEL_LEN = 4, 64  # 16 pages per sequence


@pytest.fixture(scope="module")
def small():
    cfg = ModelConfig.from_hf(SMALL)
    params = init_random(llama.param_specs(cfg), jax.random.key(0))
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, params)  # far from greedy ties
    return cfg, params


def small_runner(small, **kw) -> ModelRunner:
    cfg, params = small
    # NOTE: one token bucket, so only the page buckets multiply the programs to compile.
    return ModelRunner(
        cfg,
        params,
        page_size=PAGE_SIZE,
        num_pages=65,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        token_buckets=(16,),
        **kw,
    )


def drive(
    runner: ModelRunner,
    requests: list[tuple[int, Request]],
    on_prepared=None,
    abort: tuple[int, str] | None = None,
    split: bool = False,
) -> dict[str, list[int]]:
    """Adds each request at its step, runs schedule -> runner -> update until done (synchronous);
    `abort` = (step, request id); `split`: every step as forward, then sampler (structured
    output's path). Returns every request's output ids."""
    sched = Scheduler(
        PageAllocator(runner.num_pages, PAGE_SIZE, enable_prefix_caching=False),
        max_num_seqs=runner.max_num_seqs,
        max_num_batched_tokens=16,
        max_model_len=MAX_MODEL_LEN,
    )
    pending = sorted(requests, key=lambda x: x[0])
    step = 0
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= step:
            sched.add_request(pending.pop(0)[1])
        if abort is not None and abort[0] == step:
            sched.abort(abort[1])
        out = sched.schedule()
        if split:
            launched = runner.launch(out, defer_sampling=True)
            if launched is not None:
                runner.sample(launched)
                sched.update(out, runner.collect(launched))
            step += 1
            continue
        prepared = runner.prepare(out)
        if prepared is not None:
            if on_prepared is not None:
                on_prepared(out, prepared)
            sched.update(out, runner.unpack(prepared.plan, *runner.run(prepared)))
        step += 1
        assert step < 200
    runner.prepare(sched.schedule())  # report the last finished requests: rows freed
    assert not runner.batch.rows and len(runner.batch.free_rows) == runner.max_num_seqs
    return {r.request_id: r.output_token_ids for _, r in requests}


def req(rid: str, prompt: list[int], max_tokens: int = 6, **kw) -> Request:
    return Request(
        rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)
    )


def test_default_page_buckets() -> None:
    assert default_page_buckets(32) == (32,)
    assert default_page_buckets(256) == (64, 256)
    assert default_page_buckets(8192) == (128, 512, 2048, 8192)  # 128K tokens in 16-token pages


def test_step_arrays_equal_a_from_scratch_build(small) -> None:
    """Each step's vectorized arrays equal `build_step_arrays` over the scheduled chunks, while
    rows join, grow pages, and leave (an abort) and decodes share steps with prefill chunks."""
    runner = small_runner(small, page_buckets=(2, 4, 16))
    rng = np.random.default_rng(0)
    reqs = [
        (0, req("a", rng.integers(0, 512, 5).tolist(), 12)),
        (1, req("b", rng.integers(0, 512, 22).tolist(), 4)),
        (3, req("c", rng.integers(0, 512, 9).tolist(), 8)),
        (4, req("d", rng.integers(0, 512, 3).tolist(), 10)),
    ]
    seen_buckets = set()

    def check(out, prepared) -> None:
        step = prepared.inputs["step"]
        t, (s, p) = step.token_ids.shape[0], step.page_indices.shape
        seqs = [(x.token_ids, x.start_pos, list(x.page_table)) for x in out.scheduled]
        need = max(-(-(start + len(toks)) // PAGE_SIZE) for toks, start, _ in seqs)
        assert p == min(b for b in runner.page_buckets if b >= need)
        seen_buckets.add(p)
        want = build_step_arrays(
            [(toks, start, pages[:p]) for toks, start, pages in seqs],
            PAGE_SIZE,
            num_tokens=t,
            num_seqs=s,
            pages_per_seq=p,
            num_logits=s,
        )
        for name, value in want.items():
            np.testing.assert_array_equal(getattr(step, name), value, err_msg=name)
        extras = prepared.inputs["extras"]
        rows = [runner.batch.rows[x.request.request_id] for x in out.scheduled]
        np.testing.assert_array_equal(extras.seq_rows[: len(rows)], rows)
        np.testing.assert_array_equal(
            extras.reset_rows[: len(rows)], [x.is_new for x in out.scheduled]
        )

    got = drive(runner, reqs, check, abort=(6, "b"))
    assert seen_buckets == {2, 4, 16}
    # Page buckets change nothing the model computes: the widest alone gives the same tokens (the
    # same runner, so its compiled programs are reused), and so does each request alone.
    runner.buckets.page_buckets = (16,)
    assert drive(runner, reqs_again(reqs), abort=(6, "b")) == got
    alone = {
        r.request_id: drive(runner, [(0, x)])[r.request_id]
        for (_, r), (_, x) in zip(reqs, reqs_again(reqs))
        if r.request_id != "b"
    }
    assert {k: v for k, v in got.items() if k != "b"} == alone


def test_decode_step_arrays_equal_the_ragged_build(small) -> None:
    """A decode step's shortcut in `StepInputBuilder.arrays` (one token per sequence, one group) builds exactly
    what the general ragged build does (a group array of zeros takes that path)."""
    runner = small_runner(small)
    rng = np.random.default_rng(1)
    n = 3
    runner.batch.page_table[:n, :4] = rng.integers(1, 65, (n, 4))
    runner.batch.prompt_len[:n] = [5, 2, 9]
    runner.batch.last_sample[:n] = [4, -1, 0]  # where rows 0 and 2 sampled last step
    rows = np.array([2, 0, 1], np.int32)
    starts = np.array([7, 13, 6], np.int32)  # row 1 computes a prompt token, the others outputs
    tokens = np.array([-1, -1, 33], np.int32)  # PENDING_TOKEN on the two rows that sampled
    args = (
        16,
        4,
        False,
        rows,
        starts,
        np.ones(n, np.int32),
        tokens,
        np.array([False, False, True]),
    )
    fast = runner.inputs.arrays(*args, None)
    ragged = runner.inputs.arrays(*args, np.zeros(n, np.int32))
    for got, want in zip(fast[:2], ragged[:2]):
        for name in got.__dataclass_fields__:
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    for got, want in zip(fast[2:], ragged[2:]):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(fast[0].cu_q_lens[:5], [0, 1, 2, 3, 3])


def reqs_again(reqs: list[tuple[int, Request]]) -> list[tuple[int, Request]]:
    return [(t, Request(r.request_id, r.prompt_token_ids, r.sampling)) for t, r in reqs]


def test_fetches_logprobs_only_when_asked_and_reuses_unchanged_metadata(small) -> None:
    runner = small_runner(small)
    results, metas = [], []

    def record(out, prepared) -> None:
        metas.append((len(out.scheduled), prepared.inputs["meta"], prepared.fetch_logprobs))

    original = runner.run

    def run(prepared):
        fetched = original(prepared)
        results.append(fetched)
        return fetched

    runner.run = run
    on_device = []
    to_device = runner._meta_on_device
    runner._meta_on_device = lambda meta: on_device.append(to_device(meta)) or on_device[-1]
    drive(runner, [(0, req("plain", [5, 6, 7], 5)), (2, req("plain2", [8, 9], 5))], record)
    assert all(out is None and prompt is None for _, out, prompt in results)  # ids only
    # The sampling metadata is gathered again only when a row joins or leaves, and only then
    # moved to the device: the steps between reuse the device copy.
    fresh = [i == 0 or m is not metas[i - 1][1] for i, (_, m, _) in enumerate(metas)]
    assert fresh == [True, False, True, False, False, True, False], fresh  # joins at 2, leaves at 5
    moved = [i == 0 or d is not on_device[i - 1] for i, d in enumerate(on_device)]
    assert moved == fresh and isinstance(on_device[0].temperature, jax.Array)
    results.clear()
    drive(runner, [(0, req("lp", [5, 6, 7], 3, logprobs=2)), (0, req("plain", [8, 9], 3))])
    assert all(out is not None and out.topk_ids.shape[1] >= 2 for _, out, _ in results)


def test_fetch_results_takes_ids_alone_without_the_tree_walk(monkeypatch) -> None:
    """A step's sampled ids alone come back as one numpy array (no `jax.device_get`: on a small
    host each jax call beside the running step costs tens of microseconds); with logprob arrays
    the whole tuple goes through `jax.device_get`, every leaf numpy."""
    from jaxinfer.engine.runner import outputs

    ids = jnp.array([7, 3], jnp.int32)
    walked, device_get = [], jax.device_get
    monkeypatch.setattr(outputs.jax, "device_get", lambda x: walked.append(x) or device_get(x))
    got, out, prompt = outputs.fetch_results((ids, None, None))
    assert type(got) is np.ndarray and got.tolist() == [7, 3] and out is None and prompt is None
    assert walked == []
    lps = {"logprobs": jnp.zeros((2,), jnp.float32)}
    got, out, prompt = outputs.fetch_results((ids, lps, None))
    assert len(walked) == 1 and type(out["logprobs"]) is np.ndarray and got.tolist() == [7, 3]


@pytest.fixture(scope="module")
def model():
    return tiny_model(load_vocab())


def seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=8, ignore_eos=True)


@pytest.mark.slow
def test_seeded_tokens_are_the_same_alone_batched_and_joining_mid_batch(model) -> None:
    """64 seeds at temperature 0.8 over a 49k vocabulary: the same tokens alone, in a batch of 64
    (other programs, other rounding of the logits) and joining a running batch (prefill chunks in
    steps with decodes)."""
    n = 64
    # NOTE: buckets 1 and 8 (a request alone: its decodes, its 8-token prompt) and 64 (the batch):
    # alone, batched and mixed still run different programs; the powers of two between them
    # (2, 16, 32: steps as the batch drains) would only add programs to compile.
    engine = make_engine(
        model,
        max_num_seqs=n,
        max_num_batched_tokens=64,
        num_pages=n * 4 + 1,
        token_buckets=(1, 8, 64),
    )
    rng = np.random.default_rng(5)
    prompts = [random_prompt(rng, 8, model.cfg.vocab_size) for _ in range(n)]
    alone = [
        generate(engine, prompts[i], seeded(i), request_id=f"a{i}").token_ids for i in range(n)
    ]
    batched = run(engine, [(f"b{i}", prompts[i], seeded(i)) for i in range(n)])
    assert [batched[f"b{i}"][0].token_ids for i in range(n)] == alone
    for i in range(n // 2):
        engine.add_request(prompts[i], seeded(i), request_id=f"m{i}")
    deltas = [d for _ in range(3) for d in engine.step()]
    for i in range(n // 2, n):
        engine.add_request(prompts[i], seeded(i), request_id=f"m{i}")
    mixed = collect(deltas + list(engine.stream()))
    assert [mixed[(f"m{i}", 0)].token_ids for i in range(n)] == alone
    assert len({tuple(t) for t in alone}) == n


@pytest.mark.parametrize("committed", [True, False], ids=["placed-params", "host-params"])
def test_warmup_leaves_nothing_to_compile(small, committed) -> None:
    """Loaders place params on the device (committed arrays): the initial KV cache and state must
    then look like the step's own outputs, or the first program warmup builds is built again by
    the first real step of its bucket."""
    cfg, params = small
    if committed:
        params = jax.device_put(params, jax.devices()[0])
    runner = small_runner((cfg, params))
    runner.warmup(structured=committed)  # structured output's sampler program too
    # NOTE: warmup compiles without running (`lower().compile()`): only compile events show a
    # program built again.
    with compile_events() as compiles:
        drive(runner, [(0, req("a", [5, 6, 7], max_tokens=3)), (1, req("b", list(range(40, 52))))])
        if committed:
            split = [(0, req("c", [5, 6, 7], max_tokens=3)), (1, req("d", [8, 9]))]
            drive(runner, split, split=True)
    assert not [c for c in compiles if "program" in c], compiles


def test_int4_programs_warmup_built_run_their_steps_on_the_fast_path(small, monkeypatch) -> None:
    """int4 codes are uint4 arrays, whose layouts XLA:CPU reports without the sub-byte size the
    programs were compiled for. Warmup's programs must still run them: no compile on first use
    (each new shape of a served int4 model compiled for seconds), and through JAX's C++ dispatch
    (a program whose layout check failed once took the Python path on every later call: half the
    int4 decode speed)."""
    cfg, params = small
    placed = jax.device_put(params, jax.devices()[0])
    params = quantization.quantize_params(placed, llama.param_specs(cfg), "int4")
    assert any(x.dtype == jnp.uint4 for x in jax.tree.leaves(params))  # the layers' codes
    runner = small_runner((cfg, params))
    leaves = jax.tree.leaves(runner.params)  # held packed: half a byte a code, not `nbytes`' one
    packed = sum(x.size // 2 if x.dtype == jnp.uint4 else x.nbytes for x in leaves)
    assert runner.bytes_per_device()["params"] == packed < sum(x.nbytes for x in leaves)
    runner.warmup()
    real_call, real_table = stages.Compiled.call, ProgramTable.__call__
    python_calls, table_calls = [], []

    def slow_path(*args, **kwargs):  # what a program runs where the C++ dispatch declines
        python_calls.append(1)
        return real_call(*args, **kwargs)

    def table(self, *args):
        table_calls.append(self.name)
        return real_table(self, *args)

    monkeypatch.setattr(stages.Compiled, "call", staticmethod(slow_path))
    monkeypatch.setattr(ProgramTable, "__call__", table)
    with compile_events() as compiles:
        drive(runner, [(0, req("a", [5, 6, 7], max_tokens=12)), (1, req("b", [8, 9] * 10))])
    assert not [c for c in compiles if "program" in c], compiles
    assert runner._steps.jit_cache_size() == 0
    kept = {id(p) for t in (runner._steps, runner._samplers) for p in t.programs.values()}
    assert len(table_calls) >= 12  # at most one Python-path call per program, its first
    assert len(python_calls) <= len(kept) and len(python_calls) < len(table_calls) // 3


def test_warmed_programs_run_directly_with_the_same_tokens(small, monkeypatch) -> None:
    """After its first checked call, a warmed program runs through its loaded executable
    (`direct_call`: no per-argument checks); the tokens equal the checked calls' ones."""
    from jaxinfer.engine.runner import direct_call

    runner = small_runner(small)
    runner.warmup()
    ran, real = [], direct_call.DirectCall.__call__

    def counted(self, args):
        out = real(self, args)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(direct_call.DirectCall, "__call__", counted)
    reqs = [(0, req("a", [5, 6, 7], max_tokens=12)), (1, req("b", [8, 9] * 10))]
    direct = drive(runner, reqs)
    assert sum(ran) >= 8, ran
    monkeypatch.setattr(direct_call, "ENABLED", False)
    assert drive(runner, reqs_again(reqs)) == direct


def test_gpu_attention_marks_pure_decode_steps_and_warms_their_programs(small) -> None:
    """With the `gpu` attention backend (interpreted here) a step whose every sequence decodes one
    token is marked `decode_only` (the kernel's decode-only path, a program of its own per
    bucket, which warmup builds); a step with a prompt chunk is not; on the CPU backends nothing
    is marked (no extra programs)."""
    assert not small_runner(small).inputs.decode_only
    runner = small_runner(small, attention_backend="gpu")
    keys = list(warmup.plan(runner))
    assert (16, runner.page_buckets[0], False, 0, True) in keys
    assert len(keys) == 3 * len(runner.page_buckets)  # each page bucket: 2 logits variants + decode
    marks = []
    out = drive(
        runner,
        [(0, req("a", [5, 6, 7], max_tokens=3)), (0, req("b", [8, 9], max_tokens=3))],
        on_prepared=lambda _, p: marks.append(p.inputs["step"].decode_only),
    )
    assert marks == [False, True, True], marks
    ref = drive(
        small_runner(small, attention_backend="reference"),
        [(0, req("a", [5, 6, 7], max_tokens=3)), (0, req("b", [8, 9], max_tokens=3))],
    )
    assert out == ref
