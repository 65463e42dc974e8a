"""Serve a model over gRPC (`jaxinfer.v1.GenerateService`, health, reflection, Prometheus metrics).

    python scripts/serve.py                                  # the embedded SmolLM2, port 50051
    python scripts/serve.py --model path/to/model.gguf --port 50051 --metrics-port 8000
    python scripts/serve.py --trace-dir /tmp/trace --trace-steps 20   # profile 20 busy steps
    python scripts/serve.py --profile-port 9999              # live capture from TensorBoard
    python scripts/serve.py --model cfg_dir --load-format dummy  # random weights from config.json
    python scripts/serve.py --http-port 8080                 # plus the OpenAI-compatible HTTP API

1. The front end (this process, which imports no JAX) checks the flags (a bad `--mesh` string
   fails here), reads the model's config and tokenizer (no weights, no device) and spawns the
   engine-core process (`jaxinfer.engine.core_client`), which builds the mesh (`--mesh tensor=8`
   style, over every device), loads the weights onto it, builds the engine (`EngineConfig` from
   the flags) and compiles every program. `--engine-in-process` keeps the core on a thread of
   this process instead (JAX then loads here, as it does for multi-host serving).
2. Build one `FrontEnd` (`serving/frontend.py`: engine loop, admission, lifecycle, metrics) and
   start it, then the gRPC server over it and, with `--http-port`, the OpenAI-compatible HTTP API
   (`serving/http_server.py`) over the same front end: health NOT_SERVING until the core says
   ready, then SERVING; print a start-up summary and one load line per second while busy.
3. SIGTERM / SIGINT: health NOT_SERVING, new requests UNAVAILABLE, in-flight streams finish
   within `--grace-period`, then exit 0 (a second signal aborts what is left at once). If the
   engine-core process dies, in-flight requests fail and this process exits 1 (within 2 s); if
   this process dies, the engine core exits within 0.1 s.
4. Multi-host (`--coordinator-address host:port --num-processes N --process-id i`, one process
   per host): `jax.distributed` starts before anything touches a device; every process adopts
   process 0's engine flags and builds the same engine on the global mesh; process 0 serves gRPC
   and broadcasts each step to the others, which only follow (`jaxinfer/engine/multihost.py`)
   and exit 0 when process 0 shuts down. Under a Kubernetes LeaderWorkerSet the three flags
   default from its env (`lws_defaults`): `LWS_LEADER_ADDRESS` (+ port 8476) names the
   coordinator, `LWS_GROUP_SIZE` the number of processes, `LWS_WORKER_INDEX` the process id.
5. Under an orchestrator: `GET /health` (HTTP) or gRPC health is the readiness probe (200 /
   SERVING once warmed up; 503 / NOT_SERVING while loading, warming up or draining); on SIGTERM
   the server drains for `--grace-period` seconds, so give the pod a termination grace period a
   little longer. `scripts/deploy/` has a Deployment (one host) and a LeaderWorkerSet
   (multi-host); README "Running under an orchestrator" says more.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import sys
import time

import _path  # noqa: F401

logger = logging.getLogger("serve")

LWS_COORDINATOR_PORT = 8476  # jax.distributed's usual port, on the LeaderWorkerSet's leader

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'4GiB', '512M', '1000000' -> bytes (K/M/G/T are powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512M, 1000000)")
    scale = 1024 ** " kmgt".index(m.group(2).lower() or " ")
    return int(float(m.group(1)) * scale)


def quantization_flag(text: str) -> str:
    """--quantization: a format name (`int4-g32`, `int4-sym`, ...), vLLM's GPTQ / AWQ / GGUF
    names, or "none" (float weights)."""
    from checkpoints.quantize import check_requested  # NOTE: numpy only, no JAX

    try:
        return check_requested(text, "--quantization")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    from jaxinfer.model_info import LOAD_FORMATS
    from jaxinfer.vision.media import DEFAULT_MAX_BYTES

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default=None,
        help="GGUF file, HF dir or orbax dir (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0: a free one)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=8000,
        help="Prometheus /metrics HTTP port (0: a free one)",
    )
    p.add_argument("--no-metrics", action="store_true", help="do not serve /metrics")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="default: float32 on CPU, bfloat16 on accelerators",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=LOAD_FORMATS,
        help="'auto': the checkpoint's weights; 'dummy': random weights of the right "
        "shapes, made on the devices from --model's config.json (or GGUF metadata) "
        "and tokenizer, for benchmarking without the weights",
    )
    p.add_argument(
        "--quantization",
        type=quantization_flag,
        default=None,
        help="weight-only quantization of the linear weights and the embedding (int8: "
        "a scale per output channel and 128 input channels; fp8: per output "
        "channel; int4: 4-bit layers, scale + offset per 128 input channels, GGUF Q4_0/Q4_1 "
        "kept exactly; int8-g<n> / int4-g<n> other group sizes, int4-sym a symmetric grid), "
        "applied at load; gptq / awq (vLLM's names, also gptq_marlin / awq_marlin): a GPTQ / "
        "AWQ checkpoint in its own packed format (the default for one), any other refused; "
        "gguf: a GGUF file in its own bits (int4 for Q4 blocks, else int8; the default for "
        "one, as vLLM); none: float weights (a GGUF file's blocks dequantized to --dtype)",
    )
    p.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="load no tokenizer (a checkpoint without one serves): requests send "
        "token_ids, responses carry token ids with empty text",
    )
    e = p.add_argument_group("engine")
    e.add_argument("--page-size", type=int, default=16)
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-num-batched-tokens", type=int, default=512)
    e.add_argument(
        "--token-buckets",
        type=_token_buckets,
        default=None,
        help="the step token counts programs are compiled for, comma-separated (e.g. 8,64,512; "
        "the largest must reach --max-num-batched-tokens); default: 1, 2, 4, ... up to "
        "--max-num-batched-tokens. Fewer buckets compile fewer programs and pad more",
    )
    e.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="default: 2048 on CPU, the model's context elsewhere",
    )
    e.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=None,
        help="bytes for the KV cache, e.g. 2GiB (default: most of free device memory)",
    )
    e.add_argument("--num-pages", type=int, default=None, help="KV-cache pages (overrides memory)")
    e.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8"),
        default="auto",
        help="KV-cache storage: the model dtype, or fp8 (e4m3 with a power-of-two scale "
        "per slot and head: about twice the tokens of bf16 in the same memory)",
    )
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="wait for each step's tokens before scheduling the next (default: the next "
        "step is launched first, its decode tokens fed on the device)",
    )
    e.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=1,
        help="decode steps one program may run while every running request is a plain "
        "decode and nobody waits (multi-step scheduling; no data / pipeline mesh axes, no "
        "speculative decoding; default 1: off)",
    )
    e.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="most prompt tokens one request computes per step; smaller values cut "
        "the inter-token latency tail of running streams (default: no cap)",
    )
    e.add_argument(
        "--max-num-encoder-input-tokens",
        type=int,
        default=None,
        help="images' encoder tokens one step may take (a vision-language model): a step with "
        "several new images spreads them over steps (default: --max-num-batched-tokens)",
    )
    e.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s fields, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 3}\' (speculates while at '
        'most "disable_by_batch_size" requests are queued; default: off)',
    )
    e.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (vLLM)")
    e.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="PEFT LoRA adapters served as OpenAI model NAME (needs --enable-lora)",
    )
    e.add_argument("--max-loras", type=int, default=1, help="adapters in one batch (slots)")
    e.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank")
    e.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept on the host")
    e.add_argument(
        "--mesh",
        default="",
        help="mesh axis sizes over all devices, e.g. 'tensor=8' or "
        "'data=2,tensor=4' (default: one device)",
    )
    e.add_argument(
        "--attention-backend",
        default=None,
        choices=("auto", "reference", "cpu", "gpu", "tpu"),
        help="'auto' (default): the platform's kernel (compiled C++ on CPU, Pallas on GPU and "
        "TPU); 'reference' is the pure-JAX oracle",
    )
    e.add_argument(
        "--linear-backend",
        default=None,
        choices=("auto", "xla", "cpu", "gpu"),
        help="dense products: 'cpu' runs steps of <= 8 float32 token rows through the "
        "compiled CPU kernel (decode), 'gpu' int8 / int4 weights of steps of <= 64 rows through "
        "the Pallas dequantizing matmul, 'xla' always uses XLA's dot; default 'auto': 'cpu' on a "
        "CPU platform where the kernel builds, 'gpu' on a GPU",
    )
    s = p.add_argument_group("server")
    s.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics) on this port over "
        "the same engine (0: a free one; default: off)",
    )
    s.add_argument("--http-host", default=None, help="address of the HTTP API (default: --host)")
    s.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='chat tool_choice "auto" (the default with tools): the model\'s own tool calls, '
        "parsed by --tool-call-parser",
    )
    s.add_argument(
        "--tool-call-parser",
        default=None,
        choices=("hermes", "llama3_json", "mistral"),
        help="the model's tool-call format: hermes (Qwen, Hermes: <tool_call> JSON), "
        "llama3_json (Llama 3.x JSON), mistral ([TOOL_CALLS] JSON)",
    )
    s.add_argument(
        "--reasoning-parser",
        default=None,
        choices=("deepseek_r1", "qwen3"),
        help="split <think> output into chat responses' reasoning_content",
    )
    s.add_argument(
        "--served-model-name",
        default=None,
        help="the model id HTTP clients name (default: the checkpoint's name)",
    )
    s.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="fcfs (default, as vLLM): first come first served, a non-zero request `priority` "
        "is refused; priority: lower `priority` first, and when KV-cache pages run short the "
        "lowest-priority (then newest) running request is preempted",
    )
    s.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every HTTP endpoint but /health, /ping and "
        "/metrics, and the same `authorization` metadata on gRPC (default: open; also read "
        "from $JAXINFER_API_KEY)",
    )
    s.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="sequences admitted beyond --max-num-seqs before RESOURCE_EXHAUSTED",
    )
    s.add_argument(
        "--limit-mm-per-prompt",
        type=_mm_limits,
        default=None,
        help="most items per prompt of each modality, as JSON, e.g. '{\"image\": 2}' "
        "(vision-language models; default: no limit)",
    )
    s.add_argument(
        "--allowed-local-media-path",
        type=_media_dir,
        default=None,
        help="chat image parts may name file:// URLs under this directory (resolved: `..` and "
        "symlinks out of it are refused; default: no files are read)",
    )
    s.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        help="hosts http(s):// image URLs may be fetched from (redirects checked too; default: "
        "any host). Fetches time out after $VLLM_IMAGE_FETCH_TIMEOUT s (default 5); "
        "VLLM_MEDIA_URL_ALLOW_REDIRECTS=0 refuses redirects",
    )
    s.add_argument(
        "--max-image-bytes",
        type=parse_bytes,
        default=DEFAULT_MAX_BYTES,
        help="largest image fetched from a URL or read from a file, e.g. 20MiB (the default)",
    )
    s.add_argument(
        "--max-request-bytes",
        type=parse_bytes,
        default=None,
        help="largest HTTP request body / gRPC message read, e.g. 8MiB (HTTP 413 / "
        "RESOURCE_EXHAUSTED beyond, before it is read; default: 128 bytes per "
        "max_model_len token, at least 4MiB)",
    )
    s.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        help="seconds in-flight streams get to finish on SIGTERM/SIGINT",
    )
    s.add_argument(
        "--no-warmup", action="store_true", help="serve at once and compile programs on first use"
    )
    cache = s.add_mutually_exclusive_group()
    cache.add_argument(
        "--compilation-cache-dir",
        default=None,
        metavar="DIR",
        help="persistent XLA compilation cache: a restart reads its compiled programs from here "
        "(default: $JAX_COMPILATION_CACHE_DIR if set, else $XDG_CACHE_HOME/jaxinfer/xla or "
        "~/.cache/jaxinfer/xla; an empty DIR turns it off)",
    )
    cache.add_argument(
        "--no-compilation-cache",
        action="store_true",
        help="compile every program at start (no persistent compilation cache)",
    )
    s.add_argument(
        "--log-interval", type=float, default=1.0, help="seconds between load log lines while busy"
    )
    s.add_argument(
        "--engine-in-process",
        action="store_true",
        help="run the engine core on a thread of the server process (default: a process "
        "of its own, so the gRPC front end never shares the GIL with the step loop; "
        "multi-host serving always runs it in process)",
    )
    s.add_argument(
        "--fake-runner",
        action="store_true",
        help="no model compute: tokens are a function of prompt and position "
        "(tests, and measuring the server's own overhead)",
    )
    s.add_argument(
        "--fake-step-delay", type=float, default=0.0, help="seconds each --fake-runner step sleeps"
    )
    s.add_argument(
        "--fake-poison-token",
        type=int,
        default=None,
        help="testing, with --fake-runner only: a step holding a request whose prompt has this "
        "token id raises (fault isolation fails that request alone)",
    )
    m = p.add_argument_group("multi-host (one process per host; process 0 serves gRPC)")
    m.add_argument(
        "--coordinator-address",
        default=None,
        help="host:port of process 0's jax.distributed coordinator (same on every process; "
        "default under a LeaderWorkerSet with more than one process: "
        f"$LWS_LEADER_ADDRESS:{LWS_COORDINATOR_PORT})",
    )
    m.add_argument(
        "--num-processes",
        type=int,
        default=None,
        help="processes (hosts) in all (default: $LWS_GROUP_SIZE under a Kubernetes "
        "LeaderWorkerSet, else 1)",
    )
    m.add_argument(
        "--process-id",
        type=int,
        default=None,
        help="this process's index, 0 serves (default: $LWS_WORKER_INDEX, else 0)",
    )
    s.add_argument(
        "--kv-events-config",
        default=None,
        help="vLLM's KV-cache events JSON, e.g. '{\"enable_kv_cache_events\": true, "
        '"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}\': BlockStored / '
        "BlockRemoved / AllBlocksCleared batches over ZMQ PUB for cache-aware routers",
    )
    prof = p.add_argument_group("profiling")
    prof.add_argument(
        "--profile-port",
        type=int,
        default=None,
        help="start jax.profiler's server, for live capture from TensorBoard",
    )
    prof.add_argument(
        "--trace-dir",
        default=None,
        help="write a jax profiler trace of --trace-steps busy engine steps here",
    )
    prof.add_argument("--trace-steps", type=int, default=10)
    return p


def engine_args(args: argparse.Namespace):
    """The flags that shape the engine, as the data the engine-core process is built from."""
    from jaxinfer.spec_decode import SpeculativeConfig
    from serving.launch import EngineArgs

    spec = SpeculativeConfig.parse(args.speculative_config)  # a bad field fails before loading
    options = dict(
        page_size=args.page_size,
        num_pages=args.num_pages,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        token_buckets=args.token_buckets,
        enable_prefix_caching=not args.no_prefix_caching,
        async_scheduling=not args.no_async_scheduling,
        num_scheduler_steps=args.num_scheduler_steps,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_encoder_input_tokens=args.max_num_encoder_input_tokens,
        speculative_config=spec.to_dict() if spec else None,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
    )
    return EngineArgs(
        model=args.model,
        dtype=args.dtype,
        mesh=args.mesh,
        max_model_len=args.max_model_len,
        options=options,
        attention_backend=args.attention_backend,
        linear_backend=args.linear_backend,
        fake_runner=args.fake_runner,
        fake_step_delay=args.fake_step_delay,
        fake_poison_token=args.fake_poison_token,
        load_format=args.load_format,
        quantization=args.quantization,
        skip_tokenizer_init=args.skip_tokenizer_init,
        compilation_cache_dir="" if args.no_compilation_cache else args.compilation_cache_dir,
    )


def loop_options(args: argparse.Namespace):
    from jaxinfer.engine.core_client import LoopOptions

    return LoopOptions(
        warmup=not args.no_warmup,
        trace_dir=args.trace_dir,
        trace_steps=args.trace_steps if args.trace_dir else 0,
        profile_port=args.profile_port,
        kv_events=args.kv_events_config,
    )


def summary(frontend, grpc_server, http, args, load_s: float, ready_s: float) -> str:
    info = grpc_server.model_info
    core = frontend.info
    cfg = frontend.model.cfg
    cap = info.capacity
    mesh = ",".join(f"{k}={v}" for k, v in sorted(info.mesh_shape.items())) or "-"
    where = (
        "engine core in this process"
        if args.engine_in_process or args.num_processes > 1
        else "engine core in its own process"
    )
    # the format the core loaded (a GPTQ / AWQ checkpoint's or a GGUF file's own without
    # --quantization; None: floats)
    quantization = core.quantization if core is not None else args.quantization
    quantization = None if quantization == "none" else quantization
    http_line = "off (--http-port)"
    if http is not None:
        http_line = f"http://{http.host}:{http.port}/v1 (OpenAI API, model id {http.model_name!r})"
    metrics = frontend.metrics_port
    cache = "compilation cache off"
    if core is not None and core.compilation_cache:
        cache = (
            f"{core.cached_programs} from the compilation cache {core.compilation_cache} "
            f"({core.loaded_programs} loaded as executables)"
        )
    lines = [
        f"jaxinfer server ready in {ready_s:.1f}s (front end {load_s:.1f}s, engine load + warmup "
        f"{ready_s - load_s:.1f}s, {frontend.compiled_programs} programs, {cache}; {where})",
        f"  model     {info.name} ({info.architecture}, {cfg.num_params() / 1e6:.1f}M params, "
        f"{info.dtype}{f', {quantization} weights' if quantization else ''}"
        f"{', FAKE RUNNER' if args.fake_runner else ''}"
        f"{', DUMMY WEIGHTS' if args.load_format == 'dummy' and not args.fake_runner else ''})",
        f"  devices   {core.devices if core is not None else '?'}; mesh {mesh}; "
        f"attention {info.attention_backend}; linear {info.linear_backend}",
        f"  kv cache  {cap.num_pages} pages x {info.page_size} tokens = {cap.max_tokens} tokens"
        f"{' (fp8)' if args.kv_cache_dtype == 'fp8' else ''}; "
        f"max_model_len {info.max_model_len}",
        f"  batching  max_num_seqs {cap.max_num_seqs}, max_num_batched_tokens "
        f"{cap.max_num_batched_tokens}, max_queue {cap.max_queue}",
        f"  speculate {args.speculative_config or 'off'}",
        f"  grpc      {args.host}:{grpc_server.port} (jaxinfer.v1.GenerateService, health, "
        f"reflection)",
        f"  metrics   {f'http://{args.host}:{metrics}/metrics' if metrics else 'off'}",
        f"  http      {http_line}",
    ]
    if args.profile_port is not None:
        lines.append(f"  profiler  port {args.profile_port} (TensorBoard > Profile > Capture)")
    if args.trace_dir:
        lines.append(f"  trace     first {args.trace_steps} busy steps -> {args.trace_dir}")
    return "\n".join(lines)


# Flags that shape the engine: in multi-host mode every process uses process 0's values.
ENGINE_FLAGS = (
    "model",
    "dtype",
    "load_format",
    "quantization",
    "kv_cache_dtype",
    "skip_tokenizer_init",
    "page_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "kv_cache_memory",
    "num_pages",
    "no_prefix_caching",
    "mesh",
    "attention_backend",
    "linear_backend",
    "no_warmup",
    "long_prefill_token_threshold",
    "max_num_encoder_input_tokens",
    "no_async_scheduling",
    "num_scheduler_steps",
    "speculative_config",
)


def start_multihost(args: argparse.Namespace):
    """Starts jax.distributed; returns the step channel with every process on process 0's flags."""
    from jaxinfer.engine import multihost

    if args.coordinator_address is None:
        raise ValueError("--num-processes > 1 needs --coordinator-address host:port (process 0's)")
    if args.fake_runner:
        raise ValueError("--fake-runner serves from one process; drop --num-processes")
    multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)
    channel = multihost.StepChannel()
    flags = None
    if multihost.is_leader():
        if args.num_pages is None and args.kv_cache_memory is None:
            from jaxinfer.engine.core import default_kv_cache_memory

            # NOTE: free memory differs per host; the KV cache must not, so process 0 decides.
            args.kv_cache_memory = default_kv_cache_memory()
        flags = {k: getattr(args, k) for k in ENGINE_FLAGS}
    flags = multihost.broadcast_config(channel, flags)
    for k, v in flags.items():
        if getattr(args, k) != v and not multihost.is_leader():
            logger.info(
                "--%s: using process 0's %r (not %r)", k.replace("_", "-"), v, getattr(args, k)
            )
        setattr(args, k, v)
    if not args.mesh:
        import jax

        raise ValueError(
            f"multi-host serving needs a --mesh over all {jax.device_count()} devices "
            f"of the {args.num_processes} processes, e.g. --mesh tensor={jax.device_count()}"
        )
    return channel


def engine_identity(core) -> tuple[str, tuple]:
    """What must be equal on every process for them to compile the same programs."""
    return (
        "the engine (model config, engine config, token buckets)",
        (core.cfg, core.config, core.runner.token_buckets),
    )


def follow(args: argparse.Namespace, channel) -> int:
    """Processes other than 0: build the same engine, run what process 0 sends, exit 0."""
    from jaxinfer.engine import multihost
    from serving.launch import build_core

    core = build_core(engine_args(args))
    multihost.check_same_everywhere(*engine_identity(core))
    logger.info("process %d follows process 0", args.process_id)
    steps = multihost.follow(core.runner, channel)
    logger.info("process %d: process 0 shut down after %d steps; exiting", args.process_id, steps)
    return 0


async def serve(args: argparse.Namespace, channel=None) -> int:
    """Process 0: the gRPC front end; the engine core in its own process (default) or, with
    --engine-in-process and on multi-host, on a thread of this one."""
    from jaxinfer.engine.core_client import CoreSpec, ProcessCoreClient
    from jaxinfer.engine.core_loop import ThreadCoreClient
    from serving.launch import build_core, frontend_model

    t0 = time.perf_counter()
    eargs = engine_args(args)
    model = await asyncio.to_thread(frontend_model, eargs)
    if channel is None and not args.engine_in_process:
        client = ProcessCoreClient(CoreSpec(build_core, {"args": eargs}, loop_options(args)))
    else:
        core = await asyncio.to_thread(build_core, eargs)
        if channel is not None:
            from jaxinfer.engine import multihost

            await asyncio.to_thread(multihost.check_same_everywhere, *engine_identity(core))
            core.runner = multihost.attach_leader(core.runner, channel)
        client = ThreadCoreClient(core, loop_options(args))
    load_s = time.perf_counter() - t0
    try:
        return await _serve(args, model, client, t0, load_s)
    finally:
        if channel is not None:
            channel.shutdown()  # the engine thread has stopped: no step can interleave


def _token_buckets(text: str) -> tuple[int, ...]:
    """`--token-buckets`: comma-separated step sizes >= 1."""
    try:
        buckets = tuple(int(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 8,64,512, got {text!r}") from None
    if min(buckets) < 1:
        raise argparse.ArgumentTypeError(f"buckets must be >= 1, got {text!r}")
    return buckets


def _mm_limits(text: str) -> dict[str, int]:
    """`--limit-mm-per-prompt`: a JSON object of modality -> count (only "image" is served)."""
    try:
        limits = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r}") from None
    if not isinstance(limits, dict) or set(limits) - {"image"}:
        raise argparse.ArgumentTypeError(f'expected an object like {{"image": 2}}, got {text!r}')
    if any(not isinstance(v, int) or v < 0 for v in limits.values()):
        raise argparse.ArgumentTypeError(f"limits must be integers >= 0, got {text!r}")
    return limits


def _media_dir(text: str) -> str:
    """`--allowed-local-media-path`: an existing directory."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"not a directory: {text!r}")
    return text


async def _serve(args: argparse.Namespace, model, client, t0: float, load_s: float) -> int:
    from jaxinfer.vision.media import MediaConnector
    from serving.frontend import FrontEnd
    from serving.http_server import OpenAIServer
    from serving.server import GenerateServer

    frontend = FrontEnd(
        model=model,
        core=client,
        max_num_seqs=args.max_num_seqs,
        metrics_port=None if args.no_metrics else args.metrics_port,
        max_queue=args.max_queue,
        grace_period=args.grace_period,
        log_interval=args.log_interval,
        max_request_bytes=args.max_request_bytes,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        media=MediaConnector(
            args.allowed_local_media_path,
            args.allowed_media_domains,
            max_bytes=args.max_image_bytes,
        ),
        scheduling_policy=args.scheduling_policy,
        api_key=args.api_key or os.environ.get("JAXINFER_API_KEY") or None,
    )
    if args.enable_lora:
        from serving.lora_adapters import LoRAAdapters, parse_lora_modules

        frontend.loras = LoRAAdapters(args.max_lora_rank)
        for name, path in parse_lora_modules(args.lora_modules):
            frontend.loras.add(name, path)
    grpc_server = GenerateServer(
        frontend=frontend, host=args.host, port=args.port, reasoning_parser=args.reasoning_parser
    )
    http = None
    if args.http_port is not None:
        http = OpenAIServer(
            frontend,
            host=args.http_host or args.host,
            port=args.http_port,
            served_model_name=args.served_model_name,
            chat_options=args.chat_options,
        )
    try:
        await frontend.start()
    except RuntimeError as e:
        why = str(e)
        if "failed to start: " in why:  # the engine's arguments: a usage error
            print(f"error: {why.split('failed to start: ', 1)[1]}", file=sys.stderr)
            return 2
        raise
    # NOTE: HTTP first: bench_serving.py --spawn reads the HTTP URL from the log before the gRPC
    # "listening on" line.
    if http is not None:
        await http.start()
    await grpc_server.start()
    frontend.install_signal_handlers()
    ready = asyncio.create_task(frontend.wait_ready())
    stopped = asyncio.create_task(frontend.wait_for_termination())
    await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():  # a signal arrived during warmup
        ready.cancel()
    elif ready.exception() is not None:
        logger.error("%s", ready.exception())
        await frontend.shutdown(0)
        return 1
    else:
        elapsed = time.perf_counter() - t0
        logger.info("%s", summary(frontend, grpc_server, http, args, load_s, elapsed))
    await stopped
    return frontend.exit_code


def lws_defaults(args: argparse.Namespace, env: dict[str, str] | os._Environ = os.environ) -> None:
    """Fills the multi-host flags left unset from a Kubernetes LeaderWorkerSet's env
    (`LWS_GROUP_SIZE`, `LWS_WORKER_INDEX`, `LWS_LEADER_ADDRESS`); 1 process without it."""
    if args.num_processes is None:
        args.num_processes = int(env.get("LWS_GROUP_SIZE", "1"))
    if args.process_id is None:
        args.process_id = int(env.get("LWS_WORKER_INDEX", "0"))
    leader = env.get("LWS_LEADER_ADDRESS")
    if args.coordinator_address is None and leader and args.num_processes > 1:
        args.coordinator_address = f"{leader}:{LWS_COORDINATOR_PORT}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    lws_defaults(args)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    try:
        from serving.chat import ChatOptions

        args.chat_options = ChatOptions(
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
        )
        if args.kv_events_config is not None:
            from jaxinfer.engine.kv_events import KVEventsConfig

            KVEventsConfig.parse(args.kv_events_config)  # a bad field fails before loading
        channel = start_multihost(args) if args.num_processes > 1 else None
        if channel is not None and args.process_id != 0:
            return follow(args, channel)
        return asyncio.run(serve(args, channel))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
