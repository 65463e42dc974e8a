"""Engine host time per step: every host path of `LLMEngine.step()` runs, the device does not.

    python scripts/bench_host.py                              # 1, 64, 256 sequences; prompts 128, 1024
    python scripts/bench_host.py --seqs 256 --prompt-lens 128 --steps 200

1. The runner is a real `ModelRunner` over the default model's vocabulary and a one-layer,
   tiny-width config whose jitted step program is replaced by outputs of the program's own
   shapes (`jax.eval_shape`, once per bucket): input building, packing, the transfer-free call,
   unpacking, the scheduler, the output processor (detokenizer, stop strings) all run as served.
2. For each (sequences, prompt length, stop strings) case, that many requests are added and
   prefilled, then `--steps` decode steps are timed one by one (max_tokens is large enough that
   every request still runs in the last one: the case fails otherwise); p50 / p99 / mean host
   ms per step are printed as a table (and as JSON lines with --json). "core" is `EngineCore.step`
   (scheduler + runner: the host work of the process that owns the device, what the device
   waits for); "engine" is `LLMEngine.step` = core + the output processor (detokenization and
   stop strings, which `scripts/serve.py` runs in its front-end process, beside the core).
   Not included: the jitted call's dispatch (a real program's launch, ~0.1 ms) and the core
   process's msgpack encoding of its step message (~0.08 ms at 256 sequences).
3. Like the engine-core process after its warmup, each case freezes the heap it was built on
   (`core_loop.settle_heap`) before its requests arrive; `--no-freeze` measures without that
   (what an in-process `LLMEngine` that never freezes pays for the cyclic collector).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import _path  # noqa: F401
import jax
import numpy as np

from jaxinfer import params as params_lib
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.core_loop import settle_heap
from jaxinfer.engine.engine import LLMEngine
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.model_info import LoadedModel, load_model_info
from jaxinfer.models import llama
from jaxinfer.sampling_params import SamplingParams

FILL_TOKEN = 1000  # the id every fake sample takes (an ordinary SmolLM2 token, never EOS)


class HostOnlyRunner(ModelRunner):
    """`ModelRunner` with its device program replaced by zero-cost outputs of the same shapes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        real, outputs = self._jit, {}

        def fill(s):
            v = FILL_TOKEN if np.issubdtype(s.dtype, np.integer) else 0
            a = np.full(s.shape, v, s.dtype)
            a.flags.writeable = False  # a device result: the host only reads it
            return a

        def fake(*args, **kwargs):
            # kv caches, state and params keep their shapes: the packed buffers and the static
            # layout name the program
            key = (tuple(sorted(kwargs.items())), tuple(np.shape(x) for x in args[5]))
            if key not in outputs:
                (out, prompt, _), _, _, next_tokens = real.eval_shape(*args, **kwargs)
                # NOTE: made once per program: a device returns its results without host work
                # (allocating them every step measured ~60 us of the fake's own at 256 rows)
                outputs[key] = (
                    jax.tree.map(fill, out),
                    jax.tree.map(fill, prompt),
                    jax.tree.map(fill, next_tokens),
                )
            out, prompt, next_tokens = outputs[key]
            # the device state (KV cache, penalty rows) passes through untouched; no row logits
            # (only a step with structured-output rows reads them)
            return (out, prompt, None), args[2], args[3], next_tokens

        # NOTE: the runner calls its step programs through `self._steps` (a `ProgramTable`: the
        # programs warmup built, else the jit's, run through their executables), never through
        # `self._jit` alone: the table itself is replaced
        self._jit = fake
        self._steps = _FakeTable(self._steps, fake)


class _FakeTable:
    """A runner's `ProgramTable` whose calls all go to `fake` (its other attributes: the
    table's)."""

    def __init__(self, table, fake) -> None:
        self._table, self._fake = table, fake

    def __call__(self, key, args: tuple, kwargs: dict):
        return self._fake(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._table, name)


def make_engine(args, model: LoadedModel, max_num_seqs: int, max_len: int) -> LLMEngine:
    hf = dict(
        model_type="llama",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=1 << 20,
        vocab_size=model.tokenizer.vocab_size,
    )
    cfg = ModelConfig.from_hf(hf)
    params = params_lib.init_random(llama.param_specs(cfg), jax.random.key(0))
    tiny = LoadedModel(
        name="host-bench",
        path="<none>",
        source="none",
        cfg=cfg,
        hf_config=hf,
        params=params,
        tokenizer=model.tokenizer,
        dtype="float32",
    )
    pages = max_num_seqs * -(-max_len // args.page_size) + 1
    config = EngineConfig(
        page_size=args.page_size,
        num_pages=pages,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_len,
        dtype="float32",
    )
    engine = LLMEngine(tiny, config)
    engine.runner = HostOnlyRunner(
        cfg,
        params,
        page_size=args.page_size,
        num_pages=pages,
        max_model_len=max_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    return engine


def run_case(args, model: LoadedModel, seqs: int, prompt_len: int, stops: bool) -> dict:
    # Nobody may finish inside the timed window: while the prompts are prefilled a chunk at a
    # time, the requests admitted first already decode (at most one token per step), so
    # max_tokens covers that ramp (bounded by the prefill tokens over the budget the decodes
    # leave, plus a step per request) and the timed steps.
    ramp = -(-seqs * prompt_len // max(1, args.max_num_batched_tokens - seqs)) + seqs
    max_tokens = ramp + args.steps + 32
    max_len = prompt_len + max_tokens
    engine = make_engine(args, model, max(seqs, 1), max_len)
    if not args.no_freeze:  # as the engine-core process does once it is loaded and warmed up
        settle_heap()
    rng = np.random.default_rng(0)
    stop = ["\n\nUser:", "###", "<|im_end|>"] if stops else None
    sp = SamplingParams(
        max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=1, ignore_eos=True, stop=stop
    )
    for i in range(seqs):
        ids = rng.integers(1000, 20000, prompt_len).tolist()
        engine.add_request(ids, sp, request_id=f"b{i}")
    # Prefill everything (and compile the fake's shapes), then time decode steps only.
    while engine.scheduler.num_waiting or engine.core.scheduler.num_running < seqs:
        engine.step()
    for _ in range(5):
        engine.step()
    core_step, core_times = engine.core.step, []

    def timed_core_step():
        t0 = time.perf_counter()
        out = core_step()
        core_times.append((time.perf_counter() - t0) * 1e3)
        return out

    engine.core.step = timed_core_step
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    core_times = core_times[-args.steps :]
    if engine.core.scheduler.num_running != seqs:
        raise RuntimeError(
            f"{seqs - engine.core.scheduler.num_running} of {seqs} requests "
            f"finished inside the timed window: the case did not run {seqs} "
            f"sequences in every timed step"
        )
    return {
        "seqs": seqs,
        "prompt_len": prompt_len,
        "stop_strings": stops,
        "core_p50_ms": statistics.median(core_times),
        "core_p99_ms": _p99(core_times),
        "p50_ms": statistics.median(times),
        "p99_ms": _p99(times),
        "mean_ms": statistics.fmean(times),
    }


def _p99(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seqs", default="1,64,256", help="running sequences per case")
    p.add_argument("--prompt-lens", default="128,1024")
    p.add_argument("--steps", type=int, default=100, help="decode steps timed per case")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--no-stop-cases", action="store_true", help="only cases without stop strings")
    p.add_argument("--json", action="store_true", help="also print one JSON line per case")
    p.add_argument(
        "--no-freeze",
        action="store_true",
        help="leave the loaded heap in the cyclic collector's generations (the engine-core "
        "process freezes it after warmup: core_loop.settle_heap)",
    )
    args = p.parse_args(argv)
    model = load_model_info(None)
    rows = []
    for seqs in [int(x) for x in args.seqs.split(",")]:
        for plen in [int(x) for x in args.prompt_lens.split(",")]:
            for stops in (False,) if args.no_stop_cases else (False, True):
                rows.append(run_case(args, model, seqs, plen, stops))
                if args.json:
                    print(json.dumps(rows[-1]), flush=True)
    print(
        f"\nhost ms per engine step ({jax.default_backend()}, {args.steps} decode steps per case)"
    )
    print(
        "| seqs | prompt | stop strings | core p50 ms | core p99 ms | engine p50 ms | "
        "engine p99 ms | engine mean ms |"
    )
    print("| ---: | ---: | :---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['seqs']} | {r['prompt_len']} | {'yes' if r['stop_strings'] else 'no'} | "
            f"{r['core_p50_ms']:.3f} | {r['core_p99_ms']:.3f} | {r['p50_ms']:.3f} | "
            f"{r['p99_ms']:.3f} | {r['mean_ms']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
