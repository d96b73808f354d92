"""Structured outputs and tool calls through `blockdraft serve`, with the official `openai` client.

One server (the shipped DFlash drafter, full blocks every step, fp32) answers every request; the
oracle for its tokens is plain decoding (`ar`) in-process on the same weights under the same
grammar, fed the prompt tokens the server returns (`return_token_ids`)."""

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from blockdraft.engine import Engine
from blockdraft.grammar import GrammarSpec
from blockdraft.serve.client import ServerProcess
from blockdraft.serve.tools import TAG, compile_grammar, read_tools

N = 40  # max_tokens of the answers compared with ar
IDS = {"return_token_ids": True}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"type": "string", "enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
PEOPLE = [
    "Describe a fictional person as JSON.",
    "Give me a JSON profile of a cat owner.",
    "Write a JSON record for a retired chess player.",
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>{"name":"get_weather","arguments":{"city":"Tokyo","unit":"celsius"}}</tool_call>'
# "auto": the first prompt makes the model write a call, the second plain text (checked below)
AUTO_CALL = [{"role": "user", "content": f"Repeat exactly, with nothing else: {CALL}"}]
AUTO_TEXT = [{"role": "user", "content": f"Copy this text: {CALL}"}]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(
        "--dtype",
        "float32",
        "--speculation",
        "fixed",
        "--block-size",
        "8",
        "--max-tokens",
        "48",
        "--max-batch",
        "4",
        "--served-model-name",
        "smol",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def engine():
    return Engine.load(dtype="float32", use_draft=False)


def ar(engine, answer, grammar, n=N) -> list[int]:
    """Plain decoding's tokens for the server's prompt under `grammar` (a spec or compiled)."""
    return engine.generate(answer.prompt_token_ids, method="ar", max_new_tokens=n, grammar=grammar).token_ids


def tools_grammar(engine, body: dict):
    return compile_grammar(engine, None, read_tools(body))


def check_person(value):
    assert set(value) == {"name", "age", "pet"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 10
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120 and value["pet"] in ("cat", "dog", "none")


def check_call(call, name: str):
    """A parsed tool call of `name` whose arguments satisfy its parameters schema."""
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == name
    args = json.loads(call.function.arguments)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and args["city"] in ("Paris", "London", "Tokyo")
        assert args["unit"] in ("celsius", "fahrenheit")
    else:
        assert set(args) == {"zone"} and isinstance(args["zone"], str) and len(args["zone"]) <= 12
    return args


def post(server, body, path="/v1/chat/completions"):
    return httpx.post(server.url + path, json=body, timeout=300)


def test_json_schema_answers_satisfy_the_schema_and_equal_ar(client, engine):
    """Each answer under a JSON schema parses and satisfies it, and its tokens are `ar`'s under
    the same schema (DFlash with several drafts a block, masked along them)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    for prompt in PEOPLE:
        r = client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=N,
            temperature=0,
            response_format=fmt,
            extra_body=IDS,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        check_person(json.loads(choice.message.content))
        assert choice.token_ids == ar(engine, r, GrammarSpec("json_schema", SCHEMA))


def test_the_clients_parse_with_a_pydantic_model(client):
    """`client.chat.completions.parse(response_format=Model)`: the client's strict schema is
    followed and its `.parsed` comes back."""

    class Person(BaseModel):
        name: str = Field(max_length=10)
        age: int
        pet: Literal["cat", "dog", "none"]

    r = client.chat.completions.parse(
        model="smol",
        messages=[{"role": "user", "content": PEOPLE[1]}],
        max_tokens=N,
        temperature=0,
        response_format=Person,
    )
    assert isinstance(r.choices[0].message.parsed, Person)
    check_person(r.choices[0].message.parsed.model_dump())


def test_json_object_is_an_object_on_both_endpoints_and_streams_as_text(client, engine):
    """json_object: a JSON object (chat, and legacy completions as vLLM takes it), `ar`'s tokens;
    streamed, the same text in text deltas."""
    messages = [{"role": "user", "content": "Name one colour, as a JSON object."}]
    r = client.chat.completions.create(
        model="smol",
        messages=messages,
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_object"},
        extra_body=IDS,
    )
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    assert r.choices[0].token_ids == ar(engine, r, GrammarSpec("json_object"))
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="smol",
            messages=messages,
            max_tokens=48,
            temperature=0,
            response_format={"type": "json_object"},
            stream=True,
        )
        if c.choices
    ]
    assert "".join(pieces) == r.choices[0].message.content and sum(1 for p in pieces if p) > 1
    legacy = client.completions.create(
        model="smol",
        prompt="A JSON object describing a dog:",
        max_tokens=48,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert legacy.choices[0].finish_reason == "stop" and isinstance(json.loads(legacy.choices[0].text), dict)


def test_required_and_named_tool_calls_are_parsed_by_the_client(client, engine):
    """tool_choice "required" and a named function: `message.tool_calls` as the client parses it,
    the right name, arguments that satisfy the schema, content null, finish "tool_calls"; the
    tokens are `ar`'s under the same grammar."""
    for choice, name in [
        ("required", "get_weather"),
        ({"type": "function", "function": {"name": "get_time"}}, "get_time"),
    ]:
        r = client.chat.completions.create(
            model="smol", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=N, temperature=0, extra_body=IDS
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
        check_call(c.message.tool_calls[0], name)
        body = {"messages": ASK, "tools": TOOLS, "tool_choice": choice}
        assert c.token_ids == ar(engine, r, tools_grammar(engine, body))


def test_auto_answers_with_text_or_a_valid_call(client, engine):
    """tool_choice "auto" (the default with tools): one prompt gets a tool call, another plain
    text; each is `ar`'s answer under the auto grammar."""
    kinds = []
    for messages in (AUTO_CALL, AUTO_TEXT):
        r = client.chat.completions.create(
            model="smol", messages=messages, tools=TOOLS, max_tokens=N, temperature=0, extra_body=IDS
        )
        c = r.choices[0]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            check_call(c.message.tool_calls[0], c.message.tool_calls[0].function.name)
        else:
            assert c.message.content and not c.message.content.startswith(TAG)
        kinds.append(bool(c.message.tool_calls))
        assert c.token_ids == ar(engine, r, tools_grammar(engine, {"messages": messages, "tools": TOOLS}))
    assert kinds == [True, False]


def test_streamed_tool_calls_equal_the_answers(client):
    """Streamed, a tool call arrives as OpenAI sends one (id, type and name first, then the
    arguments in pieces, finish "tool_calls"): the client's stream helper and plain delta
    accumulation both get the call the answer without streaming has."""
    whole = (
        client.chat.completions.create(
            model="smol", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=N, temperature=0
        )
        .choices[0]
        .message.tool_calls[0]
    )
    with client.chat.completions.stream(
        model="smol", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=N, temperature=0
    ) as s:
        final = s.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content is None
    call = final.message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == (whole.function.name, whole.function.arguments)
    assert call.function.parsed_arguments == json.loads(whole.function.arguments)  # (strict: the helper parses)

    for messages, choice in [(ASK, {"type": "function", "function": {"name": "get_time"}}), (AUTO_CALL, "auto")]:
        whole = client.chat.completions.create(
            model="smol", messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=N, temperature=0
        ).choices[0]
        deltas, finish = [], None
        for chunk in client.chat.completions.create(
            model="smol", messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=N, temperature=0, stream=True
        ):
            if chunk.choices:
                deltas.append(chunk.choices[0].delta)
                finish = chunk.choices[0].finish_reason or finish
        assert not any(d.content for d in deltas) and finish == "tool_calls"
        parts = [t for d in deltas for t in d.tool_calls or []]
        assert parts[0].id.startswith("call_") and parts[0].type == "function" and parts[0].index == 0
        assert parts[0].function.name == whole.message.tool_calls[0].function.name
        assert "".join(p.function.arguments or "" for p in parts) == whole.message.tool_calls[0].function.arguments
        assert len(parts) > 2  # the arguments in pieces


def test_auto_text_streams_as_text(client):
    """An "auto" answer that is plain text streams as text deltas, the answer's text."""
    whole = client.chat.completions.create(
        model="smol", messages=AUTO_TEXT, tools=TOOLS, max_tokens=N, temperature=0
    ).choices[0]
    chunks = [
        c
        for c in client.chat.completions.create(
            model="smol", messages=AUTO_TEXT, tools=TOOLS, max_tokens=N, temperature=0, stream=True
        )
        if c.choices
    ]
    pieces = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(pieces) == whole.message.content and sum(1 for p in pieces if p) > 1
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert not any(c.choices[0].delta.tool_calls for c in chunks)


def test_a_call_cut_by_max_tokens_is_text_with_finish_length(client):
    """A tool call (or JSON) that max_tokens cuts is never presented as complete: finish "length",
    the raw text as content, no tool_calls, streamed or not."""
    r = client.chat.completions.create(
        model="smol", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=8, temperature=0
    ).choices[0]
    assert r.finish_reason == "length" and r.message.tool_calls is None and r.message.content.startswith(TAG)
    chunks = [
        c.choices[0]
        for c in client.chat.completions.create(
            model="smol", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    ]
    assert "".join(c.delta.content or "" for c in chunks) == r.message.content
    assert chunks[-1].finish_reason == "length" and not any(c.delta.tool_calls for c in chunks)
    cut = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": PEOPLE[0]}],
        max_tokens=6,
        temperature=0,
        response_format={"type": "json_object"},
    ).choices[0]
    assert cut.finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(cut.message.content)


def test_requests_with_and_without_grammars_share_a_batch(client):
    """A JSON-schema answer, a tool call, a json_object answer and a plain answer decoded in one
    batch (concurrently) are each the answer they get alone."""
    requests = [
        dict(
            messages=[{"role": "user", "content": PEOPLE[2]}],
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
        ),
        dict(messages=ASK, tools=TOOLS, tool_choice="required"),
        dict(
            messages=[{"role": "user", "content": "Name three fruits as JSON."}],
            response_format={"type": "json_object"},
        ),
        dict(messages=[{"role": "user", "content": "Write a haiku about rain."}]),
    ]

    def ask(kw):
        r = client.chat.completions.create(model="smol", max_tokens=32, temperature=0, extra_body=IDS, **kw)
        return r.choices[0].token_ids, r.choices[0].finish_reason

    alone = [ask(kw) for kw in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(ask, requests))
    assert together == alone
    assert [f for _, f in alone][:2] == ["stop", "tool_calls"]


def test_a_conversation_with_tool_calls_and_results(client, server):
    """A tool round trip: the assistant's call and the tool's result go back in the messages (the
    call in the model's format, the result as a user turn) and the next answer follows."""
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    r = client.chat.completions.create(model="smol", messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].message.content or r.choices[0].message.tool_calls
    bad = post(
        server,
        {
            "messages": history[:1]
            + [
                {
                    "role": "assistant",
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{not json"}}],
                }
            ],
            "max_tokens": 2,
        },
    )
    assert bad.status_code == 400 and "arguments must be JSON text" in bad.json()["error"]["message"]


BAD = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
        "response_format",
        "cannot be compiled",
    ),
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {"type": "xml"}}, "response_format", "'response_format.type' must be"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema' must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
        "response_format",
        "name",
    ),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format", "Unrecognized"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "name"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
        "tools",
        "must be a JSON schema of an object",
    ),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "x"}}}}}
            ]
        },
        "tools",
        "tools[0].function.parameters: the json schema cannot be compiled",
    ),
    ({"tools": [WEATHER, WEATHER]}, "tools", "given twice"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "must be"),
    ({"tools": {"f": 1}}, "tools", "must be a list"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "send_mail"}}},
        "tool_choice",
        "send_mail, which is not in 'tools'",
    ),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when 'tools' are specified"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
]


@pytest.mark.parametrize("extra, param, words", BAD)
def test_bad_structured_requests_get_one_line_400s(server, extra, param, words):
    r = post(server, {"messages": ASK, "max_tokens": 4, **extra})
    assert r.status_code == 400, (extra, r.text)
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert words in err["message"] and "\n" not in err["message"], err


def test_the_client_raises_bad_request_and_tools_are_chat_only(client, server):
    with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
        client.chat.completions.create(
            model="smol",
            messages=ASK,
            max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        )
    r = post(server, {"prompt": "Hi", "max_tokens": 2, "tools": TOOLS}, "/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["message"] == "Unrecognized request argument supplied: tools"
    # neutral values change nothing
    for extra in (
        {"tools": []},
        {"tool_choice": "none"},
        {"tools": TOOLS, "tool_choice": "none"},
        {"response_format": {"type": "text"}},
        {"parallel_tool_calls": False},
    ):
        r = post(server, {"messages": ASK, "max_tokens": 2, **extra})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", (extra, r.text)


def test_the_auto_grammar_with_a_response_format(engine):
    """ "auto" beside a response_format: the answer is JSON under it, or a call; plain text and a
    malformed call are refused (the grammar alone, on the tokenizer's tokens)."""
    tools = read_tools({"tools": TOOLS})
    assert tools.choice == "auto"
    grammar = compile_grammar(engine, GrammarSpec("json_schema", SCHEMA), tools)

    def accepts(text: str) -> bool:
        m = grammar.matcher()
        return all(m.advance(t) for t in engine.tokenizer(text, add_special_tokens=False).input_ids) and m.accepting

    assert accepts('{"name":"Ann","age":3,"pet":"cat"}') and accepts(CALL)
    assert not accepts("Hello") and not accepts('<tool_call>{"name":"get_weather"}</tool_call>')
    text_or_call = compile_grammar(engine, None, tools)
    m = text_or_call.matcher()
    assert all(m.advance(t) for t in engine.tokenizer("Hello <tool_call>", add_special_tokens=False).input_ids)
    m = text_or_call.matcher()
    assert not all(m.advance(t) for t in engine.tokenizer("<tool_call>Hello", add_special_tokens=False).input_ids)


def test_a_parameters_schema_with_refs(engine):
    """Each function's schema is its own root in the grammar: its `$ref`s to `#/$defs` resolve."""
    params = {
        "type": "object",
        "$defs": {"City": {"type": "string", "enum": ["Paris", "Rome"]}},
        "properties": {"city": {"$ref": "#/$defs/City"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools = read_tools(
        {
            "tools": [CLOCK, {"type": "function", "function": {"name": "f", "parameters": params}}],
            "tool_choice": "required",
        }
    )
    grammar = compile_grammar(engine, None, tools)

    def accepts(text: str) -> bool:
        m = grammar.matcher()
        return all(m.advance(t) for t in engine.tokenizer(text, add_special_tokens=False).input_ids) and m.accepting

    assert accepts('<tool_call>{"name":"f","arguments":{"city":"Rome"}}</tool_call>')
    assert not accepts('<tool_call>{"name":"f","arguments":{"city":"Oslo"}}</tool_call>')
    assert not accepts("Rome")
