"""`kvfleet status` (and `kvfleet top`, which shares its reader) against a Redis it cannot read says what to do: a
real Redis with a password (as `kvfleet up` starts one), asked without it, and a port where nothing listens."""

from __future__ import annotations

import argparse

import pytest

from services import status_cmd
from services.ports import free_port
from services.redis_server import RedisServer

pytestmark = pytest.mark.integration


def status(capsys, url: str) -> tuple[int, str]:
    code = status_cmd.run(argparse.Namespace(redis_url=url, json=False))
    return code, capsys.readouterr().out


def test_status_without_the_password_or_without_a_redis_says_where_the_url_is(capsys):
    with RedisServer(password="s3cret") as srv:
        code, out = status(capsys, srv.url)
        assert code == 0, out  # the right URL reads the (empty) fleet
        code, out = status(capsys, srv.url.replace(":s3cret@", "@"))
        assert code == 1 and "needs the Redis's password" in out and "DATA_DIR/redis-url" in out, out
        assert "s3cret" not in out
        code, out = status(capsys, srv.url.replace(":s3cret@", ":wrong@"))  # a wrong one: the same advice
        assert code == 1 and "needs the Redis's password" in out and "wrong" not in out, out
    code, out = status(capsys, f"redis://127.0.0.1:{free_port()}/0")
    assert code == 1 and "Is a Redis running there?" in out and "DATA_DIR/redis-url" in out, out
