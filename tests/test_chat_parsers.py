"""The tool-call and reasoning parsers on text (`serving.tool_parsers`, `serving.reasoning`):
whole answers and the same answers streamed in small pieces give the same calls and text; the
reasoning-then-answer grammar lets `<think>` text through and constrains what follows."""

from __future__ import annotations

import json

import pytest

from serving.reasoning import REASONING_PARSERS, answer_grammar
from serving.tool_parsers import TOOL_PARSERS, JsonArrayToolParser
from tests.script_utils import script

WEATHER = {"city": "Paris", "days": 2}

CASES = {
    "hermes": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
        + json.dumps(WEATHER)
        + '}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me check.\n",
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "get_weather", "parameters": '
        + json.dumps(WEATHER)
        + '}; {"name": "get_time", "parameters": {}}',
        None,
    ),
    "mistral": (
        'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": '
        + json.dumps(WEATHER)
        + '}, {"name": "get_time", "arguments": {}}]',
        "Sure. ",
    ),
}


def _streamed(parser, text: str, step: int = 3):
    content, calls = "", []
    for i in range(0, len(text), step):
        c, new = parser.stream(text[i : i + step])
        content += c
        calls += new
    c, new = parser.finish()
    return content + c, calls


@pytest.mark.parametrize("name", sorted(CASES))
def test_tool_parser_whole_and_streamed(name):
    text, content = CASES[name]
    got = TOOL_PARSERS[name]().extract(text)
    assert got.content == content
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [
        ("get_weather", WEATHER),
        ("get_time", {}),
    ]
    s_content, s_calls = _streamed(TOOL_PARSERS[name](), text)
    assert (s_content or None) == content
    assert [(c.name, c.arguments) for c in s_calls] == [(c.name, c.arguments) for c in got.calls]


@pytest.mark.parametrize("name", sorted(CASES))
def test_tool_parser_plain_text_and_broken_calls_stay_content(name):
    for text in (
        "The weather is fine.",
        "x <tool_call>{not json</tool_call> [TOOL_CALLS][{",
        '{"not": "a call"}',
        '<tool_call>{"no": "name"}</tool_call>',
    ):
        got = TOOL_PARSERS[name]().extract(text)
        assert (got.content, got.calls) == (text, [])
        assert _streamed(TOOL_PARSERS[name](), text) == (text, [])


def test_required_array_parser():
    text = '[{"name":"a","parameters":{"x":1}},{"name":"b","parameters":{}}]'
    got = JsonArrayToolParser().extract(text)
    assert [(c.name, c.arguments) for c in got.calls] == [("a", '{"x": 1}'), ("b", "{}")]
    _, calls = _streamed(JsonArrayToolParser(), text, step=5)
    assert [c.name for c in calls] == ["a", "b"]


@pytest.mark.parametrize(
    ("name", "text", "reasoning", "content"),
    [
        ("deepseek_r1", "I think so.</think>\n\nYes.", "I think so.", "\n\nYes."),
        ("deepseek_r1", "<think>Hmm</think>Yes.", "Hmm", "Yes."),
        ("deepseek_r1", "still thinking", "still thinking", None),
        ("qwen3", "<think>\nHmm.\n</think>\n\nYes.", "\nHmm.\n", "\n\nYes."),
        ("qwen3", "Yes, no thinking.", None, "Yes, no thinking."),
        ("qwen3", "<think>cut off", "cut off", None),
    ],
)
def test_reasoning_split_whole_and_streamed(name, text, reasoning, content):
    assert REASONING_PARSERS[name]().split(text) == (reasoning, content)
    for step in (1, 2, 5):
        parser = REASONING_PARSERS[name]()
        r = c = ""
        for i in range(0, len(text), step):
            dr, dc = parser.stream(text[i : i + step])
            r, c = r + dr, c + dc
        dr, dc = parser.finish()
        assert ((r + dr) or None, (c + dc) or None) == (reasoning, content), step


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_answer_grammar_constrains_after_the_reasoning(name):
    llg = pytest.importorskip("llguidance")
    from engine_utils import load_vocab

    from jaxinfer.sampling_params import StructuredOutputsParams
    from jaxinfer.structured import grammar_of, llguidance_tokenizer, validate

    tok = load_vocab()
    lltok = llguidance_tokenizer(tok, tok.vocab_size)
    schema = {"type": "object", "properties": {"a": {"enum": ["x"]}}, "required": ["a"]}
    params = StructuredOutputsParams(grammar=answer_grammar(name, f"%json {json.dumps(schema)}"))
    validate(params)

    def accepts(text: str) -> bool:
        m = llg.LLMatcher(lltok, grammar_of(params))
        return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    assert accepts('<think>Any text { here.</think>\n\n{"a":"x"}')
    assert not accepts('<think>Any text.</think>\n\n{"a":"y"}')
    assert not accepts("<think>Any text.</think>\n\nfree text")
    assert accepts('reasoning first</think>{"a":"x"}') == (name == "deepseek_r1")
    assert not accepts('{"a":"x"}')  # a thinking request reasons first


def _req(**kw):
    from serving.openai_protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **kw}
    )


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_plan_refusals_name_the_field():
    from serving.chat import AUTO_NEEDS_FLAGS, ChatOptions, plan
    from serving.errors import InvalidArgument

    plain = ChatOptions()
    with pytest.raises(InvalidArgument) as e:  # tools default to tool_choice auto, as in vLLM
        plan(_req(tools=[TOOL]), plain)
    assert (str(e.value), e.value.field) == (AUTO_NEEDS_FLAGS, "tool_choice")
    assert plan(_req(tools=[TOOL], tool_choice="none"), plain).structured is None
    bad = [
        (dict(tools=[{"type": "function", "function": {}}]), "tools[0].function.name"),
        (dict(tool_choice="sometimes"), "tool_choice"),
        (
            dict(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}),
            "tool_choice",
        ),
    ]
    for kw, field in bad:
        with pytest.raises(InvalidArgument) as e:
            plan(_req(**kw), plain)
        assert e.value.field == field, kw
    thinking = ChatOptions(reasoning_parser="qwen3")
    with pytest.raises(InvalidArgument) as e:
        plan(_req(structured_outputs={"grammar": 'root ::= "a"'}), thinking)
    assert e.value.field == "structured_outputs.grammar"
    off = plan(
        _req(
            structured_outputs={"grammar": 'root ::= "a"'},
            chat_template_kwargs={"enable_thinking": False},
        ),
        thinking,
    )
    assert off.structured.grammar == 'root ::= "a"' and not off.thinking
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ChatOptions(enable_auto_tool_choice=True)


def test_plan_required_schema_follows_parallel_tool_calls():
    from serving.chat import ChatOptions, plan

    one = plan(_req(tools=[TOOL], tool_choice="required", parallel_tool_calls=False), ChatOptions())
    many = plan(_req(tools=[TOOL], tool_choice="required"), ChatOptions())
    assert json.loads(one.structured.json)["maxItems"] == 1
    assert "maxItems" not in json.loads(many.structured.json)


def test_auto_keeps_special_tokens_where_the_call_marker_is_one():
    """Mistral's `[TOOL_CALLS]` and Llama's `<|python_tag|>` are special tokens: `auto` with
    their parsers keeps special tokens in the output text (else the parser never sees them)."""
    from serving.chat import ChatOptions, plan

    def keeps(parser: str, **kw) -> bool:
        options = ChatOptions(enable_auto_tool_choice=True, tool_call_parser=parser)
        return plan(_req(tools=[TOOL], **kw), options).keep_special_tokens

    assert keeps("mistral") and keeps("llama3_json")
    assert not keeps("hermes") and not keeps("mistral", tool_choice="none")


def test_serve_refuses_auto_tool_choice_without_a_parser(monkeypatch, capsys):
    import logging

    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)
    serve = script("serve")
    assert serve.main(["--enable-auto-tool-choice", "--fake-runner"]) == 2  # before any start
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_output_whole_and_streamed_keeps_parallel_calls_or_the_first(parallel):
    from serving.chat import ChatOptions, merge, plan

    options = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    chat_plan = plan(_req(tools=[TOOL], parallel_tool_calls=parallel), options)
    text, _ = CASES["hermes"]
    msg, finish = chat_plan.output().message(text, "stop")
    assert finish == "tool_calls" and msg["content"] == "Let me check.\n"
    names = [c["function"]["name"] for c in msg["tool_calls"]]
    assert names == (["get_weather", "get_time"] if parallel else ["get_weather"])
    out, delta = chat_plan.output(), {}
    for i in range(0, len(text), 4):
        delta = merge(delta, out.feed(text[i : i + 4]))
    last, finish = out.close("stop")
    delta = merge(delta, last)
    assert finish == "tool_calls" and delta["content"] == "Let me check.\n"
    assert [c["function"]["name"] for c in delta["tool_calls"]] == names
    assert [c["index"] for c in delta["tool_calls"]] == list(range(len(names)))
