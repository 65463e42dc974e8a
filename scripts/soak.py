"""Soak test: minutes of mixed valid / invalid / cancelled requests on both protocols, then
checks that the server came back to idle.

    python scripts/soak.py --minutes 10 --concurrency 16            # spawns serve.py --fake-runner
    python scripts/soak.py --minutes 1 --serve-args="--model cfg_dir --load-format dummy"
    python scripts/soak.py --minutes 5 --http-url http://host:8080/v1 --grpc-address host:50051

1. The server: `scripts/serve.py` spawned on free ports (`--fake-runner --max-model-len 512
   --no-warmup` unless `--serve-args` says otherwise), or a running one (`--http-url` and
   `--grpc-address`; RSS is then not measured).
2. `--concurrency` workers, each sending one request after another until the time is up, every
   request drawn at random (seeded): over HTTP a completion, a streamed chat, an invalid body
   (bad field value, unknown model, not JSON), a stream the client drops after its first chunk;
   over gRPC a stream, an invalid request (empty prompt, bad sampling value), a stream the client
   cancels after its first message.
3. Outcomes per protocol: 2xx / 4xx / 5xx (gRPC: OK, a client-side status such as
   INVALID_ARGUMENT or RESOURCE_EXHAUSTED, or INTERNAL / UNAVAILABLE / UNKNOWN), cancelled; an
   error event inside a streamed 200 counts as a 5xx. "unexpected": a valid request refused with
   anything but 429 / RESOURCE_EXHAUSTED, or an invalid one accepted.
4. Then, within `--settle` seconds: no request running, waiting or in flight and no KV page in
   use (`/metrics`); front-end and engine-core RSS (from /proc, after a warm-up round) grew by at
   most `--max-rss-growth-mb` each.
Prints a report and one JSON line; exits 1 on any violation (a 5xx, an unexpected outcome, a
leaked stream or page, RSS growth over the bound).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import re
import signal
import sys
import time
import urllib.request

import _path  # noqa: F401
import grpc

from serving.client import build_request
from serving.protos.jaxinfer.v1 import generate_pb2_grpc as pb_grpc

DEFAULT_SERVE_ARGS = "--fake-runner --fake-step-delay 0.005 --max-model-len 512 --no-warmup"
KINDS = (
    ("http", "valid"),
    ("http", "stream"),
    ("http", "invalid"),
    ("http", "cancel"),
    ("grpc", "valid"),
    ("grpc", "invalid"),
    ("grpc", "cancel"),
)
_CLIENT_CODES = {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "NOT_FOUND", "OUT_OF_RANGE"}
_IDLE = (
    "jaxinfer_num_requests_running",
    "jaxinfer_num_requests_waiting",
    "jaxinfer_num_requests_in_flight",
    "jaxinfer_kv_cache_pages_used",
)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def core_pid(pid: int) -> int | None:
    """The engine-core process: serve.py's child spawned by multiprocessing (not its tracker)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as c:
                    if b"spawn_main" in c.read():
                        return int(child)
    return None


def metrics(http_url: str) -> dict[str, float]:
    base = http_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for name in _IDLE:
        m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        out[name] = float(m.group(1)) if m else float("nan")
    return out


class Soak:
    def __init__(self, http_url: str, grpc_address: str, seed: int) -> None:
        self.http_url, self.grpc_address = http_url, grpc_address
        self.rng = random.Random(seed)
        self.counts: dict[str, collections.Counter] = {
            "http": collections.Counter(),
            "grpc": collections.Counter(),
        }
        self.unexpected: list[str] = []
        self.errors: list[str] = []

    def record(self, proto: str, kind: str, outcome: str, detail: str = "") -> None:
        self.counts[proto][outcome] += 1
        if outcome == "5xx":
            self.errors.append(f"{proto} {kind}: {detail}"[:300])
        valid = kind in ("valid", "stream")
        refused = outcome == "4xx" and not detail.startswith(("429", "RESOURCE_EXHAUSTED"))
        if (valid and refused) or (kind == "invalid" and outcome == "2xx"):
            self.unexpected.append(f"{proto} {kind} -> {outcome} {detail}"[:300])

    async def http(self, session, kind: str) -> None:
        import aiohttp

        url = f"{self.http_url}/completions"
        body: dict | str = {"prompt": "The sea is", "max_tokens": self.rng.randint(1, 24)}
        if kind == "stream" or kind == "cancel":
            url = f"{self.http_url}/chat/completions"
            body = {
                "messages": [{"role": "user", "content": "Tell me about the sea."}],
                "max_tokens": self.rng.randint(4, 48),
                "stream": True,
            }
        elif kind == "invalid":
            body = self.rng.choice(
                [
                    {"prompt": "x", "temperature": -1},
                    {"prompt": "x", "model": "no-such-model"},
                    {"prompt": "", "max_tokens": 2},
                    {"prompt": "x", "max_tokens": 10**6},
                    "{not json",
                ]
            )
        data = body if isinstance(body, str) else json.dumps(body)
        headers = {"Content-Type": "application/json"}
        try:
            async with session.post(url, data=data, headers=headers) as r:
                if kind == "cancel" and r.status == 200:
                    await r.content.readline()
                    self.counts["http"]["cancelled"] += 1
                    return  # leaving the block drops the connection mid-stream
                text = await r.text()
                outcome = f"{r.status // 100}xx"
                if r.status == 200 and '"error"' in text:
                    outcome = "5xx"  # a failure after the stream started
                self.record("http", kind, outcome, f"{r.status} {text[:200]}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.record("http", kind, "5xx", f"client error {type(e).__name__}: {e}")

    async def grpc(self, stub, kind: str) -> None:
        prompt = "The sea is"
        sampling: dict = {"max_tokens": self.rng.randint(1, 32)}
        if kind == "invalid":
            prompt, sampling = self.rng.choice(
                [("", {}), ("x", {"top_p": 0.0}), ("x", {"max_tokens": 10**6})]
            )
        call = stub.Generate(build_request(prompt, **sampling), timeout=120)
        try:
            async for _ in call:
                if kind == "cancel":
                    call.cancel()
                    self.counts["grpc"]["cancelled"] += 1
                    return
            self.record("grpc", kind, "2xx")
        except grpc.aio.AioRpcError as e:
            code = e.code().name
            outcome = "4xx" if code in _CLIENT_CODES else "5xx"
            if code == "CANCELLED" and kind == "cancel":
                self.counts["grpc"]["cancelled"] += 1
                return
            self.record("grpc", kind, outcome, f"{code}: {e.details()}")

    async def run(self, seconds: float, concurrency: int) -> int:
        import aiohttp

        deadline = time.monotonic() + seconds
        n = 0
        timeout = aiohttp.ClientTimeout(total=120)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            grpc.aio.insecure_channel(self.grpc_address) as channel,
        ):
            stub = pb_grpc.GenerateServiceStub(channel)

            async def worker() -> None:
                nonlocal n
                while time.monotonic() < deadline:
                    proto, kind = self.rng.choice(KINDS)
                    n += 1
                    if proto == "http":
                        await self.http(session, kind)
                    else:
                        await self.grpc(stub, kind)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n


def spawn(serve_args: str, timeout: float = 600) -> tuple[object, str, str]:
    from bench_serving import spawn_server

    proc, address, http_url = spawn_server(serve_args, timeout)
    deadline = time.monotonic() + timeout
    while True:
        health = f"{http_url.removesuffix('/v1')}/health"
        with contextlib.suppress(OSError), urllib.request.urlopen(health, timeout=5):
            return proc, address, http_url
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("the spawned server did not become ready")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=None, help="overrides --minutes")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--serve-args",
        default=DEFAULT_SERVE_ARGS,
        help=f'serve.py flags of the spawned server (default "{DEFAULT_SERVE_ARGS}")',
    )
    p.add_argument("--http-url", default=None, help="a running server's HTTP API (…/v1)")
    p.add_argument("--grpc-address", default=None, help="a running server's gRPC host:port")
    p.add_argument("--settle", type=float, default=15.0, help="seconds to come back to idle")
    p.add_argument("--max-rss-growth-mb", type=float, default=256.0)
    args = p.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else 60 * args.minutes
    if (args.http_url is None) != (args.grpc_address is None):
        p.error("--http-url and --grpc-address go together (a running server)")
    proc = None
    if args.http_url is None:
        proc, grpc_address, http_url = spawn(args.serve_args)
    else:
        grpc_address, http_url = args.grpc_address, args.http_url.rstrip("/")
    violations: list[str] = []
    try:
        pids = {}
        if proc is not None:
            pids = {"frontend": proc.pid, "core": core_pid(proc.pid)}
        soak = Soak(http_url, grpc_address, args.seed)
        warm = min(5.0, seconds / 10)  # first-use allocations are not growth
        asyncio.run(soak.run(warm, args.concurrency))
        rss0 = {k: rss_mb(v) for k, v in pids.items() if v}
        t0 = time.monotonic()
        total = asyncio.run(soak.run(seconds, args.concurrency))
        elapsed = time.monotonic() - t0
        deadline = time.monotonic() + args.settle
        while True:
            idle = metrics(http_url)
            if all(v == 0 for v in idle.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        rss1 = {k: rss_mb(v) for k, v in pids.items() if v}
        for name, value in idle.items():
            if value != 0:
                violations.append(f"{name} = {value} after {args.settle:.0f}s (not idle)")
        for name in rss0:
            if rss1[name] - rss0[name] > args.max_rss_growth_mb:
                violations.append(
                    f"{name} RSS grew {rss1[name] - rss0[name]:.0f} MB "
                    f"(> {args.max_rss_growth_mb:.0f})"
                )
        for proto, counts in soak.counts.items():
            if counts["5xx"]:
                violations.append(f"{proto}: {counts['5xx']} unexpected 5xx")
        if soak.unexpected:
            violations.append(f"{len(soak.unexpected)} unexpected outcomes")
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(Exception):
                proc.wait(60)
    report = {
        "seconds": round(elapsed, 1),
        "concurrency": args.concurrency,
        "requests": total,
        "requests_per_s": round(total / max(elapsed, 1e-9), 1),
        "counts": {k: dict(sorted(v.items())) for k, v in soak.counts.items()},
        "idle_after": idle,
        "rss_mb_start": {k: round(v) for k, v in rss0.items()},
        "rss_mb_end": {k: round(v) for k, v in rss1.items()},
        "violations": violations,
        "errors": soak.errors[:5],
        "unexpected": soak.unexpected[:5],
    }
    print(f"soak: {total} requests in {elapsed:.0f}s at concurrency {args.concurrency}")
    for proto, counts in report["counts"].items():
        print(f"  {proto:5s} " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    print("  idle  " + ", ".join(f"{k.removeprefix('jaxinfer_')} {v:g}" for k, v in idle.items()))
    for name in rss0:
        print(f"  rss   {name}: {rss0[name]:.0f} MB -> {rss1[name]:.0f} MB")
    print("  " + ("OK" if not violations else "VIOLATIONS: " + "; ".join(violations)))
    print(json.dumps(report))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
