"""Reading an OpenAI request: the body (size, time, JSON), the model name, the prompt (chat
messages through the template, or completion text / token ids) and the generation settings,
each checked against this server's limits. Anything malformed is an `ApiError` (a 4xx in
OpenAI's error shape) that names the offending field; nothing here touches the scheduler.
"""

from __future__ import annotations

import asyncio
import json
import threading

from fastapi import Request
from starlette.requests import ClientDisconnect

from ..errors import BlockdraftError
from ..sampling import MAX_TOP_K
from .checks import (
    MAX_TOP_LOGPROBS,
    UNSUPPORTED,
    ApiError,
    ClientGone,
    check_field,
    check_number,
    check_stops,
    check_text,
)
from .tools import Tools, call_text, compile_grammar, read_tools, response_format

# the body fields each endpoint reads: implemented, or refused by `unsupported` unless at their neutral value
# (`user` only labels the caller: it changes no answer); any other field is refused by name, as OpenAI does
_COMMON = {
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "top_logprobs",
    "user",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "return_token_ids",
}  # (the last two: extensions, as vLLM's)
# structured outputs (`serve.tools`): response_format on both endpoints (as vLLM), tools in chat only (as OpenAI)
FIELDS = {
    "chat": _COMMON
    | {"messages", "functions", "function_call", "response_format", "tools", "tool_choice", "parallel_tool_calls"},
    "completions": _COMMON | {"prompt", "echo", "suffix", "best_of", "response_format"},
}
PENALTIES = ("presence_penalty", "frequency_penalty")  # not implemented: only 0 (no penalty) is accepted


def shown(text: str) -> str:
    """`text` fit to quote in a one-line error: control characters and lone surrogates (JSON's
    \\ud800 escapes, which no UTF-8 answer can carry) escaped."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


class RequestReader:
    """An OpenAI request body -> prompt token ids and the engine row to run, under the server's
    limits (context, max_tokens, body size and arrival time)."""

    def __init__(
        self,
        engine,
        *,
        model_name: str,
        max_model_len: int,
        max_tokens_limit: int,
        max_body_bytes: int,
        body_timeout: float,
    ):
        self.engine, self.model_name = engine, model_name
        self.max_model_len, self.max_tokens_limit = max_model_len, max_tokens_limit
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout  # seconds a client may take between two pieces of its body
        # the longest token's text (a byte-level token's string is at least as long as its text)
        self.max_token_chars = max(8, max((len(t) for t in engine.tokenizer.get_vocab()), default=8))
        self.compiling = threading.Lock()  # one grammar compiled at a time

    async def read_json(self, request: Request) -> dict:
        kind = request.headers.get("content-type")
        if kind is not None and kind.split(";")[0].strip().lower() != "application/json":
            raise ApiError(415, f"Content-Type must be application/json, not {kind!r}")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            raise ApiError(413, f"request body larger than {self.max_body_bytes} bytes")
        body = bytearray()
        pieces = request.stream().__aiter__()
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(pieces.__anext__(), self.body_timeout)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    raise ApiError(408, f"the request body did not arrive within {self.body_timeout:g} s") from None
                body += chunk
                if len(body) > self.max_body_bytes:
                    raise ApiError(413, f"request body larger than {self.max_body_bytes} bytes")
        except ClientDisconnect:
            raise ClientGone("while sending its body") from None
        try:
            data = json.loads(bytes(body).decode("utf-8"))
        except UnicodeDecodeError:
            raise ApiError(400, "request body is not valid UTF-8") from None
        except (json.JSONDecodeError, RecursionError):
            raise ApiError(400, "request body is not valid JSON") from None
        except ValueError as exc:  # e.g. an integer of more digits than Python converts
            raise ApiError(400, f"request body is not acceptable JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object")
        return data

    def check_model(self, body: dict):
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, "'model' must be a string", "model")
        if model and model != self.model_name:
            raise ApiError(
                404,
                f"The model '{shown(model)}' does not exist; this server serves '{self.model_name}'",
                "model",
                code="model_not_found",
            )

    @staticmethod
    def check_fields(body: dict, chat: bool):
        """400 for a field the endpoint does not know (a typo or another endpoint's field is never
        silently ignored), in OpenAI's words."""
        known = FIELDS["chat" if chat else "completions"]
        for name in body:
            if name not in known:
                raise ApiError(400, f"Unrecognized request argument supplied: {shown(name)}", shown(name))

    def unsupported(self, body: dict):
        """400 for OpenAI features this server does not implement (never silently ignored)."""
        for name, off in UNSUPPORTED.items():
            if name in body and body[name] not in off:
                raise ApiError(400, f"'{name}' is not supported by this server", name)
        for name in PENALTIES:
            value = body.get(name)
            if value is not None and (isinstance(value, bool) or value != 0):
                raise ApiError(400, f"'{name}' is not supported by this server (only 0, no penalty)", name)

    @staticmethod
    def logprobs(body: dict, chat: bool) -> int | None:
        """How many most likely alternatives to return per token (None: no logprobs). Chat:
        `logprobs: true` with `top_logprobs` 0..20; legacy completions: `logprobs` 0..5."""
        if not chat:
            if body.get("top_logprobs") is not None:
                raise ApiError(
                    400,
                    "'top_logprobs' is a chat completions field; legacy completions take 'logprobs': N",
                    "top_logprobs",
                )
            top = MAX_TOP_LOGPROBS["completions"]
            return check_field(
                body, "logprobs", int, None, check=lambda v: 0 <= v <= top, what=f"an integer in [0, {top}]"
            )
        on = check_field(body, "logprobs", bool, False, what="a boolean")
        top = MAX_TOP_LOGPROBS["chat"]
        k = check_field(
            body, "top_logprobs", int, None, check=lambda v: 0 <= v <= top, what=f"an integer in [0, {top}]"
        )
        if k is not None and not on:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (k or 0) if on else None

    def structured(self, body: dict, chat: bool):
        """The request's tools (None: none) and its compiled grammar (None: free text); a 400 naming
        `response_format` or `tools` for one that is malformed or cannot be compiled."""
        answer = response_format(body)
        tools = read_tools(body) if chat else None
        if answer is None and tools is None:
            return None, None
        with self.compiling:  # (the engine's grammar cache is not thread-safe; compiling one is ms)
            return tools, compile_grammar(self.engine, answer, tools)

    def sampling(
        self, body: dict, prompt_len: int, default_max: int | None, prompt_param: str = "messages", grammar=None
    ):
        n = check_field(body, "n", int, 1, check=lambda v: v == 1, what="1 (one choice per request)")
        del n
        self.unsupported(body)
        logprobs = self.logprobs(body, chat=prompt_param == "messages")
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ApiError(
                400,
                f"the prompt has {prompt_len} tokens; this server's context is {self.max_model_len} tokens",
                prompt_param,
            )
        limit = min(self.max_tokens_limit, room)
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = check_field(
            body,
            name,
            int,
            default_max if default_max is not None else limit,
            check=lambda v: v >= 1,
            what="an integer >= 1",
        )
        if max_tokens > self.max_tokens_limit:
            raise ApiError(400, f"'{name}' is {max_tokens}; this server allows at most {self.max_tokens_limit}", name)
        if max_tokens > room:
            raise ApiError(
                400,
                f"prompt ({prompt_len} tokens) + {name} ({max_tokens}) exceeds this server's "
                f"context of {self.max_model_len} tokens",
                name,
            )
        temperature = check_number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = check_number(body, "top_p", 1.0, 0.0, 1.0)
        if top_p <= 0:
            raise ApiError(400, "'top_p' must be in (0, 1]", "top_p")
        seed = check_field(body, "seed", int, None, check=lambda v: -(2**63) <= v < 2**64, what="a 64-bit integer")
        if seed is not None:
            seed %= 2**64
        top_k = check_field(
            body,
            "top_k",
            int,
            0,
            check=lambda v: -1 <= v <= MAX_TOP_K,
            what=f"an integer in [-1, {MAX_TOP_K}] (-1 or 0: off)",
        )
        stream = check_field(body, "stream", bool, False, what="a boolean")
        options = check_field(body, "stream_options", dict, None, what="an object")
        include_usage = False
        if options is not None:  # as OpenAI: refused rather than ignored without a stream
            if not stream:
                raise ApiError(
                    400, "The 'stream_options' parameter is only allowed when 'stream' is enabled", "stream_options"
                )
            for key in options:
                if key != "include_usage":
                    raise ApiError(
                        400, f"Unrecognized request argument supplied: stream_options.{shown(key)}", "stream_options"
                    )
            usage = options.get("include_usage")
            if usage is not None and not isinstance(usage, bool):  # "no" is truthy: only a boolean is clear
                raise ApiError(400, "'stream_options.include_usage' must be a boolean", "stream_options")
            include_usage = usage is True
        try:
            row = self.engine.make_row(
                [], max_tokens, temperature, top_p, max(top_k, 0), seed, check_stops(body), grammar
            )
        except BlockdraftError as exc:
            raise ApiError(400, str(exc)) from None
        row.request.logprobs = logprobs
        return row, stream, include_usage

    def completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "'prompt' must not be empty", "prompt")
            self.check_length(len(prompt), "prompt")
            return self.engine.tokenizer(check_text(prompt, "prompt")).input_ids
        vocab = self.engine.target.config.vocab_size
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt)
        ):
            return list(prompt)
        raise ApiError(400, f"'prompt' must be a non-empty string or a list of token ids in [0, {vocab})", "prompt")

    def check_length(self, chars: int, param: str):
        """Refuse, before tokenizing, text that cannot fit the context whatever its tokens: no token
        of the vocabulary is longer than `max_token_chars` characters."""
        if chars > self.max_token_chars * self.max_model_len:
            raise ApiError(
                400,
                f"the prompt has {chars} characters, more than this server's context of "
                f"{self.max_model_len} tokens can hold",
                param,
            )

    def chat_prompt(self, body: dict, tools: Tools | None = None) -> list[int]:
        """The conversation's token ids: tool results as user turns (`<tool_response>`), an
        assistant's tool calls in the format the model writes them, the tools in the system turn."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list", "messages")
        clean, results = [], []  # results: which turns hold tool results (consecutive ones are merged)
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer", "tool"):
                raise ApiError(
                    400, f"messages[{i}] must be an object with role system, user, assistant or tool", "messages"
                )
            calls = m.get("tool_calls") if m["role"] == "assistant" else None
            content = m.get("content")
            if content is None and calls:  # (OpenAI's assistant turn that only calls tools)
                content = ""
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                if not all(
                    isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
                ):
                    raise ApiError(400, f"messages[{i}].content parts must be text parts", "messages")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string", "messages")
            check_text(content, "messages")
            if calls is not None:
                content = "\n".join([content] * bool(content) + [call_text(c) for c in self.tool_calls(calls, i)])
            if m["role"] == "tool":
                content = f"<tool_response>\n{content}\n</tool_response>"
                if results and results[-1]:
                    clean[-1]["content"] += "\n" + content
                    continue
            role = {"developer": "system", "tool": "user"}.get(m["role"], m["role"])
            clean.append({"role": role, "content": content})
            results.append(m["role"] == "tool")
        if tools is not None:  # the tools in the system turn (the first one, or a new one)
            if clean[0]["role"] == "system":
                clean[0]["content"] += "\n\n" + tools.system_text()
            else:
                clean.insert(0, {"role": "system", "content": tools.system_text()})
        self.check_length(sum(len(m["content"]) for m in clean), "messages")
        try:
            return self.engine.encode_chat(clean)
        except Exception as exc:  # a template that rejects the conversation (e.g. role order)
            raise ApiError(400, f"the chat template rejected the messages: {exc}", "messages") from None

    @staticmethod
    def tool_calls(calls, i: int) -> list[dict]:
        """An assistant turn's `tool_calls`, checked: [{"name", "arguments" (JSON text)}]."""
        where = f"messages[{i}].tool_calls"
        if not isinstance(calls, list):
            raise ApiError(400, f"{where} must be a list", "messages")
        out = []
        for j, c in enumerate(calls):
            f = c.get("function") if isinstance(c, dict) else None
            if (
                not isinstance(f, dict)
                or c.get("type", "function") != "function"
                or not isinstance(f.get("name"), str)
                or not isinstance(f.get("arguments"), str)
            ):
                raise ApiError(
                    400,
                    f'{where}[{j}] must be {{"type": "function", "function": {{"name": ..., "arguments": ...}}}}',
                    "messages",
                )
            try:
                json.loads(f["arguments"])
            except (ValueError, RecursionError):
                raise ApiError(400, f"{where}[{j}].function.arguments must be JSON text", "messages") from None
            out.append({"name": check_text(f["name"], "messages"), "arguments": check_text(f["arguments"], "messages")})
        return out
