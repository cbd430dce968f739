"""How a write Redis refuses is answered, whichever door the request came in by: full (OOM under noeviction) or
unable to persist (MISCONF: a full or read-only disk) each gets its own 503 whose message says what to do, and the
Python client's and Celery's FleetUnavailable carries the same code (retried as a full fleet); any other Redis
error is the generic 503 redis_unavailable."""

from __future__ import annotations

import json

import pytest
import redis

from gateway.errors import error_response, redis_cannot_persist, redis_full
from services.call_errors import FleetUnavailable, from_api_error
from shared import streams

pytestmark = pytest.mark.unit

OOM = redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'.")
MISCONF = redis.ResponseError("MISCONF Errors writing to the AOF file: No space left on device")
MISCONF_IN_SCRIPT = redis.ResponseError("Error running script (call to f_4157): @user_script:4: @user_script: 4: "
                                        "-MISCONF Redis is configured to save RDB snapshots, but it is currently not "
                                        "able to persist on disk.")  # Redis 6.2's words


@pytest.mark.parametrize(("error", "code", "says"), [
    (OOM, "redis_full", "raise its maxmemory"),
    (MISCONF, "redis_cannot_persist", "Free space on its data volume"),
    (MISCONF_IN_SCRIPT, "redis_cannot_persist", "Free space on its data volume"),
    (redis.ConnectionError("Connection refused"), "redis_unavailable", "retry shortly"),
])
def test_each_refusal_gets_its_own_503(error, code, says):
    assert streams.out_of_memory(error) == (code == "redis_full")
    assert streams.cannot_persist(error) == (code == "redis_cannot_persist")
    response = error_response(error)
    body = json.loads(response.body)["error"]
    assert response.status_code == 503 and response.headers["retry-after"] and body["code"] == code, body
    assert says.lower() in body["message"].lower(), body


@pytest.mark.parametrize("api_error", [redis_full(), redis_cannot_persist()])
def test_the_python_client_and_celery_get_it_as_a_full_fleet(api_error):
    unavailable = from_api_error(api_error)
    assert isinstance(unavailable, FleetUnavailable) and unavailable.code == api_error.code
