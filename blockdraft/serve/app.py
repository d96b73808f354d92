"""`blockdraft serve`: an OpenAI-compatible HTTP server over the scheduler.

Endpoints: GET /health, GET /metrics (Prometheus), GET /v1/models,
POST /v1/completions, POST /v1/chat/completions (`stream: true` as server-sent
events in OpenAI's chunk format; structured outputs and tool calls: `serve.tools`).
Bodies are parsed and checked by hand so that any malformed input gets a 4xx in
OpenAI's error shape, never a 5xx.
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

from ..errors import BlockdraftError
from .checks import ApiError, ClientGone, check_field
from .logprobs import CompletionLogprobs, TokenTexts, chat_logprobs
from .metrics import Metrics
from .reader import RequestReader
from .scheduler import QueueFull, Scheduler, ShuttingDown
from .tools import CallStream, call_chunks, parse_call

log = logging.getLogger("blockdraft.serve")


class Server:
    """The app's state: engine, scheduler, request reader (limits), metrics; `run` follows one request."""

    def __init__(
        self,
        engine,
        *,
        model_name: str,
        method="dflash",
        max_batch: int = 8,
        max_queue: int = 64,
        max_model_len: int = 2048,
        max_tokens_limit: int = 1024,
        block_size: int | None = None,
        adaptive: bool = True,
        api_key: str | None = None,
        max_body_bytes: int = 1 << 20,
        shutdown_grace: float = 30.0,
        metrics_public: bool = False,
        body_timeout: float = 30.0,
        max_requests: int | None = None,
    ):
        self.engine, self.model_name = engine, model_name
        precision = engine.precision() if hasattr(engine, "precision") else None
        self.metrics = Metrics(lambda: self.scheduler, max_block=max(1, block_size or 16), precision=precision)
        self.scheduler = Scheduler(
            engine,
            method=method,
            max_batch=max_batch,
            max_queue=max_queue,
            max_model_len=max_model_len,
            block_size=block_size,
            adaptive=adaptive,
            metrics=self.metrics,
        )
        self.reader = RequestReader(
            engine,
            model_name=model_name,
            max_model_len=max_model_len,
            max_tokens_limit=max_tokens_limit,
            max_body_bytes=max_body_bytes,
            body_timeout=body_timeout,
        )
        self.api_key, self.shutdown_grace = api_key, shutdown_grace
        self.metrics_public = metrics_public  # with an API key: /metrics readable without it
        self.max_requests = max_requests  # HTTP requests handled at once (None: no cap); more get a JSON 503
        self.token_texts = TokenTexts(engine.tokenizer)  # tokens' text and bytes, for logprobs
        self.created = int(time.time())

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
                try:  # a tenth of a second between looks at the connection: requests take that long now
                    h = await asyncio.wait_for(events.get(), timeout=0.1)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise ClientGone("while its request waited or ran") from None
                    continue
                if h.error:
                    raise ApiError(
                        h.error_status,
                        h.error,
                        kind="server_error" if h.error_status >= 500 else "invalid_request_error",
                    )
                while not events.empty():
                    events.get_nowait()
                if h.done and not stream and await request.is_disconnected():
                    raise ClientGone("before its answer was sent")
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
    """The ASGI app: FastAPI's, behind `RequestCap` when the server has a request cap.
    `start_scheduler=False`: the caller steps the scheduler itself
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
            # the scheme is case-insensitive (RFC 9110: "bearer" is "Bearer"); the key is compared in constant time
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.lstrip(" ").encode(), server.api_key.encode()
            ):
                raise ApiError(
                    401,
                    "invalid or missing API key (Authorization: Bearer ...)",
                    kind="authentication_error",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )

    @app.exception_handler(ApiError)
    async def api_error(_request, exc: ApiError):
        try:
            return exc.response()
        except UnicodeEncodeError:  # a message quoting the client's lone surrogate: escaped, the status kept
            exc.message = exc.message.encode("utf-8", "backslashreplace").decode("utf-8")
            exc.param = exc.param and exc.param.encode("utf-8", "backslashreplace").decode("utf-8")
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
        server.reader.check_model({"model": model_id})
        return model_card()

    @app.exception_handler(Exception)
    async def unexpected(_request, exc: Exception):  # a bug: one JSON error, one log line, never plain text
        log.error("internal error: %s: %s", type(exc).__name__, exc)
        return ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error").response()

    async def generate(request: Request, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            authorize(request)
            body = await server.reader.read_json(request)
            server.reader.check_model(body)
            server.reader.check_fields(body, chat)
            # compiling a grammar (cached) and tokenizing a long prompt take a while: off the event loop
            tools, grammar = await asyncio.to_thread(server.reader.structured, body, chat)
            if chat:
                prompt_ids = await asyncio.to_thread(server.reader.chat_prompt, body, tools)
            else:
                prompt_ids = await asyncio.to_thread(server.reader.completion_prompt, body)
            row, stream, include_usage = server.reader.sampling(
                body, len(prompt_ids), None if chat else 16, "messages" if chat else "prompt", grammar
            )
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
        trace = {
            "x-request-id": given if given and len(given) <= 128 and given.isascii() and given.isprintable() else rid
        }
        created = int(time.time())
        base = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": server.model_name,
        }

        scoring = row.request.logprobs is not None
        completion_logprobs = CompletionLogprobs(server.token_texts) if scoring and not chat else None

        def logprobs(state, start: int):
            """OpenAI's logprobs object for the output tokens from `start` scored so far."""
            if not scoring:
                return None
            scores = state.logprobs[start:]  # (a copy: the scheduler thread may be appending)
            ids = state.output_ids[start : start + len(scores)]
            scores = scores[: len(ids)]
            if chat:
                return chat_logprobs(server.token_texts, ids, scores)
            return completion_logprobs(ids, scores)

        def count(lp) -> int:
            return 0 if lp is None else len(lp["content"] if chat else lp["tokens"])

        def choice(delta: str, finish, lp=None):
            if chat:
                return {
                    "index": 0,
                    "delta": {"content": delta} if delta else {},
                    "logprobs": lp,
                    "finish_reason": finish,
                }
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
                calls = CallStream(tools) if tools is not None else None  # holds back what may be a tool call
                try:
                    if chat:  # (content null, as OpenAI's, where the answer may be a tool call)
                        yield _sse(
                            {
                                **base,
                                "choices": [
                                    {
                                        "index": 0,
                                        "delta": {"role": "assistant", "content": None if calls else ""},
                                        "logprobs": None,
                                        "finish_reason": None,
                                    }
                                ],
                            }
                        )
                    item = first
                    while True:
                        delta, handle, ended = item
                        if calls is not None:
                            delta = calls.feed(delta)
                        if delta:  # with the logprobs of the tokens scored since the last chunk
                            lp = logprobs(handle.state, scored)
                            scored += count(lp)
                            yield _sse({**base, "choices": [choice(delta, None, lp)]})
                        if ended:
                            break
                        item = await gen.__anext__()
                    finish = server.finish_reason(handle)
                    if calls is not None and calls.held:  # what was held back: a whole tool call, or text
                        call = parse_call(calls.held, tools)
                        if call is not None:
                            finish = "tool_calls"
                            for piece in call_chunks(call):
                                yield _sse(
                                    {
                                        **base,
                                        "choices": [
                                            {"index": 0, "delta": piece, "logprobs": None, "finish_reason": None}
                                        ],
                                    }
                                )
                        else:  # a call cut short (max_tokens) is its text, never a call
                            lp = logprobs(handle.state, scored)
                            scored += count(lp)
                            yield _sse({**base, "choices": [choice(calls.held, None, lp)]})
                    # the last chunk: the finish reason (and the logprobs of tokens without text, if any)
                    lp = logprobs(handle.state, scored)
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

            return StreamingResponse(
                events(),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **trace},
            )

        text, handle = "", None
        try:
            async for delta, handle, _ended in server.run(request, row, endpoint, stream=False):  # noqa: B007 (handle: the last one, read after the loop)
                text += delta
        except ApiError as exc:
            server.metrics.observe_request(endpoint, exc.status)
            raise
        server.metrics.observe_request(endpoint, 200, handle)
        finish = server.finish_reason(handle)
        lp = logprobs(handle.state, 0)
        if chat:
            message = {"role": "assistant", "content": text}
            call = parse_call(text, tools) if tools is not None else None  # a whole call only, never a cut one
            if call is not None:
                message, finish = {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
            choices = [{"index": 0, "message": message, "logprobs": lp, "finish_reason": finish}]
        else:
            choices = [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]
        reply = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": server.model_name,
            "choices": choices,
            "usage": server.usage(handle),
        }
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
            refused = ApiError(
                503,
                f"the server is handling {self.limit} requests, its limit (--max-connections); retry later",
                kind="server_error",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
            return await refused.response()(scope, receive, send)
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
