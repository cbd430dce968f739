"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, never a bare 500 for bad input."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared import streams
from shared.outage_log import OutageLog

log = logging.getLogger("kvfleet.gateway")
# Every request refused while Redis is away or refuses writes would log a line: one per outage instead, and one
# every 30 s while it goes on (with the count).
_REFUSED = OutageLog(log, "a request's write to redis")
_UNAVAILABLE = OutageLog(log, "a request's call to redis")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
         429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list|dict|[a-z-]+\[.*\])$")  # pydantic's union-member locs


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate cannot be sent
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or TYPES.get(status, "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def param_of(message: str) -> str | None:
    """SamplingParams errors start with the field name ("top_p must be in (0, 1], got 2")."""
    first = message.split(" ", 1)[0]
    return first if first.isidentifier() else None


def error_path(loc: Any, at: str = "") -> str | None:
    """A pydantic error location as a JSON path: ("body", "messages", 0, "content") -> "messages[0].content";
    `at` (a validator's own sub-path, gateway.openai_api.invalid) is appended. Union-member tags are left out."""
    path = ""
    for p in loc:
        if p == "body" and not path or isinstance(p, str) and _UNION_TAG.match(p):
            continue
        path += f"[{p}]" if isinstance(p, int) else f".{p}" if path else str(p)
    if at:
        path += at if at[0] in ".[" or not path else f".{at}"
    return path or None


def validation_error(exc: Any) -> tuple[str | None, str]:
    """(field, message) of a pydantic ValidationError (or FastAPI's RequestValidationError), named as the 400s
    name it: ("temperature", "temperature: Input should be ... , got 5.0"). Of several errors (a value that
    matches no member of a union) the one that went deepest."""
    errors = exc.errors() or [{"loc": (), "msg": "invalid request"}]
    if (body := _body_error(errors[0])) is not None:
        return None, body
    paths = [error_path(e.get("loc", ()), (e.get("ctx") or {}).get("at", "")) for e in errors]
    i = max(range(len(errors)), key=lambda j: (len(paths[j] or ""), -j))
    err, param = errors[i], paths[i]
    detail = err.get("msg", "invalid value")
    if "input" in err and err.get("type") not in ("missing", "invalid_value") and not isinstance(err["input"],
                                                                                                  dict | list):
        detail += f", got {err['input']!r}"
    return param, f"{param}: {detail}" if param else detail


_JSON_TYPE = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _body_error(err: dict) -> str | None:
    """The message for a body that is not a JSON object at all (FastAPI's "JSON decode error" at a bare character
    offset, or "Input should be a valid dictionary" for a list or a string), or None for an error in a field."""
    loc, kind = tuple(err.get("loc", ())), err.get("type")
    if kind == "json_invalid":
        at = f" at character {loc[1]}" if len(loc) > 1 and isinstance(loc[1], int) else ""
        reason = (err.get("ctx") or {}).get("error", "JSON decode error")
        return f"the request body is not valid JSON: {reason}{at}"
    if loc == ("body",) and kind in ("model_attributes_type", "dict_type", "missing"):
        got = "nothing" if kind == "missing" else f"a JSON {_JSON_TYPE.get(type(err.get('input')), 'value')}"
        return f"the request body must be a JSON object (its fields: model, messages or prompt, ...), got {got}"
    return None


def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    param, message = validation_error(exc)
    return APIError(400, message, param=param, code="invalid_value").response()


def error_response(exc: Exception) -> JSONResponse:
    """The answer to an exception a request raised (the app's handlers, and gateway.fast_lane, answer with it)."""
    if isinstance(exc, APIError):
        return exc.response()
    if isinstance(exc, StarletteHTTPException):
        cause = exc.__cause__  # FastAPI's 400 "There was an error parsing the body" keeps the reason here
        if isinstance(cause, UnicodeDecodeError):
            return APIError(400, f"the request body is not valid UTF-8 (byte {cause.start} of the body): send "
                                 "JSON encoded as UTF-8", code="invalid_utf8").response()
        return APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()
    if (refused := refusal(exc)) is not None:
        _REFUSED.failed(exc, "answering 503")
        return refused.response()
    if isinstance(exc, streams.RedisError):
        _UNAVAILABLE.failed(exc, "answering 503 redis_unavailable")
        return APIError(503, "the request queue (Redis) is unavailable; retry shortly", code="redis_unavailable",
                        headers={"Retry-After": "1"}).response()
    log.error("internal error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()


def refusal(exc: BaseException) -> APIError | None:
    """The 503 for a write Redis refused (full, or unable to persist: streams.write_refused), or for a key of
    another type in kvfleet's names (streams.KeyOfAnotherType, which names it); None for any other error. The
    gateway answers it; the Python client and Celery raise it as FleetUnavailable (services.fleet_calls)."""
    if streams.wrong_type(exc):
        return key_of_another_type(exc)
    why = streams.write_refused(exc)
    return redis_full() if why == "full" else redis_cannot_persist() if why else None


def key_of_another_type(exc: BaseException) -> APIError:
    """The 503 for a key of another Redis type in kvfleet's names (another program's write): the key and what to
    do when a fleet read or the enqueue found it (streams.KeyOfAnotherType), else where to look."""
    message = str(exc) if isinstance(exc, streams.KeyOfAnotherType) else (
        "a key in kvfleet's names in Redis holds another type than kvfleet keeps there (another program's write); "
        "find it with `redis-cli --scan --pattern 'kvfleet:*'` and TYPE, then delete it")
    return APIError(503, f"the request queue takes no new request now. {message}", code="redis_key_of_another_type",
                    headers={"Retry-After": "5"})


def redis_cannot_persist() -> APIError:
    """The 503 for a write Redis refused because it cannot save it to disk (MISCONF)."""
    return APIError(503, f"the request queue takes no new request now. {streams.CANNOT_PERSIST}",
                    code="redis_cannot_persist", headers={"Retry-After": "5"})


def redis_full() -> APIError:
    """The 503 for a write a full Redis refused (maxmemory, noeviction): what is wrong and what to do."""
    return APIError(503, f"the request queue is full and takes no new request now. {streams.FULL}",
                    code="redis_full", headers={"Retry-After": "5"})


async def named_response(request: Request, exc: Exception) -> JSONResponse:
    """error_response, with a WRONGTYPE that names no key looked up first among the fleet's keys (the app's
    handlers and gateway.fast_lane answer with it)."""
    if streams.wrong_type(exc) and not isinstance(exc, streams.KeyOfAnotherType):
        try:
            await streams.araise_named(request.app.state.kvfleet.redis, exc)
        except streams.KeyOfAnotherType as named:
            exc = named
        except Exception:  # noqa: BLE001 (none found, or Redis away: answered unnamed)
            pass
    return error_response(exc)


async def _handled(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, StarletteHTTPException) and exc.detail in ("Not Found", "Method Not Allowed"):
        exc = _no_such_endpoint(request, exc)
    return await named_response(request, exc)


def _no_such_endpoint(request: Request, exc: StarletteHTTPException) -> APIError:
    """Starlette's bare "Not Found" (no such path) or "Method Not Allowed", naming what the gateway serves."""
    served = sorted({(m, r.path) for r in request.app.routes if getattr(r, "include_in_schema", False)
                     for m in getattr(r, "methods", ()) if m != "HEAD"}, key=lambda mp: (mp[1], mp[0]))
    what = "no such endpoint" if exc.status_code == 404 else "this method is not allowed on this path"
    return APIError(exc.status_code, f"{what}: {request.method} {request.url.path}; this gateway serves "
                    + ", ".join(f"{m} {p}" for m, p in served), code="not_found" if exc.status_code == 404
                    else "method_not_allowed", headers=getattr(exc, "headers", None))


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    for kind in (APIError, StarletteHTTPException, streams.RedisError, Exception):
        app.add_exception_handler(kind, _handled)
