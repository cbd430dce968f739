"""Compile every kernel for a Hopper GPU (sm_90) with the ptxas that Triton ships, without a GPU, and print
each one's registers, spills and shared memory as JSON lines. The interpreter accepts code that the
compiler rejects, so test_sm90_compile.py runs this (in a subprocess: TRITON_INTERPRET must be unset)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

assert not os.environ.get("TRITON_INTERPRET"), "run without TRITON_INTERPRET"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kernels  # noqa: E402, F401  (imports every kernel module)

MODULES = {name: sys.modules[f"kernels.{name}"] for name in
           ("paged_attention", "kv_cache_store", "rms_norm", "activation", "rotary")}
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_kernel(kernel, ptrs: dict[str, str], constexprs: dict, floats=(), num_warps=4, num_stages=2):
    """ptrs: pointer arg -> element type ('fp16', 'i32', ...); other non-constexpr args are i32 (strides
    and sizes; strides marked divisible by 16, as Triton specializes them at launch) or fp32 (`floats`)."""
    names = list(kernel.arg_names)
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in ptrs:
            sig[n], attrs[(i,)] = f"*{ptrs[n]}", [["tt.divisibility", 16]]
        elif n in floats:
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if n.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = (int(x) for x in re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    return {"regs": regs, "stack": stack, "shared": compiled.metadata.shared}


def attention(dt: str, decode: bool, split: bool, head_dim=128, group=4):
    """The tile shapes paged_attention's wrapper picks on a GPU for this case."""
    pa = MODULES["paged_attention"]
    ptrs = {n: dt for n in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
    ptrs |= {n: "fp32" for n in ("part_acc_ptr", "part_max_ptr", "part_sum_ptr")}
    ptrs |= {n: "i32" for n in ("block_tables_ptr", "query_start_loc_ptr", "context_lens_ptr")}
    narrow = dt == "fp32"
    block_n = 16 if narrow else (64 if decode else 32)
    block_m = 16 if decode or narrow else 64
    const = dict(NUM_Q_HEADS=8 * group, GROUP=group, GROUP_PAD=group, HEAD_DIM=head_dim, HEAD_PAD=head_dim,
                 BLOCK_SIZE=16, BLOCK_M=block_m, BLOCK_Q=1 if decode else block_m // group, BLOCK_N=block_n,
                 SPLIT=split, DOT_FP32=narrow)
    return compile_kernel(pa._paged_attention_kernel, ptrs, const, floats=("qk_scale",),
                          num_stages=2 if narrow else 3)


def main() -> None:
    pa, st, rn, act, rot = (MODULES[n] for n in ("paged_attention", "kv_cache_store", "rms_norm", "activation",
                                                 "rotary"))
    results = {
        "attention decode split fp16": attention("fp16", True, True),
        "attention decode bf16": attention("bf16", True, False),
        "attention decode split fp32": attention("fp32", True, True),
        "attention prefill fp16": attention("fp16", False, False),
        "attention prefill bf16 d64": attention("bf16", False, False, head_dim=64, group=2),
        "attention prefill fp32": attention("fp32", False, False),
        "merge splits": compile_kernel(pa._merge_splits_kernel, {n: "fp16" if n == "out_ptr" else "fp32" for n in (
            "out_ptr", "part_acc_ptr", "part_max_ptr", "part_sum_ptr")},
            dict(NUM_Q_HEADS=32, HEAD_DIM=128, HEAD_PAD=128, SPLITS_PAD=8)),
        "kv store": compile_kernel(st._kv_cache_store_kernel, {n: "bf16" for n in (
            "key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr")} | {"slot_mapping_ptr": "i64"},
            dict(NUM_HEADS=8, HEAD_DIM=128, HEADS_PAD=8, HEAD_PAD=128)),
        "rms norm": compile_kernel(rn._rms_norm_kernel, {n: "bf16" for n in (
            "out_ptr", "new_residual_ptr", "x_ptr", "residual_ptr", "weight_ptr")},
            dict(HAS_RESIDUAL=True, BLOCK_H=4096), floats=("eps",), num_warps=16),
        "silu and mul": compile_kernel(act._silu_and_mul_kernel, {"out_ptr": "fp16", "x_ptr": "fp16"},
                                       dict(BLOCK=1024)),
        "rotary": compile_kernel(rot._rotary_embedding_kernel, {"q_out_ptr": "bf16", "k_out_ptr": "bf16",
            "q_ptr": "bf16", "k_ptr": "bf16", "positions_ptr": "i64", "cos_sin_ptr": "fp32"},
            dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, Q_HEADS_PAD=32, KV_HEADS_PAD=8, HEAD_DIM=128, HALF_PAD=64,
                 IS_NEOX=True)),
    }
    for name, r in results.items():
        print(json.dumps({"kernel": name, **r}))


if __name__ == "__main__":
    main()
