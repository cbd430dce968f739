"""Keys of another Redis type in kvfleet's names: a string where kvfleet keeps a stream, a hash where it keeps a set
(another program's write, or another kvfleet version's). A command on one fails with WRONGTYPE, which names no key;
this finds which key it was (TYPE of the names the failed step touches) and says what to do. kvfleet deletes no key
it did not write: an operator looks at it and deletes it, and the fleet goes on by itself. Meanwhile each part goes
on without that key and names it: the gateway's and the services' 503s, `kvfleet status`, the worker's log (its
reader reads its other streams, its flush writes its other outputs)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, NoReturn, TypeVar

import redis
import redis.asyncio as aioredis

from shared import keys
from shared.streams.client import KeyOfAnotherType, wrong_type

log = logging.getLogger("kvfleet.streams")
T = TypeVar("T")

REPORT_EVERY_S = 60.0  # a key of another type is logged once a minute, not at every retry
RECHECK_S = 5.0  # a worker looks again this often at the keys it reads around
# A read refused for a key's type (WRONGTYPE) whose keys, looked at right after, hold no other type (the key expired
# or was deleted in between: a Redis paused past a foreign string's TTL) is read again, up to this many times in a row
READS_OF_A_TYPE_THAT_CHANGED = 3


def _of_another_type(names: Sequence[str], types: Sequence[Any]) -> list[KeyOfAnotherType]:
    found = []
    for name, kind in zip(names, types, strict=True):
        expected = keys.redis_type(name)
        if isinstance(kind, str) and kind not in ("none", expected) and expected is not None:
            found.append(KeyOfAnotherType(name, kind, expected))
    return found


def find(r: redis.Redis, names: Iterable[str]) -> list[KeyOfAnotherType]:
    """The keys among `names` that hold another type than kvfleet keeps there (one TYPE each, one round trip)."""
    names = list(dict.fromkeys(names))
    if not names:
        return []
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.type(name)
    return _of_another_type(names, pipe.execute(raise_on_error=False))


async def afind(r: aioredis.Redis | Any, names: Iterable[str]) -> list[KeyOfAnotherType]:
    """find, on an asyncio client or a multiplexed connection (shared.streams.multiplexed: no pipelines; its
    commands go out together all the same)."""
    names = list(dict.fromkeys(names))
    types = await asyncio.gather(*(r.execute_command("TYPE", name) for name in names), return_exceptions=True)
    return _of_another_type(names, types)


async def afind_in_fleet(r: aioredis.Redis | Any) -> list[KeyOfAnotherType]:
    """Every key of another type among the fleet-wide names and each known worker's (its stream, its status, its
    reservations): a few round trips, made only after a WRONGTYPE."""
    found = await afind(r, [keys.SHARDS, keys.CANCEL, keys.DEAD, keys.ROUND_ROBIN])
    shards = [0]
    if not any(f.key == keys.SHARDS for f in found):
        members = await r.execute_command("SMEMBERS", keys.SHARDS)
        shards = sorted({0} | {int(k) for k in members if k.isascii() and k.isdigit()})
    names = []
    sets = await asyncio.gather(*(r.execute_command("SMEMBERS", keys.workers(s)) for s in shards),
                                return_exceptions=True)
    for shard, members in zip(shards, sets, strict=True):
        names += [keys.workers(shard), keys.req_any(shard)]
        if not isinstance(members, Exception):
            names += [name for w in sorted(members)
                      for name in (keys.req_stream(w, shard), keys.status(w, shard), keys.reserved(w, shard))]
    return found + await afind(r, names)


async def araise_named(r: aioredis.Redis | Any, e: BaseException, names: Iterable[str] | None = None) -> NoReturn:
    """Raise `e` as KeyOfAnotherType when it is a WRONGTYPE and a key of another type is found among `names` (every
    fleet-wide name and each known worker's when None); else `e` as it is."""
    if wrong_type(e) and not isinstance(e, KeyOfAnotherType):
        found = await (afind(r, names) if names is not None else afind_in_fleet(r))
        if found:
            raise found[0] from e
    raise e


async def arun_named(r: aioredis.Redis | Any, call: Callable[[], Awaitable[T]], names: Sequence[str]) -> T:
    """await call(), a step on `names` that writes nothing before it meets a key of another type (the enqueue scripts
    check or pcall first). A WRONGTYPE raises KeyOfAnotherType naming the key among `names`; one whose keys hold no
    other type when looked at (the key expired or was deleted in between: the read_set race) runs the step again, up
    to READS_OF_A_TYPE_THAT_CHANGED times in all, the last one as araise_named raises."""
    for _ in range(READS_OF_A_TYPE_THAT_CHANGED - 1):
        try:
            return await call()
        except redis.ResponseError as e:
            if not wrong_type(e) or isinstance(e, KeyOfAnotherType):
                raise
            if found := await afind(r, names):
                raise found[0] from e
    try:
        return await call()
    except redis.ResponseError as e:
        await araise_named(r, e, names)


def read_set(r: redis.Redis, name: str, what: str, error: Exception | None = None) -> set[str] | None:
    """The members of the set `name` (read here, or whose read already failed with `error`); None when it holds
    another type (reported for `what`: the caller reads around it). A read refused for its type while the TYPE that
    looks right after finds none (the key expired or was deleted in between: a Redis paused past another program's
    string's TTL runs the read before the pause and the TYPE after it; chaos seed 229 got two 503s from it) reads the
    set again, up to READS_OF_A_TYPE_THAT_CHANGED times; any other error is raised."""
    for _ in range(READS_OF_A_TYPE_THAT_CHANGED):
        if error is None:
            try:
                return {str(m) for m in r.smembers(name)}
            except redis.ResponseError as e:
                error = e
        if not wrong_type(error):
            raise error
        if found := find(r, [name]):
            report(found, what)
            return None
        last, error = error, None  # of its own type again, or gone: read it again
    raise last


async def aread_set(r: aioredis.Redis, name: str, what: str, error: Exception | None = None) -> set[str] | None:
    """read_set, on an asyncio client (the re-reads: arun_named)."""
    async def read() -> set[str]:
        nonlocal error
        if error is not None:  # the first read failed already (in the caller's pipeline)
            failed, error = error, None
            raise failed
        return {str(m) for m in await r.smembers(name)}

    try:
        return await arun_named(r, read, [name])
    except KeyOfAnotherType as found:
        report([found], what)
        return None


_logged: dict[tuple[str, str], float] = {}  # (what, key) -> when this process last said so (report)


def report(found: Iterable[KeyOfAnotherType], what: str) -> None:
    """Log that `what` ("worker w0's reader", "the gateway's routing") goes on without each key of `found`, unless
    it said so in the last REPORT_EVERY_S."""
    now = time.monotonic()
    for f in found:
        if now - _logged.get((what, f.key), float("-inf")) >= REPORT_EVERY_S:
            _logged[(what, f.key)] = now
            log.error("%s goes on without %s: %s", what, f.key, f)


class Avoided:
    """The keys of another type one process met and works around (a worker's reader leaves such a stream out of
    its reads), each logged when found and once a minute after, and looked at again every RECHECK_S: once gone,
    or of kvfleet's type again, it is used again (and that is logged too). Shared by a worker's reader threads."""

    def __init__(self, r: redis.Redis, what: str):
        self.r, self.what = r, what  # `what`: who works around them, for the log ("worker w0's reader")
        self._keys: dict[str, KeyOfAnotherType] = {}
        self._next_look = 0.0
        self._lock = threading.Lock()

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def __bool__(self) -> bool:
        return bool(self._keys)

    def met(self, e: BaseException, names: Iterable[str]) -> bool:
        """`e` (an error of a step that touches `names`) was a WRONGTYPE: the keys of another type among them are
        avoided from now on, and logged. False when it was no WRONGTYPE or none was found (written over since)."""
        if not wrong_type(e):
            return False
        found = find(self.r, names)
        with self._lock:
            self._keys.update({f.key: f for f in found})
            self._next_look = time.monotonic() + RECHECK_S
        report(found, self.what)
        return bool(found)

    def recheck(self) -> list[str]:
        """Look again at the avoided keys (at most every RECHECK_S); those gone or of kvfleet's type are used
        again, and returned."""
        if not self._keys or time.monotonic() < self._next_look:
            return []
        found = find(self.r, list(self._keys))
        with self._lock:
            back = sorted(set(self._keys) - {f.key for f in found})
            for key in back:
                log.warning("%s uses %s again: it no longer holds another type", self.what, key)
                _logged.pop((self.what, key), None)
            self._keys = {f.key: f for f in found}
            self._next_look = time.monotonic() + RECHECK_S
        report(found, self.what)
        return back
