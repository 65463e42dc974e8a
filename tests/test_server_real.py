"""gRPC server over the real runner: a tiny random Llama with the SmolLM2 vocabulary (CPU).

The engine has the shared test shapes of `engine_utils` (so it reuses the programs `test_engine`
compiles in the same session) and no warmup: only the buckets these requests touch compile.

1. Concurrent streams equal the offline engine's output, token for token and text for text.
2. `trace_dir`: a JAX profiler trace of the first busy steps is written and holds the model's
   named scopes ("layer_0", "attention").
3. Cancel mid-stream frees every page; a request that cannot fit the KV cache is INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import glob
import time

import grpc
import pytest
from engine_utils import greedy, load_vocab, make_engine, run, tiny_model

from serving.client import GenerateClient, build_request
from serving.protos.jaxinfer.v1 import generate_pb2 as pb
from serving.protos.jaxinfer.v1 import generate_pb2_grpc as pb_grpc
from serving.server import GenerateServer
from serving.testing import ServerThread

pytestmark = pytest.mark.slow  # ~40 s of XLA compilation when run alone on the 2-core CI machine

PROMPTS = [
    "The sea is",
    "Once upon a time, in a land far away, there lived",
    [1000, 2000, 3000] * 7,
]
TRACE_STEPS = 3


@pytest.fixture(scope="module")
def model():
    return tiny_model(load_vocab())


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("trace"))


@pytest.fixture(scope="module")
def srv(model, trace_dir):
    server = GenerateServer(
        make_engine(model),
        metrics_port=None,
        warmup=False,
        trace_dir=trace_dir,
        trace_steps=TRACE_STEPS,
    )
    st = ServerThread(server)
    yield st
    st.stop()


def test_streams_equal_offline_engine(srv, model):
    offline = run(make_engine(model), [(str(i), p, greedy(12)) for i, p in enumerate(PROMPTS)])

    async def one(stub, i):
        return [
            m
            async for m in stub.Generate(
                build_request(PROMPTS[i], request_id=str(i), max_tokens=12, temperature=0.0)
            )
        ]

    async def main():
        async with grpc.aio.insecure_channel(srv.address) as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            return await asyncio.gather(*(one(stub, i) for i in range(len(PROMPTS))))

    for i, msgs in enumerate(asyncio.run(main())):
        want = offline[str(i)][0]
        assert [t for m in msgs for t in m.token_ids] == want.token_ids, i
        assert "".join(m.text for m in msgs) == want.text, i
        # NOTE: one message per step, or several steps' tokens merged into one message when the
        # client is behind (the front end merges a stream's pending deltas): never empty
        assert all(len(m.token_ids) >= 1 for m in msgs)
        last = msgs[-1]
        assert pb.GenerateResponse.FinishReason.Name(last.finish_reason).lower() == (
            want.finish_reason if want.finish_reason != "abort" else "aborted"
        )
        assert last.usage.completion_tokens == len(want.token_ids)
        assert last.usage.prompt_tokens == want.usage.prompt_tokens


def test_trace_has_named_scopes(srv, trace_dir):
    """The first TRACE_STEPS busy steps were traced (a file TensorBoard's profile tab opens)."""
    with GenerateClient(srv.address) as c:  # busy steps, in case this test runs alone
        c.generate_once("The sea is", max_tokens=TRACE_STEPS, temperature=0.0)
    # NOTE: the trace is written on a thread after its last step, into a file that exists (empty,
    # then growing) before it is complete: read it until every scope shows or the deadline passes
    scopes = (b"layer_0", b"attention", b"sampler")
    deadline = time.monotonic() + 60
    while True:
        files = glob.glob(f"{trace_dir}/plugins/profile/*/*.xplane.pb")
        data = b""
        if files:
            with open(files[0], "rb") as f:
                data = f.read()
        missing = [s for s in scopes if s not in data]
        if not missing:
            break
        assert time.monotonic() < deadline, ("no trace written", files, missing, len(data))
        time.sleep(0.2)


def test_cancel_frees_pages_and_capacity_check(srv):
    engine = srv.server.frontend.engine
    alloc = engine.allocator
    with GenerateClient(srv.address) as c:
        call = c.stub.Generate(
            build_request(
                [1000, 1001, 1002, 1003, 1004, 1005],
                max_tokens=80,
                temperature=0.0,
                ignore_eos=True,
            )
        )
        for _ in range(3):
            next(call)
        assert alloc.num_free_pages < alloc.num_usable_pages
        call.cancel()
        deadline = time.monotonic() + 10
        while alloc.num_free_pages != alloc.num_usable_pages or engine.scheduler.has_unfinished():
            assert time.monotonic() < deadline, "pages not freed after cancel"
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as info:
            list(c.generate([1000] * 6, max_tokens=100))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.max_tokens" in info.value.details()
        assert "KV-cache pages" in info.value.details()
