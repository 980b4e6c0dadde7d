"""Structured output: a grammar (xgrammar) applied as a token bitmask in the engine's sampler, per request.

Engine: sampled outputs of a tiny random model match their JSON schema / regex / choice; requests without a grammar
in the same steps get exactly the tokens they get alone; the compiled grammar is cached by spec. Server (loopback,
the real ``openai`` client): ``response_format`` json_schema / json_object and vLLM's ``structured_outputs``; the
embedded SmolLM2 answers ``chat.completions.parse(response_format=PydanticModel)`` with a valid object."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("xgrammar")

from test_serve import MODEL, Server, tiny_lm, tiny_tokenizer  # noqa: E402

from helpers.engine_shadow import one_thread  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged import BlockPool  # noqa: E402
from hf_paged.engine import structured  # noqa: E402
from hf_paged.engine.structured import GrammarCompiler, GrammarSpec  # noqa: E402

# Strings bounded by a pattern (a random model rarely closes a free string); integers bounded by a range.
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog"]}},
    "required": ["name", "n", "ok", "kind"], "additionalProperties": False}


def valid(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"name", "n", "ok", "kind"}
            and isinstance(obj["name"], str) and re.fullmatch("[a-z]{1,8}", obj["name"]) is not None
            and type(obj["n"]) is int and 0 <= obj["n"] <= 99 and isinstance(obj["ok"], bool)
            and obj["kind"] in ("cat", "dog"))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_thread()


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_lm(tokenizer, seed=2)


def test_engine_outputs_match_their_grammar_and_others_pay_nothing(model, tokenizer):
    """Eight sampled requests under a JSON schema, a regex and a choice, batched with unconstrained ones: every
    constrained output parses and validates (finish "stop"); every unconstrained request gets the tokens it gets
    when run alone; a spec compiled twice is compiled once."""
    grammars = GrammarCompiler(tokenizer, vocab_size=model.config.vocab_size)
    schema = grammars.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    assert grammars.compile(GrammarSpec("json_schema", json.dumps(SCHEMA))) is schema and grammars.compiles == 1
    regex = grammars.compile(GrammarSpec("regex", "[0-9]{3}-[a-c]+"))
    choice = grammars.compile(GrammarSpec("choice", json.dumps(["yes", "no", "maybe so"])))
    prompt = tokenizer("Write a haiku about")["input_ids"]
    pool = BlockPool(block_size=16, num_blocks=96)
    with hf_paged.init_continuous_batching(model, pool=pool) as manager:
        alone = [manager.get_result(manager.add_request(prompt, max_new_tokens=12, do_sample=True, seed=s),
                                    timeout=60).generated_tokens for s in (1, 2)]
        rids = [manager.add_request(prompt, max_new_tokens=80, grammar=schema, do_sample=True, seed=s)
                for s in range(8)]
        plain = [manager.add_request(prompt, max_new_tokens=12, do_sample=True, seed=s) for s in (1, 2)]
        other = [manager.add_request(prompt, max_new_tokens=30, grammar=g, do_sample=True, seed=s)
                 for g in (regex, choice) for s in range(3)]
        outs = [manager.get_result(r, timeout=120) for r in rids]
        plain_outs = [manager.get_result(r, timeout=120).generated_tokens for r in plain]
        other_outs = [manager.get_result(r, timeout=120) for r in other]
    for out in outs:
        text = tokenizer.decode(out.generated_tokens, skip_special_tokens=True)
        assert out.finish_reason == "stop" and valid(json.loads(text)), text
    assert plain_outs == alone
    for out in other_outs[:3]:
        assert re.fullmatch("[0-9]{3}-[a-c]+", tokenizer.decode(out.generated_tokens, skip_special_tokens=True))
    for out in other_outs[3:]:
        assert tokenizer.decode(out.generated_tokens, skip_special_tokens=True) in ("yes", "no", "maybe so")


def test_missing_library_names_the_extra(tokenizer, monkeypatch):
    """Without xgrammar, building a compiler raises ImportError naming the 'structured' extra."""
    monkeypatch.setattr(structured, "xgr", None)
    with pytest.raises(ImportError, match=r"hf_paged\[structured\]"):
        GrammarCompiler(tokenizer)


@pytest.fixture(scope="module")
def served(model, tokenizer):
    server = Server(model, tokenizer, num_blocks=96)
    yield server
    server.close()


def test_server_response_format_and_structured_outputs(served):
    """response_format json_schema (strict) and json_object, vLLM's structured_outputs (json, regex, choice) and
    guided_choice, at temperature 1: every output parses / matches; a bad schema or two constraints at once is a
    400 naming the field."""
    client = served.client()
    msgs = [{"role": "user", "content": "Describe a pet as JSON."}]
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=80, temperature=1, seed=3, n=4,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}})
    for c in r.choices:
        assert valid(json.loads(c.message.content)) and c.finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=200, temperature=1, seed=4,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")  # a random model may not close a free object in 200 tokens; parsed when it does
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    r = client.completions.create(model=MODEL, prompt="Phone:", max_tokens=20, temperature=1, seed=5, n=3,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    assert all(re.fullmatch("[0-9]{3}-[0-9]{4}", c.text) for c in r.choices)
    r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=20, temperature=1, seed=6, n=3,
                                  extra_body={"guided_choice": ["red", "green"]})
    assert all(c.text in ("red", "green") for c in r.choices)
    r = client.completions.create(model=MODEL, prompt="Pet:", max_tokens=80, temperature=1, seed=7,
                                  extra_body={"structured_outputs": {"json": SCHEMA}})
    assert valid(json.loads(r.choices[0].text))
    bad = served.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
            "a": {"$ref": "#/$defs/missing"}}}}}})
    assert bad.status_code == 400 and "json_schema" in bad.json()["error"]["message"]
    two = served.post("/v1/completions", {"model": MODEL, "prompt": "x", "guided_regex": "a",
                                          "structured_outputs": {"choice": ["a"]}})
    assert two.status_code == 400 and "constraints" in two.json()["error"]["message"]
