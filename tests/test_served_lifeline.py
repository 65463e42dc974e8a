"""Big inputs and process death through the real launcher (`scripts/serve.py`, the engine core
in its own process, `--fake-runner`: the tokenizer and both protocols are the real ones).

1. A body over `--max-request-bytes` is a 413 naming the prompt field before it is read
   (Content-Length) or once the bytes read pass the cap (chunked); on gRPC RESOURCE_EXHAUSTED.
2. Prompt text that cannot fit max_model_len tokens is refused without tokenizing (400 /
   INVALID_ARGUMENT naming `prompt` / `messages`).
3. While big prompts are refused and tokenized, another client's small request completes.
4. Without `--trace-dir` the profiler endpoints do not exist (HTTP 404, gRPC
   FAILED_PRECONDITION), and `--no-compilation-cache` shows in the start-up summary (the
   big-input server runs with it; tests/test_served_profile.py serves the trace itself).
5. SIGKILL the engine core while streams are in flight on both protocols: each stream ends with
   an error, and serve.py logs why and exits non-zero.
6. SIGKILL serve.py: the orphaned engine core exits too. That is the big-input server, killed by
   the module's last test (one server start fewer).

Deadlines here only guard against a hang (the measured times are in the README).
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import re
import signal
import socket
import threading
import time

import grpc
import pytest
from served_utils import ServedProcess

from serving.client import GenerateClient
from serving.protos.jaxinfer.v1 import generate_pb2 as pb
from serving.protos.jaxinfer.v1 import generate_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # server subprocesses: the core imports JAX

ARGS = ["--fake-runner", "--fake-step-delay", "0.02", "--max-model-len", "512", "--no-warmup"]


CAP = 1 << 20  # --max-request-bytes of the big-input server


@pytest.fixture(scope="module")
def srv():
    """The big-input server; NOTE: the module's last test kills it."""
    s = ServedProcess([*ARGS, "--max-request-bytes", str(CAP), "--no-compilation-cache"])
    yield s
    s.stop()


def _post(port: int, path: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _raw(port: int, head: str, chunks: list[bytes] = ()) -> bytes:
    """Sends `head` (and `chunks`), then reads the whole response."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode())
        for c in chunks:
            sock.sendall(c)
        out = b""
        while b"\r\n\r\n" not in out or not out.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            out += data
        return out


def test_content_length_over_the_cap_is_413_before_the_body_is_sent(srv):
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {10 * CAP}\r\n\r\n"
    )
    resp = _raw(srv.http_port, head)  # not one byte of the body sent
    status, _, body = resp.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413"), resp[:300]
    err = json.loads(body)["error"]
    assert err["param"] == "prompt" and "--max-request-bytes" in err["message"], err


def test_chunked_body_over_the_cap_is_413(srv):
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b"x" * (64 << 10)
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * (CAP // len(piece) + 1) + [b"0\r\n\r\n"]
    resp = _raw(srv.http_port, head, chunks)
    status, _, body = resp.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413"), resp[:300]
    assert json.loads(body)["error"]["param"] == "messages"


def test_grpc_message_over_the_cap_is_resource_exhausted(srv):
    client = GenerateClient(srv.grpc_address)
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate("x" * (2 * CAP), max_tokens=2))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_text_that_cannot_fit_the_context_is_refused_untokenized(srv):
    text = "hello " * 100_000  # 600k characters: far more than 512 tokens of any vocabulary
    status, body = _post(srv.http_port, "/v1/completions", {"prompt": text, "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "prompt", body
    assert "characters cannot fit max_model_len=512" in body["error"]["message"]
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
    status, body = _post(srv.http_port, "/v1/chat/completions", chat)
    assert status == 400 and body["error"]["param"] == "messages", body
    with pytest.raises(grpc.RpcError) as e:
        list(GenerateClient(srv.grpc_address).generate(text, max_tokens=2))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("prompt: "), e.value.details()


def test_small_requests_complete_while_big_prompts_arrive(srv):
    """Four clients send big prompts (over the body cap, over the character cap, and big but
    allowed: tokenized, then too long for the context) while a 2-token request is served."""
    big = [
        {"prompt": "x" * (2 * CAP)},
        {"prompt": "hello " * 100_000},
        {"prompt": "The sea is calm. " * 4000},
        {"messages": [{"role": "user", "content": "The sea is calm. " * 4000}]},
    ]
    stop = threading.Event()

    def flood(body: dict) -> set[int]:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        seen = set()
        while not stop.is_set():
            seen.add(_post(srv.http_port, path, {**body, "max_tokens": 2})[0])
        return seen

    with concurrent.futures.ThreadPoolExecutor(len(big)) as pool:
        floods = [pool.submit(flood, b) for b in big]
        try:
            for _ in range(5):
                status, body = _post(
                    srv.http_port, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, 30
                )
                assert status == 200 and body["usage"]["completion_tokens"] == 2, body
        finally:
            stop.set()
        assert [f.result() for f in floods] == [{413}, {400}, {400}, {400}]


def test_no_profile_endpoints_without_trace_dir(srv):
    assert "programs, compilation cache off;" in "".join(srv.log)
    assert _post(srv.http_port, "/start_profile", {})[0] == 404
    assert _post(srv.http_port, "/stop_profile", {})[0] == 404
    with grpc.insecure_channel(srv.grpc_address) as channel, pytest.raises(grpc.RpcError) as e:
        pb_grpc.GenerateServiceStub(channel).StartProfile(pb.ProfileRequest())
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_the_engine_core_preloads_jemalloc_where_the_machine_has_it(srv):
    """`jaxinfer.engine.allocator`: the spawned core process maps jemalloc when the machine has
    it (the front end does not, and its own environment is as it was), else neither does."""
    from jaxinfer.engine import allocator

    with open(f"/proc/{_core_pid(srv)}/maps") as f:
        core_maps = f.read()
    with open(f"/proc/{srv.proc.pid}/maps") as f:
        front_maps = f.read()
    log = "".join(srv.log)
    assert "libjemalloc" not in front_maps
    if allocator.jemalloc() is None:
        assert "libjemalloc" not in core_maps and "LD_PRELOAD" not in log
    else:
        assert "libjemalloc" in core_maps, core_maps[-2000:]
        assert f"LD_PRELOAD={allocator.jemalloc()}" in log


def _core_pid(srv: ServedProcess) -> int:
    """The engine core's pid (logged by the launcher), checked to be serve.py's child."""
    m = re.search(r"engine core process (\d+) started", "".join(srv.log))
    assert m, "".join(srv.log[-20:])
    pid = int(m.group(1))
    with open(f"/proc/{pid}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    assert ppid == srv.proc.pid
    return pid


def _gone(pid: int) -> bool:
    """No such process, or a zombie nobody has reaped yet (it has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _http_stream(port: int, started: threading.Event, out: list[str]) -> None:
    """A streamed completion; `out` gets every event's data (the last: an error or [DONE])."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"prompt": "The sea is", "max_tokens": 400, "stream": True, "ignore_eos": True}
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "text/json"})
        resp = conn.getresponse()
        for line in resp:
            if line.startswith(b"data: "):
                out.append(line[6:].decode().strip())
                started.set()
    except (OSError, http.client.HTTPException) as e:
        out.append(f"connection: {e}")
    finally:
        started.set()
        conn.close()


def _grpc_stream(address: str, started: threading.Event, out: list[str], after: int = 1) -> None:
    """A streamed Generate; `started` is set after `after` responses, `out` gets its end."""
    client = GenerateClient(address)
    try:
        for i, _ in enumerate(client.generate("The sea is", max_tokens=400, ignore_eos=True)):
            if i + 1 >= after:
                started.set()
        out.append("finished")
    except grpc.RpcError as e:
        out.append(f"{e.code().name}: {e.details()}")
    finally:
        started.set()


def test_killed_engine_core_fails_streams_and_exits_the_front_end():
    srv = ServedProcess(ARGS)
    try:
        core = _core_pid(srv)
        results: dict[str, list[str]] = {"http": [], "grpc": []}
        events = {k: threading.Event() for k in results}
        threads = [
            threading.Thread(
                target=_http_stream, args=(srv.http_port, events["http"], results["http"])
            ),
            threading.Thread(
                target=_grpc_stream, args=(srv.grpc_address, events["grpc"], results["grpc"])
            ),
        ]
        for t in threads:
            t.start()
        for e in events.values():
            assert e.wait(60)
        os.kill(core, signal.SIGKILL)
        rc = srv.wait(30)
        for t in threads:
            t.join(30)
        log = "".join(srv.log)
        assert rc != 0, log[-3000:]
        assert "engine core is gone" in log
        assert "engine core process exited" in results["http"][-2], results["http"][-3:]
        assert results["http"][-1] == "[DONE]"
        assert results["grpc"][-1].startswith("INTERNAL"), results["grpc"]
        assert "engine core process exited" in results["grpc"][-1]
    finally:
        srv.stop()


def test_killed_front_end_takes_the_engine_core_down(srv):
    """Killed mid-stream: the core is stepping and holds output nobody will read. NOTE: kills the
    module's big-input server, so it stays the module's last test."""
    core = _core_pid(srv)
    try:
        started = [threading.Event() for _ in range(8)]
        outs: list[list[str]] = [[] for _ in started]
        clients = [
            threading.Thread(target=_grpc_stream, args=(srv.grpc_address, e, out, 15))
            for e, out in zip(started, outs)
        ]
        for c in clients:
            c.start()
        for e in started:
            assert e.wait(60)
        srv.proc.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 3  # the old 5 s zmq linger would miss it
        while not _gone(core) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _gone(core)
        srv.wait(30)  # NOTE: the core shares serve.py's stderr: the log ends when both have
        for c, out in zip(clients, outs):
            c.join(30)
            assert out and out[-1].startswith("UNAVAILABLE"), out
    finally:
        if not _gone(core):
            os.kill(core, signal.SIGKILL)
