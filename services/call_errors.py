"""What a fleet call outside HTTP (Celery task, Python client, batch line) can fail with, mirroring the
gateway's statuses: InvalidRequest (4xx: fix the request, never retried), FleetUnavailable (429 / 503: retry
later), GenerationFailed (the fleet failed it: dead letter, timeout, internal error).

Each keeps (message, status, param, code) as its args, so Celery's JSON result backend rebuilds it as the same
class on the caller's side (`AsyncResult.get()` raises InvalidRequest, not a generic error).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from gateway.errors import APIError, validation_error


class CallError(Exception):
    status = 500

    def __init__(self, message: str, status: int | None = None, param: str | None = None,
                 code: str | None = None):
        super().__init__(message, status if status is not None else type(self).status, param, code)

    @property
    def message(self) -> str:
        return self.args[0]

    @property
    def status_code(self) -> int:
        return self.args[1]

    @property
    def param(self) -> str | None:
        return self.args[2]

    @property
    def code(self) -> str | None:
        return self.args[3]

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        """The error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
        return APIError(self.status_code, self.message, param=self.param, code=self.code).body()


class InvalidRequest(CallError, ValueError):
    status = 400


class FleetUnavailable(CallError):
    status = 429


class GenerationFailed(CallError):
    status = 500


def from_api_error(e: APIError) -> CallError:
    if e.status in (429, 503):
        cls: type[CallError] = FleetUnavailable
    elif 400 <= e.status < 500 and e.status != 408:
        cls = InvalidRequest
    else:
        cls = GenerationFailed
    return cls(e.message, e.status, e.param, e.code)


def from_validation_error(e: ValidationError) -> InvalidRequest:
    """The first error, named like the gateway's 400s: "temperature: Input should be ... , got 5.0"."""
    param, message = validation_error(e)
    return InvalidRequest(message, 400, param, "invalid_value")
