"""shared.streams.Multiplexed against a real Redis: concurrent commands on its one connection each get their own
reply, errors are redis-py's classes (so the Lua-script runner's EVAL fallback works through it), the URL's
password and database are used, a caller that gives up does not shift the replies of the others, a killed
connection or a Redis restart is reconnected (an outage past the retries is a ConnectionError), and a blocking
XREAD through one gives the inbox reader the same chunks as redis-py's client."""

from __future__ import annotations

import asyncio

import pytest
import redis

from services.ports import free_port
from services.redis_server import RedisServer
from shared import keys, streams
from shared.messages import OutputChunk
from shared.streams.client import LuaScript

pytestmark = pytest.mark.integration


def test_concurrent_commands_each_get_their_own_reply(redis_url):
    async def main() -> list:
        m = streams.Multiplexed(redis_url)
        try:
            await asyncio.gather(*(m.execute_command("SET", f"mx:{i}", f"v{i}") for i in range(300)))
            return await asyncio.gather(*(m.execute_command("GET", f"mx:{i}") for i in range(300)))
        finally:
            await m.aclose()

    assert asyncio.run(main()) == [f"v{i}" for i in range(300)]


def test_error_replies_are_redis_py_errors_and_scripts_fall_back_to_eval(redis_url):
    script = LuaScript("return {KEYS[1], ARGV[1], redis.call('INCR', KEYS[1])}")

    async def main() -> tuple:
        m = streams.Multiplexed(redis_url)
        try:
            await m.execute_command("DEL", "mx:script", "mx:list")
            await m.execute_command("SCRIPT", "FLUSH")
            with pytest.raises(redis.exceptions.NoScriptError):
                await m.evalsha(script.sha, 1, "mx:script", "a")
            first = await streams.arun_script(m, script, ["mx:script"], ["a"])  # NOSCRIPT -> EVAL
            second = await streams.arun_script(m, script, ["mx:script"], ["b"])  # cached now: EVALSHA
            await m.execute_command("RPUSH", "mx:list", "x")
            with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
                await m.execute_command("GET", "mx:list")
            after_error = await m.execute_command("PING")
            return first, second, after_error
        finally:
            await m.aclose()

    first, second, after_error = asyncio.run(main())
    assert first == ["mx:script", "a", 1] and second == ["mx:script", "b", 2]
    assert after_error == "PONG"


def test_the_urls_password_and_database_are_used():
    with RedisServer(password="p@ss:word") as srv:
        url = srv.url.rsplit("/", 1)[0] + "/3"

        async def main() -> tuple:
            m = streams.Multiplexed(url)
            try:
                await m.execute_command("SET", "mx:db", "three")
                return await m.execute_command("CLIENT", "INFO")
            finally:
                await m.aclose()

        info = asyncio.run(main())
        assert " db=3 " in info
        assert streams.connect(url).get("mx:db") == "three"
        assert streams.connect(srv.url).get("mx:db") is None  # not in database 0
        wrong = srv.url.replace("p%40ss%3Aword", "nope").replace("p@ss:word", "nope")
        with pytest.raises(redis.AuthenticationError):
            asyncio.run(streams.Multiplexed(wrong).execute_command("PING"))


def test_a_caller_that_gives_up_does_not_shift_the_others_replies(redis_url):
    async def main() -> list:
        m = streams.Multiplexed(redis_url)
        try:
            await m.execute_command("SET", "mx:slow", "late")
            slow = asyncio.ensure_future(m.execute_command("BLPOP", "mx:nothing", 0.3))
            await asyncio.sleep(0.05)
            slow.cancel()  # its reply (nil, in 0.3 s) still comes, and is read past
            return [await m.execute_command("GET", "mx:slow"), await m.execute_command("ECHO", "next")]
        finally:
            await m.aclose()

    assert asyncio.run(main()) == ["late", "next"]


def test_a_killed_connection_and_a_restarted_redis_are_reconnected():
    port = free_port()
    srv = RedisServer(port=port).start()
    try:
        async def main() -> None:
            m = streams.Multiplexed(srv.url)
            try:
                await m.execute_command("SET", "mx:k", "1")
                admin = streams.connect(srv.url)
                assert streams.kill_clients(admin) >= 1  # every client but the caller: the multiplexed one too
                assert await m.execute_command("GET", "mx:k") == "1"  # sent again on a new connection

                srv.stop()
                with pytest.raises(redis.ConnectionError):  # down past the retries (~0.35 s)
                    await m.execute_command("GET", "mx:k")
                srv.start()
                assert await m.execute_command("PING") == "PONG"
            finally:
                await m.aclose()

        asyncio.run(main())
    finally:
        srv.stop()


def test_the_inbox_read_through_it_gives_the_same_chunks(redis_url):
    inbox = "mx:inbox"
    chunks = [OutputChunk(request_id=f"r{i}", seq=0, text=f"t{i}", token_ids=[i], final=True) for i in range(3)]

    async def main() -> tuple:
        r = streams.connect_async(redis_url)
        m = streams.Multiplexed(redis_url)
        try:
            await r.delete(inbox)
            await r.xadd(inbox, {keys.FIELD: "[" + ",".join(c.model_dump_json() for c in chunks) + "]"})
            through_redis_py = await streams.aread_inbox(r, inbox, "0-0", block_ms=100)
            through_multiplexed = await streams.aread_inbox(m, inbox, "0-0", block_ms=100)
            waited = asyncio.ensure_future(streams.aread_inbox(m, inbox, through_multiplexed[0], block_ms=2000))
            await asyncio.sleep(0.1)
            await r.xadd(inbox, {keys.FIELD: "[" + chunks[0].model_dump_json() + "]"})
            return through_redis_py, through_multiplexed, await asyncio.wait_for(waited, 5)
        finally:
            await m.aclose()
            await r.aclose()

    through_redis_py, through_multiplexed, waited = asyncio.run(main())
    assert through_multiplexed == through_redis_py and through_multiplexed[1] == chunks
    assert waited[1] == chunks[:1] and waited[0] > through_multiplexed[0]


def test_what_it_does_not_speak_gets_none():
    assert streams.multiplexed("redis+cluster://127.0.0.1:7000") is None
    assert streams.multiplexed("rediss://127.0.0.1:6380/0") is None
    assert streams.multiplexed("redis://127.0.0.1:6379/0") is not None
