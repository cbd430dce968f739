"""Run an OpenAI Batch API file through the fleet: `kvfleet batch INPUT.jsonl OUTPUT.jsonl`.

Each INPUT line: {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions" (or "/v1/completions"),
"body": {...the HTTP API's parameters...}}. Each OUTPUT line, written and flushed as its request finishes (so
in completion order): {"id": "batch_req_...", "custom_id": "q1", "response": {"status_code": 200,
"request_id": "...", "body": {...the OpenAI response...}}, "error": null}. A line that fails gets its error in
its own output line (response.status_code 4xx/5xx with the OpenAI error body, and error {code, message}); the
batch goes on. A full fleet (429) or no live worker (503) is retried with backoff (--retries) first.

Redis away (restarted, say) does not end the run: each line in flight tries again, with backoff, until Redis
answers (its job record makes the retry attach to its request, or place it again if Redis came back without
it). Only an outage longer than --redis-wait stops the run, with a message that says so; a rerun resumes.

Resumable: a rerun skips the custom_ids already in OUTPUT (a line torn by a kill is cut off and redone). A
line that was in flight when a run died attaches to its request in the fleet instead of generating it again:
request ids derive from OUTPUT's path and the custom_id. A line edited meanwhile (same custom_id, another body)
gets a 409 (request_id_conflict), never the first body's result.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("kvfleet.batch")

URLS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", type=Path, help="JSONL file in the OpenAI Batch API format")
    p.add_argument("output", type=Path, help="JSONL results (appended to; lines already there are skipped)")
    p.add_argument("--redis-url", help="the fleet's Redis URL; env KVFLEET_REDIS_URL")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    p.add_argument("--retries", type=int, default=10, help="retries of a line the fleet cannot take now (429/503)")
    p.add_argument("--redis-wait", type=float, default=300.0, metavar="SECONDS",
                   help="how long to wait for Redis while it is unreachable (a restart, say) before stopping the run "
                        "(a rerun resumes)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass
class Summary:
    total: int = 0  # lines in INPUT
    skipped: int = 0  # already in OUTPUT
    ran: int = 0  # sent to the fleet (or failed validation) in this run
    failed: int = 0  # of those, recorded with an error


def run(args: argparse.Namespace) -> int:
    from shared.settings import Settings, hf_offline

    hf_offline()
    if args.concurrency < 1:
        raise SystemExit("--concurrency must be at least 1")
    if args.redis_wait < 0:
        raise SystemExit("--redis-wait must be at least 0")
    if not args.input.is_file():
        raise SystemExit(f"input file {args.input} does not exist")
    settings = Settings.from_env(redis_url=args.redis_url)
    try:
        s = asyncio.run(run_batch(settings, args.input, args.output, concurrency=args.concurrency,
                                  retries=args.retries, progress=not args.no_progress, redis_wait_s=args.redis_wait))
    except RedisGone as e:
        print(f"kvfleet batch: {e}; the lines answered so far are in {args.output}: run the same command again "
              "to resume", file=sys.stderr, flush=True)
        return 1
    print(f"batch: ran {s.ran} request(s), {s.failed} failed; skipped {s.skipped} already in {args.output}; "
          f"{s.total} line(s) in {args.input}", flush=True)
    return 0


def load_done(output: Path) -> tuple[set[str], set[int]]:
    """The custom_ids OUTPUT already answers, and the input line numbers of lines answered without one (not
    JSON, no custom_id). A last line without its newline (a kill mid-write) is cut off, to be done again."""
    ids: set[str] = set()
    lines: set[int] = set()
    if not output.exists():
        return ids, lines
    good = 0
    with output.open("rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            good += len(raw)
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            if isinstance(obj.get("custom_id"), str) and "line" not in obj:
                ids.add(obj["custom_id"])
            elif isinstance(obj.get("line"), int):
                lines.add(obj["line"])
    if good < output.stat().st_size:
        with output.open("r+b") as f:
            f.truncate(good)
    return ids, lines


def request_id_for(output: Path, custom_id: str) -> str:
    return "batch-" + hashlib.sha256(f"{output.resolve()}\0{custom_id}".encode()).hexdigest()[:32]


def output_line(custom_id: str | None, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"id": "batch_req_" + request_id.removeprefix("batch-"), "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


def error_line(custom_id: str | None, request_id: str, e: Any) -> dict[str, Any]:
    """A failed line (e: a services.call_errors.CallError): its status and OpenAI error body, and `error`."""
    body = e.body()
    return {"id": "batch_req_" + request_id.removeprefix("batch-"), "custom_id": custom_id,
            "response": {"status_code": e.status_code, "request_id": request_id, "body": body},
            "error": {"code": e.code or body["error"]["type"], "message": e.message}}


def parse_line(raw: str) -> dict[str, Any]:
    """JSON object with a string custom_id; ValueError (message for the output line) otherwise."""
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"the line is not valid JSON: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("custom_id"), str) or not obj["custom_id"]:
        raise ValueError("custom_id: each line needs a non-empty string custom_id")
    return obj


def request_of(obj: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(kind, body) of a line; InvalidRequest naming what is wrong."""
    from services.call_errors import InvalidRequest

    if str(obj.get("method", "POST")).upper() != "POST":
        raise InvalidRequest(f"method: only POST is supported, got {obj.get('method')!r}", 400, "method")
    kind = URLS.get(obj.get("url", ""))
    if kind is None:
        raise InvalidRequest(f"url: must be one of {', '.join(URLS)}, got {obj.get('url')!r}", 400, "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise InvalidRequest("body: must be a JSON object with the request's parameters", 400, "body")
    return kind, {k: v for k, v in body.items() if k != "stream" or v}


class RedisGone(Exception):
    """Redis stayed unreachable past --redis-wait: the run stops (a rerun resumes)."""


class _RedisWait:
    """The run's wait for Redis, shared by the lines in flight: an outage begins at the first failure after a
    success, and each failing line retries after a backoff until it gets through, or until the outage, or the
    line's own failures (Redis answers the others, but keeps failing this one), outlast `limit_s`."""

    def __init__(self, url: str, limit_s: float):
        self.url, self.limit_s = url, limit_s
        self.since: float | None = None  # monotonic time of the outage's first failure, None while Redis answers

    def answered(self) -> None:
        if self.since is not None:
            log.warning("Redis at %s answers again after %.1fs", self.url, time.monotonic() - self.since)
            self.since = None

    async def failed(self, error: Exception, tries: int, line_since: float) -> None:
        """A line failed on Redis (its `tries`-th failure in a row, the first at `line_since`): wait before it
        tries again, or raise RedisGone."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
            log.warning("Redis at %s is unreachable (%s: %s); waiting up to %gs for it", self.url,
                        type(error).__name__, error, self.limit_s)
        since = min(self.since, line_since)
        if now - since >= self.limit_s:
            raise RedisGone(f"Redis at {self.url} was unreachable for {now - since:.0f}s (--redis-wait "
                            f"{self.limit_s:g}); the last error: {type(error).__name__}: {error}") from None
        await asyncio.sleep(min(0.25 * 2 ** tries, 5.0, max(0.0, since + self.limit_s - now)))


class _Runner:
    def __init__(self, caller: Any, output: Path, retries: int, redis: _RedisWait):
        self.caller, self.output, self.retries, self.redis = caller, output, retries, redis

    async def line(self, obj: dict[str, Any]) -> dict[str, Any]:
        from services.call_errors import CallError
        from shared import streams

        cid = obj["custom_id"]
        rid = request_id_for(self.output, cid)
        try:
            kind, body = request_of(obj)
            tries, first_failure = 0, 0.0
            while True:
                try:  # again after a Redis failure: the job record makes it attach, or place it again
                    body_out = await self._answer(kind, body, rid)
                    self.redis.answered()
                    return output_line(cid, rid, body_out)
                except streams.CONNECTION_ERRORS as e:  # (RedisAway and OutputLost too)
                    first_failure = first_failure or time.monotonic()
                    await self.redis.failed(e, tries, first_failure)
                    tries += 1
        except CallError as e:
            return error_line(cid, rid, e)

    async def _answer(self, kind: str, body: dict[str, Any], rid: str) -> dict[str, Any]:
        from services.call_errors import FleetUnavailable

        for attempt in range(self.retries + 1):
            try:
                call = await self.caller.submit(kind, body, rid)
                break
            except FleetUnavailable:
                if attempt == self.retries:
                    raise
                await asyncio.sleep(min(30.0, 2.0 ** attempt))
        return await self.caller.result(call)


async def run_batch(settings: Any, input_path: Path, output: Path, *, concurrency: int = 16, retries: int = 10,
                    progress: bool = True, redis_wait_s: float = 300.0) -> Summary:
    from tqdm import tqdm

    from services.fleet_calls import FleetCaller
    from shared.settings import redacted_url

    done, done_lines = load_done(output)
    summary = Summary(total=sum(1 for raw in input_path.open(encoding="utf-8") if raw.strip()))
    bar = tqdm(total=summary.total, unit="req", desc="batch", disable=not progress, file=sys.stderr)
    caller = FleetCaller(settings)
    runner = _Runner(caller, output, retries, _RedisWait(redacted_url(settings.redis_url), redis_wait_s))
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * concurrency)
    out = output.open("a", encoding="utf-8")

    def write(line: dict[str, Any]) -> None:
        out.write(json.dumps(line, ensure_ascii=False) + "\n")
        out.flush()
        summary.ran += 1
        summary.failed += line["error"] is not None
        bar.update(1)

    async def work() -> None:
        while (obj := await queue.get()) is not None:
            write(await runner.line(obj))

    def refuse(line_no: int, custom_id: str | None, message: str, code: str) -> None:
        """A line that cannot become a request; `line` (its number in INPUT) lets a rerun skip it."""
        from services.call_errors import InvalidRequest

        error = InvalidRequest(message, 400, "custom_id" if message.startswith("custom_id") else None, code)
        line = error_line(custom_id, request_id_for(output, f"line {line_no}"), error)
        line["response"]["request_id"] = None  # it never reached the fleet
        write(line | {"line": line_no})

    async def feed() -> None:
        seen: set[str] = set()
        with input_path.open(encoding="utf-8") as f:
            for line_no, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                if line_no in done_lines:
                    summary.skipped += 1
                    bar.update(1)
                    continue
                try:
                    obj = parse_line(raw)
                except ValueError as e:
                    refuse(line_no, None, str(e), "invalid_line")
                    continue
                cid = obj["custom_id"]
                if cid in done:
                    summary.skipped += 1
                    bar.update(1)
                elif cid in seen:
                    refuse(line_no, cid, f"custom_id: {cid!r} appears more than once in the input",
                           "duplicate_custom_id")
                else:
                    seen.add(cid)
                    await queue.put(obj)
        for _ in range(concurrency):
            await queue.put(None)

    try:  # one failing task (Redis gone past the wait) cancels the rest; what is written stays, a rerun resumes
        async with asyncio.TaskGroup() as tg:
            tg.create_task(feed())
            for _ in range(concurrency):
                tg.create_task(work())
    except ExceptionGroup as group:
        raise group.exceptions[0] from None
    finally:
        out.close()
        bar.close()
        await caller.aclose()
    return summary
