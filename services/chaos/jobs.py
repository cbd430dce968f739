"""The load's doors that skip HTTP. Each request through them is a job (no lease: it runs to the end unless
cancelled), checked like the HTTP ones, one load.Record each:

  python_client   services.client: submit, then Handle.result(); a streaming spec iterates the handle instead,
                  and its chunks' sequence numbers must run 0, 1, 2, ... (none twice, none skipped)
  python_cancel   the same, Handle.cancel() after a fraction of a second: it must end (finish_reason "abort",
                  or done before the cancel came), and counts as answered
  celery          a task sent by name (kvfleet.generate / kvfleet.chat) to the fleet's Celery worker through a
                  Celery app of the load's own, as a backend that does not import kvfleet would; results read
                  from the Redis result backend, then forgotten
  batch           a small OpenAI batch file through `kvfleet batch` (a subprocess), run again while it exits
                  with an error (Redis away past the grace): a rerun resumes, as its contract says

A Redis restart may lose what was written in its last second (AOF everysec), a Celery result among it. A task
sent before Redis went down and with no result well after it came back is sent again under the same task id: its job record makes the second
delivery attach to the first one's generation, or return the stored result (the way a backend retries).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from services.chaos.faults import FaultLog
from services.chaos.load import CLIENT_TIMEOUT_S, Record, Spec, check_scored
from shared import streams
from shared.settings import Settings

CANCEL_AFTER_S = (0.05, 0.5)
CELERY_TIMEOUT_S = 240.0  # a task retries with backoff while the fleet is full or Redis away
CELERY_POLL_S = 0.25
BATCH_LINES = 4
BATCH_RUNS = 5  # runs of one batch file before its unanswered lines count as lost


def _answered(rec: Record, body: dict[str, Any], cancelled: bool, spec: Spec) -> None:
    """Texts and outcome from an OpenAI response body: "cancelled" when a choice was aborted by our cancel."""
    choices = sorted(body["choices"], key=lambda c: c["index"])
    rec.texts = [c["message"]["content"] if "message" in c else c["text"] for c in choices]
    if spec.score and not cancelled:
        check_scored(rec, [c.get("logprobs") for c in choices])
    aborted = any(c["finish_reason"] == "abort" for c in choices)
    rec.outcome = "cancelled" if aborted and cancelled else "ok"
    if aborted and not cancelled:
        rec.outcome = "lost"
        rec.order_errors.append("aborted though its client never cancelled it")


def send_python(client: Any, specs: list[Spec], idx: int, model: str, rng: random.Random, *,
                cancel: bool = False) -> Record:
    """One request through the Python client (straight into Redis: no gateway, no lease): its chunks read as
    they come when the spec streams, else its result; with `cancel`, Handle.cancel() after a fraction of a
    second, then its result (it must end)."""
    from services.call_errors import FleetUnavailable, GenerationFailed, InvalidRequest

    rec = Record(spec=idx, mode="python_cancel" if cancel else "python_client", port=0, t0=time.time())
    try:
        handle = client.submit(**specs[idx].params(model))
        if specs[idx].stream and not cancel:
            _stream(rec, handle, specs[idx].n)
        elif cancel:
            time.sleep(rng.uniform(*CANCEL_AFTER_S))
            try:
                handle.cancel()
            except streams.CONNECTION_ERRORS as e:  # Redis away: the request runs to its end instead
                rec.detail = f"cancel not delivered: {e!r}"
                cancel = False
        if not rec.outcome:
            _answered(rec, handle.result(timeout=CLIENT_TIMEOUT_S), cancel, specs[idx])
    except FleetUnavailable as e:
        rec.outcome, rec.status, rec.code, rec.detail = "refused", e.status_code, e.code or "", str(e)
    except (InvalidRequest, GenerationFailed) as e:
        rec.outcome, rec.status, rec.code, rec.detail = "http_error", e.status_code, e.code or "", str(e)
    except TimeoutError:
        rec.outcome = "lost"
        rec.order_errors.append(f"no result within {CLIENT_TIMEOUT_S:g}s")
    except streams.CONNECTION_ERRORS as e:  # Redis away past the grace, or it lost the request: said, not silent
        rec.outcome, rec.detail = "connection_error", repr(e)
    rec.t1 = time.time()
    return rec


def _stream(rec: Record, handle: Any, n: int) -> None:
    """The handle's chunks as they come (OutputChunks, numbered by `seq` across the choices)."""
    texts, want = [""] * n, 0
    for chunk in handle:
        if chunk.seq != want:
            rec.order_errors.append(f"chunk seq {chunk.seq} " + ("answered twice" if chunk.seq < want else
                                                                 f"after {want - 1}: seq skipped"))
        want = max(want, chunk.seq + 1)
        texts[chunk.index] += chunk.text
        if chunk.error is not None:
            rec.outcome, rec.code = "stream_error", str(chunk.error.kind)
    rec.texts, rec.outcome = texts, rec.outcome or "ok"


def resend_due(windows: list[tuple[float, float]], sent: float, now: float, resent: set[float]) -> list[float]:
    """The Redis outages (by their end) that call for sending a task again: Redis went down after the task
    was sent, the outage (with its aftermath) is over, and the task was not sent again for it yet."""
    return [end for down, end in windows if down > sent and now > end and end not in resent]


class CeleryDoor:
    """Sends tasks to the fleet's Celery worker and waits for their results, from any load thread (Celery
    keeps one result backend per thread)."""

    def __init__(self, redis_url: str):
        from celery import Celery
        from kombu.exceptions import OperationalError

        from services.celery_app import configure

        self.app = Celery("kvfleet-chaos-load")
        configure(self.app, Settings(redis_url=redis_url))
        self.errors = (OperationalError, *streams.CONNECTION_ERRORS)  # Redis away or the connection dropped

    def send(self, specs: list[Spec], idx: int, model: str, log: FaultLog) -> Record:
        spec = specs[idx]
        params = spec.params(model)
        name = "kvfleet.chat" if spec.chat else "kvfleet.generate"
        rec = Record(spec=idx, mode="celery", port=0, t0=time.time())
        task_id = f"chaos-{uuid.uuid4().hex}"
        try:
            res = self.app.send_task(name, kwargs=params, task_id=task_id)
        except self.errors as e:  # the broker took nothing: not accepted
            rec.outcome, rec.detail, rec.t1 = "refused", repr(e), time.time()
            return rec
        resent: set[float] = set()
        deadline = rec.t0 + CELERY_TIMEOUT_S
        while time.time() < deadline:
            try:
                if res.ready():
                    self._read(rec, res, spec)
                    break
            except self.errors:
                pass  # Redis away or our connection killed: ask again
            for end in resend_due(log.redis_windows, rec.t0, time.time(), resent):
                try:
                    self.app.send_task(name, kwargs=params, task_id=task_id)
                    resent.add(end)
                    rec.detail = f"sent again {len(resent)}x after a Redis restart"
                except self.errors:
                    pass  # next poll
            time.sleep(CELERY_POLL_S)
        else:
            rec.outcome = "lost"
            rec.order_errors.append(f"task {task_id}: no result within {CELERY_TIMEOUT_S:g}s")
        rec.t1 = time.time()
        return rec

    def _read(self, rec: Record, res: Any, spec: Spec) -> None:
        if res.successful():
            _answered(rec, res.result, cancelled=False, spec=spec)
        else:  # the task raised: InvalidRequest / GenerationFailed carry the HTTP status and code
            exc = res.result
            rec.outcome, rec.detail = "http_error", repr(exc)
            rec.status, rec.code = int(getattr(exc, "status_code", 0) or 0), str(getattr(exc, "code", "") or "")
        try:
            res.forget()  # its result key: Redis memory goes back to the baseline
        except self.errors:
            pass


def run_batch(env: dict[str, str], work_dir: Path, k: int, specs: list[Spec], idxs: list[int],
              model: str) -> list[Record]:
    """Batch file number `k` with the catalogue's requests `idxs` through `kvfleet batch`; one Record a line."""
    inp, out, log = (work_dir / f"batch-{k}.{ext}" for ext in ("in.jsonl", "out.jsonl", "log"))
    cids = [f"b{k}-{i}" for i in range(len(idxs))]
    with open(inp, "w") as f:
        for cid, idx in zip(cids, idxs, strict=True):
            url = "/v1/chat/completions" if specs[idx].chat else "/v1/completions"
            f.write(json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": specs[idx].params(model)}) + "\n")
    t0, runs = time.time(), 0
    while runs < BATCH_RUNS:
        runs += 1
        with open(log, "ab") as f:
            proc = subprocess.Popen([sys.executable, "-m", "services.cli", "batch", str(inp), str(out), "--no-progress",
                                     "--concurrency", str(len(idxs))], env=env, stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        try:
            if proc.wait(CELERY_TIMEOUT_S) == 0:
                break
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    answers: dict[str, list[dict[str, Any]]] = {}
    if out.exists():
        for raw in out.read_text().splitlines():
            line = json.loads(raw)
            answers.setdefault(line["custom_id"], []).append(line)
    records = []
    for cid, idx in zip(cids, idxs, strict=True):
        rec = Record(spec=idx, mode="batch", port=0, t0=t0, t1=time.time(), detail=f"{runs} run(s) of {inp.name}")
        got = answers.get(cid, [])
        if not got:
            rec.outcome = "lost"
            rec.order_errors.append(f"{cid}: no line in {out} after {runs} run(s) of kvfleet batch")
        elif got[0]["error"] is None:
            _answered(rec, got[0]["response"]["body"], cancelled=False, spec=specs[idx])
        else:
            rec.outcome, rec.status = "http_error", got[0]["response"]["status_code"]
            rec.code, rec.detail = got[0]["error"]["code"], got[0]["error"]["message"]
        if len(got) > 1:
            rec.order_errors.append(f"{cid} answered twice in {out}")
        records.append(rec)
    return records
