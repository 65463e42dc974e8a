"""Online serving benchmark: a ShareGPT-like workload sent to a running server over gRPC and/or
its OpenAI-compatible HTTP API.

    python scripts/bench_serving.py --port 50051 --num-requests 200 --request-rate 4
    python scripts/bench_serving.py --spawn --num-requests 64 --request-rate inf
    python scripts/bench_serving.py --spawn --spawn-args="--fake-runner" --num-requests 512
    python scripts/bench_serving.py --spawn --model cfg_dir --load-format dummy  # random weights
    python scripts/bench_serving.py --spawn --backend both --spawn-args="--fake-runner"  # gRPC vs HTTP
    python scripts/bench_serving.py --backend openai --http-url http://localhost:8000/v1  # vLLM, ...

In the spirit of vLLM's `benchmark_serving.py` and JetStream's `benchmark_serving.py`:
1. Workload: `bench_offline.sharegpt_like` prompt/output lengths (fixed seed, clipped to the
   server's max_model_len); prompts are random token ids, and each request generates exactly its
   output length (`ignore_eos`, greedy), so runs are comparable.
2. Arrivals: a Poisson process at `--request-rate` requests/s (exponential gaps, seeded), or all
   at t=0 with `inf`; `--max-concurrency` caps requests in flight on the client side.
3. Each request is one streamed `Generate` (`--backend grpc`), or one streamed
   `POST /v1/completions` (`--backend openai`, over aiohttp like vLLM's benchmark: token ids as
   the prompt, `stream_options.include_usage` for the token count; a chunk's tokens share its
   gap); `--backend both` runs the same workload over gRPC, then HTTP, on the same server, and
   prints their output-throughput ratio. Each backend first serves 16 unmeasured requests. The
   client stamps every message. Reported: request
   throughput, output and total tok/s, TTFT, inter-token latency (gaps between tokens after the
   first, each token of a multi-token message getting its share), TPOT ((e2e - TTFT) / (output
   - 1) per request) and end-to-end latency as mean / p50 / p90 / p99, and goodput: requests/s
   that met the SLO (TTFT <= --slo-ttft and TPOT <= --slo-tpot).
   `--backend openai` needs nothing but `--http-url` (any OpenAI-compatible server: this one,
   vLLM, ...): the model id and max_model_len come from `GET /v1/models`, prompts are random ids
   below `--vocab-size` (default 32000 there), `--api-key` (or $OPENAI_API_KEY) is sent as a
   Bearer token; no gRPC port is contacted.
4. `--spawn` starts `scripts/serve.py` (port 0, `--http-port 0`, plus `--model`,
   `--load-format` and `--spawn-args`) as a subprocess, waits for health SERVING, runs the benchmark, then stops it
   with SIGTERM. `--load-format dummy` serves random weights made on the device from `--model`'s
   config.json (+ tokenizer): any architecture without its checkpoint.
Prints a table and one JSON line for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import _path  # noqa: F401
import grpc
import numpy as np
from bench_offline import sharegpt_like

from serving.client import GenerateClient, build_request
from serving.protos.jaxinfer.v1 import generate_pb2_grpc as pb_grpc

SCRIPTS = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass
class Result:
    prompt_len: int
    output_len: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_len < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)


async def one_request(
    stub, prompt: list[int], max_tokens: int, timeout: float | None, metadata: tuple = ()
) -> Result:
    res = Result(len(prompt))
    req = build_request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = last = time.perf_counter()
    try:
        async for msg in stub.Generate(req, timeout=timeout, metadata=metadata):
            now = time.perf_counter()
            k = len(msg.token_ids)
            if k:
                if res.ttft is None:
                    res.ttft = now - start
                else:
                    res.itl += [(now - last) / k] * k
                last = now
                res.output_len += k
    except grpc.aio.AioRpcError as e:
        res.error = f"{e.code().name}: {e.details()}"
    res.e2e = time.perf_counter() - start
    return res


async def one_openai_request(
    session, url: str, model: str, prompt: list[int], max_tokens: int, timeout: float | None
) -> Result:
    """One streamed `POST /v1/completions`: the same request as the openai client's
    `completions.create(..., stream=True)`, over aiohttp (as vLLM's benchmark does: the SDK's
    per-chunk pydantic objects cost the CPU-sharing client more than the server spends)."""
    import aiohttp

    res = Result(len(prompt))
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    start = last = time.perf_counter()
    gaps: list[float] = []
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        gaps.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.output_len = chunk["usage"]["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.e2e = time.perf_counter() - start
    if gaps and res.output_len > 1:  # the tokens after the first, shared by the chunks' gaps
        per = (res.output_len - 1) / len(gaps)
        res.itl = [g / per for g in gaps for _ in range(round(per))] or gaps
    return res


async def run(
    address: str,
    workload: list[tuple[int, int]],
    prompts: list[list[int]],
    rate: float,
    max_concurrency: int | None,
    seed: int,
    timeout: float | None,
    backend: str = "grpc",
    http_url: str | None = None,
    model: str = "",
    api_key: str | None = None,
) -> tuple[list[Result], float]:
    rng = np.random.default_rng(seed + 2)
    gaps = (
        rng.exponential(1.0 / rate, len(workload)) if np.isfinite(rate) else np.zeros(len(workload))
    )
    limit = asyncio.Semaphore(max_concurrency or len(workload))
    async with contextlib.AsyncExitStack() as stack:
        if backend == "openai":
            import aiohttp

            session = await stack.enter_async_context(
                aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0),
                    headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
                )
            )
            url = f"{http_url}/completions"

            def request(prompt, out_len):
                return one_openai_request(session, url, model, prompt, out_len, timeout)
        else:
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(address))
            stub = pb_grpc.GenerateServiceStub(channel)

            def request(prompt, out_len):
                auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()
                return one_request(stub, prompt, out_len, timeout, auth)

        async def limited(prompt, out_len):
            async with limit:
                return await request(prompt, out_len)

        start = time.perf_counter()
        tasks = []
        for gap, prompt, (_, out_len) in zip(gaps, prompts, workload):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(prompt, out_len)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    a = np.asarray(values)
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
    }


def report(results: list[Result], elapsed: float, slo_ttft: float, slo_tpot: float) -> dict:
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.output_len for r in ok)  # NOTE: from each stream's usage
    good = [
        r
        for r in ok
        if r.ttft is not None and r.ttft <= slo_ttft and (r.tpot is None or r.tpot <= slo_tpot)
    ]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": elapsed,
        "request_throughput": len(ok) / elapsed,
        "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (out_tokens + sum(r.prompt_len for r in ok)) / elapsed,
        "ttft_s": _stats([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": _stats([x for r in ok for x in r.itl]),
        "tpot_s": _stats([r.tpot for r in ok if r.tpot is not None]),
        "e2e_s": _stats([r.e2e for r in ok]),
        "goodput_req_s": len(good) / elapsed,
        "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot},
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def spawn_server(extra: str, timeout: float) -> tuple[subprocess.Popen, str, str | None]:
    """Starts scripts/serve.py on free ports; returns (process, gRPC address, HTTP API base URL)
    once it listens."""
    cmd = [
        sys.executable,
        os.path.join(SCRIPTS, "serve.py"),
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--http-port",
        "0",
        "--host",
        "127.0.0.1",
        *shlex.split(extra),
    ]
    print("spawning:", " ".join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    assert proc.stderr is not None
    http_url = None
    for line in proc.stderr:
        sys.stderr.write("  | " + line)
        h = re.search(r"HTTP API at (http://[^ ]*/v1)", line)
        if h:
            http_url = h.group(1)
        m = re.search(r"listening on [^ ]*:(\d+)", line)
        if m:
            address = f"127.0.0.1:{m.group(1)}"
            break
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError("the spawned server did not start listening in time")
    else:
        raise RuntimeError(f"the spawned server exited with {proc.wait()}")
    # Keep draining its log so the pipe never fills up.
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return proc, address, http_url


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--host", default="localhost")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--spawn", action="store_true", help="start scripts/serve.py for this run")
    p.add_argument(
        "--spawn-args",
        default="",
        help='extra serve.py flags for --spawn (write --spawn-args="--flag ...")',
    )
    p.add_argument("--model", default=None, help="serve.py --model for --spawn")
    p.add_argument(
        "--load-format",
        default=None,
        choices=("auto", "dummy"),
        help="serve.py --load-format for --spawn ('dummy': random weights)",
    )
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrival rate in requests/s (inf: all at once)",
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="clip lengths to this (default: the server's max_model_len, at most 1024)",
    )
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO on TTFT, seconds")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="goodput SLO on TPOT, seconds")
    p.add_argument("--timeout", type=float, default=None, help="per-request deadline, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--backend",
        default="grpc",
        choices=("grpc", "openai", "both"),
        help="gRPC Generate, the OpenAI-compatible HTTP API, or both in turn",
    )
    p.add_argument(
        "--http-url",
        default=None,
        help="base URL of the HTTP API without --spawn (default http://HOST:8080/v1); with "
        "--backend openai nothing else is needed (any OpenAI-compatible server)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="Bearer key for the HTTP API (default $OPENAI_API_KEY)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="prompt ids are drawn below this (default: the gRPC model info, else 32000)",
    )
    args = p.parse_args()

    proc = None
    address = f"{args.host}:{args.port}"
    spawn_args = " ".join(
        [
            *(["--model", shlex.quote(args.model)] if args.model else []),
            *(["--load-format", args.load_format] if args.load_format else []),
            args.spawn_args,
        ]
    )
    if not args.spawn and (args.model or args.load_format):
        p.error("--model and --load-format configure the server that --spawn starts")
    http_url = args.http_url or f"http://{args.host}:8080/v1"
    if args.spawn:
        proc, address, http_url = spawn_server(spawn_args, timeout=600)
    backends = ("grpc", "openai") if args.backend == "both" else (args.backend,)
    runs = {}
    try:
        if backends == ("openai",):  # any OpenAI-compatible server: no gRPC port
            info = _http_info(http_url, args.api_key)
        else:
            with GenerateClient(address) as client:
                client.wait_ready(timeout=900)
                info = client.model_info()
        model = _http_info(http_url, args.api_key).name if "openai" in backends else ""
        max_len = args.max_model_len or min(info.max_model_len, 1024)
        workload = sharegpt_like(args.num_requests, args.seed, max_len)
        rng = np.random.default_rng(args.seed + 1)
        vocab = args.vocab_size or info.vocab_size
        prompts = [rng.integers(100, min(40000, vocab), n).tolist() for n, _ in workload]
        for backend in backends:
            warm = min(16, len(workload))  # first requests of a backend pay one-off costs
            asyncio.run(
                run(
                    address,
                    workload[:warm],
                    prompts[:warm],
                    float("inf"),
                    None,
                    args.seed,
                    args.timeout,
                    backend,
                    http_url,
                    model,
                    args.api_key,
                )
            )
            runs[backend] = asyncio.run(
                run(
                    address,
                    workload,
                    prompts,
                    args.request_rate,
                    args.max_concurrency,
                    args.seed,
                    args.timeout,
                    backend,
                    http_url,
                    model,
                    args.api_key,
                )
            )
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    reports = {b: show(b, *runs[b], info, args, max_len) for b in backends}
    if len(reports) == 2:
        ratio = reports["openai"]["output_tok_s"] / reports["grpc"]["output_tok_s"]
        print(f"HTTP / gRPC output throughput: {ratio:.3f}")


@dataclasses.dataclass
class HTTPInfo:
    """What `GET /v1/models` tells of an OpenAI-compatible server (the fields `show` reads)."""

    name: str
    max_model_len: int
    vocab_size: int = 32000  # unknown over HTTP: --vocab-size
    dtype: str = "?"


def _http_info(http_url: str, api_key: str | None, timeout: float = 900) -> HTTPInfo:
    """The served model of an OpenAI-compatible server (`GET /v1/models`), retried until it
    answers (a server still starting) or `timeout` passes."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{http_url}/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                card = json.loads(r.read())["data"][0]
            break
        except (urllib.error.URLError, ConnectionError) as e:
            if isinstance(e, urllib.error.HTTPError) and e.code in (401, 403, 404):
                raise SystemExit(f"{http_url}/models: HTTP {e.code}: {e.read()[:200]!r}") from None
            if time.monotonic() > deadline:
                raise SystemExit(f"{http_url} did not answer within {timeout:.0f}s: {e}") from None
            time.sleep(1.0)
    return HTTPInfo(card["id"], int(card.get("max_model_len") or 1024))


def show(backend: str, results: list[Result], elapsed: float, info, args, max_len: int) -> dict:
    r = report(results, elapsed, args.slo_ttft, args.slo_tpot)
    print(
        f"[{backend}] model {info.name} ({info.dtype}), {args.num_requests} requests at "
        f"{args.request_rate} req/s, {r['completed']} ok, {r['failed']} failed, {elapsed:.1f}s"
    )
    print(
        f"  request throughput {r['request_throughput']:.2f} req/s, output {r['output_tok_s']:.1f} "
        f"tok/s, total {r['total_tok_s']:.1f} tok/s, goodput {r['goodput_req_s']:.2f} req/s"
    )
    for key, name in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("tpot_s", "TPOT"), ("e2e_s", "E2E")):
        s = r[key]
        print(
            f"  {name:5s} mean {s['mean'] * 1e3:9.1f} ms  p50 {s['p50'] * 1e3:9.1f} ms  "
            f"p90 {s['p90'] * 1e3:9.1f} ms  p99 {s['p99'] * 1e3:9.1f} ms"
        )
    for err in r["errors"]:
        print("  error:", err)
    print(
        json.dumps(
            {
                "bench": "serving",
                "backend": backend,
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "model": info.name,
                "num_requests": args.num_requests,
                "request_rate": str(args.request_rate),
                "max_len": max_len,
                **r,
            }
        )
    )
    return r


if __name__ == "__main__":
    main()
