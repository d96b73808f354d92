"""Request checking for the OpenAI API: its error shape (`ApiError`), the fields this server does
not implement, and the checks every body field goes through, so that malformed input gets a 4xx
in OpenAI's shape, never a 5xx."""

from __future__ import annotations

import logging
import math

from fastapi.responses import JSONResponse

log = logging.getLogger("blockdraft.serve")


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}},
            status_code=self.status,
            headers=self.headers,
        )


# fields of OpenAI's API this server does not implement, with the values that mean "not used"
# (`tools` and `response_format` are implemented: `serve.tools`; the deprecated `functions` are not)
UNSUPPORTED = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
}
MAX_TOP_LOGPROBS = {"chat": 20, "completions": 5}  # OpenAI's bounds: top_logprobs (chat), logprobs (legacy)


class ClientGone(ApiError):
    """The client went away (an ordinary event: logged at INFO in one line, counted as status 499)."""

    def __init__(self, when: str):
        super().__init__(499, f"client disconnected {when}")
        log.info("client disconnected %s", when)


def check_field(body: dict, name: str, types, default=None, *, check=None, what: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ApiError(400, f"'{name}' must be {what or types}", name)
    if not isinstance(value, types):
        raise ApiError(400, f"'{name}' must be {what or getattr(types, '__name__', types)}", name)
    if check is not None and not check(value):
        raise ApiError(400, f"'{name}' must be {what}", name)
    return value


def check_number(body, name, default, lo, hi):
    def finite(v):
        try:
            return math.isfinite(v) and lo <= v <= hi
        except OverflowError:  # an integer too large for a float
            return False

    return float(check_field(body, name, (int, float), default, what=f"a number in [{lo}, {hi}]", check=finite))


def check_text(value: str, param: str) -> str:
    """A string the tokenizer can take: valid Unicode (JSON's \\ud800 escapes can make lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"'{param}' holds text that is not valid Unicode (a lone surrogate)", param) from None
    return value


def check_stops(body) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    return [check_text(s, "stop") for s in stop]
