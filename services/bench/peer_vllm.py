"""Baseline: vLLM's CPU build, offline `LLM.generate`, run as its own process with vLLM's own Python.

`VENV/bin/python -m services.bench.peer_vllm REQUESTS.json --dtype float32` (cwd: the repository) reads the
peer-file form of a workload and prints one line `RESULT {json}`: greedy (or its "sampling"), ignore_eos,
exactly output_len tokens per request. With `--rounds N` it loads and warms up, prints `READY`, then
runs the requests once per line `go` read on stdin, printing `ROUND {json}` after each and emptying its prefix
cache (`LLM.reset_prefix_cache`), then `RESULT` (services.bench.interleave drives it). `vllm_env()` builds the environment of ../shared/peers/vllm_env.sh, vLLM's best
configuration on a small machine: every core for the model (VLLM_CPU_OMP_THREADS_BIND), Intel OpenMP and
tcmalloc preloaded, loopback only. Imports nothing but the standard library and vLLM (and, for memory,
services.bench.metrics, and shared.settings: neither needs torch nor kvfleet's dependencies).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from shared.settings import child_env, foreign_var

TCMALLOC = "debs/root/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"  # next to the venv (install script)


def vllm_env(venv: Path, threads: int, kv_cache_gib: int = 4) -> dict[str, str]:
    """The environment vllm_env.sh sets, on top of this process's."""
    env = child_env()
    preload = [str(p) for p in (venv.parent / TCMALLOC, venv / "lib" / "libiomp5.so") if p.is_file()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    env.update({
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "THP_MEM_ALLOC_ENABLE": "0",  # as vllm_env.sh leaves it (a parent that imported gpu_worker set it to 1)
    })
    return env


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m services.bench.peer_vllm")
    ap.add_argument("requests_json")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--progress", action="store_true", help="vLLM's progress bar on stderr")
    ap.add_argument("--rounds", type=int, default=1, help="timed rounds, each started by a line 'go' on stdin "
                                                          "when more than 1")
    args = ap.parse_args(argv)

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from services.bench.metrics import PeakRssSampler

    with open(args.requests_json) as f:
        wl = json.load(f)
    reqs = wl["requests"]
    with PeakRssSampler(interval_s=0.2, children=True) as rss:
        t0 = time.perf_counter()
        llm = LLM(model=wl["model"], tokenizer=wl["model"], dtype=args.dtype, seed=0,
                  enable_prefix_caching=args.prefix_caching)
        init_s = time.perf_counter() - t0
        cfg = llm.llm_engine.vllm_config
        cache, sched = cfg.cache_config, cfg.scheduler_config
        # warm-up (not timed), as ../shared/peers/bench_vllm.py does: 2 requests x 4 tokens; reversed prompts,
        # so that prefix caching (when on) finds nothing of them later
        llm.generate([TokensPrompt(prompt_token_ids=r["prompt_token_ids"][::-1]) for r in reqs[:2]],
                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in reqs]
        sampling = wl.get("sampling") or {"temperature": 0.0}  # kvfleet's names; top_k 0 is off in both
        params = [SamplingParams(**sampling, max_tokens=r["output_len"], min_tokens=r["output_len"],
                                 ignore_eos=True) for r in reqs]
        rounds = []
        if args.rounds > 1:
            print("READY", flush=True)
        for i in range(args.rounds):
            if args.rounds > 1:
                if sys.stdin.readline().strip() != "go":  # the parent is gone, or stops early
                    break
                if i and not llm.reset_prefix_cache():
                    raise RuntimeError("vLLM refused to empty its prefix cache between rounds")
            t1 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=args.progress)
            wall = time.perf_counter() - t1
            assert all(len(o.outputs[0].token_ids) == r["output_len"] for o, r in zip(outs, reqs, strict=True))
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            rounds.append({"wall_s": round(wall, 3), "output_tokens": n_out, "output_tok_per_s": n_out / wall,
                           "peak_rss_bytes": rss.peak})
            if args.rounds > 1:
                print("ROUND " + json.dumps(rounds[-1]), flush=True)
    if not rounds:
        return
    mid = sorted(rounds, key=lambda r: r["output_tok_per_s"])[(len(rounds) - 1) // 2]  # the median round
    n_in = sum(len(r["prompt_token_ids"]) for r in reqs)
    result = {
        "system": "vLLM CPU (best config: all cores, iomp+tcmalloc)", "vllm": vllm.__version__,
        "dtype": args.dtype, "kv_cache_dtype": str(cache.cache_dtype), "block_size": cache.block_size,
        "num_kv_blocks": cache.num_gpu_blocks, "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens, "prefix_caching": cache.enable_prefix_caching,
        "threads_bind": foreign_var("VLLM_CPU_OMP_THREADS_BIND") or None,
        "sampling": sampling, "num_requests": len(reqs), "prompt_tokens": n_in, "output_tokens": mid["output_tokens"],
        "load_s": round(init_s, 2), "wall_s": mid["wall_s"],
        "output_tok_per_s": mid["output_tok_per_s"], "total_tok_per_s": (n_in + mid["output_tokens"]) / mid["wall_s"],
        "peak_rss_bytes": rss.peak,
    } | ({"rounds": rounds} if args.rounds > 1 else {})
    print("RESULT " + json.dumps(result), flush=True)
    del llm


if __name__ == "__main__":
    main()
