"""Structured output through the real served process (`scripts/serve.py`, engine core in its own
process), driven as users drive it: the official `openai` client and the gRPC stub.

The model is a 2-layer Llama with SmolLM2's vocabulary and random weights (`served_utils`): its
unconstrained output is noise, so output that a grammar accepts shows the constraint applied.
1. `response_format` `json_schema` (bounded: enums, a boolean and no free whitespace, so the
   object always closes):
   the reply parses and validates against the schema.
2. `response_format` `json_object`: the reply is accepted by the JSON grammar token by token (a
   length finish may cut it; a stop finish must parse to an object).
3. vLLM's `extra_body={"structured_outputs": ...}`: `choice`, `regex` and `grammar` replies match.
4. gRPC `sampling.structured_outputs` (field 17): `choice`, `regex`, `grammar` and `json_schema`
   constrain the streamed token ids.
5. An invalid schema is a 400 / INVALID_ARGUMENT naming the field, and the server keeps serving.
"""

from __future__ import annotations

import json
import re

import grpc
import pytest
from served_utils import serve_tiny

from jaxinfer.sampling_params import StructuredOutputsParams
from jaxinfer.structured import grammar_of, llguidance_tokenizer
from serving.client import build_request
from serving.protos.jaxinfer.v1 import generate_pb2 as pb
from serving.protos.jaxinfer.v1 import generate_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # a server subprocess: imports JAX, compiles on first use

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

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
def served(tmp_path_factory):
    srv = serve_tiny(tmp_path_factory.mktemp("served") / "tiny")
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


@pytest.fixture(scope="module")
def tok(served):
    from engine_utils import load_vocab

    return load_vocab()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.http_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def stub(served):
    channel = grpc.insecure_channel(served.grpc_address)
    yield pb_grpc.GenerateServiceStub(channel)
    channel.close()


def accepted(tok, params: StructuredOutputsParams, ids: list[int]) -> tuple[bool, bool]:
    """(every token accepted by the grammar, the grammar accepts the sequence as complete)."""
    import llguidance as llg

    matcher = llg.LLMatcher(llguidance_tokenizer(tok, tok.vocab_size), grammar_of(params))
    ids = [i for i in ids if i not in tok.eos_token_ids]
    ok = matcher.consume_tokens(ids) and not matcher.is_error()
    return ok, ok and matcher.is_accepting()


def chat(client, **kw):
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
    r = chat(
        client,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_openai_json_object(client, tok):
    r = chat(client, response_format={"type": "json_object"})
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
        chat(client, response_format={"type": "json_schema", "json_schema": {"schema": bad}})
    assert "response_format.json_schema" in str(e.value)
    req = build_request("x", max_tokens=4)
    req.sampling.structured_outputs.regex = "("
    with pytest.raises(grpc.RpcError) as g:
        list(stub.Generate(req, timeout=60))
    assert g.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_outputs.regex" in g.value.details()
    ids, _ = _grpc_ids(stub, pb.StructuredOutputs(choice=pb.Choices(choices=CHOICES)))
    assert tok.decode(ids) in CHOICES
