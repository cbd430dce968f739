// kvfleet's native CPU kernels (built by gpu_worker/executor/ops/cpu/kernels.py with the system's g++, loaded
// with ctypes). This file holds the extern "C" functions; the kernels are in its parts, one concept each,
// included below in order (kernels.py splices them into one translation unit: `kernels.source()`):
//   common.h               bfloat16 <-> float, exp, the paged KV cache's layout, AMX tile state
//   simd.h                 vector helpers (masks, float32 / bfloat16 loads and stores, exp, sums)
//   decode_attention.h     decode attention over the paged cache (AVX2, AVX-512, scalar)
//   elementwise.h          RMSNorm with residual, SiLU-and-mul, rotary embedding, KV store
//   prefill_tiles.h        prefill attention's pieces and float32 tile; prefill_tiles_bf16.h its bfloat16 tiles
//   prefill_attention.h    prefill attention: the tile for the CPU and dtype, over OpenMP
//   argmax.h               greedy sampling
//   gemm_f32.h, gemm_bf16.h  the panel GEMMs for few rows (decode steps); bfloat16 on vdpbf16ps or AMX tiles
//   decode_layers.h        a decode step's decoder layers in one call
//
// Decode attention reads keys and values where they lie in the paged cache (no gathered copy). The
// elementwise ops (RMSNorm with residual, SiLU-and-mul, rotary embedding, KV store) each make one pass where
// torch makes several; they follow Hugging Face's rounding in bfloat16 (each torch op's result is rounded to
// the model dtype). OpenMP (torch's own runtime) only from kParallelElems elements (a decode step's 64 rows and
// up: the other threads are spinning there after the step's matmuls); a parallel region ends in a barrier, and
// on cores shared with other processes one barrier can cost milliseconds.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#include "common.h"
#include "simd.h"
#include "decode_attention.h"
#include "elementwise.h"
#include "prefill_tiles.h"
#include "prefill_tiles_bf16.h"
#include "prefill_attention.h"
#include "argmax.h"
#include "gemm_f32.h"
#include "gemm_bf16.h"
#include "decode_layers.h"

}  // namespace

extern "C" {
void kvf_decode_attention_f32(const float* q, const float* kc, const float* vc, const int32_t* bt,
                              int64_t bt_stride, const int32_t* ctx, const int64_t* rows, int s, int hq, int hkv,
                              int d, int bs, int head_major, float scale, int max_ctx, float* out, int simd) {
  decode_attention(q, kc, vc, bt, bt_stride, ctx, rows, s, hq, hkv, d, bs, head_major, scale, max_ctx, out, simd);
}
void kvf_decode_attention_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int32_t* bt,
                               int64_t bt_stride, const int32_t* ctx, const int64_t* rows, int s, int hq, int hkv,
                               int d, int bs, int head_major, float scale, int max_ctx, uint16_t* out, int simd) {
  decode_attention(q, kc, vc, bt, bt_stride, ctx, rows, s, hq, hkv, d, bs, head_major, scale, max_ctx, out, simd);
}
#define KVF_TYPED(SUFFIX, T)                                                                                       \
  void kvf_rms_norm_##SUFFIX(const T* x, const T* residual, const T* w, T* out, T* new_residual, int64_t rows,    \
                             int64_t h, float eps) {                                                              \
    rms_norm(x, residual, w, out, new_residual, rows, h, eps);                                                   \
  }                                                                                                              \
  void kvf_silu_and_mul_##SUFFIX(const T* x, T* out, int64_t rows, int64_t inter) {                               \
    silu_and_mul(x, out, rows, inter);                                                                           \
  }                                                                                                              \
  void kvf_rotary_##SUFFIX(const int64_t* pos, const T* q, int64_t q_stride, const T* k, int64_t k_stride,       \
                           const T* cos_sin, T* q_out, T* k_out, int64_t n, int hq, int hkv, int d, int neox) {  \
    rotary(pos, q, q_stride, k, k_stride, cos_sin, q_out, k_out, n, hq, hkv, d, neox);                         \
  }                                                                                                              \
  int kvf_prefill_attention_##SUFFIX(const T* q, const T* kc, const T* vc, const int32_t* table, int ctx,       \
                                     int q_len, int hq, int hkv, int d, int bs, int head_major, float scale,      \
                                     T* out) {                                                                    \
    return prefill_attention(q, kc, vc, table, ctx, q_len, hq, hkv, d, bs, head_major, scale, out) ? 1 : 0;     \
  }                                                                                                              \
  void kvf_store_kv_##SUFFIX(const T* k, int64_t k_stride, const T* v, int64_t v_stride, T* kc, T* vc,           \
                             const int64_t* slots, int64_t n, int hkv, int d, int bs, int head_major) {          \
    store_kv(k, k_stride, v, v_stride, kc, vc, slots, n, hkv, d, KVLayout(bs, hkv, d, head_major));             \
  }                                                                                                              \
  /* a decode step's decoder layers; only where the dtype's panel GEMM is compiled in (kvf_gemm*available) */     \
  void kvf_decode_layers_##SUFFIX(const DecodeLayer* layers, int num_layers, const DecodeShape* shape, T* hidden, \
                                  T* residual, int64_t n, const int64_t* positions, const T* cos_sin,            \
                                  const int64_t* slots, const int32_t* tables, int64_t table_stride,              \
                                  const int32_t* lens, double* seconds) {                                         \
    decode_layers(layers, num_layers, *shape, hidden, residual, n, positions, cos_sin, slots, tables,             \
                  table_stride, lens, seconds);                                                                   \
  }
KVF_TYPED(f32, float)
KVF_TYPED(bf16, uint16_t)
// The instruction sets this build's kernels use (-march=native on the CPU it was built for): 1 AVX2+FMA,
// 2 AVX-512F, 4 AVX512_BF16 dot products; 0: scalar loops only.
// Does this build have a native prefill attention kernel for head dim d (else: torch's SDPA)?
int kvf_prefill_covers(int d) { return prefill_covers(d) ? 1 : 0; }
int kvf_isa() {
  int isa = 0;
#if defined(__AVX2__) && defined(__FMA__)
  isa |= 1;
#endif
#if defined(__AVX512F__)
  isa |= 2;
#endif
#if defined(__AVX512BF16__)
  isa |= 4;
#endif
  return isa;
}
int kvf_argmax_f32(const float* x, int64_t rows, int64_t cols, int64_t stride, int64_t* out) {
  return argmax_rows(x, rows, cols, stride, out) ? 1 : 0;
}
// the panel GEMMs (no-ops where not compiled in: the *_available functions say 0 there)
int kvf_gemm_available() { return kGemmCompiled; }
int kvf_gemm_bf16_available() { return kGemmBf16Compiled; }
// Do the bfloat16 panel GEMM and prefill attention run on AMX tiles (built with them, and Linux lends this process
// the tile state)? use: 1 or 0 turns that on or off (off: the vdpbf16ps kernels, to compare), -1 leaves it.
int kvf_amx(int use) {
#ifdef KVF_AMX
  if (use >= 0) g_amx = use != 0;
  return use_amx() ? 1 : 0;
#else
  return 0 * use;
#endif
}
// The float32 panel GEMM's blocking (see gemm): 0 or 1 sets it; -1 leaves it; returns the one in use.
int kvf_gemm_blocking(int which) {
  if (which == 0 || which == 1) g_gemm_blocking = which;
  return g_gemm_blocking;
}
int kvf_gemm_slice(int which) { return gemm_slice(which); }  // k per slice under blocking `which` (0: none built)
int kvf_gemm_panel_width() { return kGemmCompiled ? kGemmNR : 0; }  // output columns per packed panel
int64_t kvf_gemm_packed_size(int64_t n, int64_t k) { return (n + kGemmNR - 1) / kGemmNR * kGemmNR * k; }
int64_t kvf_gemm_packed_size_bf16(int64_t n, int64_t k) {  // uint16 elements
  return (n + kGemmBf16NR - 1) / kGemmBf16NR * kGemmBf16NR * ((k + 1) / 2) * 2;
}
void kvf_gemm_pack_f32(const float* w, int64_t n, int64_t k, float* packed) { gemm_pack(w, n, k, packed); }
void kvf_gemm_pack_bf16(const uint16_t* w, int64_t n, int64_t k, uint16_t* packed) {
  gemm_pack_bf16(w, n, k, packed);
}
void kvf_gemm_f32(const float* x, int64_t xs, int64_t m, int64_t k, const float* packed, int64_t n,
                  const float* bias, float* out, int64_t os) {
  gemm(x, xs, m, k, packed, n, bias, out, os);
}
// out_f32: out is float32 (the bfloat16-rounded results widened), else bfloat16
void kvf_gemm_bf16(const uint16_t* x, int64_t xs, int64_t m, int64_t k, const uint16_t* packed, int64_t n,
                   const uint16_t* bias, void* out, int64_t os, int out_f32) {
  if (out_f32) gemm_bf16(x, xs, m, k, packed, n, bias, static_cast<float*>(out), os);
  else gemm_bf16(x, xs, m, k, packed, n, bias, static_cast<uint16_t*>(out), os);
}
}
