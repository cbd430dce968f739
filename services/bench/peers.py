"""The baselines of `kvfleet bench throughput`, each run as a child process (its own memory, its own
threads): Hugging Face generate with this Python (services.bench.peer_hf), vLLM CPU with its venv's Python
(services.bench.peer_vllm). Each child prints `RESULT {json}` on stdout; everything else it says passes by."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from shared.settings import child_env

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VLLM_VENV = Path("/tmp/kvfleet-peers/vllm-venv")  # where ../shared/peers/install_vllm_cpu.sh puts it


class PeerFailed(RuntimeError):
    pass


def parse_result(stdout: str) -> dict | None:
    """The last `RESULT {json}` line of a child's stdout."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return None


def heartbeat(label: str, stop: threading.Event) -> None:
    start = time.monotonic()
    while not stop.wait(1.0):
        print(f"\r  {label}: {time.monotonic() - start:.0f} s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr, flush=True)


def _run_child(cmd: list[str], label: str, *, env: dict[str, str] | None = None, log_path: Path | None = None,
               progress: bool) -> dict:
    """Run a peer. Its stderr (progress bar) reaches the terminal, or log_path when given; then a line
    counting seconds shows that it is alive."""
    log = open(log_path, "w") if log_path is not None else None  # noqa: SIM115 - closed below
    stop = threading.Event()
    beat = threading.Thread(target=heartbeat, args=(label, stop), daemon=True)
    if progress and log is not None:
        beat.start()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                              check=False)
    finally:
        stop.set()
        if beat.is_alive():
            beat.join()
        if log is not None:
            log.close()
    result = parse_result(proc.stdout)
    if proc.returncode != 0 or result is None:
        raise PeerFailed(f"{label} failed (exit code {proc.returncode})\n{proc.stdout[-2000:]}")
    return result


def run_hf(requests_json: Path, args: argparse.Namespace, *, progress: bool) -> dict:
    print(f"HF generate, static batches of {args.hf_batch_size} ...", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "services.bench.peer_hf", str(requests_json), "--dtype", args.dtype,
           "--batch-size", str(args.hf_batch_size), "--threads", str(args.threads)]
    if progress:
        cmd.append("--progress")
    # as transformers runs out of the box: torch's huge-page allocation off (kvfleet's engine turns it on, and
    # a parent that imported gpu_worker passes that on in its environment)
    env = child_env(THP_MEM_ALLOC_ENABLE="0")
    return _run_child(cmd, "HF generate", env=env, progress=progress)


def vllm_available(args: argparse.Namespace) -> bool:
    """Whether vLLM's venv is there; a note on stderr when it is not."""
    venv = Path(args.vllm_venv)
    if (venv / "bin" / "python").is_file():
        return True
    print(f"vLLM baseline skipped: no venv at {venv} (install it with ../shared/peers/install_vllm_cpu.sh "
          f"{venv}, or pass --vllm-venv)", file=sys.stderr, flush=True)
    return False


def vllm_command(requests_json: Path, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of vLLM's child (services.bench.peer_vllm) in its best configuration."""
    from services.bench.peer_vllm import vllm_env

    venv = Path(args.vllm_venv)
    cmd = [str(venv / "bin" / "python"), "-m", "services.bench.peer_vllm", str(requests_json), "--dtype", args.dtype]
    if not args.no_prefix_caching:
        cmd.append("--prefix-caching")
    env = vllm_env(venv, args.threads)
    env["PYTHONPATH"] = str(REPO_ROOT)
    return cmd, env


def run_vllm(requests_json: Path, args: argparse.Namespace, *, progress: bool) -> dict | None:
    """None (with a note) when no vLLM venv is there."""
    if not vllm_available(args):
        return None
    log_path = Path(requests_json).parent / "vllm.log"
    print(f"vLLM CPU from {args.vllm_venv} (starting takes 1-2 min: it compiles) ...", file=sys.stderr, flush=True)
    cmd, env = vllm_command(requests_json, args)
    try:
        return _run_child(cmd, "vLLM", env=env, log_path=log_path, progress=progress)
    except PeerFailed:
        tail = log_path.read_text()[-3000:] if log_path.is_file() else ""
        print(tail, file=sys.stderr)
        raise
