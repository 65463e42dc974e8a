"""Request bounds, request fields and structured output through one real served process
(`scripts/serve.py --scheduling-policy priority --api-key KEY`, engine core in its own process,
tiny model with random weights), driven as users drive it: the `openai` client, plain HTTP and
the gRPC stub. NOTE: one module, one server (a served start is most of such a module's CPU):
every client here sends the API key unless a test is about leaving it out.

Bounds: every hostile field is a 400 / INVALID_ARGUMENT naming it, never a 5xx, and the server
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

Fields (vLLM's request fields, cache salts, priority scheduling, utility endpoints, the API key):
4. Completions `echo` with `logprobs` and `max_tokens=0` (lm-evaluation-harness's loglikelihood):
   the prompt comes back with its logprobs (None first), equal to the logprobs the same tokens
   had when they were generated; nothing generated is returned or counted; streamed alike.
5. `logit_bias` (+100 on one id: greedy emits only it), `allowed_token_ids` (every sampled id is
   one of them), `bad_words` (the greedy first word never comes), `include_stop_str_in_output`,
   the legacy `guided_choice`, `return_tokens_as_token_ids`, and the same token controls on gRPC.
6. `cache_salt`: one prompt twice under salt "a" hits the prefix cache (`cached_tokens` > 0,
   and the same count on `vllm:prefix_cache_hits`); under salt "b", or no salt, it does not;
   on gRPC too.
7. Priority: four long requests fill every row, four low-priority requests queue, then one
   high-priority request: it finishes before the last low one (first come first served would
   run it last).
8. `--api-key`: HTTP without the Bearer key is a 401 OpenAI error (`/health`, `/ping`,
   `/metrics` stay open); gRPC without `authorization` metadata is UNAUTHENTICATED.
9. An unknown field is a 400 naming it; `/tokenize`, `/detokenize`, `/version`, `/ping`; 404 and
   405 are OpenAI error objects.

Structured output (issue 27's served bug). The model's unconstrained output is noise, so output
that a grammar accepts shows the constraint applied.
10. `response_format` `json_schema` (bounded: enums, a boolean and no free whitespace, so the
   object always closes): the reply parses and validates against the schema.
11. `response_format` `json_object`: the reply is accepted by the JSON grammar token by token (a
   length finish may cut it; a stop finish must parse to an object).
12. vLLM's `extra_body={"structured_outputs": ...}`: `choice`, `regex` and `grammar` replies match.
13. gRPC `sampling.structured_outputs` (field 17): `choice`, `regex`, `grammar` and `json_schema`
   constrain the streamed token ids.
14. An invalid schema is a 400 / INVALID_ARGUMENT naming the field, and the server keeps serving.
"""

from __future__ import annotations

import collections
import dataclasses
import http.client as httplib
import json
import re
import threading
import time
from typing import Any

import grpc
import pytest
from served_utils import serve_tiny

from jaxinfer.sampling_params import StructuredOutputsParams
from jaxinfer.structured import grammar_of, llguidance_tokenizer
from serving import validation
from serving.client import build_request
from serving.protos.jaxinfer.v1 import generate_pb2 as pb
from serving.protos.jaxinfer.v1 import generate_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # a server subprocess: imports JAX, compiles on first use

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies
openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")
jsonschema = pytest.importorskip("jsonschema")

KEY = "test-key-123"
AUTH = (("authorization", f"Bearer {KEY}"),)
MAX_MODEL_LEN = 256
# NOTE: the priority test needs 4 running + 5 waiting requests.
MAX_IN_FLIGHT = 9  # --max-num-seqs 4 + --max-queue 5
VOCAB = 49152  # SmolLM2's (served_utils.tiny_model_dir)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    srv = serve_tiny(
        tmp_path_factory.mktemp("served") / "tiny",
        *("--max-model-len", str(MAX_MODEL_LEN), "--max-queue", "5"),
        *("--scheduling-policy", "priority"),  # priorities span int64 here
        *("--api-key", KEY),
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
        headers = {"Authorization": f"Bearer {KEY}"}
        if body is not None:
            headers["Content-Type"] = "application/json"
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


class AuthedStub:
    """The gRPC stub whose calls send the API key (unless a call passes its own `metadata`)."""

    def __init__(self, stub: pb_grpc.GenerateServiceStub) -> None:
        self.stub = stub

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.stub, name)
        return lambda *args, **kw: method(*args, **{"metadata": AUTH, **kw})


@pytest.fixture(scope="module")
def stub(served):
    channel = grpc.insecure_channel(served.grpc_address)
    yield AuthedStub(pb_grpc.GenerateServiceStub(channel))
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
    # no token of the model can write the choice: llguidance fails its first mask (in the core,
    # after admission); a stream must still answer 400, not 200 with an error inside
    "unwritable choice, streamed": (
        "completions",
        {"structured_outputs": {"choice": ["\x1d"]}, "stream": True},
        "structured_outputs.choice",
    ),
    "unwritable choice, streamed chat": (
        "chat",
        {"structured_outputs": {"choice": ["\x1d"]}, "stream": True},
        "structured_outputs.choice",
    ),
    "unwritable choice": (
        "completions",
        {"structured_outputs": {"choice": ["\x1d"]}},
        "structured_outputs.choice",
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


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.http_url, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def root(served):
    return served.http_url.removesuffix("/v1")


def ids_of(choice) -> list[int]:
    """Token ids of a completion choice asked with logprobs + return_tokens_as_token_ids."""
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def complete(client, model, prompt, **kw):
    extra = kw.pop("extra_body", {})
    return client.completions.create(
        model=model, prompt=prompt, temperature=0, extra_body=extra, **kw
    )


def tokenize(root, text: str) -> list[int]:
    r = requests.post(
        f"{root}/tokenize", json={"prompt": text}, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_echo_logprobs_max_tokens_0_scores_the_prompt(client, model, root):
    gen = complete(
        client,
        model,
        "The quick brown fox",
        max_tokens=3,
        logprobs=1,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    ).choices[0]
    prompt_ids = tokenize(root, "The quick brown fox")
    full = prompt_ids + ids_of(gen)
    r = complete(client, model, full, max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(full) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(t for t in lp.top_logprobs[1:])
    scored = lp.token_logprobs[len(prompt_ids) :]
    assert scored == pytest.approx(gen.logprobs.token_logprobs, abs=2e-3)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(full)
    assert r.choices[0].text == "".join(lp.tokens)
    chunks = client.completions.create(
        model=model, prompt=full, max_tokens=0, echo=True, logprobs=1, temperature=0, stream=True
    )
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in streamed) == r.choices[0].text
    assert streamed[0].logprobs.token_logprobs == lp.token_logprobs
    more = complete(client, model, "The quick brown fox", max_tokens=2, echo=True)
    assert more.choices[0].text.startswith("The quick brown fox")
    assert len(more.choices[0].text) > len("The quick brown fox")


def test_logit_bias_allowed_token_ids_and_bad_words(client, model):
    tids = {"return_tokens_as_token_ids": True, "ignore_eos": True}
    r = complete(client, model, "hi", max_tokens=4, logprobs=0, logit_bias={"1234": 100},
                 extra_body=tids)  # fmt: skip
    assert ids_of(r.choices[0]) == [1234] * 4
    allowed = [1234, 2345, 3456]
    r = client.completions.create(
        model=model,
        prompt="hi",
        max_tokens=8,
        temperature=1.0,
        seed=5,
        logprobs=0,
        extra_body={**tids, "allowed_token_ids": allowed},
    )
    assert set(ids_of(r.choices[0])) <= set(allowed)
    first = complete(client, model, "hello there", max_tokens=1, logprobs=0, extra_body=tids)
    (t0,) = ids_of(first.choices[0])
    word = complete(client, model, "hello there", max_tokens=1).choices[0].text.strip()
    assert word, "the greedy first token has no word to ban"
    banned = complete(
        client, model, "hello there", max_tokens=3, logprobs=0,
        extra_body={**tids, "bad_words": [word]},
    )  # fmt: skip
    assert ids_of(banned.choices[0])[0] != t0
    assert word not in banned.choices[0].text


def test_include_stop_str_and_guided_choice(client, model):
    base = complete(client, model, "hello", max_tokens=6, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    cut = text[: text.find(stop)]
    kw = {"max_tokens": 6, "stop": [stop]}
    without = complete(client, model, "hello", extra_body={"ignore_eos": True}, **kw)
    with_ = complete(
        client,
        model,
        "hello",
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
        **kw,
    )
    assert without.choices[0].text == cut
    assert with_.choices[0].text == cut + stop
    r = complete(client, model, "pick", max_tokens=8, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")


def test_cache_salt_isolates_prefix_cache(client, model, served):
    prompt = "salted " * 40  # several full KV pages

    def cached(salt=None, **kw):
        """(cached tokens in the usage, the hits the engine counted) of one request."""
        extra = {} if salt is None else {"cache_salt": salt}
        before = served.metric("vllm:prefix_cache_hits_total")  # cached prompt tokens
        r = complete(client, model, prompt, max_tokens=1, extra_body=extra, **kw)
        hits = served.metric("vllm:prefix_cache_hits_total") - before
        assert hits == r.usage.prompt_tokens_details.cached_tokens
        return hits

    assert cached("a") == 0
    assert cached("a") > 0  # same salt: hit
    assert cached("b") == 0  # another tenant: no hit on "a"'s pages
    assert cached() == 0  # no salt: no hit either
    assert cached("b") > 0


def test_grpc_fields_and_cache_salt(stub):
    def run(**kw):
        salt = kw.pop("cache_salt", None)
        kw = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, **kw}
        req = build_request("grpc salted prompt " * 12, **kw)
        if salt is not None:
            req.cache_salt = salt
        return stub.GenerateOnce(req, timeout=300)

    assert list(run(logit_bias={77: 100.0}).token_ids) == [77] * 3
    assert set(run(allowed_token_ids=[5000, 6000], temperature=1.0, seed=1).token_ids) <= {
        5000,
        6000,
    }
    assert run(cache_salt="x").usage.cached_prompt_tokens == 0
    assert run(cache_salt="x").usage.cached_prompt_tokens > 0
    assert run(cache_salt="y").usage.cached_prompt_tokens == 0
    with pytest.raises(grpc.RpcError) as info:
        run(logit_bias={77: 1000.0})
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.logit_bias.77" in info.value.details()


def test_priority_runs_the_urgent_request_first(client, model, root):
    started = [threading.Event() for _ in range(4)]
    done: dict[str, float] = {}
    errors: list[BaseException] = []

    def blocker(i: int) -> None:
        try:
            stream = client.completions.create(
                model=model, prompt=f"block {i}", max_tokens=200, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            for _ in stream:
                started[i].set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            started[i].set()

    def queued(name: str, priority: int) -> None:
        try:
            complete(client, model, f"q {name}", max_tokens=8,
                     extra_body={"ignore_eos": True, "priority": priority})  # fmt: skip
            done[name] = time.monotonic()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=blocker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(120), "a blocker never started"
    lows = [threading.Thread(target=queued, args=(f"low{i}", 5)) for i in range(4)]
    for t in lows:
        t.start()
    deadline = time.monotonic() + 60
    while waiting(root) < 4:  # every low-priority request has arrived before the urgent one
        assert time.monotonic() < deadline, "the low-priority requests never queued"
        time.sleep(0.02)
    high = threading.Thread(target=queued, args=("high", -5))
    high.start()
    for t in [*threads, *lows, high]:
        t.join(180)
    assert not errors, errors
    assert done["high"] < max(done[f"low{i}"] for i in range(4)), done


def waiting(root) -> float:
    text = requests.get(f"{root}/metrics").text
    for line in text.splitlines():
        if line.startswith("jaxinfer_num_requests_waiting "):
            return float(line.split()[1])
    raise AssertionError("no jaxinfer_num_requests_waiting gauge")


def test_api_key_on_both_protocols(served, model, root, stub):
    anonymous = openai.OpenAI(base_url=served.http_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        anonymous.completions.create(model=model, prompt="hi", max_tokens=1)
    assert info.value.body["param"] == "authorization"
    assert requests.post(f"{root}/tokenize", json={"prompt": "x"}).status_code == 401
    for path in ("/health", "/ping", "/metrics"):
        assert requests.get(root + path).status_code == 200, path
    req = build_request("hi", max_tokens=1)
    with pytest.raises(grpc.RpcError) as info:
        stub.GenerateOnce(req, metadata=(), timeout=60)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        stub.GenerateOnce(req, metadata=(("authorization", "Bearer nope"),), timeout=60)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert stub.GenerateOnce(req, metadata=AUTH, timeout=60).usage.completion_tokens == 1


def test_unknown_field_and_endpoints(client, model, root):
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, model, "hi", max_tokens=1, extra_body={"max_token": 3})
    assert info.value.body["param"] == "max_token"
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, model, "hi", max_tokens=1, extra_body={"use_beam_search": True})
    assert info.value.body["param"] == "use_beam_search"
    auth = {"Authorization": f"Bearer {KEY}"}
    tok = requests.post(
        f"{root}/tokenize", json={"prompt": "hello there", "return_token_strs": True}, headers=auth
    ).json()
    assert tok["count"] == len(tok["tokens"]) and "".join(tok["token_strs"]) == "hello there"
    text = requests.post(f"{root}/detokenize", json={"tokens": tok["tokens"]}, headers=auth)
    assert text.json() == {"prompt": "hello there"}
    assert requests.get(f"{root}/version", headers=auth).json()["version"]
    assert requests.post(f"{root}/ping").status_code == 200
    missing = requests.get(f"{root}/v1/nope", headers=auth)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    wrong = requests.get(f"{root}/v1/completions", headers=auth)
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"


SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
        "sure": {"type": "boolean"},
    },
    "required": ["answer", "sure"],
    "additionalProperties": False,
    # NOTE: llguidance's option: no whitespace between tokens. JSON grammars allow any amount by
    # default, and a random-weight model takes that path at length; so would a real small model.
    "x-guidance": {"whitespace_flexible": False},
}
CHOICES = ["red", "green", "blue"]
REGEX = r"[A-Z][a-z]{2,5} is [0-9]{1,2}"


@pytest.fixture(scope="module")
def tok(served):
    from engine_utils import load_vocab

    return load_vocab()


def accepted(tok, params: StructuredOutputsParams, ids: list[int]) -> tuple[bool, bool]:
    """(every token accepted by the grammar, the grammar accepts the sequence as complete)."""
    import llguidance as llg

    matcher = llg.LLMatcher(llguidance_tokenizer(tok, tok.vocab_size), grammar_of(params))
    ids = [i for i in ids if i not in tok.eos_token_ids]
    ok = matcher.consume_tokens(ids) and not matcher.is_error()
    return ok, ok and matcher.is_accepting()


def chat_json(client, **kw):
    model = client.models.list().data[0].id
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Answer in JSON."}],
        max_tokens=48,
        temperature=0.8,
        seed=3,
        **kw,
    )


def test_openai_json_schema(client):
    r = chat_json(
        client,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_openai_json_object(client, tok):
    r = chat_json(client, response_format={"type": "json_object"})
    choice = r.choices[0]
    text = choice.message.content
    ok, complete = accepted(
        tok,
        StructuredOutputsParams(json_object=True),
        tok.encode(text, add_special_tokens=False),
    )
    assert ok, text
    if choice.finish_reason == "stop":
        assert complete and isinstance(json.loads(text), dict), text


def test_openai_extra_body_choice_regex_and_grammar(client, tok):
    model = client.models.list().data[0].id
    r = client.completions.create(
        model=model,
        prompt="Pick a color:",
        max_tokens=16,
        n=2,
        seed=5,
        extra_body={"structured_outputs": {"choice": CHOICES}},
    )
    assert [c.text for c in r.choices if c.text not in CHOICES] == []
    r = client.completions.create(
        model=model,
        prompt="A name and an age:",
        max_tokens=24,
        temperature=0,
        extra_body={"structured_outputs": {"regex": REGEX}},
    )
    assert re.fullmatch(REGEX, r.choices[0].text), r.choices[0].text
    grammar = 'root ::= "(" [0-9]+ ")"'
    r = client.completions.create(
        model=model,
        prompt="A number in parentheses:",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    ok, complete = accepted(
        tok,
        StructuredOutputsParams(grammar=grammar),
        tok.encode(r.choices[0].text, add_special_tokens=False),
    )
    assert ok and (complete or r.choices[0].finish_reason == "length"), r.choices[0].text


def _grpc_ids(stub, so: pb.StructuredOutputs, max_tokens: int = 32) -> tuple[list[int], int]:
    req = build_request("Say something:", max_tokens=max_tokens, temperature=0.7, seed=11)
    req.sampling.structured_outputs.CopyFrom(so)
    msgs = list(stub.Generate(req, timeout=120))
    return [t for m in msgs for t in m.token_ids], msgs[-1].finish_reason


def test_grpc_structured_outputs(stub, tok):
    ids, _ = _grpc_ids(stub, pb.StructuredOutputs(choice=pb.Choices(choices=CHOICES)))
    assert tok.decode(ids) in CHOICES
    ids, _ = _grpc_ids(stub, pb.StructuredOutputs(regex=REGEX))
    assert re.fullmatch(REGEX, tok.decode(ids)), tok.decode(ids)
    grammar = 'root ::= "(" [0-9]+ ")"'
    ids, finish = _grpc_ids(stub, pb.StructuredOutputs(grammar=grammar), max_tokens=8)
    ok, complete = accepted(tok, StructuredOutputsParams(grammar=grammar), ids)
    assert ok and (complete or finish == pb.GenerateResponse.LENGTH), tok.decode(ids)
    ids, finish = _grpc_ids(stub, pb.StructuredOutputs(json_schema=json.dumps(SCHEMA)), 48)
    assert finish == pb.GenerateResponse.STOP
    jsonschema.validate(json.loads(tok.decode(ids)), SCHEMA)


def test_invalid_schema_is_named_and_the_server_keeps_serving(client, stub, tok):
    bad = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as e:
        chat_json(client, response_format={"type": "json_schema", "json_schema": {"schema": bad}})
    assert "response_format.json_schema" in str(e.value)
    req = build_request("x", max_tokens=4)
    req.sampling.structured_outputs.regex = "("
    with pytest.raises(grpc.RpcError) as g:
        list(stub.Generate(req, timeout=60))
    assert g.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_outputs.regex" in g.value.details()
    ids, _ = _grpc_ids(stub, pb.StructuredOutputs(choice=pb.Choices(choices=CHOICES)))
    assert tok.decode(ids) in CHOICES
