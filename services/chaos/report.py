"""The checks at the end of a soak, and the tables it prints: each check with its figure and PASS / FAIL,
then the faults injected by kind and the requests by mode (the door they came in by: HTTP whole, cancelled or
disconnected, the Python client whole or cancelled, Celery tasks, batch files, poison) and outcome."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from services.chaos.faults import FaultLog
from services.chaos.fleet import ChaosFleet
from services.chaos.load import SHAPE, UNSCORED, Record, Spec

EXPECTED_503 = ("redis_unavailable", "redis_lost_request")
ANSWERED = ("ok", "http_error", "stream_error", "connection_error", "cancelled", "disconnected")
STREAMING_MODES = ("whole", "cancel", "disconnect", "python_client")  # where a streaming spec streams
TWICE = ("after it finished", "answered twice")  # order_errors that mean a request was answered more than once
# the per-mode table's columns, and the outcomes each counts
COLUMNS = {"refused": ("refused",), "ok": ("ok",), "error": ("http_error", "stream_error", "connection_error",
                                                             "client_exception"),
           "left": ("cancelled", "disconnected"), "lost": ("lost",)}


@dataclass
class Report:
    checks: list[tuple[str, str, bool]] = field(default_factory=list)  # (what, figure, passed)
    faults: Counter = field(default_factory=Counter)
    outcomes: Counter = field(default_factory=Counter)  # (mode, outcome)
    differ: Counter = field(default_factory=Counter)  # mode -> answers that differ from the reference
    requests: int = 0
    lost: int = 0
    duplicated: int = 0
    problems: list[str] = field(default_factory=list)  # one line per failing request or process
    # seeded sampled answers that diverged after their request was resumed on another worker (allowed: see
    # faults.HANDOVER), one line each
    resumed_diverged: list[str] = field(default_factory=list)

    @staticmethod
    def memory_limit(baseline: int) -> int:
        return int(baseline * 1.25) + 2**20

    @property
    def passed(self) -> bool:
        return all(ok for _, _, ok in self.checks)

    def failed(self) -> list[str]:
        return [what for what, _, ok in self.checks if not ok]

    def table(self) -> str:
        width = max(len(w) for w, _, _ in self.checks)
        lines = [f"{'check':<{width}}  {'figure':<28} result", "-" * (width + 38)]
        lines += [f"{w:<{width}}  {fig:<28} {'PASS' if ok else 'FAIL'}" for w, fig, ok in self.checks]
        lines += ["", f"{'fault':<20} count", "-" * 26]
        lines += [f"{k:<20} {v}" for k, v in sorted(self.faults.items())]
        lines += [f"{'total':<20} {sum(self.faults.values())}", "", self.mode_table()]
        lines += ["", f"requests {self.requests}, lost {self.lost}, duplicated {self.duplicated}"]
        if self.resumed_diverged:
            lines += ["", "seeded answers that diverged after a resume on another worker (allowed: the resumed "
                          "tokens' keys and values are computed again in one prefill; first 10):",
                      *self.resumed_diverged[:10]]
        if self.problems:
            lines += ["", "problems (first 30):", *self.problems[:30]]
        return "\n".join(lines)


    def mode_table(self) -> str:
        """Requests by mode: sent, then by outcome (left: cancelled or disconnected by its client), and how many
        answers differ from the reference."""
        modes = sorted({m for m, _ in self.outcomes})
        head = f"{'mode':<15}{'sent':>6}" + "".join(f"{c:>8}" for c in COLUMNS) + f"{'differ':>8}"
        lines = [head, "-" * len(head)]
        for m in modes:
            counts = [sum(self.outcomes[m, o] for o in outs) for outs in COLUMNS.values()]
            sent = sum(n for (mode, _), n in self.outcomes.items() if mode == m)
            lines.append(f"{m:<15}{sent:>6}" + "".join(f"{n:>8}" for n in counts) + f"{self.differ[m]:>8}")
        return "\n".join(lines)


def _compare(got: list[str], want: list[str]) -> str:
    """'' when equal; else duplicated (more text than the reference, which it starts with), skipped (less),
    or mismatch."""
    if got == want:
        return ""
    if len(got) == len(want) and all(g.startswith(w) for g, w in zip(got, want, strict=True)):
        return "duplicated"
    if len(got) == len(want) and all(w.startswith(g) for g, w in zip(got, want, strict=True)):
        return "skipped"
    return "mismatch"


def _fits_shape(text: str) -> bool:
    """An answer held to load.SHAPE: a JSON object with exactly its keys and values."""
    try:
        got = json.loads(text)
    except ValueError:
        return False
    return (isinstance(got, dict) and set(got) == set(SHAPE["required"]) and isinstance(got["ok"], bool)
            and got["size"] in SHAPE["properties"]["size"]["enum"])


def check(specs: list[Spec], reference: list[list[str]], records: list[Record], log: FaultLog, fleet: ChaosFleet,
          baseline: int, memory: int, lingering: dict[str, int]) -> Report:
    rep = Report(faults=Counter(log.counts), requests=len(records))
    rep.outcomes = Counter((r.mode, r.outcome) for r in records)
    greedy_bad = seeded_bad = stream_bad = bad_5xx = poison_bad = 0
    accepted = [r for r in records if r.accepted and r.mode != "poison"]
    for r in records:
        if r.status >= 500 and not (r.status == 503 and r.code in EXPECTED_503 and log.in_redis_outage(r.t0, r.t1)):
            bad_5xx += 1
            rep.problems.append(f"unexpected {r.status} {r.code} on port {r.port} at {r.t0:.1f} ({r.mode})")
        if r.mode == "poison" and r.outcome != "refused" and not 400 <= r.status < 500:
            poison_bad += 1
            rep.problems.append(f"poison {r.code}: {r.outcome} {r.status}, not a 4xx")
    scored = unscored = shaped = misshapen = 0
    for r in accepted:
        spec, want = specs[r.spec], reference[r.spec]
        if spec.shaped and r.outcome == "ok":
            shaped += len(r.texts)
            bad = [t for t in r.texts if not _fits_shape(t)]
            misshapen += len(bad)
            if bad:
                rep.problems.append(f"misshapen: spec {r.spec} {r.mode} at {r.t0:.1f}: {bad!r}")
        if spec.score and r.outcome == "ok":
            scored += 1
            if any(UNSCORED in e for e in r.order_errors):
                unscored += 1
                rep.problems.append(f"unscored: spec {r.spec} {r.mode} at {r.t0:.1f}: {r.order_errors}")
        if r.outcome == "lost":
            rep.lost += 1
            rep.problems.append(f"lost: spec {r.spec} {r.mode} on port {r.port} at {r.t0:.1f}: {r.order_errors}")
        if any(t in e for e in r.order_errors for t in TWICE):
            rep.duplicated += 1
            rep.problems.append(f"answered twice: spec {r.spec} ({r.mode}) on port {r.port} at {r.t0:.1f}: "
                                f"{r.order_errors}")
        if any("seq skipped" in e for e in r.order_errors):
            stream_bad += 1
            rep.problems.append(f"skipped chunks: spec {r.spec} ({r.mode}) at {r.t0:.1f}: {r.order_errors}")
        if r.outcome in ("disconnected", "cancelled") and r.texts:  # what it got is the start of the answer
            verdict = "" if all(w.startswith(g) for g, w in zip(r.texts, want, strict=True)) else "mismatch"
        elif r.outcome == "ok":
            verdict = _compare(r.texts, want)
        else:
            continue
        if not verdict:
            continue
        handover = log.handover_during(r.t0, r.t1) if spec.seed is not None and verdict == "mismatch" else None
        if handover is not None:
            rep.differ[r.mode] += 1
            rep.resumed_diverged.append(f"spec {r.spec} {r.mode} (seed {spec.seed}) port {r.port}, over a "
                                        f"{handover}: {r.texts!r} != {want!r}")
            continue
        rep.duplicated += verdict == "duplicated"
        rep.differ[r.mode] += 1
        streamed = r.mode == "disconnect" or (spec.stream and r.mode in STREAMING_MODES)
        stream_bad += streamed and verdict in ("duplicated", "skipped")
        greedy_bad += spec.seed is None
        seeded_bad += spec.seed is not None
        rep.problems.append(f"{verdict}: spec {r.spec} {r.mode} ({'stream' if streamed else 'whole'}, "
                            f"{'greedy' if spec.seed is None else f'seed {spec.seed}'}) port {r.port}: "
                            f"{r.texts!r} != {want!r}")
    harness = [r for r in records if r.outcome == "client_exception"]
    rep.problems += [f"client exception ({r.mode}): {r.detail}" for r in harness]
    crashes = {c.name: c.crashes for c in fleet.children.values() if c.crashes}
    gone = fleet.gone()
    rep.problems += [f"{name} exited on its own: {codes}" for name, codes in crashes.items()]
    rep.problems += [f"{name} is not running at the end" for name in gone]
    # answered: ok, an error the client saw, or ended as its client asked (cancelled, or left mid-stream)
    answered = sum(r.outcome in ANSWERED for r in accepted)
    left = sum(r.outcome in COLUMNS["left"] for r in accepted)
    rep.checks = [
        ("accepted requests answered (ok, an error, or cancelled)", f"{answered}/{len(accepted)} "
         f"({left} cancelled or left)", rep.lost == 0 and answered == len(accepted)),
        ("no request duplicated", str(rep.duplicated), rep.duplicated == 0),
        ("greedy outputs equal the fault-free reference", f"{greedy_bad} differ", greedy_bad == 0),
        ("seeded sampled outputs equal the reference", f"{seeded_bad} differ" + (
            f" (+{len(rep.resumed_diverged)} resumed)" if rep.resumed_diverged else ""), seeded_bad == 0),
        ("streams: no token twice or skipped", f"{stream_bad} bad", stream_bad == 0),
        ("no 5xx but 503 while Redis was down", f"{bad_5xx} unexpected", bad_5xx == 0),
        ("poison requests refused with a 4xx", f"{poison_bad} not", poison_bad == 0),
        ("scoring answers carry the prompt's logprobs", f"{unscored} of {scored} without", unscored == 0),
        ("schema-held answers follow the schema", f"{misshapen} of {shaped} not", misshapen == 0),
        ("no client met an unexpected exception", str(len(harness)), not harness),
        ("no fleet process gone for good", ", ".join(gone) or "all running", not gone),
        ("no fleet process exited on its own", f"{sum(map(len, crashes.values()))} crashes", not crashes),
        ("no work left in the workers after the drain", ", ".join(f"{w}: {n}" for w, n in lingering.items())
         or "all idle", not lingering),
        ("Redis memory back near its baseline", f"{memory / 2**20:.1f} MiB (base {baseline / 2**20:.1f}), keys only",
         memory <= Report.memory_limit(baseline)),
    ]
    return rep
