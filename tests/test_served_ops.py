"""Operating the real served process (`scripts/serve.py`, engine core in its own process) the way
a vLLM operator does: vLLM's metric names on `/metrics` and KV-cache events over ZMQ.

One server for the module: the tiny model on a data-parallel mesh of two CPU devices
(`--mesh data=2`, 9 usable pages per replica: a few prompts evict), `--served-model-name`, and
`--kv-events-config` publishing on a free port that a ZMQ SUB socket joined before the server
started (so it sees the first batch).

1. The KV events: the first batch opens with AllBlocksCleared; a prompt's prefill stores its full
   pages (BlockStored: chained 16-byte hashes, the page's tokens, block size, medium "GPU");
   later prompts evict them (BlockRemoved of stored hashes).
2. `/metrics` parses with prometheus_client's text parser; every vLLM name is there with vLLM's
   type and the `model_name` label; counters end in `_total` and nothing else does (the old
   `jaxinfer_kv_cache_pages_total` gauge broke that); the page capacity counts both replicas;
   prefix-cache hits, prompt tokens and per-phase histograms follow the requests sent; and
   `promtool check metrics` (when installed) finds nothing but the ':' in vLLM's own names.
3. Every data replica counted: a running request's pages over both replicas' pages.
4. (no server) Under a Kubernetes LeaderWorkerSet the multi-host flags default from its env.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.request

import pytest
from served_utils import serve_tiny

from tests.script_utils import script

pytestmark = pytest.mark.slow  # a server subprocess: imports JAX, compiles on first use

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")
parser = pytest.importorskip("prometheus_client.parser")

MODEL_NAME = "tiny-ops"
PAGE = 16
USABLE_PER_REPLICA = 9  # --num-pages 20 over data=2: 10 each, page 0 is the null page
TOPIC = "kv-test"
PROMPTS = [[(7 * k + 3 * i) % 40000 + 100 for i in range(100)] for k in range(5)]  # 6 full pages

VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    port = _free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(f"tcp://127.0.0.1:{port}")  # before the server binds: ZMQ reconnects
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "topic": TOPIC,
    }
    srv = serve_tiny(
        tmp_path_factory.mktemp("served") / "tiny",
        *("--mesh", "data=2", "--num-pages", "20", "--max-model-len", "128"),
        *("--served-model-name", MODEL_NAME, "--kv-events-config", json.dumps(config)),
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
    )
    # A first prompt twice (the second hits the prefix cache), then others that evict it.
    for prompt in [PROMPTS[0], *PROMPTS]:
        _complete(srv, prompt)
    yield srv, sub
    sub.close(0)
    ctx.term()
    assert srv.stop() == 0, "".join(srv.log[-30:])


def _complete(srv, prompt: list[int]) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 3, "temperature": 0.0}
    req = urllib.request.Request(
        srv.http_url + "/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _batches(sub, until, timeout: float = 30.0) -> list:
    """Received batches (decoded) until `until(batches)` holds or the deadline passes."""
    batches: list = []
    deadline = time.monotonic() + timeout
    while not until(batches) and time.monotonic() < deadline:
        if sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            assert topic == TOPIC.encode() and len(seq) == 8
            batches.append(msgpack.unpackb(payload, raw=False))
    return batches


def test_kv_events_stored_on_prefill_removed_on_eviction(served):
    srv, sub = served

    def events(batches):
        return [e for b in batches for e in b[1]]

    def evicted(batches):
        return any(e[0] == "BlockRemoved" for e in events(batches))

    batches = _batches(sub, evicted)
    evs = events(batches)
    assert batches and batches[0][1][0] == ["AllBlocksCleared"], batches[:1]
    for ts, _, rank in batches:
        assert ts > 0 and rank in (0, 1)
    stored = [e for e in evs if e[0] == "BlockStored"]
    first = next(e for e in stored if e[3][:PAGE] == PROMPTS[0][:PAGE])
    _, hashes, parent, tokens, block_size, lora_id, medium = first
    assert parent is None and block_size == PAGE and lora_id is None and medium == "GPU"
    hashes, tokens = list(hashes), list(tokens)
    for e in stored:  # the prefill's later chunks (64-token steps) continue the chain
        if e[2] == hashes[-1]:
            hashes += e[1]
            tokens += e[3]
    assert len(hashes) == 6 and all(isinstance(h, bytes) and len(h) == 16 for h in hashes)
    assert tokens == PROMPTS[0][: 6 * PAGE]  # the prompt's six full pages
    known = {h for e in stored for h in e[1]}
    removed = [h for e in evs if e[0] == "BlockRemoved" for h in e[1]]
    assert removed and set(removed) <= known
    assert all(e[2] == "GPU" for e in evs if e[0] == "BlockRemoved")


def _families(srv) -> tuple[str, dict]:
    base = srv.http_url.removesuffix("/v1")
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return text, {f.name: f for f in parser.text_string_to_metric_families(text)}


def _value(family, suffix: str = "", **labels) -> float:
    return sum(
        s.value
        for s in family.samples
        if s.name == family.name + suffix and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_vllm_metrics_named_typed_and_counted(served):
    srv, _ = served
    text, fams = _families(srv)
    for name, kind in VLLM_METRICS.items():
        assert name in fams, f"{name} missing"
        fam = fams[name]
        assert fam.type == kind, (name, fam.type)
        assert fam.samples and all(s.labels["model_name"] == MODEL_NAME for s in fam.samples)
    for fam in fams.values():  # promtool's naming rule: "_total" for counters, and only them
        for s in fam.samples:
            if fam.type == "counter":
                assert s.name in (fam.name + "_total", fam.name + "_created"), s.name
            else:
                assert not s.name.endswith("_total"), (s.name, fam.type)
    assert _value(fams["jaxinfer_kv_cache_pages_capacity"]) == 2 * USABLE_PER_REPLICA
    sent = [PROMPTS[0], *PROMPTS]
    assert _value(fams["vllm:prompt_tokens"], "_total") == sum(len(p) for p in sent)
    assert _value(fams["vllm:prefix_cache_queries"], "_total") == sum(len(p) for p in sent)
    assert _value(fams["vllm:prefix_cache_hits"], "_total") >= 6 * PAGE  # the repeated prompt
    assert _value(fams["vllm:generation_tokens"], "_total") == 3 * len(sent)
    for phase in ("queue", "prefill", "decode"):
        fam = fams[f"vllm:request_{phase}_time_seconds"]
        assert _value(fam, "_count") == len(sent), phase
        assert _value(fam, "_sum") >= 0
    assert 0.0 <= _value(fams["vllm:kv_cache_usage_perc"]) <= 1.0
    promtool = shutil.which("promtool")
    if promtool is not None:
        run = subprocess.run(
            [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
        )
        # NOTE: promtool reserves ':' for recording rules; vLLM's own names break that rule
        # (vLLM's /metrics gets the same lines), so those are the only findings allowed.
        findings = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
        colon = "metric names should not contain ':'"
        assert all(f.startswith("vllm:") and f.endswith(colon) for f in findings), findings


def test_leaderworkerset_env_names_the_multihost_flags():

    serve = script("serve")
    lws = {"LWS_LEADER_ADDRESS": "llm-0.llm", "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "2"}
    args = serve.build_parser().parse_args([])
    serve.lws_defaults(args, lws)
    assert (args.coordinator_address, args.num_processes, args.process_id) == (
        f"llm-0.llm:{serve.LWS_COORDINATOR_PORT}",
        4,
        2,
    )
    given = serve.build_parser().parse_args(["--process-id", "1", "--coordinator-address", "h:1"])
    serve.lws_defaults(given, lws)  # flags given win
    assert (given.coordinator_address, given.num_processes, given.process_id) == ("h:1", 4, 1)
    alone = serve.build_parser().parse_args([])
    serve.lws_defaults(alone, {})
    assert (alone.coordinator_address, alone.num_processes, alone.process_id) == (None, 1, 0)


def test_kv_usage_counts_every_data_replica(served):
    """A request running on either replica: `vllm:kv_cache_usage_perc` is its pages over both
    replicas' 18 (replica 0 alone would say x/9, or 0 when it runs on replica 1)."""
    srv, _ = served
    for attempt in range(3):  # a scrape that came after the stream ended (a loaded machine)
        prompt = [(11 * i + attempt) % 40000 + 200 for i in range(100)]  # 7 pages, 8 past 112
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 28, "stream": True}
        body |= {"ignore_eos": True, "temperature": 0.0}
        req = urllib.request.Request(
            srv.http_url + "/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as stream:
            assert stream.readline().startswith(b"data: ")  # the first token: it runs
            _, fams = _families(srv)
            stream.read()
        if _value(fams["vllm:num_requests_running"]) == 1:
            break
    else:
        pytest.fail("every stream finished before its scrape")
    usage = _value(fams["vllm:kv_cache_usage_perc"])
    assert round(usage * 2 * USABLE_PER_REPLICA, 6) in (7, 8), usage
