"""Tool calling: the request's ``tools`` / ``tool_choice`` into the prompt and the grammar, the model's output back
into OpenAI's ``tool_calls``.

- The chat template gets the tools (``apply_chat_template(tools=...)``) when it reads them; a template that does not
  gets a system message listing them and asking for Hermes-style ``<tool_call>{"name", "arguments"}</tool_call>``.
- ``tool_choice="auto"``: the output is parsed with the format the template uses (:func:`tool_format`): Hermes /
  Qwen ``<tool_call>`` JSON, Llama 3 JSON (``{"name", "parameters"}``, optionally after ``<|python_tag|>``) or Mistral
  ``[TOOL_CALLS] [{"name", "arguments"}]``. Text before a call is content; text that does not parse stays content.
- ``"required"`` / a named function: decoding is constrained by a JSON schema built from the tools
  (:func:`required_schema`: a non-empty array of ``{"name", "arguments"}`` (of the arguments alone with a single
  tool), or exactly one without parallel calls; :func:`named_schema`: the function's parameters), so any model
  produces a valid call. An array
  cut by ``max_tokens`` (a model repeating calls) gives the complete calls it holds; the response says ``length``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from .errors import APIError

HERMES, LLAMA3, MISTRAL = "hermes", "llama3", "mistral"
REQUIRED, NAMED = "required", "named"  # constrained outputs (a JSON array of calls / one call's arguments)
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_MISTRAL_MARK = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


@dataclass
class ToolRequest:
    """What a chat request asks about tools (None of it when it sends no tools)."""

    tools: list[dict]  # [{"type": "function", "function": {"name", "description"?, "parameters"?}}]
    choice: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the named function; "required" with a single tool: that tool (calls name no other)
    parallel: bool = True  # parallel_tool_calls: False allows one call at most

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def function(self, name: str) -> dict:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


def parse_tools(body: dict) -> ToolRequest | None:
    """``tools`` and ``tool_choice`` checked; None when the request has no tools (``tool_choice`` then must be
    absent or "none")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "'tool_choice' needs 'tools'.", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise APIError(400, "'tools' must be a list of {\"type\": \"function\", \"function\": {...}} objects.",
                       param="tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                "\"parameters\": {...}}}}.", param="tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object.", param="tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError(400, "'parallel_tool_calls' must be true or false.", param="parallel_tool_calls")
    request = ToolRequest(tools, "auto", parallel=parallel is not False)
    if choice is None or choice in ("none", "auto", "required"):
        request.choice = choice or "auto"
        if choice == REQUIRED and len(request.names) == 1:
            request.name = request.names[0]
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in request.names:
            raise APIError(400, f"tool_choice names {name!r}, which is not one of the tools "
                                f"({', '.join(request.names)}).", param="tool_choice")
        request.choice, request.name = NAMED, name
    else:
        raise APIError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}.", param="tool_choice")
    return request


def _parameters(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def required_schema(request: ToolRequest) -> dict:
    """The calls ``tool_choice="required"`` allows: each ``{"name": <a tool>, "arguments": <its parameters>}``
    (with a single tool, ``request.name``, just its arguments: the name is known); a non-empty JSON array of them,
    or, without parallel calls (``parallel_tool_calls: false``), exactly one (no array: the grammar itself allows
    one call, and it costs no bracket tokens)."""
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "arguments": _parameters(t["function"])},
              "required": ["name", "arguments"], "additionalProperties": False} for t in request.tools]
    if request.name is not None:
        call = _parameters(request.function(request.name))
    else:
        call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if not request.parallel:
        return call
    return {"type": "array", "minItems": 1, "items": call}


def named_schema(request: ToolRequest) -> dict:
    """The named function's parameters: the output is its arguments."""
    return _parameters(request.function(request.name))


def tool_format(chat_template: str | None) -> str:
    """The tool-call syntax a chat template teaches its model (Hermes when it names none)."""
    template = chat_template or ""
    if _MISTRAL_MARK in template:
        return MISTRAL
    if _HERMES_OPEN in template:
        return HERMES
    if _PYTHON_TAG in template or "ipython" in template:
        return LLAMA3
    return HERMES


def template_reads_tools(chat_template: str | None) -> bool:
    return "tools" in (chat_template or "")


def tools_system_prompt(request: ToolRequest) -> str:
    """For a chat template without tool support: the tools and the syntax to call them (Hermes)."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in request.tools)
    return ("You can call these functions (JSON schemas):\n" + listed + "\nTo call one, reply with "
            "<tool_call>{\"name\": <function name>, \"arguments\": <arguments object>}</tool_call>.")


def template_messages(messages: list[dict], request: ToolRequest | None, reads_tools: bool) -> list[dict]:
    """Messages for the chat template: assistant tool calls with their arguments as objects (what templates
    expect); for a template that does not read tools, the tools as a system message and past calls as Hermes
    text."""
    out = []
    for msg in messages:
        msg = dict(msg)
        calls = msg.pop("tool_calls", None)
        if calls:
            if reads_tools:
                msg["tool_calls"] = [{"type": "function", "id": c.get("id"), "function": {
                    "name": c["function"]["name"], "arguments": _as_object(c["function"].get("arguments"))}}
                    for c in calls]
            else:
                text = "".join(f"{_HERMES_OPEN}{json.dumps({'name': c['function']['name'], 'arguments': _as_object(c['function'].get('arguments'))}, ensure_ascii=False)}{_HERMES_CLOSE}"  # noqa: E501
                               for c in calls)
                msg["content"] = (msg.get("content") or "") + text
        out.append(msg)
    if request is not None and request.choice != "none" and not reads_tools:
        prompt = tools_system_prompt(request)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _as_object(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


class ToolCallParser:
    """One choice's output, fed as text pieces: the content safe to stream now, and the calls at the end.

    ``mode``: a format (``HERMES``, ``LLAMA3``, ``MISTRAL``) for ``tool_choice="auto"``, or ``REQUIRED`` / ``NAMED``
    for a constrained output (all of it is the call(s)).

    Example::

        parser = ToolCallParser(HERMES)
        parser.feed("Let me check. <tool_")    # -> "Let me check. " (the rest may open a call)
        parser.feed('call>{"name": "f", "arguments": {}}</tool_call>')  # -> ""
        parser.finish()                         # -> ("", [ToolCall("f", "{}")])
    """

    def __init__(self, mode: str, name: str | None = None, drop: str | None = None):
        self.mode, self.name = mode, name
        self.drop = drop  # text removed from every piece (an EOS decoded with special tokens kept, for Mistral)
        self.text = ""  # everything fed
        self.sent = 0  # characters of text streamed as content
        self.in_call = mode in (REQUIRED, NAMED)

    def feed(self, piece: str) -> str:
        self.text += piece.replace(self.drop, "") if self.drop else piece
        if self.in_call:
            return ""
        start = self._call_start()
        if start is not None:
            self.in_call = True
            out, self.sent = self.text[self.sent:start], start
            return out
        safe = len(self.text) - self._partial_marker()
        out, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        return out

    def _markers(self) -> list[str]:
        return {HERMES: [_HERMES_OPEN], MISTRAL: [_MISTRAL_MARK], LLAMA3: [_PYTHON_TAG, "{"]}[self.mode]

    def _call_start(self) -> int | None:
        if self.mode == LLAMA3:  # a JSON call is the whole message: only at its start
            stripped = self.text.lstrip()
            if self.sent == 0 and (stripped.startswith("{") or stripped.startswith(_PYTHON_TAG)):
                return 0
            return None
        hits = [self.text.find(m) for m in self._markers()]
        hits = [h for h in hits if h >= 0]
        return min(hits) if hits else None

    def _partial_marker(self) -> int:
        if self.mode == LLAMA3:  # hold the start while it may still become "<|python_tag|>"
            return len(self.text) if self.sent == 0 and _PYTHON_TAG.startswith(self.text.lstrip()) else 0
        best = 0
        for marker in self._markers():
            for n in range(min(len(marker) - 1, len(self.text)), best, -1):
                if self.text.endswith(marker[:n]):
                    best = n
                    break
        return best

    def finish(self) -> tuple[str, list[ToolCall]]:
        """``(content not yet streamed, calls)``; output that does not parse as calls is all content."""
        calls = self._parse()
        if calls is None:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, []
        return "", calls

    def _parse(self) -> list[ToolCall] | None:
        text = self.text[self.sent:].strip() if not self.in_call or self.mode not in (REQUIRED, NAMED) else self.text
        try:
            if self.mode == NAMED:
                return [ToolCall(self.name, json.dumps(json.loads(text), ensure_ascii=False))]
            if self.mode == REQUIRED:
                items = _complete_items(text)
                if self.name is not None:  # a single tool: each item is its arguments
                    return [ToolCall(self.name, json.dumps(_object(item), ensure_ascii=False))
                            for item in items] or None
                return [_call(item) for item in items] or None
            if not self.in_call:
                return None
            if self.mode == HERMES:
                bodies = re.findall(re.escape(_HERMES_OPEN) + r"(.*?)(?:" + re.escape(_HERMES_CLOSE) + r"|$)", text,
                                    flags=re.S)
                return [_call(json.loads(b)) for b in bodies if b.strip()] or None
            if self.mode == MISTRAL:
                items = json.loads(text[len(_MISTRAL_MARK):].strip())
                return [_call(item) for item in (items if isinstance(items, list) else [items])]
            if text.startswith(_PYTHON_TAG):
                text = text[len(_PYTHON_TAG):]
            items = [json.loads(part) for part in text.split(";") if part.strip()]
            return [_call(item) for item in items]
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            return None


def _complete_items(text: str) -> list:
    """The JSON values of ``text``: one object (one call), or the complete items of an array, also of one cut short
    (``[{...},{...},{"na`` -> the first two); ``json.JSONDecodeError`` when there is none of either."""
    text = text.strip()
    if not text.startswith("["):
        return [json.loads(text)]
    decoder, items, at = json.JSONDecoder(), [], 1
    while True:
        while at < len(text) and text[at] in " \t\n\r,":
            at += 1
        if at >= len(text) or text[at] == "]":
            return items
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            if items:
                return items
            raise
        items.append(item)


def _object(item) -> dict:
    if not isinstance(item, dict):
        raise TypeError("a tool call's arguments must be an object")
    return item


def _call(item: dict) -> ToolCall:
    arguments = item["arguments"] if "arguments" in item else item["parameters"]
    if not isinstance(item["name"], str):
        raise TypeError("a tool call's name must be a string")
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(item["name"], text)
