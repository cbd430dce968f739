"""The cores' multiply-add peak right now: the ceiling under every matmul, measured in the same run.

A loop of independent vector multiply-adds in registers (24 chains with AVX-512, 12 with AVX2: more than latency
x throughput; no memory): float32 FMAs (AVX-512 or AVX2) and bfloat16 pair dot products (`vdpbf16ps`,
AVX512_BF16) or, where the CPU has AMX, 4 independent tiles of `tdpbf16ps` (oneDNN's bf16 GEMM runs on them
there), on each of N threads at once, best of a few runs. On a shared virtual machine the clock moves with the
neighbours' load, and so does this peak: `kvfleet bench throughput` reports it beside the matmul probe, so that
a ratio to the probe can be read against the machine's state at that moment. Built with g++ on first use into
~/.cache/kvfleet/peak_rate/ (as the kernels are).

    python -m services.bench.peak_rate [--threads N]
"""

from __future__ import annotations

import argparse
import ctypes
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

SOURCE = r"""
#include <immintrin.h>
#include <time.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define HALF_A(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#if defined(__AVX512F__)
#define HALF_B(X) X(12) X(13) X(14) X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23)
#else
#define HALF_B(X)  /* AVX2: 16 registers, so 12 chains (FMA latency 4 x 2 a cycle needs 8) */
#endif
#define CHAINS(X) HALF_A(X) HALF_B(X)
#define NUM_CHAINS (0 CHAINS(COUNT))
#define COUNT(i) + 1
#if defined(__AVX512F__)
typedef __m512 vec;
#define ZERO _mm512_setzero_ps()
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SET1 _mm512_set1_ps
#define LANES 16
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec;
#define ZERO _mm256_setzero_ps()
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define SET1 _mm256_set1_ps
#define LANES 8
#endif
#define KEEP(i) , "+v"(a##i)
/* the chains stay in registers and stay apart (an asm statement takes at most 30 operands, "+v" counts 2) */
#define BARRIER __asm__ volatile("" : "+v"(x) HALF_A(KEEP)); __asm__ volatile("" : "+v"(y) HALF_B(KEEP));
extern "C" {
/* FLOP/s of one thread: NUM_CHAINS chains of FMAs (2 FLOP a lane); 0 without AVX2 + FMA */
double peak_f32(long iters) {
#ifdef LANES
  vec x = SET1(1.0001f), y = SET1(0.9999f);
#define DECL(i) vec a##i = ZERO;
  CHAINS(DECL)
  double t = now();
  for (long n = 0; n < iters; ++n) {
#define STEP(i) a##i = FMA(x, y, a##i);
    CHAINS(STEP)
    BARRIER
  }
  return iters * double(NUM_CHAINS) * LANES * 2 / (now() - t);
#else
  return 0 * iters;
#endif
}
/* FLOP/s of one thread: 24 chains of vdpbf16ps (32 pairs: 64 FLOP); 0 without AVX512_BF16 */
double peak_bf16(long iters) {
#if defined(__AVX512BF16__)
  __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = x;
#define DECLB(i) __m512 a##i = _mm512_setzero_ps();
  CHAINS(DECLB)
  double t = now();
  for (long n = 0; n < iters; ++n) {
#define STEPB(i) a##i = _mm512_dpbf16_ps(a##i, x, y);
    CHAINS(STEPB)
    BARRIER
  }
  return iters * double(NUM_CHAINS) * 64 / (now() - t);
#else
  return 0 * iters;
#endif
}
/* FLOP/s of one thread: 4 independent AMX tiles of tdpbf16ps (16 x 16 fp32 += 16 x 32 bf16 by 32 x 16: 16,384
   FLOP each), sources in tiles; 0 without AMX-BF16 or where Linux does not lend the process the tile state */
double peak_amx_bf16(long iters) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) return 0;
  struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg = {};
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) cfg.colsb[i] = 64, cfg.rows[i] = 16;
  _tile_loadconfig(&cfg);
  uint16_t ones[16 * 32];
  for (int i = 0; i < 16 * 32; ++i) ones[i] = 0x3f80;  /* 1.0 */
  _tile_loadd(4, ones, 64); _tile_loadd(5, ones, 64); _tile_loadd(6, ones, 64); _tile_loadd(7, ones, 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  long n = iters / 16;  /* a tdpbf16ps takes 16 cycles where a vdpbf16ps takes 1 */
  double t = now();
  for (long i = 0; i < n; ++i) {
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
  }
  double rate = n * 4.0 * 16384 / (now() - t);
  _tile_release();
  return rate;
#else
  return 0 * iters;
#endif
}
}
"""
FLAGS = ["-O2", "-march=native", "-shared", "-fPIC"]
ITERS = 2_000_000  # ~0.05-0.1 s a run at 3-4 GHz


@dataclass(frozen=True)
class Peak:
    flops: float  # FLOP/s, the threads' rates summed
    instruction: str  # what reached it: "FMA", "vdpbf16ps" or "AMX tdpbf16ps"


def _library() -> ctypes.CDLL | None:
    """The compiled loops (once per source and CPU), or None without a C++ compiler."""
    from gpu_worker.executor.ops.cpu.native_build import build_library

    try:
        lib = ctypes.CDLL(str(build_library(SOURCE, FLAGS, "peak_rate")))
    except (OSError, RuntimeError):
        return None
    for name in ("peak_f32", "peak_bf16", "peak_amx_bf16"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [ctypes.c_long], ctypes.c_double
    return lib


def peak_flops(threads: int, runs: int = 5) -> dict[str, Peak]:
    """{"float32": Peak, "bfloat16": Peak}: the multiply-add peak of `threads` threads running at once (the sum
    of their rates, each thread's best of `runs`), bfloat16's from AMX tiles where the CPU has them (a 2-core
    Xeon with AMX: 3.87 TFLOP/s a core, vdpbf16ps 0.12), else from vdpbf16ps; a dtype without its instructions
    here is left out, and the dict is empty without a compiler."""
    lib = _library()
    if lib is None:
        return {}
    # AMX before vdpbf16ps: where the tiles run, the vdpbf16ps loop is not timed (~30x slower there)
    loops = (("float32", "FMA", lib.peak_f32), ("bfloat16", "AMX tdpbf16ps", lib.peak_amx_bf16),
             ("bfloat16", "vdpbf16ps", lib.peak_bf16))
    result: dict[str, Peak] = {}
    with ThreadPoolExecutor(threads) as pool:  # ctypes lets go of the GIL: the threads run at once
        for dtype, instruction, fn in loops:
            if dtype in result:
                continue
            best = [0.0] * threads
            for _ in range(runs):
                rates = list(pool.map(fn, [ITERS] * threads))
                best = [max(b, r) for b, r in zip(best, rates, strict=True)]
            if sum(best) > 0:
                result[dtype] = Peak(sum(best), instruction)
    return result


def main(argv: list[str] | None = None) -> int:
    from services.bench.cpu import describe

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="threads running the loop at once (default: 1)")
    args = parser.parse_args(argv)
    print(f"CPU: {describe()}")
    rates = peak_flops(args.threads)
    if not rates:
        print("no C++ compiler: nothing measured")
        return 1
    for dtype, peak in rates.items():
        print(f"{dtype}: {peak.flops / 1e9:.1f} GFLOP/s on {args.threads} thread(s) ({peak.instruction})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
