"""`tool_choice: "auto"` with the `llama3_json` and `mistral` parsers through the real served
process (`scripts/serve.py --enable-auto-tool-choice --tool-call-parser NAME`), one server per
parser (a server takes one parser, as in vLLM); hermes is `test_served_tools.py`'s.

A random tiny model never writes a call by itself, so structured output forces each parser's
format (Llama 3.x: `<|python_tag|>{"name": ..., "parameters": {...}}`; Mistral:
`[TOOL_CALLS][{"name": ..., "arguments": {...}}]`); the parser must turn it into `tool_calls`
(finish reason `tool_calls`, no content), whole and streamed, with arguments valid for the tool's
schema. Both markers are special tokens in those models' own tokenizers, which is why `auto` with
these parsers keeps special tokens in the output text (`ChatPlan.keep_special_tokens`).
"""

from __future__ import annotations

import pytest
from served_utils import serve_tiny
from test_served_tools import NO_THINKING, TEMPLATE, TOOLS, chat, check_call

pytestmark = pytest.mark.slow  # a server subprocess per parser

openai = pytest.importorskip("openai")

ARGS = r'\{"city": "(Paris|Rome)", "celsius": (true|false)\}'
FORMATS = {
    "llama3_json": r'<\|python_tag\|>\{"name": "get_weather", "parameters": ' + ARGS + r"\}",
    "mistral": r'\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": ' + ARGS + r"\}\]",
}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def parser(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param) / "tiny"
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", request.param]
    srv = serve_tiny(root, *flags, chat_template=TEMPLATE)
    client = openai.OpenAI(base_url=srv.http_url, api_key="unused", max_retries=0, timeout=300)
    yield request.param, client
    assert srv.stop() == 0, "".join(srv.log[-30:])


def test_auto_parses_the_models_own_format(parser):
    name, client = parser
    kw = dict(
        tools=TOOLS, extra_body={"structured_outputs": {"regex": FORMATS[name]}, **NO_THINKING}
    )
    choice = chat(client, **kw)
    assert choice.finish_reason == "tool_calls", (name, choice.message.content)
    assert choice.message.content is None, name
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    check_call("get_weather", call.function.arguments)
    streamed = chat(client, stream=True, **kw)
    assert streamed["finish"] == "tool_calls" and streamed["content"] == "", (name, streamed)
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [
        ("get_weather", call.function.arguments)
    ]
