"""Multi-LoRA step cost: a batch of decodes with N adapters mixed vs the same batch without LoRA.

    python scripts/bench_lora.py                       # 64 decodes, 4 rank-16 adapters, 30 layers
    python scripts/bench_lora.py --rounds 7 --steps 5

1. The default model's shapes (`scripts/configs/smollm2-135m`, random f32 weights: the step time
   does not depend on their values), the runner's default attention and linear backends, one
   ragged decode step of `--seqs` sequences with `--context` tokens each already in the paged
   cache, logits for every row (as a decode step samples every row).
2. "base": the params without LoRA stacks (an engine without enable_lora). "lora": `--adapters`
   random PEFT-shaped adapters of rank `--rank` on every target (q/k/v/o/gate/up/down) written
   into `max_loras = --adapters` slots, the batch's rows spread over them round-robin.
3. Each is compiled once (its own jit), then `--rounds` rounds alternate the cases, `--steps`
   timed steps each; the table gives each one's median ms per step over the rounds and the
   overhead against base.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import _path  # noqa: F401
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import attention, layers
from jaxinfer import params as params_lib
from jaxinfer.config import ModelConfig
from jaxinfer.lora import device as lora_device
from jaxinfer.lora.adapter import LoRAAdapter, target_dims
from jaxinfer.models import llama
from jaxinfer.step import StepInputs, build_step_arrays

CONFIG = os.path.join(os.path.dirname(__file__), "configs", "smollm2-135m", "config.json")


def random_adapter(cfg: ModelConfig, rank: int, seed: int) -> LoRAAdapter:
    rng = np.random.default_rng(seed)
    weights = {}
    for layer in range(cfg.num_layers):
        for target, (d_in, parts, d_out) in target_dims(cfg).items():
            a = rng.normal(0, 0.02, (d_in, parts, rank)).astype(np.float32)
            b = rng.normal(0, 0.02, (parts, rank, d_out)).astype(np.float32)
            weights[layer, target] = (a, b)
    return LoRAAdapter(rank, 1.0, weights)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args()

    with open(CONFIG) as f:
        cfg = ModelConfig.from_hf(json.load(f))
    backend = attention.resolve_backend(None)
    linear = layers.resolve_linear_backend(None)
    params = params_lib.init_random(llama.param_specs(cfg), jax.random.key(0))
    stacks = lora_device.empty_stacks(cfg, args.adapters, args.rank)
    for slot in range(1, args.adapters + 1):
        stacks = lora_device.write_slot(stacks, slot, random_adapter(cfg, args.rank, slot))
    assert set(stacks[0]) == set(lora_device.GROUPS)
    with_lora = lora_device.attach(params, stacks)

    ps = args.page_size
    per_seq = -(-(args.context + 1) // ps)
    seqs = [
        ([7], args.context, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(args.seqs)
    ]
    arrays = build_step_arrays(
        seqs,
        ps,
        num_tokens=args.seqs,
        num_seqs=args.seqs,
        pages_per_seq=per_seq,
        logits_rows=list(range(args.seqs)),
        num_logits=args.seqs,
    )
    base_step = StepInputs(**{k: jnp.asarray(v) for k, v in arrays.items()})
    slots = (np.arange(args.seqs) % args.adapters + 1).astype(np.int32)
    lora_step = base_step.replace(lora_slots=jnp.asarray(slots))
    shape = llama.kv_cache_shape(cfg, backend, args.seqs * per_seq + 1, ps)
    caches = {
        name: tuple(jnp.zeros(shape, jnp.float32) for _ in range(cfg.num_layers))
        for name in ("base", "lora")
    }
    cases = {"base": (params, base_step), "lora": (with_lora, lora_step)}
    statics = ("cfg", "attention_backend", "linear_backend")
    jits = {name: jax.jit(llama.forward, static_argnames=statics) for name in cases}

    def run(name: str, n: int) -> float:
        p, step = cases[name]
        start = time.perf_counter()
        for _ in range(n):
            logits, caches[name] = jits[name](
                p, cfg, step, caches[name], attention_backend=backend, linear_backend=linear
            )
        logits.block_until_ready()
        return (time.perf_counter() - start) / n * 1e3

    for name in cases:
        run(name, 2)  # compile + one warm step
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name in cases:
            times[name].append(run(name, args.steps))
    base = statistics.median(times["base"])
    print(
        f"{args.seqs} decodes, context {args.context}, {cfg.num_layers} layers, {args.adapters} "
        f"adapters of rank {args.rank}, attention {backend}, linear {linear}, load "
        f"{os.getloadavg()[0]:.1f}"
    )
    print("| case | median ms/step | rounds (ms/step) |\n| --- | ---: | --- |")
    for name in cases:
        print(f"| {name} | {statistics.median(times[name]):.1f} | "
              f"{', '.join(f'{t:.1f}' for t in times[name])} |")  # fmt: skip
    for name in list(cases)[1:]:
        print(f"{name} overhead: {100 * (statistics.median(times[name]) / base - 1):+.1f}%")


if __name__ == "__main__":
    main()
