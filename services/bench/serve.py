"""`kvfleet bench serve`: the serving benchmark. It drives an OpenAI-compatible endpoint (the kvfleet gateway,
or vLLM's OpenAI server) with streamed /v1/completions requests and reports what a user gets under load: TTFT,
TPOT, inter-token latency and end-to-end latency (mean, p50, p90, p99), output and total tokens/s, request
throughput, goodput under an SLO, failures with their errors, and for a kvfleet gateway the requests each
worker served and the peak queue lag (from /v1/fleet).

Endpoint: --url (one endpoint; repeated, replicas of one service such as `kvfleet up --gateways N`'s gateways,
which the requests go to round-robin), or none: a fleet is started for the run (`kvfleet up`: a private Redis, the
gateway, --workers workers with --routing) and stopped afterwards. --peer vllm then runs the identical load
against vLLM's OpenAI server (started from the peer venv with ../shared/peers/vllm_env.sh's settings, on the
same model as a float32 safetensors directory) and prints both side by side with ratios.

Requests: a workload of ../shared/workloads (*.jsonl) or ../shared/peers/peer64.json, each request's prompt
as token ids and exactly its output length (max_tokens = min_tokens, ignore_eos); greedy, or sampled with
--temperature (and --top-p, --top-k), the same for every system.
Load: Poisson arrivals at --request-rate (seeded), at most --concurrency in flight; neither: all at once.
--sweep runs one load point per rate (a list, or doubling from --request-rate until saturation: output
tokens/s grows less than 10% or TTFT p50 is 10x the first point's).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from gateway.router import POLICIES
from services.bench.cpu import cpu_info
from services.bench.load_gen import Endpoint, RequestResult, run_load, send_one, shifted
from services.bench.peers import DEFAULT_VLLM_VENV
from services.bench.sampling import sampling_args
from services.bench.serve_endpoints import Server, ServerFailed, start_kvfleet, start_vllm, stop, wait_ready
from services.bench.serve_fleet import SETTLE_S, FleetWatch
from services.bench.serve_redis import RedisWatch
from services.bench.serve_report import format_table, ratios, summarize_run, write_plots
from services.bench.stats import SLO, saturated
from services.bench.workload import BenchRequest, Workload

DEFAULT_SLO = "ttft=0.5,tpot=0.05"
MAX_SWEEP_POINTS = 12
PROMPT_SHIFT = 7919  # token ids move by this (mod the vocabulary) from one sweep point to the next


def add_arguments(sub: Any) -> None:
    p = sub.add_parser("serve", help="latency and throughput through an OpenAI-compatible endpoint, under load",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--url", action="append", help="root of the endpoint (http://HOST:PORT, without /v1); repeat it for "
      "replicas of one service (gateway replicas: requests go round-robin over them); default: start a kvfleet "
      "fleet")
    a("--api-key", help="bearer key the endpoint requires")
    a("--model", default="smollm2", help="the model: alias, Hugging Face directory or .gguf file (the started "
      "fleet and vLLM serve it; its vocabulary bounds the prompt ids of .jsonl workloads; default %(default)s)")
    a("--served-model-name", help="the name sent as `model` (default: the first of the endpoint's /v1/models)")
    a("--workload", default="peer64", help="a peer .json or workload .jsonl path, or a name in ../shared/{peers,workloads} (default %(default)s)")
    a("--num-requests", type=int, help="the first N requests of the workload (default: all)")
    a("--output-len", type=int, help="every request generates exactly this many tokens instead of the "
      "workload's (e.g. 1: request throughput, the gateway's and the queue's cost per request)")
    a("--request-rate", type=float, default=math.inf, help="Poisson arrivals, requests/s (default inf: all at once)")
    a("--concurrency", type=int, help="at most C requests in flight (with no --request-rate: a closed loop)")
    a("--sweep", nargs="?", const="double", metavar="RATES",
      help="one load point per rate: a comma list (1,2,4), or bare --sweep: doubling from --request-rate (1 when "
      "unset) until saturation, at most 12 points")
    a("--temperature", type=float, default=0.0, help="every request's temperature (default 0: greedy)")
    a("--top-p", type=float, default=1.0, help="every request's top_p (default 1: off)")
    a("--top-k", type=int, default=0, help="every request's top_k (default 0: off)")
    a("--seed", type=int, default=0, help="seed of the arrival times and of .jsonl workloads' prompt ids (default %(default)s)")
    a("--slo", default=DEFAULT_SLO, help="goodput counts requests meeting all of these (seconds; keys ttft, tpot, e2e; default %(default)s)")
    a("--timeout", type=float, default=600.0, help="seconds a request may wait for the server's next bytes before it fails (default "
      "%(default)s)")
    a("--json", type=Path, metavar="PATH", help="write the report as JSON here (plots go next to it)")
    a("--plot", type=Path, metavar="PATH", help="write the plots (HTML with inline SVG) here (default: next to --json)")
    a("--no-progress", action="store_true", help="no progress bar")
    a("--workers", type=int, default=1, help="workers of the fleet started when no --url is given (else ignored; default %(default)s)")
    a("--routing", choices=POLICIES, help="routing policy of that fleet (default: the gateway's, free_blocks)")
    a("--fleet-arg", action="append", default=[], metavar="ARG",
      help="an extra `kvfleet up` argument for that fleet (repeatable), e.g. --fleet-arg=--max-num-seqs=64")
    a("--redis-stats", metavar="REDIS_URL", help="also report what this Redis did per generated token (commands, "
      "bytes, CPU; from INFO before and after each run): give the fleet's Redis, with --url")
    a("--peer", choices=["vllm"], help="also run the identical load against vLLM's OpenAI server, started here")
    a("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV, help="venv of vLLM's CPU build (../shared/peers; default %(default)s)")
    a("--threads", type=int, help="vLLM's cores (VLLM_CPU_OMP_THREADS_BIND; default: all)")
    a("--startup-timeout", type=float, default=600.0, help="seconds to wait for a started server (default %(default)s)")


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _rates(args: argparse.Namespace) -> list[float] | None:
    """The sweep's given rates; None for a single load point or a doubling sweep."""
    if args.sweep in (None, "double"):
        return None
    try:
        rates = [float(x) for x in args.sweep.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--sweep: {args.sweep!r} is not a comma list of rates (e.g. --sweep 1,2,4)") from None
    if not rates or any(not r > 0 for r in rates):
        raise SystemExit(f"--sweep: rates must be > 0 requests/s, got {args.sweep!r}")
    return rates


def _check(args: argparse.Namespace) -> SLO:
    if args.concurrency is not None and args.concurrency < 1:
        raise SystemExit(f"--concurrency must be >= 1, got {args.concurrency}")
    if not args.request_rate > 0:
        raise SystemExit(f"--request-rate must be > 0 requests/s, got {args.request_rate}")
    if args.sweep == "double" and math.isinf(args.request_rate):
        args.request_rate = 1.0
    if args.workers < 1:
        raise SystemExit(f"--workers must be >= 1, got {args.workers}")
    try:
        return SLO.parse(args.slo)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def _served_name(ep_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        return httpx.get(ep_url + "/v1/models", headers=headers, timeout=10).raise_for_status().json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise SystemExit(f"cannot read the model name from {ep_url}/v1/models ({e}); pass --served-model-name") from None


async def _measure(ep: Endpoint, requests: list[BenchRequest], rate: float, args: argparse.Namespace,
                   slo: SLO, desc: str) -> dict[str, Any]:
    from tqdm import tqdm

    bar = tqdm(total=len(requests), desc=desc, unit="req", file=sys.stderr, disable=args.no_progress)
    failed = 0

    def done(res: RequestResult) -> None:
        nonlocal failed
        failed += not res.ok
        bar.update(1)
        if failed:
            bar.set_postfix(failed=failed)

    redis = RedisWatch(args.redis_stats) if args.redis_stats else contextlib.nullcontext()
    try:  # with --redis-stats, /v1/fleet is read only outside the window Redis is measured in
        async with FleetWatch(ep, poll=not args.redis_stats) as watch:
            with redis:
                run = await run_load(ep, requests, rate=rate, concurrency=args.concurrency, seed=args.seed,
                                     timeout_s=args.timeout, on_done=done)
    finally:
        bar.close()
    summary = summarize_run(run, rate=rate, concurrency=args.concurrency, slo=slo, fleet=watch.report())
    if isinstance(redis, RedisWatch):
        summary["redis"] = redis.report(summary["output_tokens"])
    return summary


async def _warm_up(ep: Endpoint, req: BenchRequest, timeout_s: float) -> None:
    """One short request (not measured; its prompt reversed so that prefix caching keeps nothing of it for the
    run): it fails the benchmark early, with the endpoint's answer, when requests cannot be served."""
    probe = BenchRequest(id=-1, prompt_token_ids=req.prompt_token_ids[::-1], output_len=min(4, req.output_len))
    async with httpx.AsyncClient(base_url=ep.url, timeout=timeout_s) as client:
        res = await send_one(client, ep, probe, 0.0)
    if not res.ok:
        raise ServerFailed(f"the warm-up request to {ep.url}/v1/completions failed: {res.error}")


def drive(ep: Endpoint, workload: Workload, args: argparse.Namespace, slo: SLO, label: str,
          rates: list[float], vocab: int) -> list[dict[str, Any]]:
    """One run per rate of `rates`; with a doubling sweep (and no rates given) it goes on until saturation.
    Point i of a sweep sends the workload's prompts with every token id moved by i * PROMPT_SHIFT: the same
    lengths and shared prefixes, but nothing a prefix cache kept from the points before."""
    asyncio.run(_warm_up(ep, workload.requests[0], args.timeout))
    time.sleep(SETTLE_S)  # a fleet's status shows the warm-up before the run's counts start
    runs: list[dict[str, Any]] = []
    doubling = args.sweep == "double" and not rates
    todo = list(rates) or [args.request_rate]
    while todo:
        rate = todo.pop(0)
        desc = label if math.isinf(rate) else f"{label} @ {rate:g} req/s"
        requests = shifted(workload.requests, len(runs) * PROMPT_SHIFT, vocab)
        runs.append(asyncio.run(_measure(ep, requests, rate, args, slo, desc)))
        if doubling and not _saturated(runs) and len(runs) < MAX_SWEEP_POINTS:
            todo.append(rate * 2)
    return runs


def _saturated(runs: list[dict[str, Any]]) -> bool:
    if len(runs) < 2 or runs[-1]["ttft_s"] is None or runs[0]["ttft_s"] is None:
        return len(runs) >= 2  # a point where nothing succeeded is past saturation
    return saturated(runs[-2]["output_tok_per_s"], runs[-1]["output_tok_per_s"], runs[0]["ttft_s"]["p50"],
                     runs[-1]["ttft_s"]["p50"])


def _vocab_size(model: str) -> int:
    """The model's tokenizer length (the gateway's bound on prompt token ids): from a directory's
    tokenizer.json at once, else through the tokenizer (for a GGUF: a few seconds)."""
    from shared.models import resolve_model

    path = resolve_model(model)
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    from gateway.tokenizer import load_tokenizer

    return len(load_tokenizer(model))


def _system(server: Server | None, url: str, config: str, runs: list[dict]) -> dict[str, Any]:
    return {"endpoint": url, "config": config, "started_in_s": server.started_s if server else None, "runs": runs}


def run(args: argparse.Namespace) -> int:
    from services.bench.workload import load_workload

    slo = _check(args)
    try:
        sampling = sampling_args(args)
    except ValueError as e:
        raise SystemExit(f"kvfleet bench serve: error: {e}") from None
    given_rates = _rates(args)
    cpu = cpu_info()
    vocab = _vocab_size(args.model)
    workload = load_workload(args.workload, vocab_size=vocab, num_requests=args.num_requests, seed=args.seed)
    try:
        workload = workload.with_lengths(output_len=args.output_len)
    except ValueError as e:
        raise SystemExit(f"kvfleet bench serve: error: {e}") from None
    starts = args.url is None or args.peer is not None
    log_dir = Path(tempfile.mkdtemp(prefix="kvfleet-bench-serve-")) if starts else None  # the servers' logs
    _note(f"workload {workload.name}: {len(workload.requests)} requests, {workload.prompt_tokens} prompt + "
          f"{workload.output_tokens} output tokens" + (f"; server logs in {log_dir}" if log_dir else ""))
    systems: dict[str, dict[str, Any]] = {}
    server = None
    urls = [u.rstrip("/") for u in args.url or []]
    url = urls[0] if urls else None
    config = "(given by --url)" if len(urls) < 2 else f"(given by --url: {len(urls)} replicas, round-robin)"
    if url is None:
        config = f"(kvfleet up: {args.workers} worker(s), routing {args.routing or 'default'}, {args.model})"
        _note(f"starting a fleet {config} ...")
        server = start_kvfleet(args.model, args.workers, args.routing, log_dir, args.fleet_arg)
    try:
        if server is not None:
            wait_ready(server, args.startup_timeout, workers=args.workers)
            url = server.url
            _note(f"fleet ready in {server.started_s:.1f} s at {url}")
        name = args.served_model_name or _served_name(url, args.api_key)
        runs = drive(Endpoint(url, name, args.api_key, tuple(urls[1:]), sampling), workload, args, slo, "kvfleet", given_rates or [],
                     vocab)
        systems["kvfleet"] = _system(server, ", ".join(urls) or url, config, runs)
    except ServerFailed as e:
        raise SystemExit(str(e)) from None
    finally:
        if server is not None:
            stop(server)
    if args.peer == "vllm":
        from gpu_worker.executor.model_loader import load_model_files

        weights_dir = load_model_files(args.model).weights_dir  # a GGUF, de-quantized once into ~/.cache/kvfleet
        try:
            systems["vllm"] = _run_vllm(args, weights_dir, name, workload, vocab, slo, log_dir,
                                        [r["request_rate"] or math.inf for r in runs])
        except ServerFailed as e:  # kvfleet's figures stand on their own
            _note(f"the vLLM peer failed: {e}")
            systems["vllm"] = {"endpoint": None, "config": "", "error": str(e), "runs": []}
    report = {
        "benchmark": "kvfleet bench serve", "time": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu": cpu, "model": args.model, "served_model_name": name, "sampling": sampling,
        "workload": {"name": workload.name, "path": str(workload.path), "num_requests": len(workload.requests),
                     "prompt_tokens": workload.prompt_tokens, "output_tokens": workload.output_tokens},
        "load": {"request_rate": None if math.isinf(args.request_rate) else args.request_rate,
                 "concurrency": args.concurrency, "sweep": args.sweep, "seed": args.seed},
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "e2e_s": slo.e2e_s, "text": slo.describe()},
        "systems": systems,
        "ratios": {"kvfleet/vllm": ratios(systems["kvfleet"]["runs"], systems["vllm"]["runs"])}
        if "vllm" in systems else {},
        "logs": str(log_dir) if log_dir else None,
    }
    plot = args.plot or (args.json.with_suffix(".html") if args.json else None)
    if plot is not None:
        report["plot"] = str(write_plots(report, plot))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    print(format_table(report))
    return 0


def _run_vllm(args: argparse.Namespace, weights_dir: Path, name: str, workload: Workload, vocab: int, slo: SLO,
              log_dir: Path, rates: list[float]) -> dict[str, Any]:
    threads = args.threads or os.cpu_count() or 1
    _note(f"starting vLLM's OpenAI server from {args.vllm_venv} on {weights_dir} ({threads} threads; it takes "
          "1-2 min) ...")
    server = start_vllm(Path(args.vllm_venv), weights_dir, name, threads, log_dir)
    try:
        wait_ready(server, args.startup_timeout)
        _note(f"vLLM ready in {server.started_s:.1f} s at {server.url}")
        runs = drive(Endpoint(server.url, name, sampling=sampling_args(args)), workload, args, slo, "vLLM", rates, vocab)
    finally:
        stop(server)
    return _system(server, server.url, f"(vllm serve, float32, {threads} threads, vllm_env.sh)", runs)
