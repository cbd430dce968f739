"""Decode-attention benchmark on a CUDA GPU: `python -m services.bench.kernels --help`.

For each (dtype, batch, context) it times one decode step of paged attention (one query token per
sequence over a paged KV cache with shuffled blocks) three ways: the Triton kernel (kernels.paged_attention),
the torch path (gpu_worker.executor.ops.torch_ops.paged_attention) and F.scaled_dot_product_attention on contiguous KV
(no paging: what the memory system allows without a block table). It prints milliseconds, achieved
bandwidth (bytes of K/V read + query read + output written, over the time) and its fraction of the
device's peak HBM bandwidth. Attention decode does ~1 FLOP per byte, so bandwidth is the measure.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys

import torch
import torch.nn.functional as F

from shared.settings import foreign_var

# (substring of torch.cuda.get_device_name(), peak HBM bandwidth in GB/s per the vendor datasheets);
# first match wins, so the more specific names come first
PEAK_GBPS = [
    ("H200", 4800.0), ("GH200", 4000.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
    ("H800", 3350.0), ("B200", 8000.0), ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0), ("A800", 2039.0), ("L40S", 864.0), ("L40", 864.0), ("L4", 300.0), ("A10G", 600.0),
    ("A10", 600.0), ("RTX 4090", 1008.0), ("RTX 3090", 936.0), ("V100", 900.0), ("T4", 320.0),
]
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.bench.kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[64, 128, 256],
                   help="decode batch sizes (sequences, one query token each) (default: 64 128 256)")
    p.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 8192],
                   help="context lengths in tokens; every sequence of a row has this length "
                        "(default: 1024 4096 8192)")
    p.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["float16", "bfloat16"],
                   help="query and KV-cache dtypes (default: float16 bfloat16)")
    p.add_argument("--num-q-heads", type=int, default=32, help="query heads (default: 32, Llama-3-8B)")
    p.add_argument("--num-kv-heads", type=int, default=8, help="KV heads (default: 8, Llama-3-8B)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default: 128)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default: 16)")
    p.add_argument("--peak-gbps", type=float, default=None,
                   help="peak HBM bandwidth in GB/s for the %%peak column (default: looked up from the "
                        "device name in a table of datasheet values)")
    p.add_argument("--splits", type=int, nargs="+", default=None,
                   help="force the Triton kernel's decode context-split count (flash-decoding) to each of "
                        "these values, one row each (default: the kernel's own heuristic)")
    p.add_argument("--skip-torch", action="store_true",
                   help="do not time the torch path (it gathers the whole KV cache: slow and memory-hungry)")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="time plain launches instead of CUDA-graph replays (then Python launch overhead "
                        "counts for small batches)")
    p.add_argument("--rep-ms", type=int, default=100, help="milliseconds of repetitions per timing (default: 100)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--seed", type=int, default=0, help="random seed for the data (default: 0)")
    return p.parse_args(argv)


def peak_gbps(name: str) -> float | None:
    return next((gbps for key, gbps in PEAK_GBPS if key in name), None)


def make_decode_batch(batch: int, context: int, args: argparse.Namespace, dtype: torch.dtype):
    """Paged KV for `batch` sequences of `context` tokens, blocks shuffled over the cache."""
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    key_cache = torch.randn(cache_shape, dtype=dtype, device="cuda")
    value_cache = torch.randn(cache_shape, dtype=dtype, device="cuda")
    block_tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int64).to(torch.int32)
    block_tables = block_tables.view(batch, blocks_per_seq)  # [S, nb]
    query = torch.randn(batch, args.num_q_heads, args.head_dim, dtype=dtype, device="cuda")  # [S, Hq, D]
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device="cuda")  # [S + 1]
    context_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")  # [S]
    return query, key_cache, value_cache, block_tables, query_start_loc, context_lens, args.head_dim**-0.5


def time_ms(fn, graph: bool, rep_ms: int) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


@contextlib.contextmanager
def forced_splits(splits: int | None):
    """Override kernels.paged_attention's split heuristic (benchmark-only tuning knob)."""
    pa = importlib.import_module("kernels.paged_attention")  # the module: the package exports a function of its name
    original = pa._num_splits
    if splits is not None:
        pa._num_splits = lambda device, programs, num_tiles, interpret: max(1, min(splits, num_tiles))
    try:
        yield
    finally:
        pa._num_splits = original


def bench_row(batch: int, context: int, dtype_name: str, args: argparse.Namespace, peak: float | None):
    from gpu_worker.executor.ops import torch_ops as ops
    from kernels import paged_attention

    dtype = DTYPES[dtype_name]
    inputs = make_decode_batch(batch, context, args, dtype)
    query = inputs[0]
    elem = query.element_size()
    nbytes = 2 * batch * context * args.num_kv_heads * args.head_dim * elem + 2 * query.numel() * elem
    graph = not args.no_cuda_graph
    rows = []

    def row(impl: str, ms: float, err: float | None = None) -> dict:
        gbps = nbytes / ms / 1e6
        r = {"dtype": dtype_name, "batch": batch, "context": context, "impl": impl, "ms": ms, "gbps": gbps,
             "frac_peak": gbps / peak if peak else None, "max_abs_err_vs_torch": err}
        print(f"{dtype_name:>9} {batch:>5} {context:>6}  {impl:<18} {ms:8.3f} {gbps:9.0f} "
              f"{'' if peak is None else f'{100 * gbps / peak:6.1f}%':>7}"
              f"  {'' if err is None else f'{err:.2e}'}", flush=True)
        rows.append(r)
        return r

    reference = None
    if not args.skip_torch:
        try:
            reference = ops.paged_attention(*inputs)
            row("torch (ops)", time_ms(lambda: ops.paged_attention(*inputs), False, args.rep_ms))
        except torch.OutOfMemoryError:
            print(f"{dtype_name:>9} {batch:>5} {context:>6}  torch (ops)        out of memory", flush=True)
        torch.cuda.empty_cache()
    for splits in args.splits or [None]:
        with forced_splits(splits):
            out = paged_attention(*inputs)
            err = None if reference is None else (out.float() - reference.float()).abs().max().item()
            name = "triton" if splits is None else f"triton splits={splits}"
            row(name, time_ms(lambda: paged_attention(*inputs), graph, args.rep_ms), err)
    # contiguous KV: [S, Hkv, L, D]; the G query heads of a KV head act as G query rows (no KV repeat)
    group = args.num_q_heads // args.num_kv_heads
    k = torch.randn(batch, args.num_kv_heads, context, args.head_dim, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    q = query.view(batch, args.num_kv_heads, group, args.head_dim)  # [S, Hkv, G, D]
    row("sdpa contiguous", time_ms(lambda: F.scaled_dot_product_attention(q, k, v), graph, args.rep_ms))
    return rows  # the caller empties the cache allocator once this frame's tensors are gone


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("services.bench.kernels needs a CUDA GPU (torch.cuda.is_available() is False); the kernels' CPU "
              "checks are the tests: pytest tests/kernels", file=sys.stderr)
        return 2
    if foreign_var("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
        print("services.bench.kernels times compiled kernels: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    if args.num_q_heads % args.num_kv_heads:
        print("--num-q-heads must be a multiple of --num-kv-heads", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    peak = args.peak_gbps or peak_gbps(name)
    torch.manual_seed(args.seed)
    print(f"device: {name}; peak HBM bandwidth: "
          f"{'unknown (pass --peak-gbps)' if peak is None else f'{peak:.0f} GB/s'}"
          f"{' (--peak-gbps)' if args.peak_gbps else ''}")
    print(f"decode attention: {args.num_q_heads} q heads, {args.num_kv_heads} kv heads, head dim "
          f"{args.head_dim}, block size {args.block_size}; GB/s counts K/V read + q read + out written; "
          f"{'plain launches' if args.no_cuda_graph else 'triton and sdpa timed as CUDA-graph replays'}; "
          f"torch (ops) syncs on the host every call")
    print(f"{'dtype':>9} {'batch':>5} {'ctx':>6}  {'impl':<18} {'ms':>8} {'GB/s':>9} {'%peak':>7}  max|err| vs torch")
    rows = []
    for dtype_name in args.dtype:
        for batch in args.batch:
            for context in args.context:
                rows += bench_row(batch, context, dtype_name, args, peak)
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "peak_gbps": peak, "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
