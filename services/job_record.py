"""The job record: what makes a request id enter the fleet at most once, however often its caller retries
(a Celery task redelivered after its worker died, a batch file rerun after a kill).

kvfleet:job:{request_id} holds JSON {state, since, owner, call, result, request_hash}, kept `job_ttl_s`:
  placing   an attempt holds the lease: it is routing and enqueuing the request right now
  enqueued  the request is in the fleet; `call` says how to render its output (attach to its output stream)
  done      `result` is the finished response body (returned as is; the fleet is not asked again): the text,
            finish reasons, usage (and logprobs when asked for). `call` keeps how to render it but not the
            request (prompt token ids and text): a done record is a fraction of the request it answers.
A placing lease older than `lease_s` (placing is a few Redis round trips) belongs to an attempt that died while placing: the next attempt takes
it over and first looks for the request in the fleet's streams (it may have been enqueued just before the
death) before enqueuing it. Claim, promotion and release are atomic (Lua compare-and-set in shared.streams).
Every state carries `request_hash` (services.fleet_calls.request_hash): an attempt whose request differs is
refused (409) instead of attaching to another request or returning its result.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass, fields
from typing import Any

from shared import streams

log = logging.getLogger("kvfleet.jobs")

LEASE_S = 10.0  # placing (claim, route, enqueue, promote) takes milliseconds; a lease this old lost its owner


@dataclass
class Record:
    state: str  # placing | enqueued | done
    since: float
    owner: str = ""
    call: dict[str, Any] | None = None  # how to render the output (services.fleet_calls.CallInfo)
    result: dict[str, Any] | None = None
    request_hash: str = ""  # what the id stands for ("": a record written before hashes were kept)

    def same_request(self, request_hash: str) -> bool:
        return not self.request_hash or self.request_hash == request_hash

    def dumps(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def loads(cls, raw: str) -> Record:
        return cls(**json.loads(raw))

    @classmethod
    def parse(cls, request_id: str, raw: str) -> Record | None:
        """The record as stored, or None when it is not one this version reads (another program's or version's
        write; logged): then it counts as a dead attempt's, which the next attempt takes over (its claim, in
        shared.streams.jobs, judges a record readable by the same rules)."""
        try:
            data = json.loads(raw)  # fields a later version added are left aside: its records stay readable here
            rec = cls(**{k: v for k, v in data.items() if k in _FIELDS}) if isinstance(data, dict) else None
        except (ValueError, TypeError):
            rec = None
        if rec is not None and isinstance(rec.since, int | float) and (
                rec.state == "placing" or rec.state == "enqueued" and isinstance(rec.call, dict)
                or rec.state == "done" and isinstance(rec.call, dict) and isinstance(rec.result, dict)):
            return rec
        log.warning("the job record of request %s cannot be read (%.120r): taken for a dead attempt's", request_id,
                    raw)
        return None


_FIELDS = {f.name for f in fields(Record)}


class Claim(enum.Enum):
    FRESH = 1  # nobody had it: enqueue
    TAKEN_OVER = 2  # a dead attempt's lease: look in the fleet first
    HELD = 0  # another attempt placed it (or is placing it now): attach


@dataclass
class Claimed:
    outcome: Claim
    lease: str  # the placing record we wrote ("" when HELD): promote/release compare against it
    held: Record | None = None  # HELD: the record there; TAKEN_OVER: the dead attempt's lease


async def claim(r: Any, request_id: str, *, ttl_s: float, lease_s: float = LEASE_S,
                request_hash: str = "") -> Claimed:
    lease = Record(state="placing", since=time.time(), owner=uuid.uuid4().hex, request_hash=request_hash).dumps()
    outcome, old = await streams.aclaim_job(r, request_id, lease, now=time.time(), lease_s=lease_s, ttl_s=ttl_s)
    outcome = Claim(outcome)
    if outcome is Claim.HELD:  # readable: the claim's Lua judged it by Record.parse's rules
        return Claimed(outcome, "", Record.parse(request_id, old))
    return Claimed(outcome, lease, Record.parse(request_id, old) if old else None)


async def get(r: Any, request_id: str) -> Record | None:
    raw = await streams.aget_job(r, request_id)
    return Record.parse(request_id, raw) if raw is not None else None


async def promote(r: Any, request_id: str, lease: str, call: dict[str, Any], *, ttl_s: float) -> bool:
    """placing -> enqueued, if the lease is still ours."""
    mine = Record.loads(lease)
    new = Record(state="enqueued", since=time.time(), owner=mine.owner, call=call,
                 request_hash=mine.request_hash).dumps()
    return await streams.areplace_job(r, request_id, lease, new, ttl_s=ttl_s)


async def release(r: Any, request_id: str, lease: str) -> None:
    """Drop our lease: nothing was enqueued (the fleet was full, the request was refused)."""
    await streams.areplace_job(r, request_id, lease, "")


async def finish(r: Any, request_id: str, shard: int, call: dict[str, Any], result: dict[str, Any], *,
                 ttl_s: float, output_ttl_s: float, request_hash: str = "") -> None:
    """Store the finished body; the output stream is no longer needed past `output_ttl_s`. The request itself
    is dropped from `call`: the body answers every later attempt, and the record lives `ttl_s` (a day)."""
    rec = Record(state="done", since=time.time(), call=dict(call, request={}), result=result,
                 request_hash=request_hash)
    await streams.afinish_job(r, request_id, shard, rec.dumps(), ttl_s=ttl_s, output_ttl_s=output_ttl_s)


async def wait_placed(r: Any, request_id: str, *, lease_s: float = LEASE_S, poll_s: float = 0.05) -> Record | None:
    """Wait while another live attempt holds the placing lease; the record once it moved on (None: it was
    released, or its lease went stale, so the caller claims again)."""
    while True:
        rec = await get(r, request_id)
        if rec is None or rec.state != "placing" or time.time() - rec.since > lease_s:
            return None if rec is None or rec.state == "placing" else rec
        await asyncio.sleep(poll_s)
