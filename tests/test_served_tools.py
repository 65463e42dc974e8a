"""Tool calling and reasoning output through the real served process (`scripts/serve.py
--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`), driven with the
official `openai` client.

The model is the 2-layer random-weight tiny model (`served_utils`) with a ChatML template of this
module's own that renders `tools`, assistant `tool_calls`, `tool` messages and Qwen3's
`enable_thinking`. A random model never writes a tool call by itself, so:
1. `auto`: structured output forces the hermes format (`<tool_call>{...}</tool_call>`); the
   parser turns it into `tool_calls` (finish reason `tool_calls`), whole and streamed.
2. `required` and a named `tool_choice` are enforced by the server's own constraint: the calls'
   arguments validate against each tool's schema (jsonschema), whole and streamed.
3. The history's assistant `tool_calls` and `tool` message reach the template (arguments as an
   object): the prompt's token count is that of the template rendered here.
4. Reasoning: a thinking request's constrained output must open with `<think>` (the reasoning
   comes before the answer's constraint), so its text lands in `reasoning_content`, streamed as
   its own deltas; `enable_thinking: false` passes through to the template and the constrained
   output is all answer. The parsers' full splits are tested on text (`test_chat_parsers.py`).
5. gRPC: a chat (`messages`) request's reasoning comes in `reasoning_text`, the answer in
   `text`; `messages.enable_thinking` false passes through.
"""

from __future__ import annotations

import json

import pytest
from served_utils import serve_tiny

pytestmark = pytest.mark.slow  # a server subprocess: imports JAX, compiles on first use

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

TEMPLATE = """\
{%- if tools %}<|im_start|>system
Call a function as <tool_call>{"name": ..., "arguments": ...}</tool_call>. Functions:
{% for t in tools %}{{ t.function | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>
{% endfor %}<|im_end|>
{% elif m.role == "tool" %}<|im_start|>user
<tool_response id="{{ m.tool_call_id }}">{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
HERMES = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Rome)", "celsius": (true|false)\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served") / "tiny"
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    srv = serve_tiny(root, *flags, "--reasoning-parser", "qwen3", chat_template=TEMPLATE)
    srv.root = root
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.http_url, api_key="unused", max_retries=0, timeout=120)


def chat(client, stream=False, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "Weather in Paris?"}])
    r = client.chat.completions.create(
        model=client.models.list().data[0].id,
        max_tokens=kw.pop("max_tokens", 64),
        temperature=0,
        seed=1,
        stream=stream,
        **kw,
    )
    return collect(r) if stream else r.choices[0]


def collect(chunks) -> dict:
    """A streamed choice's parts: reasoning and content texts, calls by index, finish reason."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None, "deltas": []}
    for chunk in chunks:
        for choice in chunk.choices:
            d = choice.delta
            out["deltas"].append(d)
            out["reasoning"] += getattr(d, "reasoning_content", None) or ""
            out["content"] += d.content or ""
            for tc in d.tool_calls or []:
                call = out["calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or tc.id
                call["name"] += (tc.function.name or "") if tc.function else ""
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_auto_parses_the_hermes_format(client):
    kw = dict(tools=TOOLS, extra_body={"structured_outputs": {"regex": HERMES}, **NO_THINKING})
    choice = chat(client, **kw)
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    check_call("get_weather", call.function.arguments)
    streamed = chat(client, stream=True, **kw)
    assert streamed["finish"] == "tool_calls" and streamed["content"] == ""
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [
        ("get_weather", call.function.arguments)
    ]


def test_required_calls_validate(client):
    choice = chat(
        client,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        extra_body=NO_THINKING,
    )
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    check_call(call.function.name, call.function.arguments)
    streamed = chat(
        client,
        stream=True,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        extra_body=NO_THINKING,
    )
    assert streamed["finish"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [
        (call.function.name, call.function.arguments)
    ]


def test_named_call_validates_whole_and_streamed(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = chat(client, tools=TOOLS, tool_choice=named, extra_body=NO_THINKING)
    assert choice.finish_reason == "stop", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    check_call("get_time", call.function.arguments)
    streamed = chat(client, stream=True, tools=TOOLS, tool_choice=named, extra_body=NO_THINKING)
    (call_s,) = streamed["calls"].values()
    assert call_s["name"] == "get_time" and call_s["id"].startswith("chatcmpl-tool-")
    check_call("get_time", call_s["arguments"])
    assert len([d for d in streamed["deltas"] if d.tool_calls]) > 1  # arguments streamed


def test_bad_tool_choice_is_named(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice.function.name"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, tool_choice="required")
    assert e.value.body["param"] == "tools"


def test_history_tool_calls_reach_the_template(client, served):
    from jaxinfer.tokenizer import Tokenizer

    args = {"city": "Rome", "celsius": True}
    history = [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(args)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
    ]
    r = chat_raw(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=1)
    tok = Tokenizer.from_path(served.root)
    expected = [dict(m) for m in history]
    expected[1] = {**history[1], "content": ""}
    expected[1]["tool_calls"] = [
        {**history[1]["tool_calls"][0], "function": {"name": "get_weather", "arguments": args}}
    ]
    ids = tok.encode_chat(expected, tools=TOOLS)
    assert r.usage.prompt_tokens == len(ids)
    assert "22 C, sunny" in tok.decode(ids) and '"celsius": true' in tok.decode(ids)


def chat_raw(client, **kw):
    return client.chat.completions.create(model=client.models.list().data[0].id, **kw)


def test_reasoning_content_whole_and_streamed(client):
    kw = dict(max_tokens=12, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    choice = chat(client, **kw)
    reasoning = choice.message.model_extra["reasoning_content"]
    assert reasoning and choice.message.content is None, choice  # forced `<think>`, then free
    assert "<think>" not in reasoning
    streamed = chat(client, stream=True, **kw)
    assert streamed["reasoning"] == reasoning and streamed["content"] == ""
    assert any(getattr(d, "reasoning_content", None) for d in streamed["deltas"])
    no_thinking = chat(
        client, extra_body={"structured_outputs": {"choice": ["yes", "no"]}, **NO_THINKING}
    )
    assert no_thinking.message.content in ("yes", "no")
    assert no_thinking.message.model_extra["reasoning_content"] is None


def test_grpc_reasoning_text(served):
    import grpc

    from serving.protos.jaxinfer.v1 import generate_pb2 as pb
    from serving.protos.jaxinfer.v1 import generate_pb2_grpc as pb_grpc

    def once(**chat):
        req = pb.GenerateRequest(
            messages=pb.ChatMessages(
                messages=[pb.ChatMessage(role="user", content="Yes or no?")], **chat
            ),
            sampling=pb.SamplingParams(max_tokens=12, temperature=0.0),
        )
        req.sampling.structured_outputs.choice.choices.extend(["yes", "no"])
        with grpc.insecure_channel(served.grpc_address) as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            return stub.GenerateOnce(req, timeout=120), list(stub.Generate(req, timeout=120))

    whole, parts = once()
    assert whole.reasoning_text and whole.text == "", whole
    assert "".join(m.reasoning_text for m in parts) == whole.reasoning_text
    assert all(m.text == "" for m in parts)
    whole, _ = once(enable_thinking=False)
    assert whole.text in ("yes", "no") and whole.reasoning_text == "", whole
