"""Tool calling: the parsers of the three tool-call syntaxes (fed in pieces), and the server with the real
``openai`` client: ``tool_choice`` required / named constrained by the tools' schemas, ``auto`` parsed (streamed
and not), tool messages and past calls in the history, ``finish_reason: "tool_calls"``."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("xgrammar")

from test_serve import MODEL, Server, tiny_lm, tiny_tokenizer  # noqa: E402

from helpers.engine_shadow import one_thread  # noqa: E402
from hf_paged.serve.tools import (  # noqa: E402
    HERMES, LLAMA3, MISTRAL, REQUIRED, ToolCallParser, parse_tools, required_schema, tool_format,
)

TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Lima", "Oslo"]},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}


def pieces(parser: ToolCallParser, text: str, size: int = 3) -> tuple[str, str, list]:
    streamed = "".join(parser.feed(text[i:i + size]) for i in range(0, len(text), size))
    rest, calls = parser.finish()
    return streamed, rest, calls


@pytest.mark.parametrize("mode, text, content, calls", [
    (HERMES, 'Let me look. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
             '<tool_call>{"name": "g", "arguments": {}}</tool_call>', "Let me look. ", [("f", {"x": 1}), ("g", {})]),
    (HERMES, "No call here, only <tool text.", "No call here, only <tool text.", []),
    (LLAMA3, '{"name": "f", "parameters": {"city": "Oslo"}}', "", [("f", {"city": "Oslo"})]),
    (LLAMA3, '<|python_tag|>{"name": "f", "parameters": {}}', "", [("f", {})]),
    (LLAMA3, "Plain {braces} later", "Plain {braces} later", []),
    (MISTRAL, 'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"a": "b"}}]', "Sure. ", [("f", {"a": "b"})]),
    (HERMES, '<tool_call>{"name": "f", "argu', "", []),  # cut off: the text stays content
])
def test_parsers_split_content_and_calls_fed_in_pieces(mode, text, content, calls):
    """Fed three characters at a time: the content before a call streams (a possible marker held back), the
    calls parse at the end with their arguments as JSON text; output that does not parse is all content."""
    streamed, rest, got = pieces(ToolCallParser(mode), text)
    if calls:
        assert streamed + rest == content
        assert [(c.name, json.loads(c.arguments)) for c in got] == calls
        assert len({c.id for c in got}) == len(got)
    else:
        assert streamed + rest == text and got == []


@pytest.mark.parametrize("name, text, calls", [
    (None, '[{"name": "f", "arguments": {"x": 1}},{"name": "g", "arguments": {}},{"name": "f", "argu',
     [("f", {"x": 1}), ("g", {})]),  # cut by max_tokens: the complete calls
    (None, '{"name": "g", "arguments": {"y": 2}}', [("g", {"y": 2})]),  # parallel_tool_calls false: one object
    ("f", '[{"x": 1},{"x": 2},{"x"', [("f", {"x": 1}), ("f", {"x": 2})]),  # a single tool: its arguments
    ("f", '{"x": 3}', [("f", {"x": 3})]),
    (None, '[{"name": "f", "argu', []),  # no complete call: content, as before
])
def test_required_output_gives_its_complete_calls(name, text, calls):
    """tool_choice "required": an array cut short parses into the calls it completed; one object is one call."""
    streamed, rest, got = pieces(ToolCallParser(REQUIRED, name), text)
    assert streamed == ""
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert rest == ("" if calls else text)


def test_required_schema_allows_one_call_without_parallel_calls():
    """parallel_tool_calls false: the schema is one call object (no array); a single tool's calls are its
    arguments; with parallel calls, a non-empty array."""
    two = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False})
    schema = required_schema(two)
    assert "anyOf" in schema and schema.get("type") != "array"
    one = parse_tools({"tools": [TIME], "tool_choice": "required"})
    assert one.name == "get_time"
    assert required_schema(one) == {"type": "array", "minItems": 1, "items": TIME["function"]["parameters"]}


def test_tool_format_follows_the_chat_template():
    assert tool_format(TOOL_TEMPLATE) == HERMES and tool_format("{{ '[TOOL_CALLS]' }}") == MISTRAL
    assert tool_format("<|python_tag|>{{ x }}") == LLAMA3 and tool_format(None) == HERMES


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_thread()


@pytest.fixture(scope="module")
def served():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    server = Server(tiny_lm(tokenizer, seed=4, max_position_embeddings=2048), tokenizer, num_blocks=256)
    yield server
    server.close()


def check_call(call, tools=(WEATHER, TIME)) -> dict:
    fn = {t["function"]["name"]: t["function"] for t in tools}[call.function.name]
    args = json.loads(call.function.arguments)
    props = fn["parameters"]["properties"]
    assert set(args) == set(fn["parameters"]["required"])
    for key, value in args.items():
        if "enum" in props[key]:
            assert value in props[key]["enum"]
        else:
            assert type(value) is int and props[key]["minimum"] <= value <= props[key]["maximum"]
    assert call.id and call.type == "function"
    return args


def test_required_and_named_tool_choice_give_valid_calls(served):
    """tool_choice "required" (sampled, several seeds) and a named function give calls whose arguments validate
    against the tool's schema, finish_reason "tool_calls", content None."""
    client = served.client()
    msgs = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], tool_choice="required",
                                           temperature=1, seed=seed, max_tokens=600)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls and all(check_call(c) is not None for c in choice.message.tool_calls)
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], max_tokens=40,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and check_call(call)["zone"] in ("UTC", "CET")
    plain = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="none",
                                           max_tokens=5, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")
    bad = served.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "tools": [WEATHER],
                                               "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert bad.status_code == 400 and "nope" in bad.json()["error"]["message"]


def test_streamed_tool_call_is_reassembled_by_the_client(served):
    """A streamed required call (one: parallel_tool_calls false), reassembled by the openai client's stream helper,
    equals the non-streamed one (greedy); its deltas carry index, id, name and argument fragments."""
    client = served.client()
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Time in Oslo?"}], tools=[WEATHER, TIME],
                  tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=600)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert len(whole) == 1 and check_call(whole[0])
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    got = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == whole[0].function.name
    assert len(deltas) > 2  # the arguments come in fragments


def test_auto_parses_the_template_syntax_and_history_with_tool_messages(served):
    """tool_choice auto: output in the template's Hermes syntax (forced here by a regex, as a model would write it)
    becomes tool_calls, streamed or not, with the text before it as content; a history with an assistant call and
    a tool result renders and is answered."""
    client = served.client()
    forced = {"structured_outputs": {"regex": r'Checking\. <tool_call>\{"name": "get_time", "arguments": '
                                              r'\{"zone": "CET"\}\}</tool_call>'}}
    msgs = [{"role": "user", "content": "Time?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[TIME], max_tokens=200, extra_body=forced)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking. "
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_time", {"zone": "CET"})]
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, tools=[TIME], max_tokens=200,
                                                 extra_body=forced, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Checking. " and chunks[-1].choices[0].finish_reason == "tool_calls"
    history = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[TIME], max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    rendered = served.post("/tokenize", {"messages": history}).json()["tokens"]
    text = served.tokenizer.decode(rendered)
    # the template got the call's arguments as an object, and the tool's result
    assert '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>' in text and "12:00" in text
