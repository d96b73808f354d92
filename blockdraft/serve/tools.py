"""Structured outputs in the OpenAI API: `response_format` (JSON object, JSON schema) and function
tools (`tools`, `tool_choice`, `parallel_tool_calls`), read into a grammar the decode loop enforces.

A tool call is written as one text format in every mode: `<tool_call>` + compact JSON
`{"name":"NAME","arguments":{...}}` + `</tool_call>`. The tools and that format are described to
the model in a system turn; the grammar makes "required" and a named function write exactly one
call, and "auto" write either plain text (anything that does not start with `<tool_call>`) or one
call. Each function's parameters schema is embedded in the Lark grammar as a JSON schema of its
own (`%json`), so its `$ref`s resolve against it. The answer's text is parsed back into OpenAI's
`tool_calls` only when the call is complete; a call cut by max_tokens stays text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..errors import BlockdraftError
from ..grammar import GrammarSpec
from .checks import ApiError

TAG, END = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function and schema names
MAX_TOOLS = 128  # OpenAI's limit
CHOICES = ("none", "auto", "required")
# compact JSON in embedded schemas, as `GrammarSpec` writes it for response_format
COMPACT = {"whitespace_flexible": False}
# any text that is not a tool call: what "auto" allows besides one
TEXT = "TEXT: /(.|\\n)*/ & ~/<tool_call>(.|\\n)*/"


def _keys(obj: dict, allowed: set, where: str, param: str):
    for key in obj:
        if key not in allowed:
            raise ApiError(400, f"Unrecognized request argument supplied: {where}.{_shown(key)}", param)


def _shown(text) -> str:
    text = str(text)
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def response_format(body: dict) -> GrammarSpec | None:
    """`response_format` -> the grammar of the answer (None: free text), or a 400 naming the field."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise ApiError(400, "'response_format' must be an object", "response_format")
    kind = rf.get("type")
    if kind == "text":
        _keys(rf, {"type"}, "response_format", "response_format")
        return None
    if kind == "json_object":
        _keys(rf, {"type"}, "response_format", "response_format")
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise ApiError(400, "'response_format.type' must be 'text', 'json_object' or 'json_schema'", "response_format")
    _keys(rf, {"type", "json_schema"}, "response_format", "response_format")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise ApiError(400, "'response_format.json_schema' must be an object", "response_format")
    _keys(js, {"name", "description", "schema", "strict"}, "response_format.json_schema", "response_format")
    if not isinstance(js.get("name"), str) or not NAME.fullmatch(js["name"]):
        raise ApiError(
            400, "'response_format.json_schema.name' must be 1-64 letters, digits, '_' or '-'", "response_format"
        )
    if js.get("description") is not None and not isinstance(js["description"], str):
        raise ApiError(400, "'response_format.json_schema.description' must be a string", "response_format")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise ApiError(400, "'response_format.json_schema.strict' must be a boolean", "response_format")
    if not isinstance(js.get("schema"), dict):
        raise ApiError(400, "'response_format.json_schema.schema' must be a JSON schema object", "response_format")
    return GrammarSpec("json_schema", js["schema"])


@dataclass
class Tools:
    """The functions a chat request offers and how it may call them (`choice`: "auto", "required"
    or "named", then `named` is the function)."""

    functions: list[dict]  # {"name", "description", "parameters"}, in the request's order
    choice: str
    named: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """The answer must be a tool call."""
        return self.choice != "auto"

    def system_text(self) -> str:
        """The tools and the call format, for the system turn."""
        lines = ["# Tools", "", "You can call these functions:"]
        for f in self.functions:
            lines.append(
                json.dumps(
                    {k: f[k] for k in ("name", "description", "parameters") if f.get(k) is not None}, ensure_ascii=False
                )
            )
        lines += [
            "",
            f'To call a function, answer with only {TAG}{{"name":"<function name>","arguments":'
            f"<the arguments as a JSON object>}}{END}",
        ]
        lines.append(
            {
                "auto": "Otherwise, answer the user directly.",
                "required": "You must call one of the functions.",
                "named": f"You must call the function {self.named}.",
            }[self.choice]
        )
        return "\n".join(lines)

    def lark(self, answer: GrammarSpec | None = None) -> str:
        """The grammar of the answer: one call (forced), or one call or an answer ("auto": plain
        text, or JSON under `answer`, the request's response_format)."""
        offered = [f for f in self.functions if self.named in (None, f["name"])]
        rules = [f"call: {json.dumps(TAG)} ({' | '.join(f'call_{i}' for i in range(len(offered)))}) {json.dumps(END)}"]
        for i, f in enumerate(offered):
            head = '{"name":' + json.dumps(f["name"]) + ',"arguments":'
            rules.append(f'call_{i}: {json.dumps(head)} args_{i} "}}"')
            rules.append(f"args_{i}: %json {json.dumps(embedded(f['parameters']))}")
        if self.forced:
            return "\n".join(["start: call", *rules])
        if answer is None:
            return "\n".join(["start: answer | call", "answer: TEXT", TEXT, *rules])
        schema = {"type": "object"} if answer.kind == "json_object" else answer.source
        return "\n".join(["start: answer | call", f"answer: %json {json.dumps(embedded(schema))}", *rules])


def embedded(schema: dict) -> dict:
    """A JSON schema to embed in a Lark grammar: compact JSON unless it says otherwise."""
    options = schema.get("x-guidance")
    return {**schema, "x-guidance": {**COMPACT, **(options if isinstance(options, dict) else {})}}


def read_tools(body: dict) -> Tools | None:
    """`tools`, `tool_choice`, `parallel_tool_calls` -> the `Tools` the answer may call (None:
    none, e.g. tool_choice "none"), or a 400 naming the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise ApiError(400, "'tool_choice' is only allowed when 'tools' are specified", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of function tools", "tools")
    if len(tools) > MAX_TOOLS:
        raise ApiError(400, f"'tools' has {len(tools)} tools; at most {MAX_TOOLS} are allowed", "tools")
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ApiError(400, f'\'{where}\' must be {{"type": "function", "function": {{...}}}}', "tools")
        _keys(tool, {"type", "function"}, where, "tools")
        f = tool["function"]
        _keys(f, {"name", "description", "parameters", "strict"}, f"{where}.function", "tools")
        if not isinstance(f.get("name"), str) or not NAME.fullmatch(f["name"]):
            raise ApiError(400, f"'{where}.function.name' must be 1-64 letters, digits, '_' or '-'", "tools")
        if f["name"] in (g["name"] for g in functions):
            raise ApiError(400, f"'{where}.function.name': the name {f['name']} is given twice", "tools")
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise ApiError(400, f"'{where}.function.description' must be a string", "tools")
        if f.get("strict") is not None and not isinstance(f["strict"], bool):
            raise ApiError(400, f"'{where}.function.strict' must be a boolean", "tools")
        params = f.get("parameters")
        if params is None:  # as OpenAI: no parameters is an empty parameter list
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ApiError(400, f"'{where}.function.parameters' must be a JSON schema of an object", "tools")
        functions.append(
            {"name": f["name"], "description": f.get("description"), "parameters": {"type": "object", **params}}
        )
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(
                400,
                "'tool_choice' must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": NAME}}',
                "tool_choice",
            )
        if fn["name"] not in (f["name"] for f in functions):
            raise ApiError(
                400, f"'tool_choice' names the function {_shown(fn['name'])}, which is not in 'tools'", "tool_choice"
            )
        choice, named = "named", fn["name"]
    elif choice not in CHOICES:
        raise ApiError(
            400,
            "'tool_choice' must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": NAME}}',
            "tool_choice",
        )
    if choice == "none":  # the model is not told of the tools: it answers as without them
        return None
    return Tools(functions, choice, named, parallel is not False)


def compile_grammar(engine, answer: GrammarSpec | None, tools: Tools | None):
    """The compiled grammar of a request (cached on the engine), or a one-line 400 naming the
    field whose schema cannot be compiled."""
    compiled = None
    try:
        if answer is not None:
            compiled = engine.grammar(answer)
    except BlockdraftError as exc:
        raise ApiError(400, f"response_format: {exc}", "response_format") from None
    if tools is None:
        return compiled
    try:
        return engine.grammar(GrammarSpec("lark", tools.lark(answer)))
    except BlockdraftError as exc:
        for i, f in enumerate(tools.functions):  # each schema alone: the error names the tool at fault
            try:
                engine.grammar(GrammarSpec("json_schema", f["parameters"]))
            except BlockdraftError as bad:
                raise ApiError(400, f"tools[{i}].function.parameters: {bad}", "tools") from None
        raise ApiError(400, f"tools: {exc}", "tools") from None


def parse_call(text: str, tools: Tools) -> dict | None:
    """The tool call an answer's whole text makes, as OpenAI's `tool_calls` entry, or None (plain
    text, or a call cut before its end)."""
    if not (text.startswith(TAG) and text.endswith(END)):
        return None
    inner = text[len(TAG) : -len(END)]
    try:
        call = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(call, dict) or set(call) != {"name", "arguments"} or not isinstance(call["arguments"], dict):
        return None
    if call["name"] not in (f["name"] for f in tools.functions):
        return None
    head = '{"name":' + json.dumps(call["name"]) + ',"arguments":'
    # the arguments as the model wrote them (the grammar's layout), else re-serialised
    as_written = inner.startswith(head) and inner.endswith("}")
    arguments = inner[len(head) : -1] if as_written else json.dumps(call["arguments"])
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": call["name"], "arguments": arguments},
    }


def call_text(call: dict) -> str:
    """A tool call of the conversation (`tool_calls` entry) in the format the model writes."""
    return TAG + '{"name":' + json.dumps(call["name"]) + ',"arguments":' + call["arguments"] + "}" + END


class CallStream:
    """A streamed answer that may be a tool call: plain text goes out as it comes; text that is,
    or may still become, a tool call is held back until the answer ends."""

    def __init__(self, tools: Tools):
        self.held = ""
        self.mode = "call" if tools.forced else "open"  # "open": the text so far is a prefix of TAG

    def feed(self, delta: str) -> str:
        """The text to send now."""
        if self.mode == "text":
            return delta
        self.held += delta
        if self.mode == "open":
            if self.held.startswith(TAG):
                self.mode = "call"
            elif not TAG.startswith(self.held):
                self.mode, out, self.held = "text", self.held, ""
                return out
        return ""


def call_chunks(call: dict, pieces: int = 3) -> list[dict]:
    """A tool call as OpenAI streams it: the deltas of its id and name, then of its arguments."""
    first = {
        "index": 0,
        "id": call["id"],
        "type": "function",
        "function": {"name": call["function"]["name"], "arguments": ""},
    }
    args = call["function"]["arguments"]
    size = max(1, -(-len(args) // pieces))
    return [{"tool_calls": [first]}] + [
        {"tool_calls": [{"index": 0, "function": {"arguments": args[i : i + size]}}]} for i in range(0, len(args), size)
    ]
