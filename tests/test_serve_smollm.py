"""The server on the embedded SmolLM2 with the real ``openai`` client (loopback): ``chat.completions.parse`` with a
pydantic model returns a valid object (every field typed) at temperature 0 and 1; ``tool_choice="required"`` gives
a valid call (SmolLM2's chat template has no tool support: the tools reach it as a system message)."""

from __future__ import annotations

import json
from typing import Annotated

import pytest

pytest.importorskip("xgrammar")
pydantic = pytest.importorskip("pydantic")

from test_serve import MODEL, Server  # noqa: E402

from helpers import require_smollm, smollm  # noqa: E402
from helpers.engine_shadow import one_thread  # noqa: E402

require_smollm()

ASK = ("Reply with a JSON object describing a fictional person: their name, age, city, a list of two hobbies, and "
       "whether they are employed.")


class Person(pydantic.BaseModel):
    """Every field bounded, so any sampled path through the grammar ends within max_tokens (a 135M model can
    otherwise loop inside a free string or list at temperature 1)."""

    name: str = pydantic.Field(max_length=40)
    age: int = pydantic.Field(ge=0, le=130)
    city: str = pydantic.Field(max_length=40)
    hobbies: list[Annotated[str, pydantic.Field(max_length=30)]] = pydantic.Field(max_length=3)
    employed: bool


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from one_thread()


@pytest.fixture(scope="module")
def served():
    model, tokenizer = smollm()
    server = Server(model, tokenizer, num_blocks=256)
    yield server
    server.close()


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 11)])
def test_parse_with_a_pydantic_model_gives_a_valid_object(served, temperature, seed):
    """The openai client's parse() sends a strict json_schema; the reply parses into the pydantic model with every
    field of its type (the client raises if it does not)."""
    r = served.client().chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                               response_format=Person, temperature=temperature, seed=seed,
                                               max_tokens=400)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"
    assert isinstance(person.name, str) and type(person.age) is int and isinstance(person.employed, bool)
    assert all(isinstance(h, str) for h in person.hobbies) and len(person.hobbies) <= 3
    assert len(person.name) <= 40 and len(person.city) <= 40 and 0 <= person.age <= 130


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 40},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}


def test_tool_choice_required_gives_a_valid_call(served):
    """tool_choice "required" (one call): the call names the tool and its arguments validate against its schema;
    finish_reason "tool_calls"."""
    r = served.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
        tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city", "unit"}
    assert isinstance(args["city"], str) and len(args["city"]) <= 40 and args["unit"] in ("celsius", "fahrenheit")


@pytest.mark.parametrize("max_tokens", [20, 60, 120])
@pytest.mark.parametrize("choice, parallel", [
    ("required", False), ("required", True), ({"type": "function", "function": {"name": "get_weather"}}, True)])
def test_constrained_tool_choice_returns_parsed_calls_at_any_max_tokens(served, choice, parallel, max_tokens):
    """Greedy, where the model repeats a call while the grammar lets it (required with parallel calls): the
    response holds every complete call (never null) and says "length" when max_tokens cut it, "tool_calls" when the
    grammar ended it; without parallel calls (or named) the grammar allows exactly one call."""
    r = served.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
        tool_choice=choice, parallel_tool_calls=parallel, temperature=0, max_tokens=max_tokens)
    choice_out = r.choices[0]
    calls = choice_out.message.tool_calls
    assert calls, f"no tool call parsed (finish_reason {choice_out.finish_reason})"
    assert choice_out.finish_reason == ("length" if r.usage.completion_tokens == max_tokens else "tool_calls")
    if not parallel or choice != "required":
        assert len(calls) == 1
    for call in calls:
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and set(args) == {"city", "unit"}
        assert args["unit"] in ("celsius", "fahrenheit")
