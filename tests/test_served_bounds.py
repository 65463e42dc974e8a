"""Request bounds through the real served process (`scripts/serve.py`, engine core in its own
process): every hostile field is a 400 / INVALID_ARGUMENT naming it, never a 5xx, and the server
keeps serving (`serving/validation.py` says where each check lives).

1. The probe's cases, one by one, over HTTP (raw JSON bodies: NaN, huge ints, lone surrogates)
   and gRPC: `top_k: 10**12`, `priority: 10**30`, `stop_token_ids: [10**30]`, surrogates in a
   prompt, a chat message and a stop string, `chat_template_kwargs`, a prompt too long by itself
   (names the prompt) or with max_tokens (names max_tokens), ids outside the vocabulary.
2. Every HTTP error is an OpenAI error object: 404 (route), 405, 400 for a body that is not JSON
   or has a wrong type (the field from pydantic's location).
3. Property-based (Hypothesis): requests over the whole HTTP schema (completions and chat) and
   the gRPC `GenerateRequest`, valid and wild values for every field; each answer is a 2xx or a
   4xx naming a field; afterwards a normal request still succeeds.
"""

from __future__ import annotations

import collections
import dataclasses
import http.client as httplib
import json
import re
from typing import Any

import grpc
import pytest
from served_utils import serve_tiny

from serving import validation
from serving.client import build_request
from serving.protos.jaxinfer.v1 import generate_pb2 as pb
from serving.protos.jaxinfer.v1 import generate_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # a server subprocess: imports JAX, compiles on first use

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

MAX_MODEL_LEN = 256
MAX_IN_FLIGHT = 8  # --max-num-seqs 4 + --max-queue 4
VOCAB = 49152  # SmolLM2's (served_utils.tiny_model_dir)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    srv = serve_tiny(
        tmp_path_factory.mktemp("served") / "tiny",
        *("--max-model-len", str(MAX_MODEL_LEN), "--max-queue", "4"),
        *("--scheduling-policy", "priority"),  # priorities span int64 here
    )
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


@dataclasses.dataclass
class Response:
    status_code: int
    headers: dict[str, str]
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


class Http:
    """A keep-alive HTTP/1.1 client of the served API (stdlib: bodies are sent as given)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = httplib.HTTPConnection("127.0.0.1", port, timeout=120)

    def request(self, method: str, path: str, body: bytes | None = None) -> Response:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        for attempt in range(2):
            try:
                self.conn.request(method, path, body=body, headers=headers)
                r = self.conn.getresponse()
                text = r.read().decode()
                return Response(r.status, {k.lower(): v for k, v in r.getheaders()}, text)
            except (httplib.HTTPException, ConnectionError):
                self.conn.close()
                self.conn = httplib.HTTPConnection("127.0.0.1", self.port, timeout=120)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def get(self, path: str) -> Response:
        return self.request("GET", path)


@pytest.fixture(scope="module")
def http(served):
    client = Http(served.http_port)
    yield client
    client.conn.close()


@pytest.fixture(scope="module")
def stub(served):
    channel = grpc.insecure_channel(served.grpc_address)
    yield pb_grpc.GenerateServiceStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def model_id(http):
    return http.get("/v1/models").json()["data"][0]["id"]


def post(http, path: str, body: Any) -> Response:
    """POSTs `body` as JSON text (NaN / Infinity literals and `\\ud800` escapes as Python's json
    writes them), or `body` itself when it is bytes."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.request("POST", path, content)


def error_of(r: Response) -> dict[str, Any]:
    """The OpenAI error object of a failed response (asserting its shape)."""
    assert r.headers["content-type"].startswith("application/json"), (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == r.status_code and err["message"] and err["type"], err
    return err


def completion(model: str, **kw: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "Hello", "max_tokens": 2, **kw}


def chat(model: str, **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **kw}


LONG = [1000] * MAX_MODEL_LEN  # no room to generate
# (endpoint, fields over the base request, the param named)
HTTP_REFUSED = {
    "top_k 10**12": ("completions", {"top_k": 10**12}, "top_k"),
    "priority 10**30": ("completions", {"priority": 10**30}, "priority"),
    "priority -2**63-1": ("chat", {"priority": -(2**63) - 1}, "priority"),
    "stop id 10**30": ("completions", {"stop_token_ids": [5, 10**30]}, "stop_token_ids[1]"),
    "stop id = vocab": ("chat", {"stop_token_ids": [VOCAB]}, "stop_token_ids[0]"),
    "too many stop ids": (
        "chat",
        {"stop_token_ids": [1] * (validation.MAX_STOP_TOKEN_IDS + 1)},
        "stop_token_ids",
    ),
    "surrogate prompt": ("completions", {"prompt": "ab\ud800c"}, "prompt"),
    "surrogate batch prompt": ("completions", {"prompt": ["ok", "\udfff"]}, "prompt[1]"),
    "surrogate message": (
        "chat",
        {"messages": [{"role": "user", "content": "x\ud83d"}]},
        "messages[0].content",
    ),
    "surrogate stop": ("completions", {"stop": ["ok", "\ud800"]}, "stop[1]"),
    "empty stop": ("completions", {"stop": ""}, "stop[0]"),
    "too many stops": ("completions", {"stop": ["s"] * (validation.MAX_STOP_STRINGS + 1)}, "stop"),
    "temperature NaN": ("completions", {"temperature": float("nan")}, "temperature"),
    "top_p inf": ("chat", {"top_p": float("inf")}, "top_p"),
    "penalty 1e300": ("chat", {"presence_penalty": 1e300}, "presence_penalty"),
    "seed 2**64": ("completions", {"seed": 2**64}, "seed"),
    "n 10**30": ("completions", {"n": 10**30}, "n"),
    "n beyond admission": ("completions", {"n": MAX_IN_FLIGHT + 1}, "n"),
    "top_logprobs 21": ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "max_tokens 10**30": ("completions", {"max_tokens": 10**30}, "max_tokens"),
    "max_completion_tokens": ("chat", {"max_completion_tokens": 10**6}, "max_completion_tokens"),
    "prompt too long": ("completions", {"prompt": LONG}, "prompt"),
    "prompt + max_tokens": (
        "completions",
        {"prompt": [1000] * 250, "max_tokens": 10},
        "max_tokens",
    ),
    "chat too long": (
        "chat",
        {"messages": [{"role": "user", "content": "hi " * 400}], "max_tokens": None},
        "messages",
    ),
    "prompt id": ("completions", {"prompt": [1, 10**9]}, "prompt[1]"),
    "batch prompt id": ("completions", {"prompt": [[1], [2, -1]]}, "prompt[1][1]"),
    "template messages": (
        "chat",
        {"chat_template_kwargs": {"messages": []}},
        "chat_template_kwargs.messages",
    ),
    "template add_generation_prompt": (
        "chat",
        {"chat_template_kwargs": {"add_generation_prompt": "yes"}},
        "chat_template_kwargs.add_generation_prompt",
    ),
    "wrong type": ("completions", {"top_p": "abc"}, "top_p"),
    "wrong nested type": (
        "chat",
        {"messages": [{"role": "user", "content": 5}]},
        "messages[0].content",
    ),
    "missing": ("chat", {"messages": None}, "messages"),
    "structured_outputs nothing set (chat)": (
        "chat",
        {"structured_outputs": {"json_object": False}},
        "structured_outputs",
    ),
    "structured_outputs nothing set": (
        "completions",
        {"structured_outputs": {"json_object": False}},
        "structured_outputs",
    ),
    "schema with huge numbers": (
        "chat",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"maximum": 10**30, "type": "x"}},
            }
        },
        "response_format.json_schema.schema",
    ),
}


@pytest.mark.parametrize("case", sorted(HTTP_REFUSED))
def test_http_refusal_names_the_field(http, model_id, case):
    endpoint, fields, param = HTTP_REFUSED[case]
    body = (chat if endpoint == "chat" else completion)(model_id, **fields)
    body = {k: v for k, v in body.items() if v is not None}
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    r = post(http, path, body)
    assert r.status_code == 400, (r.status_code, r.text)
    err = error_of(r)
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


def test_http_accepted_edges(http, model_id):
    """top_k beyond the vocabulary (or the int32 bound) keeps every token, -1 is vLLM's "off";
    chat_template_kwargs may turn the generation prompt off; priority spans int64."""
    for fields in (
        {"top_k": VOCAB + 1},
        {"top_k": 2**31 - 1},
        {"top_k": -1},
        {"priority": 2**63 - 1, "seed": 2**63 - 1},
        {"stop_token_ids": [VOCAB - 1]},
    ):
        r = post(http, "/v1/completions", completion(model_id, **fields))
        assert r.status_code == 200, (fields, r.text)
    r = post(
        http,
        "/v1/chat/completions",
        chat(model_id, chat_template_kwargs={"add_generation_prompt": False}),
    )
    assert r.status_code == 200, r.text
    assert (
        r.json()["usage"]["prompt_tokens"]
        < post(http, "/v1/chat/completions", chat(model_id)).json()["usage"]["prompt_tokens"]
    )


def test_http_error_objects(http, model_id):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "/v1/nothing" in error_of(r)["message"]
    r = http.get("/v1/completions")
    assert r.status_code == 405 and error_of(r)["param"] is None
    r = post(http, "/v1/completions", b"{not json")
    assert r.status_code == 400 and "not valid JSON" in error_of(r)["message"]
    r = post(http, "/v1/completions", b"[" * 100_000)
    assert r.status_code == 400 and error_of(r)
    r = post(http, "/v1/completions", completion("other-model"))
    assert r.status_code == 404 and error_of(r)["param"] == "model"


# gRPC: (request, the field its INVALID_ARGUMENT message starts with)
GRPC_REFUSED = {
    "stop id past vocab": (
        build_request("x", max_tokens=2, stop_token_ids=[2**31 - 1]),
        "sampling.stop_token_ids[0]",
    ),
    "temperature inf": (build_request("x", temperature=float("inf")), "sampling.temperature"),
    "top_p NaN": (build_request("x", top_p=float("nan")), "sampling.top_p"),
    "seed 2**63": (build_request("x", seed=2**63), "sampling.seed"),
    "prompt too long": (build_request([1000] * MAX_MODEL_LEN, max_tokens=1), "token_ids.ids"),
    "prompt + max_tokens": (build_request([1000] * 250, max_tokens=10), "sampling.max_tokens"),
    "id past vocab": (build_request([1, VOCAB], max_tokens=2), "token_ids.ids[1]"),
    "stop too long": (
        build_request("x", stop=["s" * (validation.MAX_STOP_STRING_CHARS + 1)]),
        "sampling.stop[0]",
    ),
    "n beyond admission": (build_request("x", n=MAX_IN_FLIGHT + 1), "sampling.n"),
    "schema": (
        pb.GenerateRequest(
            prompt="x",
            sampling=pb.SamplingParams(
                structured_outputs=pb.StructuredOutputs(json_schema="{nope")
            ),
        ),
        "sampling.structured_outputs.json_schema",
    ),
}


@pytest.mark.parametrize("case", sorted(GRPC_REFUSED))
def test_grpc_refusal_names_the_field(stub, case):
    req, field = GRPC_REFUSED[case]
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details().startswith(field), info.value.details()


def test_grpc_top_k_beyond_vocab_is_no_filter(stub):
    msgs = list(stub.Generate(build_request("x", max_tokens=2, top_k=2**31 - 1), timeout=60))
    assert msgs[-1].finish_reason == pb.GenerateResponse.LENGTH


def serves_normally(http, stub, model_id) -> None:
    r = post(http, "/v1/completions", completion(model_id, max_tokens=3, temperature=0))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    msgs = list(stub.Generate(build_request("Hello", max_tokens=3), timeout=60))
    assert sum(len(m.token_ids) for m in msgs) == 3


def test_served_after_the_refusals(http, stub, model_id):
    serves_normally(http, stub, model_id)


def text(max_size: int = 12, *, surrogates: bool = True, min_size: int = 0) -> Any:
    """Strings; with `surrogates`, lone surrogates (JSON's `\\ud800` escapes) too."""
    chars = st.characters(exclude_categories=()) if surrogates else st.characters()
    return st.text(chars, min_size=min_size, max_size=max_size)


def wild() -> Any:
    """Values of the wrong type or out of every range."""
    return st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from([-1, 0, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30)]),
        st.integers(),
        st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e300, -1e-300, 3.5e38]),
        st.floats(),
        text(),
        st.lists(st.one_of(st.integers(), text()), max_size=3),
        st.dictionaries(text(), st.integers(), max_size=2),
    )


def plain(max_size: int, min_size: int = 0) -> Any:
    return text(max_size, surrogates=False, min_size=min_size)


# Valid values of the fields both endpoints share (each request draws a subset).
SHARED_VALID = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, VOCAB + 5),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "seed": st.integers(0, 2**63 - 1),
    "n": st.integers(1, 2),
    "stop": st.one_of(plain(4, 1), st.lists(plain(4, 1), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=4),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 1),
    "priority": st.integers(-(2**63), 2**63 - 1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": plain(8),
    "structured_outputs": st.fixed_dictionaries(
        {"choice": st.lists(plain(5, 1), min_size=1, max_size=3)}
    ),
}
# Values only a wild request carries: edges just past a limit and fields that are refused.
SHARED_EDGES = {
    "max_tokens": st.sampled_from([0, -1, 2**31, 10**30, 1.5, MAX_MODEL_LEN + 1]),
    "top_k": st.sampled_from([-2, 2**31, 10**12]),
    "seed": st.sampled_from([-1, 2**63, 2**64]),
    "n": st.sampled_from([0, MAX_IN_FLIGHT + 1, 10**30]),
    "stop": st.lists(st.just("s"), min_size=64, max_size=66),
    "stop_token_ids": st.lists(st.integers(VOCAB - 1, VOCAB + 1), min_size=1, max_size=3),
    "priority": st.sampled_from([2**63, -(2**63) - 1, 10**30]),
    "logit_bias": st.dictionaries(plain(3), st.floats(-1, 1), max_size=2),
    "structured_outputs": st.one_of(
        st.fixed_dictionaries({"regex": st.sampled_from(["[ab]{1,3}", "(", "x*"])}),
        st.fixed_dictionaries({"json_object": st.booleans()}),
        st.fixed_dictionaries({"choice": st.lists(text(3), max_size=2)}),
    ),
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "x"])}),
        st.fixed_dictionaries(
            {
                "type": st.just("json_schema"),
                "json_schema": st.fixed_dictionaries({"schema": wild()}),
            }
        ),
    ),
    "model": text(),
}
COMPLETION_VALID = {
    "prompt": st.one_of(
        plain(60, 1),
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
        st.lists(plain(20, 1), min_size=1, max_size=2),
        st.lists(
            st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5), min_size=1, max_size=2
        ),
    ),
    "logprobs": st.integers(0, 3),
}
COMPLETION_EDGES = {
    "prompt": st.one_of(
        text(60),
        st.lists(st.lists(st.integers(-2, VOCAB + 2), max_size=5), max_size=2),
        st.lists(st.just(1000), min_size=MAX_MODEL_LEN - 4, max_size=MAX_MODEL_LEN + 2),
    ),
    "logprobs": st.sampled_from([21, -1]),
    "echo": st.just(True),
    "suffix": plain(3, 1),
    "best_of": st.integers(1, 3),
}


def messages(valid: bool) -> Any:
    content = plain(40) if valid else text(40)
    roles = ["user", "system", "assistant"] + ([] if valid else ["", "x"])
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(roles), "content": st.one_of(content, st.none())},
        optional={"name": plain(5)},
    )
    part = st.fixed_dictionaries(
        {"type": st.sampled_from(["text"] if valid else ["text", "image_url"]), "text": content}
    )
    with_parts = st.fixed_dictionaries(
        {"role": st.just("user"), "content": st.lists(part, max_size=2)}
    )
    return st.lists(st.one_of(message, with_parts), min_size=1 if valid else 0, max_size=3)


CHAT_VALID = {
    "messages": messages(valid=True),
    "logprobs": st.booleans(),
    "chat_template_kwargs": st.one_of(
        st.fixed_dictionaries({"add_generation_prompt": st.booleans()}),
        st.fixed_dictionaries({"x": st.integers()}),
    ),
    "max_completion_tokens": st.integers(1, 3),
}
CHAT_EDGES = {
    "messages": messages(valid=False),
    "top_logprobs": st.sampled_from([2, 21, -1]),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function")}), min_size=1, max_size=1),
    "tool_choice": st.sampled_from(["auto", "required"]),
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["add_generation_prompt", "messages", "tools", "documents"]),
        wild(),
        max_size=2,
    ),
    "max_completion_tokens": st.sampled_from([0, 10**6, -5]),
}


ENGINE_LIMITED = ["top_k", "priority", "stop_token_ids", "seed", "n", "max_tokens", "stop"]


def draw_body(data: Any, model: str, chat: bool) -> dict[str, Any]:
    """A request: the prompt, a small max_tokens and a random subset of the other fields, all
    valid; then, in most requests, one or two fields replaced by a wild value or an edge.

    NOTE: max_tokens is never left unset: unset on chat it generates up to the context length.
    """
    valid = {**SHARED_VALID, **(CHAT_VALID if chat else COMPLETION_VALID)}
    edges = {**SHARED_EDGES, **(CHAT_EDGES if chat else COMPLETION_EDGES)}
    first = "messages" if chat else "prompt"
    body = {
        "model": model,
        first: data.draw(valid[first]),
        "max_tokens": data.draw(st.integers(1, 3)),
    }
    others = sorted(set(valid) - {first})
    for name in data.draw(st.lists(st.sampled_from(others), unique=True, max_size=6)):
        body[name] = data.draw(valid[name], label=name)
    # NOTE: Hypothesis leans to the first of a sampled_from: the fields whose edges are the
    # engine's limits come first, and so does one wild field per request.
    every = [*ENGINE_LIMITED, *sorted((set(valid) | set(edges) | {"model"}) - set(ENGINE_LIMITED))]
    for _ in range(data.draw(st.sampled_from([1, 0, 2]), label="wild fields")):
        name = data.draw(st.sampled_from(every), label="wild field")
        bad = st.one_of(edges[name], edges[name], wild()) if name in edges else wild()
        body[name] = data.draw(bad, label=f"wild {name}")
    return body


def check_http_answer(r: Response, body: dict[str, Any]) -> None:
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code >= 400:
        err = error_of(r)
        assert r.status_code in (400, 404), (body, r.text)
        assert isinstance(err["param"], str) and err["param"], (body, err)
    elif body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]"), r.text
        assert '"error"' not in r.text, (body, r.text)


SETTINGS = dict(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=list(hypothesis.HealthCheck),
)
HTTP_EXAMPLES = 150  # two endpoints, ~30 fields each; a refused request costs milliseconds


def test_http_requests_over_the_schema(http, stub, model_id):
    @hypothesis.settings(**{**SETTINGS, "max_examples": HTTP_EXAMPLES})
    @hypothesis.given(data=st.data())
    def one(data: Any) -> None:
        chat_endpoint = data.draw(st.booleans(), label="chat")
        body = draw_body(data, model_id, chat_endpoint)
        path = "/v1/chat/completions" if chat_endpoint else "/v1/completions"
        r = post(http, path, body)
        seen[r.status_code] += 1
        check_http_answer(r, body)

    seen: collections.Counter[int] = collections.Counter()
    one()
    print("HTTP answers:", dict(seen))
    assert seen[200] >= 5 and seen[400] >= 5, seen  # both valid and refused requests were made
    serves_normally(http, stub, model_id)


GRPC_FIELD = re.compile(
    r"^(request_id|prompt|token_ids\.ids|messages|input|priority|sampling\.\w+)"
)
INT32 = st.integers(-(2**31), 2**31 - 1)
FLOAT32 = st.floats(width=32)


# proto field -> (valid values, wild values of the proto's own type)
GRPC_SAMPLING = {
    "temperature": (st.floats(0, 2, width=32), FLOAT32),
    "top_k": (st.integers(-1, VOCAB + 5), INT32),
    "top_p": (st.floats(0.125, 1, width=32), FLOAT32),
    "min_p": (st.floats(0, 1, width=32), FLOAT32),
    "repetition_penalty": (st.floats(0.5, 2, width=32), FLOAT32),
    "frequency_penalty": (st.floats(-2, 2, width=32), FLOAT32),
    "presence_penalty": (st.floats(-2, 2, width=32), FLOAT32),
    "seed": (st.integers(0, 2**63 - 1), st.integers(2**63, 2**64 - 1)),
    "logprobs": (st.integers(0, 3), INT32),
    "prompt_logprobs": (st.integers(0, 2), INT32),
    "n": (st.integers(1, 2), INT32),
    "min_tokens": (st.integers(0, 1), INT32),
    "stop": (
        st.lists(st.text(min_size=1, max_size=4), max_size=3),
        st.lists(st.text(max_size=1100), max_size=66),
    ),
    "stop_token_ids": (
        st.lists(st.integers(0, VOCAB - 1), max_size=3),
        st.lists(INT32, max_size=66),
    ),
    "ignore_eos": (st.booleans(), st.booleans()),
    "max_tokens": (st.integers(1, 3), INT32),
}
GRPC_PROMPTS = (
    st.text(min_size=1, max_size=60),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
    st.lists(
        st.tuples(st.sampled_from(["user", "system"]), st.text(max_size=30)), min_size=1, max_size=3
    ),
)
GRPC_WILD_PROMPTS = (
    st.just(""),
    st.lists(INT32, max_size=5),
    st.lists(st.tuples(st.sampled_from(["user", ""]), st.text(max_size=30)), max_size=3),
    st.lists(st.just(1000), min_size=MAX_MODEL_LEN - 4, max_size=MAX_MODEL_LEN + 2),
)


def draw_grpc_request(data: Any) -> pb.GenerateRequest:
    """A GenerateRequest: a prompt, a small max_tokens and a random subset of the other sampling
    fields, all valid; then, in most requests, one or two of them (the prompt, the priority
    and request_id included) replaced by a wild value of the field's proto type."""
    names = sorted(GRPC_SAMPLING)
    sampling = {"max_tokens": data.draw(st.integers(1, 3))}
    for name in data.draw(st.lists(st.sampled_from(names), unique=True, max_size=6)):
        sampling[name] = data.draw(GRPC_SAMPLING[name][0], label=name)
    prompt, priority, rid = data.draw(st.one_of(*GRPC_PROMPTS), label="prompt"), None, ""
    first = ["stop_token_ids", "max_tokens", "seed", "prompt", "priority"]
    for _ in range(data.draw(st.sampled_from([1, 0, 2]), label="wild fields")):
        name = data.draw(st.sampled_from([*first, *sorted(set(names) - set(first)), "request_id"]))
        if name == "prompt":
            prompt = data.draw(st.one_of(*GRPC_WILD_PROMPTS), label="wild prompt")
        elif name == "priority":
            priority = data.draw(INT32, label="priority")
        elif name == "request_id":
            rid = data.draw(st.text(max_size=300), label="request_id")
        else:
            sampling[name] = data.draw(GRPC_SAMPLING[name][1], label=f"wild {name}")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], tuple):
        prompt = [{"role": r, "content": c} for r, c in prompt]
    return build_request(prompt, request_id=rid, priority=priority, **sampling)


def test_grpc_requests_over_the_schema(http, stub, model_id):
    @hypothesis.settings(**SETTINGS)
    @hypothesis.given(data=st.data())
    def one(data: Any) -> None:
        req = draw_grpc_request(data)
        try:
            msgs = list(stub.Generate(req, timeout=120))
        except grpc.RpcError as e:
            seen[e.code().name] += 1
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (req, e.code(), e.details())
            assert GRPC_FIELD.match(e.details()), (req, e.details())
            return
        seen["OK"] += 1
        assert msgs and msgs[-1].finish_reason != pb.GenerateResponse.FINISH_REASON_UNSPECIFIED

    seen: collections.Counter[str] = collections.Counter()
    one()
    print("gRPC answers:", dict(seen))
    assert seen["OK"] >= 5 and seen["INVALID_ARGUMENT"] >= 5, seen
    serves_normally(http, stub, model_id)
