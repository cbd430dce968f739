"""`kvfleet bench throughput --rounds N`: kvfleet and vLLM loaded side by side, their timed rounds alternating.

One run of each system, one after the other, measures each under whatever else the machine was doing at the
time: on a shared 2-core VM the same system moves 10-15% from one minute to the next, and the ratio with it.
Here both stay loaded (vLLM in its child process, waiting on its stdin; kvfleet's engine in this process) and
take turns on the same workload: round i runs kvfleet then vLLM, round i+1 vLLM then kvfleet (so a drift in
the machine's speed favours neither), each from an empty prefix cache. A round's ratio compares two runs a few
seconds apart; the summary gives every round's ratio and their median. While kvfleet runs, vLLM's processes are
stopped (SIGSTOP, then SIGCONT before its own round): idle, its engine still polls and took 0.2-1.0 CPU-seconds
of a 21 s kvfleet round. kvfleet's engine, in this process, only waits on vLLM's pipe meanwhile. Both idle
systems' CPU time is measured and shown.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
from pathlib import Path

from services.bench.engine import EngineBench
from services.bench.metrics import ModelShape, cpu_seconds, process_tree
from services.bench.peers import REPO_ROOT, PeerFailed, heartbeat, parse_result, vllm_command
from services.bench.workload import Workload


class VllmRounds:
    """vLLM's child (services.bench.peer_vllm --rounds N), loaded and warmed up, one round per `round()`."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in finish()
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True)
        self._stdout: list[str] = []
        try:
            self._expect("READY")
        except BaseException:
            self.kill()
            raise

    def _expect(self, word: str) -> str:
        """The next stdout line starting with `word` (other lines kept for the error message)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(word):
                return line[len(word):].strip()
            self._stdout.append(line)
        self.proc.wait()
        tail = self.log_path.read_text()[-3000:] if self.log_path.is_file() else ""
        raise PeerFailed(f"vLLM exited (code {self.proc.returncode}) before {word}\n{''.join(self._stdout)[-2000:]}"
                         f"\n{tail}")

    def round(self) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("ROUND "))

    def finish(self) -> dict:
        """Its RESULT, once every round has run; the child then exits."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        rest = self.proc.stdout.read()
        self.proc.wait()
        self._log.close()
        result = parse_result(rest)
        if self.proc.returncode != 0 or result is None:
            raise PeerFailed(f"vLLM failed at its end (exit code {self.proc.returncode})\n{rest[-2000:]}")
        return result

    @contextlib.contextmanager
    def stopped(self):
        """vLLM's processes stopped (SIGSTOP, each by its PID) for the block, continued after it."""
        pids = process_tree(self.proc.pid)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            for pid in reversed(process_tree(self.proc.pid)):  # by PID, never by name; its engine process too
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait()
        if not self._log.closed:
            self._log.close()


def _vllm_round(vllm: VllmRounds, label: str, progress: bool) -> dict:
    stop = threading.Event()
    beat = threading.Thread(target=heartbeat, args=(label, stop), daemon=True)
    if progress:
        beat.start()
    try:
        return vllm.round()
    finally:
        stop.set()
        if beat.is_alive():
            beat.join()


def run_interleaved(model_dir: Path, workload: Workload, shape: ModelShape, requests_json: Path,
                    args: argparse.Namespace, *, progress: bool, probe: bool = False) -> tuple[dict, dict, dict]:
    """(kvfleet's result, vLLM's result, the rounds): each result is its median round's (by output tokens/s),
    with every round in "rounds". probe: the matmul probe's layer cases timed right after each kvfleet round
    (vLLM still stopped), so that each round's FLOP/s is set against the best matmul a few seconds away: the
    probe's best moves 5-10% from one minute to the next on a shared VM, as the engine does. Its weights stay in
    this process's heap, so kvfleet's peak RSS is then its first round's."""
    cmd, env = vllm_command(requests_json, args)
    cmd += ["--rounds", str(args.rounds)]
    print(f"vLLM CPU from {args.vllm_venv}, loaded first and kept (starting takes 1-2 min: it compiles) ...",
          file=sys.stderr, flush=True)
    vllm = VllmRounds(cmd, env, Path(requests_json).parent / "vllm.log")
    ours = None
    try:
        ours = EngineBench(model_dir, workload, shape, args, progress=progress)
        if probe:
            from services.bench.matmul_probe import best_layer_now
        rounds, kv_rounds, vl_rounds = [], [], []
        for i in range(args.rounds):
            order = ("kvfleet", "vllm") if i % 2 == 0 else ("vllm", "kvfleet")
            row: dict = {"round": i + 1, "order": list(order)}
            for who in order:
                if who == "kvfleet":
                    idle0 = cpu_seconds(vllm.proc.pid, children=True)
                    with vllm.stopped():
                        kv = ours.round(label=f"kvfleet, round {i + 1}")
                        if probe:
                            now = best_layer_now(shape, args.dtype)
                            row["best_matmul_flops"] = now.best_flops
                            row["best_matmul_case"] = f"{now.best_path}@{now.best_tokens}"
                            row["fraction_of_best"] = kv["achieved_flops"] / now.best_flops
                    row["kvfleet"] = kv["output_tok_per_s"]
                    row["vllm_cpu_s_while_kvfleet_ran"] = round(cpu_seconds(vllm.proc.pid, children=True) - idle0, 2)
                    kv_rounds.append(kv)
                else:
                    idle0 = cpu_seconds()
                    vl = _vllm_round(vllm, f"vLLM, round {i + 1}", progress)
                    row["vllm"] = vl["output_tok_per_s"]
                    row["kvfleet_cpu_s_while_vllm_ran"] = round(cpu_seconds() - idle0, 2)
                    vl_rounds.append(vl)
            row["ratio"] = row["kvfleet"] / row["vllm"]
            rounds.append(row)
            print(f"round {i + 1} ({' then '.join(order)}): kvfleet {row['kvfleet']:.1f}, vLLM {row['vllm']:.1f} "
                  f"output tok/s, {row['ratio']:.2f}x", file=sys.stderr, flush=True)
        vllm_result = vllm.finish()
    finally:
        vllm.kill()
        if ours is not None:
            ours.close()
    kv_mid = sorted(kv_rounds, key=lambda r: r["output_tok_per_s"])[(len(kv_rounds) - 1) // 2]
    kvfleet_result = kv_mid | {"rounds": [{k: r[k] for k in ("wall_s", "output_tok_per_s", "steps", "peak_rss_bytes")}
                                          for r in kv_rounds],
                               "peak_rss_bytes": kv_rounds[0 if probe else -1]["peak_rss_bytes"]}
    ratios = [r["ratio"] for r in rounds]
    summary = {"rounds": rounds, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
               "ratio_max": max(ratios)}
    if fractions := [r["fraction_of_best"] for r in rounds if "fraction_of_best" in r]:
        summary |= {"fraction_of_best_median": statistics.median(fractions), "fraction_of_best_min": min(fractions),
                    "fraction_of_best_max": max(fractions)}
    return kvfleet_result, vllm_result, summary
