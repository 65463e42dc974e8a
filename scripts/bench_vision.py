"""Vision (issue 36): the image encoder's time per image and the TTFT of a prompt with one image on
this machine, or the encoder program's GPU launches compiled deviceless for an H100.

    python scripts/bench_vision.py --model scripts/configs/gemma-3-vlm-tiny --runs 7
    python scripts/bench_vision.py --model scripts/configs/gemma-3-4b-it --quantization int8 --runs 3
    python scripts/bench_vision.py --model scripts/configs/gemma-3-4b-it --aot h100

1. An `LLM(model, load_format="dummy", skip_tokenizer_init=True)`: random weights from the
   config (a directory with `config.json`, as `scripts/configs/`), one sequence slot, a token
   budget holding the whole prompt (`--prompt-len` text tokens around one image's run of soft
   tokens) in one step unless `--max-num-batched-tokens` chunks it, no prefix caching (every
   run computes its whole prompt).
2. Warm-up: a prompt with an image and one without compile the programs (the encoder's too).
3. Runs alternate (a) the encoder alone on a fresh random image (`ImageEncoder.embeds`: the
   host's normalization, the jitted vision tower, its rows back on the host), (b) the TTFT of the
   prompt with a fresh random image (a new hash: nothing cached): the wall time of
   `generate(max_tokens=1)`, (c) the TTFT of a text prompt of the same length. Medians.
4. `--aot TARGET` instead compiles the encoder program (`jaxinfer.vision.encoder.encode`, one
   image, the engine's f32 unless `--dtype`) for TARGET without the device
   (`jaxinfer.aot.compile_function`) and counts its GPU kernel launches from XLA's thunk dump
   (`jaxinfer.aot.report.launches`): in all, per vision layer, outside the layers; with its
   memory (weights, temp). `--encoder-only` times (a) alone, without the language model.
Prints a table and one JSON line (the command, the machine, jax's version).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import _path  # noqa: F401
import numpy as np


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a Gemma 3 VLM dir (config.json is enough)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--quantization", default=None, help="the language model's (e.g. int8)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=16, help="text tokens beside the image")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the step's token budget (default: the whole prompt in one step); smaller: "
        "chunked prefill (XLA:CPU's step temp grows with it: a 4B prompt in one 512-token step "
        "asked 35 GB)",
    )
    p.add_argument(
        "--encoder-only",
        action="store_true",
        help="time the encoder alone (its random f32 weights, no language model)",
    )
    p.add_argument("--aot", default=None, help="compile the encoder for this target (h100)")
    return p.parse_args(argv)


def _config(model: str) -> dict:
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)


def _prompts(hf: dict, text_len: int, seed: int) -> tuple[list[int], list[int]]:
    """(ids with one image run, text ids of the same length)."""
    tokens = int(hf.get("mm_tokens_per_image", 256))
    rng = np.random.default_rng(seed)
    text = rng.integers(3, 200, text_len).tolist()
    half = text_len // 2
    run = [hf["boi_token_index"], *[hf["image_token_index"]] * tokens, hf["eoi_token_index"]]
    with_image = [2, *text[:half], *run, *text[half:]]
    return with_image, [2, *text[:half], *rng.integers(3, 200, len(run)).tolist(), *text[half:]]


def bench(args: argparse.Namespace) -> dict:
    from jaxinfer.llm import LLM
    from jaxinfer.sampling_params import SamplingParams

    hf = _config(args.model)
    side = int(hf["vision_config"].get("image_size", 896))
    n = len(_prompts(hf, args.prompt_len, 0)[0])
    budget = 1 << (n - 1).bit_length()
    llm = LLM(
        args.model, load_format="dummy", skip_tokenizer_init=True, dtype=args.dtype,
        quantization=args.quantization, max_model_len=budget, max_num_seqs=1,
        max_num_batched_tokens=args.max_num_batched_tokens or budget,
        num_pages=2 * budget // 16 + 2, enable_prefix_caching=False,
    )  # fmt: skip
    encoder = llm.engine.core.runner.images.encoder
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    rng = np.random.default_rng(0)

    def image() -> np.ndarray:
        return rng.integers(0, 256, (side, side, 3), dtype=np.uint8)

    def ttft(ids: list[int], img: np.ndarray | None) -> float:
        prompt = ids if img is None else {"prompt_token_ids": ids, "multi_modal_data": {}}
        if img is not None:
            from PIL import Image

            prompt["multi_modal_data"]["image"] = Image.fromarray(img)
        t = time.perf_counter()
        llm.generate([prompt], sp)
        return time.perf_counter() - t

    t = time.perf_counter()
    ids, text = _prompts(hf, args.prompt_len, 0)
    ttft(ids, image())
    ttft(text, None)
    warmup_s = time.perf_counter() - t
    print(f"warm-up (compiles) {warmup_s:.1f} s", flush=True)
    enc, with_image, text_only = [], [], []
    for r in range(args.runs):
        ids, text = _prompts(hf, args.prompt_len, r + 1)
        t = time.perf_counter()
        encoder.embeds(image())
        enc.append(time.perf_counter() - t)
        with_image.append(ttft(ids, image()))
        text_only.append(ttft(text, None))
        print(f"run {r}: encoder {enc[-1]:.4f} s, TTFT with the image {with_image[-1]:.4f} s, "
              f"text only {text_only[-1]:.4f} s", flush=True)  # fmt: skip
    return dict(
        prompt_tokens=n,
        image_tokens=int(hf.get("mm_tokens_per_image", 256)),
        image_size=side,
        dtype=str(llm.model.dtype),
        quantization=args.quantization,
        max_num_batched_tokens=args.max_num_batched_tokens or budget,
        warmup_s=round(warmup_s, 2),
        encoder_s=round(statistics.median(enc), 4),
        ttft_image_s=round(statistics.median(with_image), 4),
        ttft_text_s=round(statistics.median(text_only), 4),
        runs={"encoder": enc, "ttft_image": with_image, "ttft_text": text_only},
    )


def encoder_only(args: argparse.Namespace) -> dict:
    """(a) alone: the model's `ImageEncoder` over random f32 weights, without the language model."""
    from jaxinfer.vision.encoder import ImageEncoder, VisionConfig, random_params
    from jaxinfer.vision.processor import VisionSpec

    hf = _config(args.model)
    vcfg = VisionConfig.from_hf(hf)
    encoder = ImageEncoder(vcfg, random_params(vcfg), VisionSpec.from_hf(hf))
    rng = np.random.default_rng(0)
    side = vcfg.image_size
    t = time.perf_counter()
    encoder.embeds(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
    warmup_s = time.perf_counter() - t
    print(f"warm-up (compiles) {warmup_s:.1f} s", flush=True)
    enc = []
    for r in range(args.runs):
        t = time.perf_counter()
        encoder.embeds(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
        enc.append(time.perf_counter() - t)
        print(f"run {r}: encoder {enc[-1]:.3f} s", flush=True)
    return dict(
        image_size=side, image_tokens=vcfg.tokens_per_image, warmup_s=round(warmup_s, 2),
        encoder_s=round(statistics.median(enc), 3), runs={"encoder": enc},
    )  # fmt: skip


def abstract_params(vcfg, dtype):
    """`VisionParams` of `jax.ShapeDtypeStruct`s (the shapes `random_params` makes)."""
    import jax

    from jaxinfer.vision.encoder import VisionLayer, VisionParams

    d, f, p = vcfg.hidden, vcfg.intermediate, vcfg.patch_size

    def s(*shape: int):
        return jax.ShapeDtypeStruct(shape, dtype)

    layer = VisionLayer(
        s(d), s(d), s(d, 3, d), s(3, d), s(d, d), s(d), s(d), s(d), s(d, f), s(f), s(f, d), s(d)
    )
    n = vcfg.patches_per_side**2
    return VisionParams(
        s(3 * p * p, d), s(d), s(n, d), (layer,) * vcfg.num_layers, s(d), s(d), s(d),
        s(d, vcfg.text_hidden),
    )  # fmt: skip


def aot(args: argparse.Namespace) -> dict:
    import tempfile

    import jax
    import jax.numpy as jnp

    from jaxinfer import aot as aot_lib
    from jaxinfer.aot import report
    from jaxinfer.vision.encoder import VisionConfig, encode

    vcfg = VisionConfig.from_hf(_config(args.model))
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    params = abstract_params(vcfg, dtype)
    px = jax.ShapeDtypeStruct((1, 3, vcfg.image_size, vcfg.image_size), jnp.float32)
    with tempfile.TemporaryDirectory(prefix="aot_vision_") as dump:
        t = time.perf_counter()
        compiled = aot_lib.compile_function(
            lambda prm, x: encode(prm, vcfg, x), [params, px], args.aot,
            compiler_options={"xla_dump_to": dump},
        )  # fmt: skip
        compile_s = time.perf_counter() - t
        lau = report.launches(dump, report.hlo_ops(compiled.as_text()))
    layers = {k: v for k, v in lau.per_scope.items() if k.startswith("vision_layer_")}
    per_layer = sorted(layers.values())
    mem = compiled.memory_analysis()
    return dict(
        target=args.aot,
        dtype=str(jnp.dtype(dtype)),
        image_size=vcfg.image_size,
        patches=vcfg.patches_per_side**2,
        vision_layers=vcfg.num_layers,
        compile_s=round(compile_s, 1),
        kernels=lau.kernels,
        memory_ops=lau.memory_ops,
        kernels_per_vision_layer=per_layer[len(per_layer) // 2] if per_layer else 0,
        kernels_outside_layers=lau.kernels - sum(per_layer),
        outside_layers={k: v for k, v in lau.per_scope.items() if k not in layers},
        host_launches=lau.host_launches,
        argument_bytes=int(mem.argument_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.aot:
        os.environ["JAX_PLATFORMS"] = "cpu"  # NOTE: deviceless compiles need the CPU platform
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import jax

    out = aot(args) if args.aot else encoder_only(args) if args.encoder_only else bench(args)
    for k, v in out.items():
        if k != "runs":
            print(f"{k:>26}: {v}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    out.update(
        command="python " + " ".join(sys.argv),
        model=args.model,
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        load_1min=load,
        jax=jax.__version__,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
