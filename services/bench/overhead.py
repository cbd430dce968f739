"""Gateway overhead: what the gateway + Redis round trip add over calling the engine directly, for short
requests (1 output token). One run, same model and engine settings on both sides:

  engine   LLMEngine in this process: add_request, step until done
  redis    a worker process fed through Redis (streams.enqueue + iter_output, as the Celery tasks do)
  gateway  the same worker behind the HTTP gateway (POST /v1/completions), i.e. the whole path

For each: p50/p90 latency one request at a time, and requests/s with --concurrency requests in flight.

With --simulate PROFILE the worker is a simulated one (`kvfleet worker --simulate`: the real worker, its steps
priced by the profile; a profile whose terms are all 0 makes them free) and the engine row is left out. What is
left is the queue's and the gateway's own time: "added by the gateway" is the gateway row's p50 less the redis
row's, the worker and the Redis round trips being the same on both.

    python -m services.bench.overhead [--model smollm2] [--requests 200] [--concurrency 8] [--simulate P]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from shared.settings import child_env, hf_offline

hf_offline()


def _prompts(n: int) -> list[str]:
    return [f"Request {i}: name one colour." for i in range(n)]


def _stats(latencies: list[float], wall_s: float, n: int) -> dict[str, float]:
    q = statistics.quantiles(latencies, n=10)
    return {"p50_ms": round(statistics.median(latencies) * 1e3, 2), "p90_ms": round(q[8] * 1e3, 2),
            "req_per_s": round(n / wall_s, 1)}


def _measure(one: Callable[[int], None], n: int, concurrency: int, warmup: int = 5) -> dict[str, float]:
    for i in range(warmup):
        one(10_000 + i)
    lat = []
    for i in range(n):
        t = time.perf_counter()
        one(i)
        lat.append(time.perf_counter() - t)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(n, 2 * n)))
    return _stats(lat, time.perf_counter() - t0, n) | {"seq_wall_s": round(sum(lat), 2)}


def bench_engine(args: argparse.Namespace) -> dict[str, float]:
    """The engine alone, in this process: latency one request at a time; requests/s as a closed loop that
    keeps --concurrency requests in flight (as a worker's batch would)."""
    from gpu_worker.engine.llm_engine import LLMEngine
    from shared.sampling_params import SamplingParams

    engine = LLMEngine.from_model(args.model, num_kv_blocks=args.num_kv_blocks)
    engine.wait_kv_resident()  # as a worker's warm-up does
    tok, params = engine.tokenizer, SamplingParams(max_tokens=1, temperature=0)
    prompts = _prompts(20_000)
    ids = [tok(p)["input_ids"] for p in prompts[: 2 * args.requests + 10_010]]

    def run(indices: list[int], in_flight: int) -> None:
        todo, live = list(indices), 0
        while todo or live:
            while todo and live < in_flight:
                i = todo.pop(0)
                engine.add_request(f"b{i}", ids[i] if i < len(ids) else ids[i % len(ids)], params)
                live += 1
            live -= sum(out.finished for out in engine.step())

    for i in range(5):
        run([10_000 + i], 1)
    lat = []
    for i in range(args.requests):
        t = time.perf_counter()
        run([i], 1)
        lat.append(time.perf_counter() - t)
    t0 = time.perf_counter()
    run(list(range(args.requests, 2 * args.requests)), args.concurrency)
    return _stats(lat, time.perf_counter() - t0, args.requests) | {"seq_wall_s": round(sum(lat), 2)}


def bench_fleet(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    import httpx

    from services.ports import free_port
    from services.redis_server import RedisServer
    from shared import streams
    from shared.messages import GenerationRequest
    from shared.sampling_params import SamplingParams

    port = free_port()
    procs: list[subprocess.Popen] = []
    with RedisServer() as srv:
        env = child_env(KVFLEET_REDIS_URL=srv.url)
        cli = [sys.executable, "-m", "services.cli"]
        try:
            worker = cli + ["worker", "--model", args.model, "--worker-id", "bench"]
            worker += ["--simulate", args.simulate] if args.simulate else []
            worker += ["--num-kv-blocks", str(args.num_kv_blocks)] if args.num_kv_blocks and not args.simulate else []
            procs.append(subprocess.Popen(worker, env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
            procs.append(subprocess.Popen(cli + ["gateway", "--port", str(port), "--model", args.model,
                                                 "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(base + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "fleet did not start"
                time.sleep(0.3)
            from gateway.tokenizer import load_tokenizer

            tok = load_tokenizer(args.model)
            prompts = _prompts(20_000)
            params = SamplingParams(max_tokens=1, temperature=0).to_dict()
            r = streams.connect(srv.url)
            local = threading.local()

            def via_redis(i: int) -> None:
                req = GenerationRequest(request_id=f"r{i}-{uuid.uuid4().hex[:6]}", sampling_params=params,
                                        prompt_token_ids=tok(prompts[i % len(prompts)])["input_ids"])
                streams.enqueue(r, req, "bench", 0)
                assert [c for c in streams.iter_output(r, req.request_id, 0, timeout_s=60)][-1].final

            def via_gateway(i: int) -> None:
                if not hasattr(local, "client"):
                    local.client = httpx.Client(base_url=base, timeout=60)
                resp = local.client.post("/v1/completions", json={
                    "model": args.model, "prompt": prompts[i % len(prompts)], "max_tokens": 1, "temperature": 0})
                assert resp.status_code == 200, resp.text

            def via_gateway_sse(i: int) -> None:
                if not hasattr(local, "client"):
                    local.client = httpx.Client(base_url=base, timeout=60)
                with local.client.stream("POST", "/v1/completions", json={
                        "model": args.model, "prompt": prompts[i % len(prompts)], "max_tokens": 1,
                        "temperature": 0, "stream": True}) as resp:
                    assert resp.status_code == 200, resp.read()
                    assert list(resp.iter_lines())[-2] == "data: [DONE]"

            return {"redis": _measure(via_redis, args.requests, args.concurrency),
                    "gateway": _measure(via_gateway, args.requests, args.concurrency),
                    "gateway_sse": _measure(via_gateway_sse, args.requests, args.concurrency)}
        finally:
            for p in procs:
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="model alias or directory (default smollm2)")
    p.add_argument("--requests", type=int, default=200, help="requests per measurement")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight for the req/s column")
    p.add_argument("--num-kv-blocks", type=int, default=512, help="the real worker's KV blocks")
    p.add_argument("--simulate", metavar="PROFILE",
                   help="a simulated worker with this cost profile (a name or a .json); no engine row")
    args = p.parse_args(argv)
    from services.bench.cpu import cpu_info, describe

    cpu = cpu_info()
    rows = {} if args.simulate else {"engine": bench_engine(args)}
    rows |= bench_fleet(args)
    base = rows["engine" if "engine" in rows else "redis"]
    worker = f"simulated worker ({args.simulate})" if args.simulate else "real worker"
    print(f"\n1-output-token requests, model {args.model}, {worker}, {args.requests} per measurement, "
          f"concurrency {args.concurrency}; {describe(cpu)}")
    print(f"{'path':<12} {'p50 ms':>8} {'p90 ms':>8} {'req/s':>8} {'added p50 ms':>13}")
    for name, row in rows.items():
        added = row["p50_ms"] - base["p50_ms"]
        print(f"{name:<12} {row['p50_ms']:>8.2f} {row['p90_ms']:>8.2f} {row['req_per_s']:>8.1f} {added:>13.2f}")
    print(f"(added: over the {'engine' if 'engine' in rows else 'redis'} row's p50)")
    print("RESULT " + json.dumps({"model": args.model, "requests": args.requests, "concurrency": args.concurrency,
                                  "simulate": args.simulate, "cpu": cpu, **rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
