"""`blockdraft serve`: an OpenAI-compatible HTTP server over the scheduler.

Endpoints: GET /health, GET /metrics (Prometheus), GET /v1/models,
POST /v1/completions, POST /v1/chat/completions (`stream: true` as server-sent
events in OpenAI's chunk format). Bodies are parsed and checked by hand so that
any malformed input gets a 4xx in OpenAI's error shape, never a 5xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from ..errors import BlockdraftError
from ..sampling import MAX_TOP_K
from .checks import (MAX_TOP_LOGPROBS, UNSUPPORTED, ApiError, ClientGone, check_field, check_number, check_stops,
                     check_text)
from .logprobs import CompletionLogprobs, TokenTexts, chat_logprobs
from .metrics import Metrics
from .scheduler import QueueFull, Scheduler, ShuttingDown

log = logging.getLogger("blockdraft.serve")


class Server:
    """The app's state: engine, scheduler, limits and metrics."""

    def __init__(self, engine, *, model_name: str, method="dflash", max_batch: int = 8, max_queue: int = 64,
                 max_model_len: int = 2048, max_tokens_limit: int = 1024, block_size: int | None = None,
                 adaptive: bool = True, api_key: str | None = None, max_body_bytes: int = 1 << 20,
                 shutdown_grace: float = 30.0, metrics_public: bool = False, body_timeout: float = 30.0,
                 max_requests: int | None = None):
        self.engine, self.model_name = engine, model_name
        self.metrics = Metrics(lambda: self.scheduler, max_block=max(1, block_size or 16))
        self.scheduler = Scheduler(engine, method=method, max_batch=max_batch, max_queue=max_queue,
                                   max_model_len=max_model_len, block_size=block_size, adaptive=adaptive,
                                   metrics=self.metrics)
        self.max_model_len, self.max_tokens_limit = max_model_len, max_tokens_limit
        self.api_key, self.max_body_bytes, self.shutdown_grace = api_key, max_body_bytes, shutdown_grace
        self.metrics_public = metrics_public  # with an API key: /metrics readable without it
        self.body_timeout = body_timeout  # seconds a client may take between two pieces of its body
        self.max_requests = max_requests  # HTTP requests handled at once (None: no cap); more get a JSON 503
        # the longest token's text (a byte-level token's string is at least as long as its text)
        self.max_token_chars = max(8, max((len(t) for t in engine.tokenizer.get_vocab()), default=8))
        self.token_texts = TokenTexts(engine.tokenizer)  # tokens' text and bytes, for logprobs
        self.created = int(time.time())

    # ---- parsing -----------------------------------------------------------------------

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
            raise ApiError(404, f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                           "model", code="model_not_found")

    def unsupported(self, body: dict):
        """400 for OpenAI features this server does not implement (never silently ignored)."""
        for name, off in UNSUPPORTED.items():
            if name in body and body[name] not in off:
                raise ApiError(400, f"'{name}' is not supported by this server", name)

    @staticmethod
    def logprobs(body: dict, chat: bool) -> int | None:
        """How many most likely alternatives to return per token (None: no logprobs). Chat:
        `logprobs: true` with `top_logprobs` 0..20; legacy completions: `logprobs` 0..5."""
        if not chat:
            if body.get("top_logprobs") is not None:
                raise ApiError(400, "'top_logprobs' is a chat completions field; legacy completions take "
                                    "'logprobs': N", "top_logprobs")
            top = MAX_TOP_LOGPROBS["completions"]
            return check_field(body, "logprobs", int, None, check=lambda v: 0 <= v <= top, what=f"an integer in [0, {top}]")
        on = check_field(body, "logprobs", bool, False, what="a boolean")
        top = MAX_TOP_LOGPROBS["chat"]
        k = check_field(body, "top_logprobs", int, None, check=lambda v: 0 <= v <= top, what=f"an integer in [0, {top}]")
        if k is not None and not on:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (k or 0) if on else None

    def sampling(self, body: dict, prompt_len: int, default_max: int | None, prompt_param: str = "messages"):
        n = check_field(body, "n", int, 1, check=lambda v: v == 1, what="1 (one choice per request)")
        del n
        self.unsupported(body)
        logprobs = self.logprobs(body, chat=prompt_param == "messages")
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ApiError(400, f"the prompt has {prompt_len} tokens; this server's context is "
                                f"{self.max_model_len} tokens", prompt_param)
        limit = min(self.max_tokens_limit, room)
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = check_field(body, name, int, default_max if default_max is not None else limit,
                            check=lambda v: v >= 1, what="an integer >= 1")
        if max_tokens > self.max_tokens_limit:
            raise ApiError(400, f"'{name}' is {max_tokens}; this server allows at most {self.max_tokens_limit}", name)
        if max_tokens > room:
            raise ApiError(400, f"prompt ({prompt_len} tokens) + {name} ({max_tokens}) exceeds this server's "
                                f"context of {self.max_model_len} tokens", name)
        temperature = check_number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = check_number(body, "top_p", 1.0, 0.0, 1.0)
        if top_p <= 0:
            raise ApiError(400, "'top_p' must be in (0, 1]", "top_p")
        seed = check_field(body, "seed", int, None, check=lambda v: -(2 ** 63) <= v < 2 ** 64, what="a 64-bit integer")
        if seed is not None:
            seed %= 2 ** 64
        top_k = check_field(body, "top_k", int, 0, check=lambda v: -1 <= v <= MAX_TOP_K,
                       what=f"an integer in [-1, {MAX_TOP_K}] (-1 or 0: off)")
        stream = check_field(body, "stream", bool, False, what="a boolean")
        options = check_field(body, "stream_options", dict, {}, what="an object")
        include_usage = bool(options.get("include_usage", False))
        try:
            row = self.engine.make_row([], max_tokens, temperature, top_p, max(top_k, 0), seed, check_stops(body))
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
        if (isinstance(prompt, list) and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt)):
            return list(prompt)
        raise ApiError(400, f"'prompt' must be a non-empty string or a list of token ids in [0, {vocab})", "prompt")

    def check_length(self, chars: int, param: str):
        """Refuse, before tokenizing, text that cannot fit the context whatever its tokens: no token
        of the vocabulary is longer than `max_token_chars` characters."""
        if chars > self.max_token_chars * self.max_model_len:
            raise ApiError(400, f"the prompt has {chars} characters, more than this server's context of "
                                f"{self.max_model_len} tokens can hold", param)

    def chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list", "messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
                raise ApiError(400, f"messages[{i}] must be an object with role system, user or assistant",
                               "messages")
            content = m.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise ApiError(400, f"messages[{i}].content parts must be text parts", "messages")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string", "messages")
            check_text(content, "messages")
            role = "system" if m["role"] == "developer" else m["role"]
            clean.append({"role": role, "content": content})
        self.check_length(sum(len(m["content"]) for m in clean), "messages")
        try:
            return self.engine.encode_chat(clean)
        except Exception as exc:  # a template that rejects the conversation (e.g. role order)
            raise ApiError(400, f"the chat template rejected the messages: {exc}", "messages") from None

    # ---- generation --------------------------------------------------------------------

    async def run(self, request: Request, row, endpoint: str, stream: bool = True):
        """Submit and yield (delta text, handle, ended) as tokens are accepted (`stream`) or once,
        with the whole text, when the request ends; cancels on disconnect."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_event(h):
            if not stream and not h.done:
                return  # nobody reads partial text: no wake-up, no detokenizing per step
            try:
                loop.call_soon_threadsafe(events.put_nowait, h)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                pass

        try:
            handle = self.scheduler.submit(row, on_event)
        except QueueFull as exc:
            raise ApiError(429, str(exc), kind="rate_limit_error", headers={"Retry-After": "1"}) from None
        except ShuttingDown as exc:
            raise ApiError(503, str(exc), kind="server_error") from None
        except BlockdraftError as exc:
            raise ApiError(400, str(exc)) from None
        try:
            while True:
                try:
                    h = await asyncio.wait_for(events.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise ClientGone("while its request waited or ran")
                    continue
                if h.error:
                    raise ApiError(h.error_status, h.error,
                                   kind="server_error" if h.error_status >= 500 else "invalid_request_error")
                while not events.empty():
                    events.get_nowait()
                delta = self.engine.text_delta(row, h.state)
                ended = h.done
                yield delta, h, ended
                if ended:
                    return
        finally:
            self.scheduler.cancel(handle)  # a no-op once finished; frees the slot otherwise

    def usage(self, h) -> dict:
        p, c = len(h.row.request.prompt_ids), len(h.state.output_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    @staticmethod
    def finish_reason(h) -> str:
        """OpenAI's values only: an answer cut short by the server (shutdown) is "length", truncated
        by a limit, as one that reached max_tokens is."""
        return h.state.finish_reason if h.state.finished and h.state.finish_reason else "length"


def create_app(server: Server, start_scheduler: bool = True):
    """The ASGI app: FastAPI's, behind `RequestCap` when the server has a request cap. `start_scheduler=False`: the caller steps the scheduler itself
    (`Scheduler.run` on the main thread, as `blockdraft serve` does)."""
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if start_scheduler:
            server.scheduler.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, server.scheduler.shutdown, server.shutdown_grace)

    app = FastAPI(title="blockdraft", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def authorize(request: Request):
        if server.api_key:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {server.api_key}".encode()):
                raise ApiError(401, "invalid or missing API key (Authorization: Bearer ...)",
                               kind="authentication_error", code="invalid_api_key")

    @app.exception_handler(ApiError)
    async def api_error(_request, exc: ApiError):
        return exc.response()

    @app.exception_handler(404)
    async def not_found(_request, _exc):
        return ApiError(404, "no such endpoint", code="not_found").response()

    @app.exception_handler(405)
    async def bad_method(_request, _exc):
        return ApiError(405, "method not allowed for this endpoint").response()

    @app.get("/health")
    async def health():
        ok = server.scheduler.alive and server.scheduler.accepting
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        if not server.metrics_public:
            authorize(request)
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "blockdraft"}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        authorize(request)
        server.check_model({"model": model_id})
        return model_card()

    @app.exception_handler(Exception)
    async def unexpected(_request, exc: Exception):  # a bug: one JSON error, one log line, never plain text
        log.error("internal error: %s: %s", type(exc).__name__, exc)
        return ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error").response()

    async def generate(request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            authorize(request)
            body = await server.read_json(request)
            server.check_model(body)
            # tokenizing a long prompt takes a while: off the event loop, so other requests go on
            prompt_ids = await asyncio.to_thread(server.chat_prompt if chat else server.completion_prompt, body)
            row, stream, include_usage = server.sampling(body, len(prompt_ids), None if chat else 16,
                                                         "messages" if chat else "prompt")
            return_ids = check_field(body, "return_token_ids", bool, False, what="a boolean")
            if return_ids and stream:
                raise ApiError(400, "'return_token_ids' is supported without streaming only", "return_token_ids")
        except ApiError as exc:
            server.metrics.observe_request(endpoint, exc.status)
            raise
        row.request.prompt_ids = prompt_ids
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        # the client's own id when it sends one (safe characters only), else ours
        given = request.headers.get("x-request-id", "")
        trace = {"x-request-id": given if given and len(given) <= 128 and given.isascii() and given.isprintable()
                 else rid}
        created = int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": server.model_name}

        scoring = row.request.logprobs is not None
        completion_logprobs = CompletionLogprobs(server.token_texts) if scoring and not chat else None

        def logprobs(state, start: int):
            """OpenAI's logprobs object for the output tokens from `start` scored so far."""
            if not scoring:
                return None
            scores = state.logprobs[start:]  # (a copy: the scheduler thread may be appending)
            ids = state.output_ids[start: start + len(scores)]
            scores = scores[: len(ids)]
            if chat:
                return chat_logprobs(server.token_texts, ids, scores)
            return completion_logprobs(ids, scores)

        def count(lp) -> int:
            return 0 if lp is None else len(lp["content"] if chat else lp["tokens"])

        def choice(delta: str, finish, lp=None):
            if chat:
                return {"index": 0, "delta": {"content": delta} if delta else {}, "logprobs": lp,
                        "finish_reason": finish}
            return {"index": 0, "text": delta, "logprobs": lp, "finish_reason": finish}

        if stream:
            gen = server.run(request, row, endpoint)
            try:  # errors that come before the first token (queue full, ...) still get a status code
                first = await gen.__anext__()
            except ApiError as exc:
                server.metrics.observe_request(endpoint, exc.status)
                raise

            async def events():
                handle, scored = None, 0  # tokens whose logprobs were sent
                try:
                    if chat:
                        yield _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                         "logprobs": None, "finish_reason": None}]})
                    item = first
                    while True:
                        delta, handle, ended = item
                        if delta:  # with the logprobs of the tokens scored since the last chunk
                            lp = logprobs(handle.state, scored)
                            scored += count(lp)
                            yield _sse({**base, "choices": [choice(delta, None, lp)]})
                        if ended:
                            break
                        item = await gen.__anext__()
                    # the last chunk: the finish reason (and the logprobs of tokens without text, if any)
                    lp = logprobs(handle.state, scored)
                    finish = server.finish_reason(handle)
                    yield _sse({**base, "choices": [choice("", finish, lp if count(lp) else None)]})
                    if include_usage:
                        yield _sse({**base, "choices": [], "usage": server.usage(handle)})
                    yield "data: [DONE]\n\n"
                    server.metrics.observe_request(endpoint, 200, handle)
                except ApiError as exc:
                    yield _sse({"error": {"message": exc.message, "type": exc.kind, "param": None, "code": None}})
                    server.metrics.observe_request(endpoint, exc.status)
                except asyncio.CancelledError:  # the client closed the stream
                    log.info("client disconnected during a stream")
                    server.metrics.observe_request(endpoint, 499)
                    raise
                finally:
                    await gen.aclose()

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **trace})

        text, handle = "", None
        try:
            async for delta, handle, _ended in server.run(request, row, endpoint, stream=False):
                text += delta
        except ApiError as exc:
            server.metrics.observe_request(endpoint, exc.status)
            raise
        server.metrics.observe_request(endpoint, 200, handle)
        finish = server.finish_reason(handle)
        lp = logprobs(handle.state, 0)
        if chat:
            choices = [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                        "finish_reason": finish}]
        else:
            choices = [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]
        reply = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                 "model": server.model_name, "choices": choices, "usage": server.usage(handle)}
        if return_ids:  # as vLLM: the exact tokens (a stop token included), for training-data regeneration
            choices[0]["token_ids"] = list(handle.state.output_ids)
            reply["prompt_token_ids"] = list(prompt_ids)
        return JSONResponse(reply, headers=trace)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return RequestCap(app, server.max_requests) if server.max_requests else app


class RequestCap:
    """ASGI wrapper: at most `limit` HTTP requests are handled at once (a slow body, a long
    stream and a queued request each hold one); the next gets a 503 in the OpenAI error shape
    with Retry-After, without reaching the app. /health is never refused, so that a load
    balancer sees an overloaded server as alive."""

    def __init__(self, app, limit: int):
        self.app, self.limit, self.active = app, limit, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") == "/health":
            return await self.app(scope, receive, send)
        if self.active >= self.limit:
            refused = ApiError(503, f"the server is handling {self.limit} requests, its limit (--max-connections); "
                                    "retry later", kind="server_error", code="overloaded",
                               headers={"Retry-After": "1"})
            return await refused.response()(scope, receive, send)
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
