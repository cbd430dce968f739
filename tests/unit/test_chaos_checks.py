"""The chaos soak's own pieces that need no fleet: how an answer compares with the reference, the Redis
outage windows that excuse a 503, the --duration flag, each fault kind covered first, how each door's answer
is read (an abort counts as cancelled only when its client cancelled), and the checks and the per-mode table
over a handful of records."""

from __future__ import annotations

import argparse
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from services.chaos.command import duration
from services.chaos.faults import KINDS, TAKE_NOTHING_AWAY, FaultLog
from services.chaos.jobs import _answered
from services.chaos.load import MAX_TOKENS, MODES, Record, Spec, catalogue, check_scored
from services.chaos.report import _compare, check

pytestmark = pytest.mark.unit


def test_compare_tells_duplicated_skipped_and_mismatch():
    assert _compare(["abc", "de"], ["abc", "de"]) == ""
    assert _compare(["abcabc", "de"], ["abc", "de"]) == "duplicated"
    assert _compare(["ab", "de"], ["abc", "de"]) == "skipped"
    assert _compare(["abd", "de"], ["abc", "de"]) == "mismatch"
    assert _compare(["abc"], ["abc", "de"]) == "mismatch"


def test_a_503_is_excused_only_when_its_request_overlaps_an_outage():
    log = FaultLog(redis_windows=[(100.0, 125.0)])
    assert log.in_redis_outage(90.0, 101.0) and log.in_redis_outage(124.0, 130.0)
    assert not log.in_redis_outage(90.0, 99.0) and not log.in_redis_outage(126.0, 130.0)


def test_duration_flag():
    assert duration("90") == 90 and duration("90s") == 90 and duration("10m") == 600 and duration("1h") == 3600
    with pytest.raises(argparse.ArgumentTypeError, match="--duration"):
        duration("ten minutes")


def test_kinds_are_the_injectors_methods():
    from services.chaos.faults import Injector

    assert all(callable(getattr(Injector, k, None)) for k in KINDS)
    assert set(TAKE_NOTHING_AWAY) < set(KINDS)


def test_a_fault_is_logged_at_the_moment_it_began(monkeypatch):
    """A SIGSTOP lasts past the status TTL; its event's time is the SIGSTOP's, not the SIGCONT's, so a request in
    flight at the stop and finished elsewhere before the SIGCONT counts as handed over (seed 131 failed a run on
    such a request while the time logged was the SIGCONT's)."""
    import signal

    from services.chaos import faults

    monkeypatch.setattr(faults, "STATUS_TTL_S", 0.0)
    seen: list[tuple[float, int]] = []
    fleet = SimpleNamespace(workers=[SimpleNamespace(name="w1")], ready=lambda: True,
                                  signal=lambda child, sig: seen.append((time.time(), sig)))
    injector = faults.Injector(fleet, seed=0, kinds=("worker_sigstop",), interval_s=(0.0, 0.0))
    injector.start()
    deadline = time.time() + 10
    while not injector.log.events and time.time() < deadline:
        time.sleep(0.05)
    injector.stop()
    [(began, kind, target), *_] = injector.log.events
    stop_at, cont_at = seen[0][0], next(t for t, sig in seen if sig == signal.SIGCONT)
    assert (kind, target, seen[0][1]) == ("worker_sigstop", "w1", signal.SIGSTOP)
    assert began <= stop_at < cont_at - 0.9
    assert injector.log.handover_during(stop_at - 0.1, cont_at - 0.1) == "worker_sigstop"  # in flight at the stop


def test_a_hang_always_ends_and_a_redis_hang_is_an_outage_window(monkeypatch):
    """gateway_sigstop and redis_sigstop continue what they stopped, even when the soak stops during the hang;
    a Redis hang is logged as an outage window (503s inside it are expected, and a request over it may be
    resumed elsewhere), a gateway hang as a handover."""
    import signal

    from services.chaos import faults

    monkeypatch.setattr(faults, "LEASE_TTL_S", 30.0)  # longer than the test: only stop() ends the hangs
    monkeypatch.setattr(faults, "STATUS_TTL_S", 30.0)
    seen: list[tuple[str, int]] = []
    fleet = SimpleNamespace(gateways=[SimpleNamespace(name="gateway-1")], redis=SimpleNamespace(port=7),
                            signal=lambda child, sig: seen.append((child.name, sig)),
                            pause_redis=lambda: seen.append(("redis", signal.SIGSTOP)),
                            resume_redis=lambda: seen.append(("redis", signal.SIGCONT)))
    for kind, target in (("gateway_sigstop", "gateway-1"), ("redis_sigstop", "redis")):
        injector = faults.Injector(fleet, seed=0, kinds=(kind,))
        hang = threading.Thread(target=getattr(injector, kind))
        began = time.time()
        hang.start()
        time.sleep(0.3)
        assert hang.is_alive() and seen[-1] == (target, signal.SIGSTOP)
        injector._stop.set()  # the soak ends mid-hang
        hang.join(5)
        assert not hang.is_alive() and seen[-1] == (target, signal.SIGCONT)
        injector.log.events.append((began, kind, target))
        assert injector.log.handover_during(began - 1, began + 1) == kind
        assert injector.log.in_redis_outage(began, began + 1) == (kind == "redis_sigstop")


def test_the_load_uses_every_door():
    assert {"whole", "cancel", "disconnect", "python_client", "python_cancel", "celery"} == set(MODES)


def test_spec_params_are_the_body_without_the_openai_clients_extra_body():
    spec = Spec(chat=True, stream=True, prompt="Hi", n=2, seed=7)
    params = spec.params("m")
    assert params["messages"] == [{"role": "user", "content": "Hi"}] and params["ignore_eos"] is True
    assert "extra_body" not in params and "stream" not in params and params["seed"] == 7


PLAIN = Spec(chat=False, stream=False, prompt="p")


def _body(*finishes: str, chat: bool = False) -> dict:
    choices = [{"index": i, "finish_reason": f} | ({"message": {"content": f"t{i}"}} if chat else {"text": f"t{i}"})
               for i, f in reversed(list(enumerate(finishes)))]
    return {"choices": choices}


def test_an_abort_is_a_cancel_only_when_the_client_cancelled():
    rec = Record(spec=0, mode="python_cancel", port=0, t0=0.0)
    _answered(rec, _body("abort", "length"), cancelled=True, spec=PLAIN)
    assert rec.outcome == "cancelled" and rec.texts == ["t0", "t1"]
    rec = Record(spec=0, mode="celery", port=0, t0=0.0)
    _answered(rec, _body("length", chat=True), cancelled=False, spec=PLAIN)
    assert rec.outcome == "ok" and rec.texts == ["t0"]
    rec = Record(spec=0, mode="python_client", port=0, t0=0.0)
    _answered(rec, _body("abort"), cancelled=False, spec=PLAIN)
    assert rec.outcome == "lost" and "never cancelled" in rec.order_errors[0]


def test_a_scoring_answer_needs_the_prompts_logprobs_before_the_completions():
    spec = Spec(chat=False, stream=False, prompt="p", score=True)
    body = spec.body("m")
    assert body["echo"] is True and body["logprobs"] == 1
    whole = [None, -1.5, -0.25] + [-0.5] * MAX_TOKENS  # the prompt's (first null), then the completion's
    for logprobs, ok in [(whole, True), ([-0.5] * MAX_TOKENS, False), ([None] * (MAX_TOKENS + 3), False),
                         (None, False)]:
        rec = Record(spec=0, mode="celery", port=0, t0=0.0)
        body = _body("length")
        body["choices"][0]["logprobs"] = None if logprobs is None else {"token_logprobs": logprobs}
        _answered(rec, body, cancelled=False, spec=spec)
        assert (rec.order_errors == []) is ok, (logprobs, rec.order_errors)
    assert any(s.score and not s.stream and not s.chat and s.seed is None for s in catalogue(0))


def _fleet(gone: tuple[str, ...] = ()) -> SimpleNamespace:
    children = {"w0": SimpleNamespace(name="w0", crashes=[]), "celery": SimpleNamespace(name="celery", crashes=[])}
    return SimpleNamespace(children=children, gone=lambda: list(gone))


def _rec(mode: str, outcome: str, texts: list[str], **kw) -> Record:
    return Record(spec=0, mode=mode, port=0, t0=1.0, t1=2.0, outcome=outcome, texts=texts, **kw)


def test_checks_count_each_door_like_the_http_ones():
    specs, ref = [Spec(chat=False, stream=True, prompt="p")], [["hello world"]]
    records = [_rec("whole", "ok", ["hello world"]), _rec("celery", "ok", ["hello world"]),
               _rec("python_cancel", "cancelled", ["hello"]), _rec("cancel", "cancelled", []),
               _rec("batch", "ok", ["hello world"]), _rec("celery", "refused", [])]
    rep = check(specs, ref, records, FaultLog(counts=Counter(poison=1)), _fleet(), 2**20, 2**20, {})
    assert rep.passed, rep.table()
    assert "5/5 (2 cancelled or left)" in rep.table()
    table = rep.mode_table().splitlines()
    assert table[0].split() == ["mode", "sent", "refused", "ok", "error", "left", "lost", "differ"]
    assert table[2].split() == ["batch", "1", "0", "1", "0", "0", "0", "0"]
    assert table[3].split() == ["cancel", "1", "0", "0", "0", "1", "0", "0"]
    assert table[4].split() == ["celery", "2", "1", "1", "0", "0", "0", "0"]


def test_checks_fail_on_a_wrong_celery_answer_a_batch_line_twice_and_work_left_behind():
    specs, ref = [Spec(chat=False, stream=False, prompt="p")], [["hello world"]]
    records = [_rec("celery", "ok", ["hello there"]), _rec("batch", "ok", ["hello world"], order_errors=["b0-0 answered twice in x"]),
               _rec("python_cancel", "cancelled", ["help"]), _rec("python_client", "lost", [])]
    rep = check(specs, ref, records, FaultLog(), _fleet(), 2**20, 2**20, {"w1": 2})
    failed = rep.failed()
    assert "greedy outputs equal the fault-free reference" in failed and rep.differ == Counter(celery=1, python_cancel=1)
    assert "no request duplicated" in failed and rep.duplicated == 1
    assert "no work left in the workers after the drain" in failed and "w1: 2" in rep.table()
    assert rep.lost == 1 and "accepted requests answered (ok, an error, or cancelled)" in failed


def _chunk(seq: int, text: str, index: int = 0) -> SimpleNamespace:
    return SimpleNamespace(seq=seq, index=index, text=text, error=None)


def test_python_client_stream_checks_the_sequence_numbers():
    from services.chaos.jobs import _stream

    rec = Record(spec=0, mode="python_client", port=0, t0=0.0)
    _stream(rec, [_chunk(0, "a"), _chunk(1, "b", 1), _chunk(2, "c")], 2)
    assert rec.outcome == "ok" and rec.texts == ["ac", "b"] and not rec.order_errors
    rec = Record(spec=0, mode="python_client", port=0, t0=0.0)
    _stream(rec, [_chunk(0, "a"), _chunk(2, "c"), _chunk(2, "c")], 1)
    assert rec.order_errors == ["chunk seq 2 after 0: seq skipped", "chunk seq 2 answered twice"]
    specs, ref = [Spec(chat=False, stream=True, prompt="p")], [["acc"]]
    rep = check(specs, ref, [rec], FaultLog(), _fleet(), 2**20, 2**20, {})
    assert {"no request duplicated", "streams: no token twice or skipped"} <= set(rep.failed())


def test_a_celery_task_is_sent_again_only_after_an_outage_that_began_after_it_was_sent():
    from services.chaos.jobs import resend_due

    windows = [(100.0, 125.0), (200.0, 230.0)]
    assert resend_due(windows, sent=90.0, now=120.0, resent=set()) == []  # the outage's aftermath is not over
    assert resend_due(windows, sent=90.0, now=126.0, resent=set()) == [125.0]
    assert resend_due(windows, sent=90.0, now=126.0, resent={125.0}) == []  # once per outage
    assert resend_due(windows, sent=110.0, now=240.0, resent=set()) == [230.0]  # sent during or after the first


def test_checks_fail_on_a_scoring_answer_without_the_prompts_logprobs():
    specs, ref = [Spec(chat=False, stream=False, prompt="p", score=True)], [["p and more"]]
    good = _rec("whole", "ok", ["p and more"])
    bad = _rec("celery", "ok", ["p and more"])
    check_scored(bad, [{"token_logprobs": [-0.5] * 3}])
    rep = check(specs, ref, [good, bad], FaultLog(), _fleet(), 2**20, 2**20, {})
    assert rep.failed() == ["scoring answers carry the prompt's logprobs"] and "1 of 2 without" in rep.table()


def test_checks_fail_on_an_answer_that_does_not_follow_the_schema():
    spec = Spec(chat=True, stream=False, prompt="p", shaped=True)
    assert spec.body("m")["response_format"]["json_schema"]["schema"]["required"] == ["ok", "size"]
    good = '{"ok": true, "size": "m"}'
    specs, ref = [spec], [[good]]
    rep = check(specs, ref, [_rec("whole", "ok", [good]), _rec("celery", "ok", [good])], FaultLog(), _fleet(),
                2**20, 2**20, {})
    assert rep.passed, rep.table()
    rep = check(specs, [['{"ok": 1}']], [_rec("python_client", "ok", ['{"ok": 1}'])], FaultLog(), _fleet(),
                2**20, 2**20, {})
    assert "schema-held answers follow the schema" in rep.failed() and "1 of 1 not" in rep.table()
    assert any(s.shaped for s in catalogue(0)) and any(s.shaped and s.seed is None for s in catalogue(0))


def test_a_seeded_answer_may_diverge_only_over_a_handover_and_a_greedy_one_never():
    """A seeded sampled answer whose request was in flight over a worker fault (or a Redis restart) may have been
    resumed elsewhere, its sent tokens' keys and values computed again in one prefill: it may diverge, and is
    listed, not failed. Without such a fault, or greedy, or a duplicate, it fails as before."""
    seeded = [Spec(chat=False, stream=False, prompt="p", seed=5)]
    ref = [["hello world"]]
    over_sigterm = FaultLog(events=[(1.5, "worker_sigterm", "w0")])
    rep = check(seeded, ref, [_rec("whole", "ok", ["hello there"])], over_sigterm, _fleet(), 2**20, 2**20, {})
    assert rep.passed, rep.table()
    assert len(rep.resumed_diverged) == 1 and "over a worker_sigterm" in rep.resumed_diverged[0]
    assert "1 differ" not in rep.table() and "(+1 resumed)" in rep.table()
    # sent while Redis was restarting (it went down just before): the takeover can come after its start
    during_restart = FaultLog(events=[(0.8, "redis_restart", "port 1")], redis_windows=[(0.8, 25.0)])
    rep = check(seeded, ref, [_rec("whole", "ok", ["hello there"])], during_restart, _fleet(), 2**20, 2**20, {})
    assert rep.passed and "over a redis_restart" in rep.resumed_diverged[0], rep.table()
    # the fault outside the request's time, or one that resumes nothing (a gateway), or greedy: a failure
    for log, specs in [(FaultLog(events=[(3.0, "worker_sigkill", "w1")]), seeded),
                       (FaultLog(events=[(0.2, "redis_restart", "port 1")], redis_windows=[(0.2, 0.9)]), seeded),
                       (during_restart, [Spec(chat=False, stream=False, prompt="p")]),
                       (FaultLog(events=[(1.5, "gateway_sigkill", "g0")]), seeded),
                       (over_sigterm, [Spec(chat=False, stream=False, prompt="p")])]:
        rep = check(specs, ref, [_rec("whole", "ok", ["hello there"])], log, _fleet(), 2**20, 2**20, {})
        assert not rep.passed and not rep.resumed_diverged
    # a seeded answer with text twice is a duplicate whatever the faults
    rep = check(seeded, ref, [_rec("whole", "ok", ["hello worldhello world"])], over_sigterm, _fleet(), 2**20, 2**20, {})
    assert not rep.passed and rep.duplicated == 1


def test_the_soak_fleet_runs_its_last_worker_with_async_output(tmp_path):
    from services.chaos.fleet import ChaosFleet

    workers = [c.args for c in ChaosFleet("smollm2", tmp_path).children.values() if c.role == "worker"]
    assert [("--async-output" in args) for args in workers] == [False, False, True]
