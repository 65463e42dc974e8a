"""Process death through the real launcher (`scripts/serve.py`, the engine core in its own
process, `--fake-runner`): either process killed with SIGKILL takes the other one down, loudly.

1. SIGKILL the engine core while streams are in flight on both protocols: each stream ends with
   an error, and serve.py logs why and exits non-zero.
2. SIGKILL serve.py: the orphaned engine core exits too.

Deadlines here only guard against a hang (the measured times are in the README).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import threading
import time

import grpc
import pytest
from served_utils import ServedProcess

from serving.client import GenerateClient

pytestmark = pytest.mark.slow  # server subprocesses: the core imports JAX

ARGS = ["--fake-runner", "--fake-step-delay", "0.02", "--max-model-len", "512", "--no-warmup"]


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


def test_killed_front_end_takes_the_engine_core_down():
    """Killed mid-stream: the core is stepping and holds output nobody will read."""
    srv = ServedProcess(ARGS)
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
