"""serve.py's engine-shaping flags through the real served process, asserting their effect.

One `scripts/serve.py` sets many such flags at once over the successor model
(`served_utils.successor_model_dir`: greedy next token = last token + 1), so a wrong mapping
shows in what the engine core reports or does:
1. the core's own report: `--attention-backend reference`, `--linear-backend xla`,
   `--page-size 8`, `--kv-cache-memory 128KiB` (pages from bytes), `--max-num-seqs 1`,
   `--max-num-batched-tokens 32`, `--no-async-scheduling`, `--no-prefix-caching`,
   `--long-prefill-token-threshold 8`, `--quantization int8`, `--no-metrics`;
2. effects: int8 weights with a draft model loaded from a saved directory decode exactly the
   model's tokens and the spec metrics move; no prefix caching caches nothing; the threshold
   splits a 40-token prompt into >= 5 steps; `priority` reorders the queue under contention
   (one sequence at a time) and `--max-queue 2` refuses the fourth sequence (RESOURCE_EXHAUSTED
   / 429); `--trace-dir` is written by the engine-core process;
3. last, the shutdown promises: SIGTERM drains (health NOT_SERVING, new requests UNAVAILABLE /
   503, the stream in flight goes on: `--grace-period 60`), a second SIGTERM aborts it at once.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2
from served_utils import ServedProcess, successor_model_dir, successors

from serving.client import GenerateClient

pytestmark = pytest.mark.slow  # a server subprocess

V = 49152
KV_BYTES = 128 * 1024  # 31 usable pages of 8 tokens: below the 33 one sequence could use
TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head_dim x f32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return successor_model_dir(tmp_path_factory.mktemp("succ") / "succ")


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("trace")


@pytest.fixture(scope="module")
def served(model_dir, trace_dir):
    spec = {
        "method": "draft_model",
        "model": str(model_dir),
        "num_speculative_tokens": 2,
        "draft_num_layers": 1,
    }
    args = [
        *("--model", str(model_dir), "--no-warmup", "--max-model-len", "256"),
        *("--max-num-seqs", "1", "--max-num-batched-tokens", "32", "--page-size", "8"),
        *("--token-buckets", "4,32"),  # NOTE: decodes and verifies in one program, chunks in one
        *("--kv-cache-memory", "128KiB", "--no-prefix-caching", "--no-async-scheduling"),
        *("--long-prefill-token-threshold", "8", "--attention-backend", "reference"),
        *("--linear-backend", "xla", "--quantization", "int8", "--max-queue", "2"),
        *("--grace-period", "60", "--trace-dir", str(trace_dir), "--trace-steps", "2"),
        *("--no-metrics", "--speculative-config", json.dumps(spec)),
        *("--scheduling-policy", "priority"),
    ]
    srv = ServedProcess(args)
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


@pytest.fixture(scope="module")
def client(served):
    c = GenerateClient(served.grpc_address)
    yield c
    c.close()


def _http(srv, path: str, body: dict | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    url = f"http://127.0.0.1:{srv.http_port}{path}"
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _tokens(c: GenerateClient, prompt, **kw) -> tuple[list[int], list]:
    msgs = list(c.generate(prompt, timeout=600, **kw))
    return [t for m in msgs for t in m.token_ids], msgs


def test_the_flags_reach_the_engine_core(served, client):
    info = client.model_info()
    assert (info.attention_backend, info.linear_backend) == ("reference", "xla")
    assert info.page_size == 8 and info.capacity.max_num_seqs == 1
    assert info.capacity.max_num_batched_tokens == 32
    assert info.capacity.num_pages == KV_BYTES // (8 * TOKEN_BYTES) - 1  # page 0 is reserved
    log = "".join(served.log)
    assert (
        "scheduling sync; prefix caching off; long_prefill_token_threshold 8; "
        "speculative draft_model"
    ) in log, log[-3000:]
    assert "int8 weights" in log and "metrics   off" in log
    assert "metrics on :" not in log


def test_int8_with_a_saved_draft_model_decodes_the_models_tokens(served, client):
    before = served.metric("jaxinfer_spec_decode_num_accepted_tokens_total")
    ids, msgs = _tokens(client, [1000, 1001, 5000], max_tokens=12, temperature=0)
    assert ids == successors(5000, 12, V) and msgs[-1].finish_reason == 2
    assert len(msgs) < 12  # several tokens per step: the draft's proposals were accepted
    assert served.metric("jaxinfer_spec_decode_num_accepted_tokens_total") > before


def test_no_prefix_caching_caches_nothing(client):
    prompt = list(range(7000, 7040))
    for _ in range(2):
        _, msgs = _tokens(client, prompt, max_tokens=1, temperature=0)
        assert msgs[-1].usage.cached_prompt_tokens == 0


def test_long_prefill_threshold_splits_the_prompt(served, client):
    """40 prompt tokens at 8 per step: >= 5 steps (the 32-token budget alone would take 2)."""
    before = served.metric("jaxinfer_engine_steps_total")
    _tokens(client, list(range(9000, 9040)), max_tokens=1, temperature=0)
    assert served.metric("jaxinfer_engine_steps_total") - before >= 5


def test_priority_reorders_under_contention_and_max_queue_refuses(served, client):
    """One sequence runs at a time: B (priority 5) and then C (priority -5) wait behind A; C
    runs first. A, B and C fill max_num_seqs + --max-queue: a fourth is refused."""
    finished: list[str] = []
    first = threading.Event()

    def run(name: str, prompt: list[int], max_tokens: int, priority: int) -> None:
        for m in client.generate(
            prompt,
            timeout=300,
            max_tokens=max_tokens,
            temperature=0,
            ignore_eos=True,
            priority=priority,
        ):
            first.set()
            if m.finish_reason:
                finished.append(name)

    a = threading.Thread(target=run, args=("A", [100], 120, 0))
    a.start()
    assert first.wait(60)
    b = threading.Thread(target=run, args=("B", [200], 2, 5))
    b.start()
    deadline = time.monotonic() + 30
    while served.metric("jaxinfer_num_requests_in_flight") < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    c = threading.Thread(target=run, args=("C", [300], 2, -5))
    c.start()
    while served.metric("jaxinfer_num_requests_in_flight") < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(grpc.RpcError) as e:
        _tokens(client, [400], max_tokens=2)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status, body = _http(served, "/v1/completions", {"prompt": [400], "max_tokens": 2})
    assert status == 429 and '"error"' in body
    for t in (a, b, c):
        t.join(120)
    assert finished == ["A", "C", "B"]


def test_trace_dir_is_written_by_the_engine_core(trace_dir):
    deadline = time.monotonic() + 60
    while not list(trace_dir.glob("plugins/profile/*/*.xplane.pb")):
        assert time.monotonic() < deadline, list(trace_dir.rglob("*"))
        time.sleep(0.1)


def test_sigterm_drains_with_503_and_a_second_sigterm_aborts_at_once(served, client):
    """Last: it stops the server."""
    msgs: list = []
    started = threading.Event()

    def stream() -> None:
        for m in client.generate(
            [100], timeout=300, max_tokens=240, temperature=0, ignore_eos=True
        ):
            msgs.append(m)
            started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    served.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while client.health_status() != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    status, body = _http(served, "/v1/completions", {"prompt": [400], "max_tokens": 2})
    assert status == 503 and '"error"' in body
    assert _http(served, "/health")[0] == 503
    with pytest.raises(grpc.RpcError) as e:
        _tokens(client, [400], max_tokens=2)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert t.is_alive() and not msgs[-1].finish_reason  # still draining, 60 s grace
    served.proc.send_signal(signal.SIGTERM)
    assert served.wait(30) == 0  # well inside the grace period
    t.join(30)
    assert msgs[-1].finish_reason == 3  # ABORTED
    assert sum(len(m.token_ids) for m in msgs) < 240
