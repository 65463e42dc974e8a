"""Profiler traces through the real served process (`scripts/serve.py`, engine core in its own
process; jaxinfer/engine/tracing.py).

1. With `--trace-dir` (and `--trace-steps 0`: on demand only), `POST /start_profile`, a request,
   then gRPC `StopProfile` (HTTP's `POST /stop_profile` is the same call) write a trace; the
   server logs its path and goes on serving. Read back from its
   `.xplane.pb` (tests/xplane.py), the host plane has one `engine_step` step marker per engine
   step (with `step_num`), the `schedule` / `prepare` / `launch` (with the step's kind and token
   count) / `collect` annotations, and the device ops' names reach `layer_0/attention`,
   `layer_0/mlp` and `sampler` (the model's and the step program's `jax.named_scope`s); no
   Python tracer frames (`$file:line name` events: they made writing a trace take 30 s).
2. Without `--trace-dir` the HTTP endpoints do not exist (404), as vLLM's without a profiler dir,
   and gRPC's answer FAILED_PRECONDITION: tests/test_served_lifeline.py's fake server checks it
   (and `--no-compilation-cache`), so no server starts for it here.
"""

from __future__ import annotations

import http.client as httplib
import json
import re
import time
from urllib.parse import urlparse

import grpc
import pytest
from served_utils import serve_tiny
from xplane import read_planes

from serving.protos.jaxinfer.v1 import generate_pb2 as pb
from serving.protos.jaxinfer.v1 import generate_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # a server subprocess: imports JAX, compiles on first use

WRITTEN = re.compile(r"profiler trace written to (\S+\.xplane\.pb)")


def post(url: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    u = urlparse(url)
    conn = httplib.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        payload = json.dumps(body or {})
        conn.request("POST", path, payload, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def completion(url: str) -> None:
    status, body = post(
        url, "/v1/completions", {"prompt": "The capital of France", "max_tokens": 3}
    )
    assert status == 200, body


def wait_for(served, pattern: re.Pattern, timeout: float = 120.0) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = pattern.search("".join(served.log))
        if m:
            return m
        time.sleep(0.1)
    log = "".join(served.log[-30:])
    raise AssertionError(f"no match for {pattern.pattern!r}:\n{log}")


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    root = tmp_path_factory.mktemp("profile")
    served = serve_tiny(root / "tiny", "--trace-dir", str(root / "trace"), "--trace-steps", "0")
    try:
        completion(served.http_url)  # NOTE: compiles outside the trace (--no-warmup)
        assert post(served.http_url, "/start_profile")[0] == 200
        completion(served.http_url)
        with grpc.insecure_channel(served.grpc_address) as channel:
            answer = pb_grpc.GenerateServiceStub(channel).StopProfile(pb.ProfileRequest())
        assert answer.trace_dir == str(root / "trace")
        path = wait_for(served, WRITTEN).group(1)
        completion(served.http_url)  # still serving after the trace
    finally:
        assert served.stop() == 0, "".join(served.log[-30:])
    return read_planes(path)


def test_step_markers_and_annotations(trace):
    host = [e for p in trace for e in p.events]
    steps = [e for e in host if e.name == "engine_step"]
    assert steps and all("step_num" in e.stats for e in steps)
    nums = [e.stats["step_num"] for e in steps]
    assert len(set(nums)) == len(nums)
    names = {e.name for e in host}
    assert not [n for n in names if n.startswith("$")]  # no Python tracer frames: slow to write
    assert {"schedule", "prepare", "launch", "collect", "update"} <= names
    launches = [e for e in host if e.name == "launch"]
    kinds = {e.stats.get("kind") for e in launches}
    assert {"prefill", "decode"} <= kinds <= {"prefill", "decode", "mixed", "idle"}
    for e in launches:
        assert (int(e.stats["tokens"]) > 0) == (e.stats["kind"] != "idle"), e.stats
        if e.stats["kind"] == "decode":
            assert e.stats["tokens"] == e.stats["seqs"]


def test_named_scopes_reach_the_device_ops(trace):
    """Each XLA op event names its program (`hlo_module`) and op (`hlo_op`); the metadata plane
    holds the programs' HLO, whose ops' op_names carry the scopes (what xprof's trace viewer and
    op profile show for an op)."""
    ran = {
        str(e.stats["hlo_op"])
        for p in trace
        for e in p.events
        if e.stats.get("hlo_module") == "jit_packed_step_program" and "hlo_op" in e.stats
    }
    hlo = [
        raw
        for p in trace
        for name, raw in p.metadata.items()
        if name.startswith("jit_packed_step_program(")
    ]
    assert ran and hlo
    assert all(any(op.encode() in raw for raw in hlo) for op in ran)
    for scope in (b"layer_0/attention", b"layer_1/mlp", b"sampler"):
        assert all(scope in raw for raw in hlo), scope
