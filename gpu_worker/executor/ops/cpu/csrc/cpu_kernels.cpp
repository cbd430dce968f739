// kvfleet's native CPU kernels (built by gpu_worker/cpu_kernels.py with the system's g++, loaded with ctypes).
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

#if defined(__AVX2__)
inline __m256 first_n_mask8(int n) {  // lanes < n all ones
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx));
}

// The lines of a block ahead, prefetched (into L1, PREFETCHT0) a line of each array every `every` (steps / lines, rounded
// down) steps of the work on the current block, so that they spread over all of it. The burst this replaced
// (every line of the block two ahead, at the block's start) overflowed the core's miss buffers: on a Zen 4, one
// thread read shuffled float32 blocks at 8.5-8.9 GB/s with it and 15-18 GB/s with the prefetches spread, which is
// what a plain read of the same blocks reaches there. Paced over the whole block, not front-loaded, the
// prefetches overlap the block's work: on a Zen 5, bfloat16 decode attention (96 lines a block, 192 steps; 64
// sequences of 200-440 tokens, 30 layers' caches, shuffled blocks) took 16.1 ms a step where it took 19.1 with a
// line per step (the work and the reads had added up).
// T0 rather than T1 (into L2 only, since Zen 4): on a 2-core Zen 5 (64 sequences of 200-440 tokens, 30 layers'
// caches, from memory, 10 interleaved rounds) bfloat16 took 10.2-12.9 ms a step where T1 took 10.6-17.5, and
// float32 24.9-26.9 where T1 took 26.4-28.4 (T1 prefetches are sometimes dropped on Zen 4; Zen 3 fills L1 for
// every hint, and its AVX2 kernel here measured the same with both).
struct SpreadPrefetch {
  const char *k = nullptr, *v = nullptr;
  int64_t i = 0, n = 0;
  int every = 1, wait = 1;
  void start(const char* nk, const char* nv, int64_t lines, int64_t steps) {
    k = nk; v = nv; i = 0; n = lines;
    every = wait = lines > 0 && steps > lines ? int(steps / lines) : 1;
  }
  inline void step() {
    if (--wait == 0 && i < n) {
      _mm_prefetch(k + 64 * i, _MM_HINT_T0);
      _mm_prefetch(v + 64 * i, _MM_HINT_T0);
      ++i;
      wait = every;
    }
  }
  void finish() {
    for (; i < n; ++i) {
      _mm_prefetch(k + 64 * i, _MM_HINT_T0);
      _mm_prefetch(v + 64 * i, _MM_HINT_T0);
    }
  }
};
#endif

inline float to_f(float x) { return x; }
inline float to_f(uint16_t b) { uint32_t u = uint32_t(b) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline void from_f(float x, float* o) { *o = x; }
inline void from_f(float x, uint16_t* o) {  // round to nearest even, as torch does
  uint32_t u; std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) { *o = uint16_t((u >> 16) | 0x40); return; }  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  *o = uint16_t(u >> 16);
}

// Cephes' expf: exp(x) = 2^n * e^r with n = round(x log2 e), r = x - n ln 2 (ln 2 split in two parts), e^r
// from a degree-5 polynomial; about 1 ulp. The scalar and the vector versions below share these constants.
constexpr float kExpMin = -87.0f, kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = 2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// exp(x) for x <= 0; written so that the loop around it vectorizes
inline float exp_neg(float x) {
  x = x < kExpMin ? kExpMin : x;
  float fx = x * kLog2e;
  fx = float(int(fx - 0.5f));  // round to nearest (x <= 0; int() truncates toward 0)
  float r = x - fx * kLn2Hi + fx * kLn2Lo;
  float y = kExpPoly[0];
  for (int i = 1; i < 6; ++i) y = y * r + kExpPoly[i];
  y = y * r * r + r + 1.0f;
  int32_t bits = (int32_t(fx) + 127) << 23;
  float scale; std::memcpy(&scale, &bits, 4);
  return y * scale;
}

// Where a KV head's row of a block slot lies in a layer's paged cache, in elements. Blocks are dense either
// way: token-major [block, slot, kv head, d] (every backend's logical layout, and the GPU's memory) or head-major
// [block, kv head, slot, d] (the CPU worker's memory: each head's keys of a block contiguous, 2 KiB at head dim
// 64 in bfloat16, so decode attention reads it as one run instead of 16 runs of 128 bytes).
struct KVLayout {
  int bs;
  int64_t blk, tok, head;
  KVLayout(int block_size, int hkv, int d, int head_major)
      : bs(block_size), blk(int64_t(block_size) * hkv * d), tok(head_major ? d : int64_t(hkv) * d),
        head(head_major ? int64_t(block_size) * d : d) {}
  // token t of a sequence (its block table given), kv head h
  int64_t at(const int32_t* table, int t, int h) const { return int64_t(table[t / bs]) * blk + (t % bs) * tok + h * head; }
};

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// AMX tiles (Sapphire Rapids and later): the bf16 panel GEMM and bf16 prefill attention use them where the CPU has
// them and Linux lends the process the tile state (asked once per process); kvf_amx turns them off and on, to
// compare with the vdpbf16ps kernels.
#define KVF_AMX 1
struct AmxTileConfig {  // LDTILECFG's 64 bytes, palette 1
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}
bool g_amx = true;  // kvf_amx(0): the vdpbf16ps kernels instead
inline bool use_amx() { return g_amx && amx_permitted(); }

inline void amx_load_config() {  // every tile 16 rows of 64 bytes; per thread, and per call (oneDNN sets its own)
  AmxTileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA (CPUs without AVX-512, e.g. AMD Zen 2/3): 8 lanes. The same algorithms as the AVX-512 code.
#define KVF_AVX2 1
#include <immintrin.h>

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline __m128i bf16_bits8(__m256 v) {  // round to nearest even, NaN stays NaN (as from_f)
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
  r = _mm256_srli_epi32(r, 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) { _mm_storeu_si128((__m128i*)p, bf16_bits8(v)); }
inline __m256 round8(__m256 v, const float*) { return v; }
inline __m256 round8(__m256 v, const uint16_t*) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16_bits8(v)), 16));
}

// exp(x), x <= 0, 8 lanes (exp_neg's polynomial)
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpMin));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fmadd_ps(fx, _mm256_set1_ps(kLn2Lo), r);
  __m256 y = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExpPoly[i]));
  y = _mm256_fmadd_ps(_mm256_mul_ps(y, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline __m256 silu8(__m256 g) {  // g * sigmoid(g), through exp(-|g|) so that nothing overflows
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  const __m256 e = exp8(_mm256_min_ps(g, _mm256_sub_ps(zero, g)));
  const __m256 num = _mm256_blendv_ps(one, e, _mm256_cmp_ps(g, zero, _CMP_LT_OQ));
  return _mm256_mul_ps(g, _mm256_div_ps(num, _mm256_add_ps(one, e)));
}

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
inline float hmax8(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
}
// r[j] = sum of v[j]'s 8 lanes, j = 0..7
inline __m256 hsum8x8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// One sequence, block size 16, head dim 8 * C: blocks outer, heads inner, as decode_seq_avx512. Each block
// runs in three phases over all heads, so that every phase holds independent work for the out-of-order core
// (per head, the chain scores -> max -> exp -> rescale is one long dependency): 1. scores of 8 keys at a time
// (8 accumulators, one query load per 8 FMAs) into sc; 2. the online softmax update of every head; 3. the
// weighted values into acc (L1). Block b + PF is prefetched meanwhile: in float32, which memory bounds, a line
// of its keys and one of its values at a time over phases 1 and 3 (SpreadPrefetch: alone on a 2-core Zen 3, 64
// sequences of 336 tokens, 30 layers' caches, 45-52 ms per step, was 50-58); in bfloat16, half the bytes and
// more work per byte, a burst of its keys per head in phase 1 and of its values in phase 3 (spread there: 38-41
// ms, was 30-35, the per-step test in the inner loops costing more than the prefetch wins).
template <int C, typename T>
void decode_seq_avx2(const T* __restrict q, const T* __restrict kc, const T* __restrict vc, const int32_t* table,
                     int len, int64_t row, int hq, int hkv, const KVLayout& kv, float scale, float* __restrict qf,
                     float* __restrict acc, float* __restrict ml, float* __restrict sc, T* __restrict out) {
  constexpr int D = 8 * C, BS = 16, PF = 1;
  const int g_size = hq / hkv;
  const int64_t tok_stride = kv.tok, head_stride = kv.head, blk_stride = kv.blk;
  const int64_t blk_bytes = blk_stride * int64_t(sizeof(T));
  constexpr bool spread = std::is_same_v<T, float>;
  const int num_blocks = (len + BS - 1) / BS;
  float* m = ml;
  float* l = ml + hq;
  float* corr = ml + 2 * hq;
  for (int hh = 0; hh < hq; ++hh) {
    for (int c = 0; c < C; ++c) {
      _mm256_storeu_ps(qf + hh * D + 8 * c, _mm256_mul_ps(load8(q + (row * hq + hh) * D + 8 * c), _mm256_set1_ps(scale)));
      _mm256_storeu_ps(acc + hh * D + 8 * c, _mm256_setzero_ps());
    }
    m[hh] = -3.0e38f;
    l[hh] = 0.0f;
  }
  const __m256 neg = _mm256_set1_ps(-3.0e38f);
  for (int b = 0; b < num_blocks; ++b) {
    const int n = b == num_blocks - 1 ? len - b * BS : BS;
    SpreadPrefetch pf;
    if (spread && b + PF < num_blocks)
      pf.start((const char*)(kc + int64_t(table[b + PF]) * blk_stride),
               (const char*)(vc + int64_t(table[b + PF]) * blk_stride), blk_bytes / 64, blk_bytes / 64);
    const int pb = std::min(b + PF, num_blocks - 1);
    const char* nk = (const char*)(kc + int64_t(table[pb]) * blk_stride);
    const char* nv = (const char*)(vc + int64_t(table[pb]) * blk_stride);
    const int64_t per_head = (blk_bytes / 64 + hq - 1) / hq * 64;
    const T* kb = kc + int64_t(table[b]) * blk_stride;
    const T* vb = vc + int64_t(table[b]) * blk_stride;
    for (int h = 0; h < hkv; ++h) {  // 1. scores
      for (int g = 0; g < g_size; ++g) {
        const int hh = h * g_size + g;
        const float* qg = qf + hh * D;
        if constexpr (!spread)
          for (int64_t off = hh * per_head; off < std::min(blk_bytes, (hh + 1) * per_head); off += 64)
            _mm_prefetch(nk + off, _MM_HINT_T0);
        for (int half = 0; half < 2; ++half) {
          __m256 dots[8];
          for (int j = 0; j < 8; ++j) dots[j] = _mm256_setzero_ps();
          for (int c = 0; c < C; ++c) {
            if constexpr (spread) pf.step();
            const __m256 qc = _mm256_loadu_ps(qg + 8 * c);
            for (int j = 0; j < 8; ++j)
              dots[j] = _mm256_fmadd_ps(qc, load8(kb + (8 * half + j) * tok_stride + h * head_stride + 8 * c), dots[j]);
          }
          _mm256_storeu_ps(sc + hh * BS + 8 * half, hsum8x8(dots));
        }
      }
    }
    const __m256 valid_lo = first_n_mask8(n), valid_hi = first_n_mask8(n - 8);
    for (int hh = 0; hh < hq; ++hh) {  // 2. softmax: sc becomes the block's weights
      const __m256 s0 = _mm256_blendv_ps(neg, _mm256_loadu_ps(sc + hh * BS), valid_lo);
      const __m256 s1 = _mm256_blendv_ps(neg, _mm256_loadu_ps(sc + hh * BS + 8), valid_hi);
      const float bmax = std::max(m[hh], hmax8(_mm256_max_ps(s0, s1)));
      const __m256 mx = _mm256_set1_ps(bmax);
      const __m256 e0 = _mm256_and_ps(valid_lo, exp8(_mm256_sub_ps(s0, mx)));
      const __m256 e1 = _mm256_and_ps(valid_hi, exp8(_mm256_sub_ps(s1, mx)));
      corr[hh] = std::exp(m[hh] - bmax);
      l[hh] = l[hh] * corr[hh] + hsum8(_mm256_add_ps(e0, e1));
      m[hh] = bmax;
      _mm256_storeu_ps(sc + hh * BS, e0);
      _mm256_storeu_ps(sc + hh * BS + 8, e1);
    }
    for (int h = 0; h < hkv; ++h) {  // 3. values
      for (int g = 0; g < g_size; ++g) {
        const int hh = h * g_size + g;
        const float* p = sc + hh * BS;
        float* a = acc + hh * D;
        if constexpr (!spread)
          for (int64_t off = hh * per_head; off < std::min(blk_bytes, (hh + 1) * per_head); off += 64)
            _mm_prefetch(nv + off, _MM_HINT_T0);
        __m256 av[C];
        const __m256 cv = _mm256_set1_ps(corr[hh]);
        for (int c = 0; c < C; ++c) av[c] = _mm256_mul_ps(_mm256_loadu_ps(a + 8 * c), cv);
        for (int j = 0; j < n; ++j) {
          if constexpr (spread) pf.step();
          const __m256 pj = _mm256_set1_ps(p[j]);
          const T* v = vb + j * tok_stride + h * head_stride;
          for (int c = 0; c < C; ++c) av[c] = _mm256_fmadd_ps(pj, load8(v + 8 * c), av[c]);
        }
        for (int c = 0; c < C; ++c) _mm256_storeu_ps(a + 8 * c, av[c]);
      }
    }
    pf.finish();
  }
  for (int hh = 0; hh < hq; ++hh) {
    const float inv = 1.0f / l[hh];
    T* o = out + (row * hq + hh) * D;
    for (int i = 0; i < D; ++i) from_f(acc[hh * D + i] * inv, o + i);
  }
}
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

inline __mmask16 first_n_mask16(int n) { return n >= 16 ? __mmask16(0xffff) : n <= 0 ? 0 : __mmask16((1u << n) - 1); }
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// r[j] = sum of v[j]'s 16 lanes, j = 0..15
inline __m512 hsum16(__m512* v) {
  __m512 t[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// exp(x), x <= 0, 16 lanes (exp_neg's polynomial)
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fmadd_ps(fx, _mm512_set1_ps(kLn2Lo), r);
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kExpPoly[i]));
  y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, fx);
}

// One sequence, block size 16, head dim 16 * C, G query heads per kv head: AVX-512 throughout. Blocks outer,
// heads inner: each block's keys and values (all heads) are read once, contiguously, while block b + 2 is
// prefetched; running max, sum and output of every head stay in L1 (acc).
template <int C, int G, typename T>
void decode_seq_avx512(const T* __restrict q, const T* __restrict kc, const T* __restrict vc,
                       const int32_t* table, int len, int64_t row, int hq, int hkv, const KVLayout& kv, float scale,
                       float* __restrict qf, float* __restrict acc, float* __restrict ml, float* __restrict lsum,
                       T* __restrict out) {
  constexpr int D = 16 * C, BS = 16, PF = 1;  // blocks ahead: 1 measured best (2 and 4 slower)
  const int64_t tok_stride = kv.tok, head_stride = kv.head, blk_stride = kv.blk;
  const int64_t blk_lines = blk_stride * int64_t(sizeof(T)) / 64;
  const int64_t steps = int64_t(hkv) * BS * (G + 1);  // pf.step()s a block: a key per head, then per kv head
  const int num_blocks = (len + BS - 1) / BS;
  float* m = ml;
  for (int hh = 0; hh < hq; ++hh) {
    for (int c = 0; c < C; ++c) {
      _mm512_storeu_ps(qf + hh * D + 16 * c, _mm512_mul_ps(load16(q + (row * hq + hh) * D + 16 * c), _mm512_set1_ps(scale)));
      _mm512_storeu_ps(acc + hh * D + 16 * c, _mm512_setzero_ps());
    }
    m[hh] = -3.0e38f;
    _mm512_storeu_ps(lsum + hh * BS, _mm512_setzero_ps());
  }
  for (int b = 0; b < PF && b < num_blocks; ++b)
    for (int64_t i = 0; i < blk_lines; ++i) {
      _mm_prefetch((const char*)(kc + int64_t(table[b]) * blk_stride) + 64 * i, _MM_HINT_T0);
      _mm_prefetch((const char*)(vc + int64_t(table[b]) * blk_stride) + 64 * i, _MM_HINT_T0);
    }
  for (int b = 0; b < num_blocks; ++b) {
    const int n = b == num_blocks - 1 ? len - b * BS : BS;
    const __mmask16 valid = n == 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
    SpreadPrefetch pf;
    if (b + PF < num_blocks)
      pf.start((const char*)(kc + int64_t(table[b + PF]) * blk_stride),
               (const char*)(vc + int64_t(table[b + PF]) * blk_stride), blk_lines, steps);
    const T* kb = kc + int64_t(table[b]) * blk_stride;
    const T* vb = vc + int64_t(table[b]) * blk_stride;
    for (int h = 0; h < hkv; ++h) {
      float p[G][BS], corr[G];
      for (int g = 0; g < G; ++g) {
        const int hh = h * G + g;
        __m512 dots[BS];
        __m512 s;
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, uint16_t> && C % 2 == 0) {
          // bf16 x bf16 pairs summed in fp32 (vdpbf16ps): half the work of converting and FMAs; scaled after
          __m512i qb[C / 2];
          for (int c = 0; c < C / 2; ++c) qb[c] = _mm512_loadu_si512(q + (row * hq + hh) * D + 32 * c);
          for (int j = 0; j < BS; ++j) {
            pf.step();
            const T* k = kb + j * tok_stride + h * head_stride;
            __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)qb[0], (__m512bh)_mm512_loadu_si512(k));
            for (int c = 1; c < C / 2; ++c)
              a = _mm512_dpbf16_ps(a, (__m512bh)qb[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
            dots[j] = a;
          }
          s = _mm512_mul_ps(hsum16(dots), _mm512_set1_ps(scale));
        } else
#endif
        {
          __m512 qv[C];
          for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(qf + hh * D + 16 * c);
          for (int j = 0; j < BS; ++j) {
            pf.step();
            const T* k = kb + j * tok_stride + h * head_stride;
            __m512 a = _mm512_mul_ps(qv[0], load16(k));
            for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[c], load16(k + 16 * c), a);
            dots[j] = a;
          }
          s = hsum16(dots);
        }
        s = _mm512_mask_mov_ps(_mm512_set1_ps(-3.0e38f), valid, s);
        // The running max moves only where a score passes it (rarely after a sequence's first blocks): the
        // reduction across lanes and the rescale factor's exp run only then; else the max stays and the factor
        // is exactly exp(0) = 1. The sum stays in lanes (lsum), reduced once at the end.
        corr[g] = 1.0f;
        if (_mm512_cmp_ps_mask(s, _mm512_set1_ps(m[hh]), _CMP_GT_OQ)) {
          const float bmax = std::max(m[hh], _mm512_reduce_max_ps(s));
          corr[g] = exp_neg(m[hh] - bmax);  // inline: a libm call here made the compiler spill every zmm register
          m[hh] = bmax;
        }
        const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m[hh]))));
        __m512 ls = _mm512_loadu_ps(lsum + hh * BS);
        if (corr[g] != 1.0f) ls = _mm512_mul_ps(ls, _mm512_set1_ps(corr[g]));
        _mm512_storeu_ps(lsum + hh * BS, _mm512_add_ps(ls, e));
        _mm512_storeu_ps(p[g], e);
      }
      __m512 a[G][C];  // the output so far, rescaled to the block's max as it is loaded (where it moved)
      bool rescale = false;
      for (int g = 0; g < G; ++g) rescale |= corr[g] != 1.0f;
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) {
          a[g][c] = _mm512_loadu_ps(acc + (h * G + g) * D + 16 * c);
          if (rescale) a[g][c] = _mm512_mul_ps(a[g][c], _mm512_set1_ps(corr[g]));
        }
      for (int j = 0; j < n; ++j) {
        pf.step();
        const T* v = vb + j * tok_stride + h * head_stride;
        __m512 vv[C];
        for (int c = 0; c < C; ++c) vv[c] = load16(v + 16 * c);
        for (int g = 0; g < G; ++g) {
          const __m512 pj = _mm512_set1_ps(p[g][j]);
          for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(pj, vv[c], a[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (h * G + g) * D + 16 * c, a[g][c]);
    }
    pf.finish();
  }
  for (int hh = 0; hh < hq; ++hh) {
    const float inv = 1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(lsum + hh * BS));
    T* o = out + (row * hq + hh) * D;
    for (int i = 0; i < D; ++i) from_f(acc[hh * D + i] * inv, o + i);
  }
}

template <int C, typename T>
bool decode_seq_fast(int g_size, const T* q, const T* kc, const T* vc, const int32_t* table, int len, int64_t row,
                     int hq, int hkv, const KVLayout& kv, float scale, float* qf, float* acc, float* ml, float* lsum,
                     T* out) {
  switch (g_size) {
    case 1: decode_seq_avx512<C, 1>(q, kc, vc, table, len, row, hq, hkv, kv, scale, qf, acc, ml, lsum, out); return true;
    case 2: decode_seq_avx512<C, 2>(q, kc, vc, table, len, row, hq, hkv, kv, scale, qf, acc, ml, lsum, out); return true;
    case 3: decode_seq_avx512<C, 3>(q, kc, vc, table, len, row, hq, hkv, kv, scale, qf, acc, ml, lsum, out); return true;
    case 4: decode_seq_avx512<C, 4>(q, kc, vc, table, len, row, hq, hkv, kv, scale, qf, acc, ml, lsum, out); return true;
    case 5: decode_seq_avx512<C, 5>(q, kc, vc, table, len, row, hq, hkv, kv, scale, qf, acc, ml, lsum, out); return true;
    case 6: decode_seq_avx512<C, 6>(q, kc, vc, table, len, row, hq, hkv, kv, scale, qf, acc, ml, lsum, out); return true;
    case 7: decode_seq_avx512<C, 7>(q, kc, vc, table, len, row, hq, hkv, kv, scale, qf, acc, ml, lsum, out); return true;
    case 8: decode_seq_avx512<C, 8>(q, kc, vc, table, len, row, hq, hkv, kv, scale, qf, acc, ml, lsum, out); return true;
    default: return false;
  }
}

// the AVX-512 kernel when it covers the shape (block size 16, head dim 64 or 128, common group sizes)
template <typename T>
bool decode_seq_simd(int d, int g_size, const T* q, const T* kc, const T* vc, const int32_t* table,
                     int len, int64_t row, int hq, int hkv, const KVLayout& kv, float scale, float* qf, float* acc,
                     float* ml, float* sc, T* out) {  // sc: hq x 16 floats, the AVX-512 kernel's sums in lanes
  if (kv.bs != 16) return false;
  if (d == 64) return decode_seq_fast<4>(g_size, q, kc, vc, table, len, row, hq, hkv, kv, scale, qf, acc, ml, sc, out);
  if (d == 128) return decode_seq_fast<8>(g_size, q, kc, vc, table, len, row, hq, hkv, kv, scale, qf, acc, ml, sc, out);
  return false;
}
#elif defined(KVF_AVX2)
// the AVX2 kernel when it covers the shape (block size 16, head dim 64 or 128, any group size)
template <typename T>
bool decode_seq_simd(int d, int, const T* q, const T* kc, const T* vc, const int32_t* table,
                     int len, int64_t row, int hq, int hkv, const KVLayout& kv, float scale, float* qf, float* acc,
                     float* ml, float* sc, T* out) {
  if (kv.bs != 16) return false;
  if (d == 64) { decode_seq_avx2<8>(q, kc, vc, table, len, row, hq, hkv, kv, scale, qf, acc, ml, sc, out); return true; }
  if (d == 128) { decode_seq_avx2<16>(q, kc, vc, table, len, row, hq, hkv, kv, scale, qf, acc, ml, sc, out); return true; }
  return false;
}
#else
template <typename T>
bool decode_seq_simd(int, int, const T*, const T*, const T*, const int32_t*, int, int64_t, int, int,
                     const KVLayout&, float, float*, float*, float*, float*, T*) {
  return false;
}
#endif

// One sequence at a time: all its heads, one pass over its blocks (each block's keys and values are read
// once, contiguously, while the next block is prefetched), softmax online. D_: head dim when known at compile
// time (0: d at run time).
template <int D_, typename T>
void decode_one(const T* __restrict q, const T* __restrict kc, const T* __restrict vc, const int32_t* table,
                int len, int64_t row, int hq, int hkv, int d_rt, const KVLayout& kv, float scale,
                float* __restrict qf, float* __restrict acc, float* __restrict sc, T* __restrict out) {
  const int d = D_ ? D_ : d_rt, g_size = hq / hkv, bs = kv.bs;
  const int64_t tok_stride = kv.tok, head_stride = kv.head, blk_stride = kv.blk;
  float m[256], l[256];  // per query head: running max and sum (hq <= 256)
  for (int hh = 0; hh < hq; ++hh) {
    for (int i = 0; i < d; ++i) qf[hh * d + i] = to_f(q[(row * hq + hh) * d + i]) * scale;
    for (int i = 0; i < d; ++i) acc[hh * d + i] = 0.0f;
    m[hh] = -3.0e38f;
    l[hh] = 0.0f;
  }
  const int num_blocks = (len + bs - 1) / bs;
  for (int b = 0; b < num_blocks; ++b) {
    const int n = b == num_blocks - 1 ? len - b * bs : bs;
    const T* kb = kc + int64_t(table[b]) * blk_stride;
    const T* vb = vc + int64_t(table[b]) * blk_stride;
    if (b + 1 < num_blocks) {  // the next block: 2 * bs * hkv * d elements, one prefetch per cache line
      const char* nk = reinterpret_cast<const char*>(kc + int64_t(table[b + 1]) * blk_stride);
      const char* nv = reinterpret_cast<const char*>(vc + int64_t(table[b + 1]) * blk_stride);
      const int64_t bytes = blk_stride * int64_t(sizeof(T));
      for (int64_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch(nk + off);
        __builtin_prefetch(nv + off);
      }
    }
    for (int h = 0; h < hkv; ++h) {
      for (int g = 0; g < g_size; ++g) {  // scores of this block
        const int hh = h * g_size + g;
        const float* qg = qf + hh * d;
        float* s = sc + hh * bs;
        float bmax = m[hh];
        for (int j = 0; j < n; ++j) {
          const T* k = kb + j * tok_stride + h * head_stride;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int i = 0; i < d; ++i) dot += qg[i] * to_f(k[i]);
          s[j] = dot;
          bmax = dot > bmax ? dot : bmax;
        }
        const float correction = exp_neg(m[hh] - bmax);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < n; ++j) { s[j] = exp_neg(s[j] - bmax); sum += s[j]; }
        l[hh] = l[hh] * correction + sum;
        m[hh] = bmax;
        float* a = acc + hh * d;
        if (correction != 1.0f)
          for (int i = 0; i < d; ++i) a[i] *= correction;
      }
      for (int j = 0; j < n; ++j) {  // acc[g] += p[g][j] * v_j
        const T* v = vb + j * tok_stride + h * head_stride;
        for (int g = 0; g < g_size; ++g) {
          const int hh = h * g_size + g;
          const float p = sc[hh * bs + j];
          float* a = acc + hh * d;
#pragma omp simd
          for (int i = 0; i < d; ++i) a[i] += p * to_f(v[i]);
        }
      }
    }
  }
  for (int hh = 0; hh < hq; ++hh) {
    const float inv = 1.0f / l[hh];
    for (int i = 0; i < d; ++i) from_f(acc[hh * d + i] * inv, &out[(row * hq + hh) * d + i]);
  }
}

template <typename T>
void decode_attention(const T* q, const T* kc, const T* vc, const int32_t* bt, int64_t bt_stride,
                      const int32_t* ctx_lens, const int64_t* rows, int num_seqs, int hq, int hkv, int d,
                      int bs, int head_major, float scale, int max_ctx, T* out, int simd) {
  (void)max_ctx;
  const KVLayout kv(bs, hkv, d, head_major);
#pragma omp parallel
  {
    std::vector<float> qf(size_t(hq) * d), acc(size_t(hq) * d), sc(size_t(hq) * bs), ml(size_t(hq) * 3);
#pragma omp for schedule(dynamic, 1)
    for (int s = 0; s < num_seqs; ++s) {
      const int32_t* table = bt + s * bt_stride;
      if (simd && decode_seq_simd(d, hq / hkv, q, kc, vc, table, ctx_lens[s], rows[s], hq, hkv, kv, scale, qf.data(),
                                  acc.data(), ml.data(), sc.data(), out))
        continue;
      if (d == 64)
        decode_one<64>(q, kc, vc, table, ctx_lens[s], rows[s], hq, hkv, d, kv, scale, qf.data(), acc.data(),
                       sc.data(), out);
      else if (d == 128)
        decode_one<128>(q, kc, vc, table, ctx_lens[s], rows[s], hq, hkv, d, kv, scale, qf.data(), acc.data(),
                        sc.data(), out);
      else
        decode_one<0>(q, kc, vc, table, ctx_lens[s], rows[s], hq, hkv, d, kv, scale, qf.data(), acc.data(),
                      sc.data(), out);
    }
  }
}


// ---- elementwise ops ---------------------------------------------------------------------------------------
// Rows of fewer elements than this in all run on the calling thread only. A decode step's (64 rows of 576 to
// 3072) are split over the threads: the other threads are spinning there after the step's matmuls.
constexpr int64_t kParallelElems = 16384;
inline bool parallel_worth(int64_t rows, int64_t row_elems) { return rows >= 2 && rows * row_elems >= kParallelElems; }

inline float round_as(float x, const float*) { return x; }
inline float round_as(float x, const uint16_t*) { uint16_t b; from_f(x, &b); return to_f(b); }

inline float silu_f(float g) {
  const float e = exp_neg(g < 0.0f ? g : -g);  // exp(-|g|)
  return g * (g < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e));
}

#if defined(__AVX512F__)
inline __m256i bf16_bits_portable(__m512 v) {  // round to nearest even, NaN stays NaN (as from_f)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
#if defined(__AVX512BF16__)
// One vcvtneps2bf16 where no lane is a float32 subnormal, which that instruction flushes to zero (torch
// rounds it to a bf16 subnormal): the same bits as bf16_bits_portable, NaN included, in one instruction of ~8.
// The subnormal test is one vfpclassps (AVX512DQ, which every AVX512_BF16 CPU has) where a test and a masked
// test had cost bfloat16 RMSNorm 17%, rotary 21% and SiLU-and-mul 7% of their time (Zen 5, 512 rows).
inline __m256i bf16_bits(__m512 v) {
#if defined(__AVX512DQ__)
  if (_mm512_fpclass_ps_mask(v, 0x20))  // 0x20: subnormal, either sign
    return bf16_bits_portable(v);
#else
  const __m512i u = _mm512_castps_si512(v);
  if (_mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000)), u,
                                  _mm512_set1_epi32(0x007fffff)))
    return bf16_bits_portable(v);
#endif
  return (__m256i)_mm512_cvtneps_pbh(v);
}
#else
inline __m256i bf16_bits(__m512 v) { return bf16_bits_portable(v); }
#endif
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, bf16_bits(v)); }
inline __m512 round16(__m512 v, const float*) { return v; }
inline __m512 round16(__m512 v, const uint16_t*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(v)), 16));
}
inline __m512 silu16(__m512 g) {
  const __m512 e = exp16(_mm512_min_ps(g, _mm512_sub_ps(_mm512_setzero_ps(), g)));  // exp(-|g|)
  const __m512 one = _mm512_set1_ps(1.0f), den = _mm512_add_ps(one, e);
  // sigmoid: e / (1 + e) where g < 0, else 1 / (1 + e): one division, of the numerator chosen first
  const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), one, e);
  return _mm512_mul_ps(g, _mm512_div_ps(num, den));
}
constexpr int64_t kVec = 16;
#else
constexpr int64_t kVec = 0;
#endif

// HF's LlamaRMSNorm: float statistics, the normalized value rounded to the model dtype, then times weight.
// With residual: h = x + residual (model dtype) is normalized and also written to new_residual.
template <typename T>
void rms_norm(const T* __restrict x, const T* __restrict residual, const T* __restrict w, T* __restrict out,
              T* __restrict new_residual, int64_t rows, int64_t h, float eps) {
  const int64_t hv = kVec ? h / 16 * 16 : 0;
#pragma omp parallel for if (parallel_worth(rows, h)) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * h;
    T* o = out + r * h;
    const T* src = xr;
    float ss = 0.0f;
    if (residual != nullptr) {
      const T* res = residual + r * h;
      T* nr = new_residual + r * h;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i < hv; i += 16) store16(nr + i, _mm512_add_ps(load16(xr + i), load16(res + i)));
#elif defined(KVF_AVX2)
      for (; i + 8 <= h; i += 8) store8(nr + i, _mm256_add_ps(load8(xr + i), load8(res + i)));
#endif
      for (; i < h; ++i) from_f(to_f(xr[i]) + to_f(res[i]), nr + i);
      src = nr;
    }
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i < hv; i += 16) {
      const __m512 v = load16(src + i);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    ss = _mm512_reduce_add_ps(acc);
#elif defined(KVF_AVX2)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= h; i += 8) {
      const __m256 v = load8(src + i);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    ss = hsum8(acc);
#endif
    for (; i < h; ++i) ss += to_f(src[i]) * to_f(src[i]);
    const float inv = 1.0f / std::sqrt(ss / float(h) + eps);
    i = 0;
#if defined(__AVX512F__)
    for (; i < hv; i += 16)
      store16(o + i, _mm512_mul_ps(load16(w + i), round16(_mm512_mul_ps(load16(src + i), _mm512_set1_ps(inv)), o)));
#elif defined(KVF_AVX2)
    for (; i + 8 <= h; i += 8)
      store8(o + i, _mm256_mul_ps(load8(w + i), round8(_mm256_mul_ps(load8(src + i), _mm256_set1_ps(inv)), o)));
#endif
    for (; i < h; ++i) from_f(to_f(w[i]) * round_as(to_f(src[i]) * inv, o), o + i);
  }
}

// silu(gate) * up for x = [gate | up] rows; silu rounded to the model dtype before the product (as HF's
// act_fn(gate_proj(x)) * up_proj(x)).
template <typename T>
void silu_and_mul(const T* __restrict x, T* __restrict out, int64_t rows, int64_t inter) {
  const int64_t iv = kVec ? inter / 16 * 16 : 0;
#pragma omp parallel for if (parallel_worth(rows, 2 * inter)) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = x + r * 2 * inter;
    const T* u = g + inter;
    T* o = out + r * inter;
    int64_t i = 0;
#if defined(__AVX512F__)
    // four registers at a time: their exps' dependency chains interleaved (one at a time the loop ran at 2.3-2.5
    // G elements/s a thread on a Zen 5, prefill-sized bfloat16 rows; four: 2.8-2.9)
    for (; i + 64 <= iv; i += 64) {
      __m512 s[4];
      for (int c = 0; c < 4; ++c) s[c] = silu16(load16(g + i + 16 * c));
      for (int c = 0; c < 4; ++c) store16(o + i + 16 * c, _mm512_mul_ps(round16(s[c], o), load16(u + i + 16 * c)));
    }
    for (; i < iv; i += 16) store16(o + i, _mm512_mul_ps(round16(silu16(load16(g + i)), o), load16(u + i)));
#elif defined(KVF_AVX2)
    for (; i + 8 <= inter; i += 8) store8(o + i, _mm256_mul_ps(round8(silu8(load8(g + i)), o), load8(u + i)));
#endif
    for (; i < inter; ++i) from_f(round_as(silu_f(to_f(g[i])), o) * to_f(u[i]), o + i);
  }
}

// Rotary embedding of query [T, hq * d] and key [T, hkv * d] rows (row strides given) into contiguous
// outputs. cos_sin: [max_pos, d], cos | sin halves. neox: rotate halves; otherwise interleaved pairs.
template <typename T>
void rotary(const int64_t* __restrict pos, const T* __restrict q, int64_t q_stride, const T* __restrict k,
            int64_t k_stride, const T* __restrict cos_sin, T* __restrict q_out, T* __restrict k_out, int64_t n,
            int hq, int hkv, int d, int neox) {
  const int half = d / 2;
  const int hv = (kVec && neox) ? half / 16 * 16 : 0;
#pragma omp parallel for if (parallel_worth(n, int64_t(hq + hkv) * d)) schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    const T* cs = cos_sin + pos[t] * d;
    for (int which = 0; which < 2; ++which) {
      const int heads = which == 0 ? hq : hkv;
      const T* src = which == 0 ? q + t * q_stride : k + t * k_stride;
      T* dst = which == 0 ? q_out + t * int64_t(hq) * d : k_out + t * int64_t(hkv) * d;
      for (int h = 0; h < heads; ++h) {
        const T* x = src + h * d;
        T* o = dst + h * d;
        int i = 0;
#if defined(__AVX512F__)
        for (; i < hv; i += 16) {  // neox: halves
          const __m512 c = load16(cs + i), s = load16(cs + half + i);
          const __m512 x1 = load16(x + i), x2 = load16(x + half + i);
          store16(o + i, _mm512_sub_ps(round16(_mm512_mul_ps(x1, c), o), round16(_mm512_mul_ps(x2, s), o)));
          store16(o + half + i, _mm512_add_ps(round16(_mm512_mul_ps(x2, c), o), round16(_mm512_mul_ps(x1, s), o)));
        }
#endif
        for (; i < half; ++i) {
          const float c = to_f(cs[i]), s = to_f(cs[half + i]);
          const int i1 = neox ? i : 2 * i, i2 = neox ? i + half : 2 * i + 1;
          const float x1 = to_f(x[i1]), x2 = to_f(x[i2]);
          from_f(round_as(x1 * c, o) - round_as(x2 * s, o), o + i1);
          from_f(round_as(x2 * c, o) + round_as(x1 * s, o), o + i2);
        }
      }
    }
  }
}


// ---- prefill attention (AVX-512) ---------------------------------------------------------------------------
// One chunk of one sequence: q_len queries at positions ctx - q_len .. ctx - 1, causal over the paged keys.
// Work item = (kv head, tile of 16 queries) with its G query heads; keys go by in tiles of 16. Everything per
// query row is held transposed, a lane per row: the queries (transposed once per work item), the scores (one
// register per key: s[j] = 16 rows . key j, from a query column times the key's element broadcast from memory),
// the running max and sum, and the output (acc[g][d] = 16 rows' element d). So the online softmax runs across
// registers (max, exp, sum per lane; no horizontal reduction, no scalar exp), and P V is again a column of
// probabilities times a broadcast value element: no key tile is ever transposed. Tiles past a query tile's last
// position are skipped; the diagonal tile is masked per lane. (Rows as lanes measured 70-79 GFLOP/s per thread
// in float32 against 37-41 with keys as lanes, which needed a transposed key tile and per-row reductions.)
// The scalar ends of a prefill work item (TILE query rows of head dim D, a register's lanes; g_size query heads
// of KV head h), shared by the AVX-512 and AVX2 kernels. The start: each query head's rows transposed and scaled
// into qt (lane i of qt[g][d] = row i's element d; rows past the last repeat it). The end: acc holds each query
// head's output transposed the same way; row i's output acc / l goes into its head's slot of out.
template <int D, int TILE, typename T>
void prefill_load_transposed(const T* __restrict q, int rows, int i0, int h, int hq, int g_size, float scale,
                             float* __restrict qt) {
  for (int g = 0; g < g_size; ++g)
    for (int i = 0; i < TILE; ++i) {
      const T* qp = q + (int64_t(i0 + std::min(i, rows - 1)) * hq + h * g_size + g) * D;
      for (int d = 0; d < D; ++d) qt[(g * D + d) * TILE + i] = to_f(qp[d]) * scale;
    }
}

template <int D, int TILE, typename T>
void prefill_store_transposed(const float* __restrict acc, const float* __restrict l, int rows, int i0, int h,
                              int hq, int g_size, T* __restrict out) {
  for (int g = 0; g < g_size; ++g)
    for (int i = 0; i < rows; ++i) {
      const float inv = 1.0f / l[g * TILE + i];
      T* o = out + (int64_t(i0 + i) * hq + h * g_size + g) * D;
      for (int d = 0; d < D; ++d) from_f(acc[(g * D + d) * TILE + i] * inv, o + d);
    }
}

#if defined(__AVX512F__)

// r[i] = row i (16 elements of 32 bits) -> r[c] = column c (lane i = row i's element c), in 64 shuffles
inline void transpose16x16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  __m512 u[16];  // u[4 i + k], 128-bit lane L: rows 4 i .. 4 i + 3 of column 4 L + k
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int k = 0; k < 4; ++k) {
    const __m512 p = _mm512_shuffle_f32x4(u[k], u[4 + k], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 q = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 p2 = _mm512_shuffle_f32x4(u[k], u[4 + k], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512 q2 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], _MM_SHUFFLE(3, 2, 3, 2));
    r[k] = _mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + k] = _mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(3, 1, 3, 1));
    r[8 + k] = _mm512_shuffle_f32x4(p2, q2, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + k] = _mm512_shuffle_f32x4(p2, q2, _MM_SHUFFLE(3, 1, 3, 1));
  }
}
// prefill_load_transposed and prefill_store_transposed for 16-row tiles: each 16 x 16 block transposed in
// registers, where the portable loops moved one element at a time (a tenth of the bf16 kernel's time).
template <int D, typename T>
void prefill_load_transposed16(const T* __restrict q, int rows, int i0, int h, int hq, int g_size, float scale,
                               float* __restrict qt) {
  for (int g = 0; g < g_size; ++g)
    for (int d0 = 0; d0 < D; d0 += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = _mm512_mul_ps(load16(q + (int64_t(i0 + std::min(i, rows - 1)) * hq + h * g_size + g) * D + d0),
                             _mm512_set1_ps(scale));
      transpose16x16(r);
      for (int c = 0; c < 16; ++c) _mm512_storeu_ps(qt + (g * D + d0 + c) * 16, r[c]);
    }
}

template <int D, typename T>
void prefill_store_transposed16(const float* __restrict acc, const float* __restrict l, int rows, int i0, int h,
                                int hq, int g_size, T* __restrict out) {
  for (int g = 0; g < g_size; ++g) {
    alignas(64) float inv[16];
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(l + g * 16)));
    for (int d0 = 0; d0 < D; d0 += 16) {
      __m512 r[16];
      for (int e = 0; e < 16; ++e) r[e] = _mm512_loadu_ps(acc + (g * D + d0 + e) * 16);
      transpose16x16(r);
      for (int i = 0; i < rows; ++i)
        store16(out + (int64_t(i0 + i) * hq + h * g_size + g) * D + d0, _mm512_mul_ps(r[i], _mm512_set1_ps(inv[i])));
    }
  }
}

// The causal mask of the key tile at t0 for the query rows first_pos .. first_pos + 15 (a lane each): visible[j]
// holds the rows at or after key t0 + j (all of them when the whole tile precedes the first row).
inline void key_tile_masks(int first_pos, int t0, __mmask16* visible) {
  const __m512i row_pos = _mm512_add_epi32(_mm512_set1_epi32(first_pos),
                                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  for (int j = 0; j < 16; ++j) visible[j] = _mm512_cmpge_epi32_mask(row_pos, _mm512_set1_epi32(t0 + j));
}

// How the prefill kernels' inner products step. float32: one element (of d, or one key) per FMA, its other
// operand a float broadcast from memory. bfloat16 (AVX512_BF16): a pair per vdpbf16ps, the broadcast a 32-bit pair.
struct F32Steps {
  using Elem = float;
  static constexpr int kPerStep = 1;
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 bcast(float x) { return _mm512_set1_ps(x); }
  static __m512 madd(__m512 acc, __m512 a, __m512 b) { return _mm512_fmadd_ps(a, b, acc); }
};
#if defined(__AVX512BF16__)
struct Bf16PairSteps {
  using Elem = uint32_t;
  static constexpr int kPerStep = 2;
  static __m512 load(const uint32_t* p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
  static __m512 bcast(uint32_t x) { return _mm512_castsi512_ps(_mm512_set1_epi32(int(x))); }
  static __m512 madd(__m512 acc, __m512 a, __m512 b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
};
#endif

// The scores of GP query heads (of one KV head) against a tile of 16 keys: lane i of s_out[g][j] = row i of head
// g . key j (unscaled in bfloat16), from qt [g][K][16] (each head's 16 rows transposed: K steps of d) and kt
// [16][K] (each key's steps). A column of each head's queries times a key step broadcast from memory: with GP
// heads sharing each broadcast, GP + J loads per GP * J FMAs (3 heads: 11 per 24; one head: 17 per 16). In
// bfloat16 a vpbroadcastd per vdpbf16ps had been a third of the kernel's cycles.
template <int GP, int K, typename S>
inline void prefill_scores(const typename S::Elem* __restrict qt, const typename S::Elem* __restrict kt,
                           float* __restrict s_out) {
  constexpr int TILE = 16, J = GP == 1 ? 16 : 8;
  for (int j0 = 0; j0 < TILE; j0 += J) {
    __m512 s[GP][J];
    for (int g = 0; g < GP; ++g)
      for (int j = 0; j < J; ++j) s[g][j] = _mm512_setzero_ps();
    for (int k = 0; k < K; ++k) {
      __m512 qv[GP];
      for (int g = 0; g < GP; ++g) qv[g] = S::load(qt + (g * K + k) * TILE);
      for (int j = 0; j < J; ++j) {
        const __m512 kb = S::bcast(kt[(j0 + j) * K + k]);
        for (int g = 0; g < GP; ++g) s[g][j] = S::madd(s[g][j], qv[g], kb);
      }
    }
    for (int g = 0; g < GP; ++g)
      for (int j = 0; j < J; ++j) _mm512_storeu_ps(s_out + (g * TILE + j0 + j) * TILE, s[g][j]);
  }
}

// acc[g] = acc[g] * corr[g] + P[g] V for GP heads: lane i of acc[g][d] = row i's element d; pt [g][16 / kPerStep]
// [16]: the 16 rows' probabilities of a step of keys (one key; in bfloat16 a pair); vt [16 / kPerStep][D]: element
// d of the step's keys. A probability column of each head times a value step broadcast from memory, E elements of
// d at a time (GP + E loads per GP * E FMAs); nj steps of keys.
template <int GP, int D, typename S>
inline void prefill_pv(const typename S::Elem* __restrict pt, const typename S::Elem* __restrict vt,
                       const float* __restrict corr, float* __restrict acc, int nj) {
  constexpr int TILE = 16, E = GP == 1 ? 16 : 8, NJ = TILE / S::kPerStep;
  for (int d0 = 0; d0 < D; d0 += E) {
    __m512 o[GP][E];
    for (int g = 0; g < GP; ++g) {
      const __m512 cv = _mm512_loadu_ps(corr + g * TILE);
      for (int e = 0; e < E; ++e) o[g][e] = _mm512_mul_ps(_mm512_loadu_ps(acc + (g * D + d0 + e) * TILE), cv);
    }
    for (int j = 0; j < nj; ++j) {
      __m512 pj[GP];
      for (int g = 0; g < GP; ++g) pj[g] = S::load(pt + (g * NJ + j) * TILE);
      for (int e = 0; e < E; ++e) {
        const __m512 vb = S::bcast(vt[j * D + d0 + e]);
        for (int g = 0; g < GP; ++g) o[g][e] = S::madd(o[g][e], pj[g], vb);
      }
    }
    for (int g = 0; g < GP; ++g)
      for (int e = 0; e < E; ++e) _mm512_storeu_ps(acc + (g * D + d0 + e) * TILE, o[g][e]);
  }
}

// f(std::integral_constant<int, GP>{}, g0) for the query heads of a KV head in groups of up to 3 (g0: the
// group's first), so that the prefill kernels' inner products take GP as a compile-time constant.
template <typename F>
inline void for_head_groups(int g_size, F&& f) {
  for (int g0 = 0; g0 < g_size; g0 += 3) {
    switch (std::min(3, g_size - g0)) {
      case 3: f(std::integral_constant<int, 3>{}, g0); break;
      case 2: f(std::integral_constant<int, 2>{}, g0); break;
      default: f(std::integral_constant<int, 1>{}, g0); break;
    }
  }
}

template <int C, typename T>
void prefill_tile(const T* __restrict q, const T* __restrict kc, const T* __restrict vc, const int32_t* table,
                  int ctx, int q_len, int i0, int h, int hq, int hkv, int g_size, const KVLayout& kv, float scale,
                  float* __restrict buf, T* __restrict out) {
  constexpr int D = 16 * C, TILE = 16;
  const int rows = std::min(TILE, q_len - i0), first_pos = ctx - q_len + i0, last_pos = first_pos + rows - 1;
  float* qt = buf;                   // [g][D][TILE]: each query head's 16 rows, transposed and scaled
  float* acc = qt + g_size * D * TILE;  // [g][D][TILE]: the output, transposed as the queries
  float* m = acc + g_size * TILE * D;   // [g][TILE]
  float* l = m + g_size * TILE;         // [g][TILE]
  float* kt = l + g_size * TILE;        // [TILE][D]: the key tile, contiguous (one base for the broadcasts)
  float* vt = kt + TILE * D;            // [TILE][D]
  float* pt = vt + TILE * D;            // [g][TILE keys][TILE rows]: probabilities
  float* corr = pt + g_size * TILE * TILE;  // [g][TILE]
  prefill_load_transposed16<D>(q, rows, i0, h, hq, g_size, scale, qt);
  for (int g = 0; g < g_size; ++g) {
    for (int d = 0; d < D; ++d) _mm512_storeu_ps(acc + (g * D + d) * TILE, _mm512_setzero_ps());
    _mm512_storeu_ps(m + g * TILE, _mm512_set1_ps(-3.0e38f));
    _mm512_storeu_ps(l + g * TILE, _mm512_setzero_ps());
  }
  for (int t0 = 0; t0 <= last_pos; t0 += TILE) {
    const int nk = std::min(TILE, last_pos + 1 - t0);  // keys t0 .. t0 + nk - 1
    for (int j = 0; j < TILE; ++j) {
      if (j < nk) {
        const int t = t0 + j;
        const T* kr = kc + kv.at(table, t, h);
        const T* vr = vc + kv.at(table, t, h);
        for (int c = 0; c < C; ++c) {
          _mm512_storeu_ps(kt + j * D + 16 * c, load16(kr + 16 * c));
          _mm512_storeu_ps(vt + j * D + 16 * c, load16(vr + 16 * c));
        }
      } else {  // scored (then masked); its value row is never read (P V stops at nk)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(kt + j * D + 16 * c, _mm512_setzero_ps());
      }
    }
    __mmask16 visible[16];
    key_tile_masks(first_pos, t0, visible);
    for_head_groups(g_size, [&](auto gp, int g0) {  // scores into pt
      prefill_scores<decltype(gp)::value, D, F32Steps>(qt + g0 * D * TILE, kt, pt + g0 * TILE * TILE);
    });
    for (int g = 0; g < g_size; ++g) {
      // online softmax, all 16 rows at once: the max and the sums run across registers, not lanes
      float* sg = pt + g * TILE * TILE;
      const __m512 m_old = _mm512_loadu_ps(m + g * TILE);
      __m512 mt[TILE];  // the rows' max over the tile as a tree (4 levels, not a chain of 16)
      for (int j = 0; j < TILE; ++j)
        mt[j] = _mm512_mask_mov_ps(_mm512_set1_ps(-3.0e38f), visible[j], _mm512_loadu_ps(sg + j * TILE));
      for (int w = TILE / 2; w > 0; w /= 2)
        for (int j = 0; j < w; ++j) mt[j] = _mm512_max_ps(mt[j], mt[j + w]);
      const __m512 mx = _mm512_max_ps(m_old, mt[0]);
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < TILE; ++j) {
        const __m512 p = _mm512_maskz_mov_ps(visible[j], exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + j * TILE), mx)));
        sum = _mm512_add_ps(sum, p);
        _mm512_storeu_ps(sg + j * TILE, p);
      }
      const __m512 cv = exp16(_mm512_sub_ps(m_old, mx));
      _mm512_storeu_ps(l + g * TILE, _mm512_fmadd_ps(_mm512_loadu_ps(l + g * TILE), cv, sum));
      _mm512_storeu_ps(m + g * TILE, mx);
      _mm512_storeu_ps(corr + g * TILE, cv);
    }
    // P V into the transposed output (lane i of acc[g][d] = row i's element d)
    for_head_groups(g_size, [&](auto gp, int g0) {
      prefill_pv<decltype(gp)::value, D, F32Steps>(pt + g0 * TILE * TILE, vt, corr + g0 * TILE, acc + g0 * D * TILE, nk);
    });
  }
  prefill_store_transposed16<D>(acc, l, rows, i0, h, hq, g_size, out);
}

#if defined(__AVX512BF16__)
// Two keys' rows side by side: the word permutation that makes a0 b0 a1 b1 ... a15 b15 of [a0..a15 | b0..b15], and
// 16 values of rows a and b (null: zeros) so interleaved, a pair of keys per 32-bit lane as vdpbf16ps and tdpbf16ps
// multiply them.
inline __m512i pair_interleave_index() {
  alignas(64) uint16_t idx[32];
  for (int i = 0; i < 16; ++i) { idx[2 * i] = uint16_t(i); idx[2 * i + 1] = uint16_t(16 + i); }
  return _mm512_load_si512(idx);
}
inline __m512i interleave_pairs(__m512i index, const uint16_t* a, const uint16_t* b) {
  const __m256i lo = a ? _mm256_loadu_si256((const __m256i*)a) : _mm256_setzero_si256();
  const __m256i hi = b ? _mm256_loadu_si256((const __m256i*)b) : _mm256_setzero_si256();
  return _mm512_permutexvar_epi16(index, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
}

// bfloat16 prefill with AVX512-BF16 dot products (vdpbf16ps: pairs of bf16 products summed into fp32): the
// same tiling and transposed layout as prefill_tile, half the instructions. A query column holds the 16 rows'
// pairs (d, d + 1); keys are broadcast in pairs. Scores accumulate in fp32 and are scaled in fp32; the
// probabilities are rounded to bfloat16 before P V, as Hugging Face's bf16 attention does, and go in pairs of
// keys (2 jp, 2 jp + 1) against the values' pairs.
template <int C>
void prefill_tile_bf16(const uint16_t* __restrict q, const uint16_t* __restrict kc, const uint16_t* __restrict vc,
                       const int32_t* table, int ctx, int q_len, int i0, int h, int hq, int hkv, int g_size,
                       const KVLayout& kv, float scale, float* __restrict buf, uint16_t* __restrict out) {
  constexpr int D = 16 * C, TILE = 16, DP = D / 2;
  const int rows = std::min(TILE, q_len - i0), first_pos = ctx - q_len + i0, last_pos = first_pos + rows - 1;
  uint32_t* qp = reinterpret_cast<uint32_t*>(buf);  // [g][DP][TILE]: row i's query pair (2 dp, 2 dp + 1)
  float* acc = buf + g_size * DP * TILE;            // [g][D][TILE]: the output, transposed
  float* m = acc + g_size * D * TILE;               // [g][TILE]
  float* l = m + g_size * TILE;                     // [g][TILE]
  uint32_t* kp = reinterpret_cast<uint32_t*>(l + g_size * TILE);  // [TILE][DP]: key j's pairs, contiguous
  uint32_t* vp = kp + TILE * DP;                    // [TILE / 2][D]: element d of keys (2 jp, 2 jp + 1)
  uint32_t* pp = vp + TILE / 2 * D;                 // [g][TILE / 2][TILE]: row i's probabilities of keys 2 jp, 2 jp + 1
  float* corr = reinterpret_cast<float*>(pp + g_size * TILE / 2 * TILE);  // [g][TILE]
  float* sc = corr + g_size * TILE;                 // [g][TILE keys][TILE rows]: scores
  const __m512i interleave = pair_interleave_index();
  for (int g = 0; g < g_size; ++g) {
    for (int dp0 = 0; dp0 < DP; dp0 += 16) {  // the rows' query pairs, 16 x 16 blocks transposed in registers
      const int width = std::min(16, DP - dp0);
      __m512 r[16];
      for (int i = 0; i < TILE; ++i) {
        const uint16_t* qr = q + (int64_t(i0 + std::min(i, rows - 1)) * hq + h * g_size + g) * D + 2 * dp0;
        r[i] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(__mmask16((1u << width) - 1), qr));
      }
      transpose16x16(r);
      for (int c = 0; c < width; ++c) _mm512_storeu_ps(reinterpret_cast<float*>(qp + (g * DP + dp0 + c) * TILE), r[c]);
    }
    for (int d = 0; d < D; ++d) _mm512_storeu_ps(acc + (g * D + d) * TILE, _mm512_setzero_ps());
    _mm512_storeu_ps(m + g * TILE, _mm512_set1_ps(-3.0e38f));
    _mm512_storeu_ps(l + g * TILE, _mm512_setzero_ps());
  }
  for (int t0 = 0; t0 <= last_pos; t0 += TILE) {
    const int nk = std::min(TILE, last_pos + 1 - t0);
    const uint16_t* vrow[TILE];
    for (int j = 0; j < TILE; ++j) {
      if (j < nk) {
        const int t = t0 + j;
        const uint16_t* kr = kc + kv.at(table, t, h);
        vrow[j] = vc + kv.at(table, t, h);
        std::memcpy(kp + j * DP, kr, D * 2);
      } else {
        vrow[j] = nullptr;
        std::memset(kp + j * DP, 0, D * 2);
      }
    }
    for (int jp = 0; jp < TILE / 2; ++jp)
      for (int c = 0; c < C; ++c) {
        const uint16_t *a = vrow[2 * jp], *b = vrow[2 * jp + 1];
        _mm512_storeu_si512(vp + jp * D + 16 * c,
                            interleave_pairs(interleave, a ? a + 16 * c : nullptr, b ? b + 16 * c : nullptr));
      }
    __mmask16 visible[16];
    key_tile_masks(first_pos, t0, visible);
    for_head_groups(g_size, [&](auto gp, int g0) {  // scores into sc
      prefill_scores<decltype(gp)::value, DP, Bf16PairSteps>(qp + g0 * DP * TILE, kp, sc + g0 * TILE * TILE);
    });
    for (int g = 0; g < g_size; ++g) {
      __m512 s[TILE];
      for (int j = 0; j < TILE; ++j) s[j] = _mm512_loadu_ps(sc + (g * TILE + j) * TILE);
      const __m512 m_old = _mm512_loadu_ps(m + g * TILE), sv = _mm512_set1_ps(scale);
      __m512 mt[TILE];  // the rows' max over the tile as a tree (4 levels, not a chain of 16)
      for (int j = 0; j < TILE; ++j) {
        s[j] = _mm512_mask_mov_ps(_mm512_set1_ps(-3.0e38f), visible[j], _mm512_mul_ps(s[j], sv));
        mt[j] = s[j];
      }
      for (int w = TILE / 2; w > 0; w /= 2)
        for (int j = 0; j < w; ++j) mt[j] = _mm512_max_ps(mt[j], mt[j + w]);
      const __m512 mx = _mm512_max_ps(m_old, mt[0]);
      __m512 sum = _mm512_setzero_ps();
      for (int jp = 0; jp < TILE / 2; ++jp) {
        const __m512 p0 = _mm512_maskz_mov_ps(visible[2 * jp], exp16(_mm512_sub_ps(s[2 * jp], mx)));
        const __m512 p1 = _mm512_maskz_mov_ps(visible[2 * jp + 1], exp16(_mm512_sub_ps(s[2 * jp + 1], mx)));
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        // exp16's results: never subnormal, so vcvtne2ps2bf16 rounds them as torch; p0's in the low half
        const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
        _mm512_storeu_si512(pp + (g * TILE / 2 + jp) * TILE, _mm512_permutexvar_epi16(interleave, ab));
      }
      const __m512 cv = exp16(_mm512_sub_ps(m_old, mx));
      _mm512_storeu_ps(l + g * TILE, _mm512_fmadd_ps(_mm512_loadu_ps(l + g * TILE), cv, sum));
      _mm512_storeu_ps(m + g * TILE, mx);
      _mm512_storeu_ps(corr + g * TILE, cv);
    }
    for_head_groups(g_size, [&](auto gp, int g0) {  // P V, key pairs
      prefill_pv<decltype(gp)::value, D, Bf16PairSteps>(pp + g0 * TILE / 2 * TILE, vp, corr + g0 * TILE,
                                                         acc + g0 * D * TILE, (nk + 1) / 2);
    });
  }
  prefill_store_transposed16<D>(acc, l, rows, i0, h, hq, g_size, out);
}
#endif

#if defined(KVF_AMX)
// bfloat16 prefill on AMX tiles: the same work item (16 query rows, one KV head and its g_size query heads) over
// blocks of 32 keys. Per block, the keys as B tiles (16 pairs of d x 16 keys: a 16 x 16 transpose of 32-bit
// pairs) and the values as B tiles (16 pairs of keys x 16 of d, interleaved as in prefill_tile_bf16), made once
// for the group's heads; per head, S = Q K^T in two C tiles (16 rows x 16 keys each, D / 32 tdpbf16ps each), the
// online softmax on the stored scores a row at a time (the rows' block maxima, then one exp16 for the 16 rows'
// corrections), P rounded to bfloat16 (as Hugging Face's bf16 attention and prefill_tile_bf16 do) into one A
// tile, P V into D / 16 C tiles, stored and folded into the fp32 output (out = out * correction + P V). The
// softmax's sums stay in 16 lanes a row until the end. Tiles: S 0-1, Q 2, K 3-4; then P 5, V 6-7, P V 0-3.
template <int C>
void prefill_tile_amx(const uint16_t* __restrict q, const uint16_t* __restrict kc, const uint16_t* __restrict vc,
                      const int32_t* table, int ctx, int q_len, int i0, int h, int hq, int g_size, const KVLayout& kv,
                      float scale, float* __restrict buf, uint16_t* __restrict out) {
  constexpr int D = 16 * C, TILE = 16, KB = 32, QC = D / 32, VC = D / 16;
  static_assert(D % 32 == 0, "a Q tile holds 32 of d");
  const int rows = std::min(TILE, q_len - i0), first_pos = ctx - q_len + i0, last_pos = first_pos + rows - 1;
  float* acc = buf;                                  // [g][TILE][D]: the output so far
  float* lsum = acc + g_size * TILE * D;             // [g][TILE][16]: the softmax's sums, in lanes
  float* m = lsum + g_size * TILE * 16;              // [g][TILE]
  float* sc = m + g_size * TILE;                     // [TILE][KB]: a head's scores
  float* pv = sc + TILE * KB;                        // [TILE][D]: a head's P V of the block
  float* corr = pv + TILE * D;                       // [TILE]
  float* bmax = corr + TILE;                         // [TILE]
  uint16_t* qt = reinterpret_cast<uint16_t*>(bmax + TILE);  // [g][TILE][D]: the rows' queries (a tail repeats its last)
  uint16_t* kt = qt + g_size * TILE * D;             // [QC][2][16 pairs][16 keys][2]
  uint16_t* vt = kt + QC * 2 * TILE * 32;            // [VC][16 key pairs][16][2]
  uint16_t* pt = vt + VC * TILE * 32;                // [TILE][KB]: the probabilities, bfloat16
  const __m512i interleave = pair_interleave_index();
  for (int g = 0; g < g_size; ++g) {
    for (int i = 0; i < TILE; ++i) {
      std::memcpy(qt + (g * TILE + i) * D, q + (int64_t(i0 + std::min(i, rows - 1)) * hq + h * g_size + g) * D, 2 * D);
      for (int d = 0; d < D; d += 16) _mm512_storeu_ps(acc + (g * TILE + i) * D + d, _mm512_setzero_ps());
      _mm512_storeu_ps(lsum + (g * TILE + i) * 16, _mm512_setzero_ps());
    }
    _mm512_storeu_ps(m + g * TILE, _mm512_set1_ps(-3.0e38f));
  }
  for (int t0 = 0; t0 <= last_pos; t0 += KB) {
    const int nk = std::min(KB, last_pos + 1 - t0);
    const uint16_t* krow[KB];
    for (int j = 0; j < KB; ++j) krow[j] = j < nk ? kc + kv.at(table, t0 + j, h) : nullptr;
    for (int c = 0; c < QC; ++c)  // keys as B tiles: row dp holds the 16 keys' pair (32 c + 2 dp, + 1)
      for (int half = 0; half < 2; ++half) {
        __m512 r[16];
        for (int j = 0; j < 16; ++j) {
          const uint16_t* kr = krow[16 * half + j];
          r[j] = kr ? _mm512_loadu_ps(reinterpret_cast<const float*>(kr + 32 * c)) : _mm512_setzero_ps();
        }
        transpose16x16(r);
        float* dst = reinterpret_cast<float*>(kt + (c * 2 + half) * 16 * 32);
        for (int dp = 0; dp < 16; ++dp) _mm512_storeu_ps(dst + 16 * dp, r[dp]);
      }
    for (int jp = 0; jp < KB / 2; ++jp) {  // values as B tiles: row jp holds d's pair of keys (2 jp, 2 jp + 1)
      const uint16_t* va = 2 * jp < nk ? vc + kv.at(table, t0 + 2 * jp, h) : nullptr;
      const uint16_t* vb = 2 * jp + 1 < nk ? vc + kv.at(table, t0 + 2 * jp + 1, h) : nullptr;
      for (int c = 0; c < VC; ++c)
        _mm512_storeu_si512(vt + (c * 16 + jp) * 32,
                            interleave_pairs(interleave, va ? va + 16 * c : nullptr, vb ? vb + 16 * c : nullptr));
    }
    for (int g = 0; g < g_size; ++g) {
      _tile_zero(0);
      _tile_zero(1);
      for (int c = 0; c < QC; ++c) {
        _tile_loadd(2, qt + g * TILE * D + 32 * c, 2 * D);
        _tile_loadd(3, kt + (c * 2 + 0) * 16 * 32, 64);
        _tile_loadd(4, kt + (c * 2 + 1) * 16 * 32, 64);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
      }
      _tile_stored(0, sc, 4 * KB);
      _tile_stored(1, sc + 16, 4 * KB);
      float* mg = m + g * TILE;
      __mmask16 vis[TILE][2];  // row i's visible keys of the block, 0-15 and 16-31
      for (int i = 0; i < TILE; ++i) {  // the rows' maxima over the block's visible keys
        const int seen = std::min(first_pos + i + 1 - t0, nk);  // keys t0 .. t0 + seen - 1 are at or before row i
        const __mmask16 v0 = vis[i][0] = first_n_mask16(seen), v1 = vis[i][1] = first_n_mask16(seen - 16);
        const __m512 lo = _mm512_set1_ps(-3.0e38f), sv = _mm512_set1_ps(scale);
        const __m512 s0 = _mm512_mask_mov_ps(lo, v0, _mm512_mul_ps(_mm512_loadu_ps(sc + i * KB), sv));
        const __m512 s1 = _mm512_mask_mov_ps(lo, v1, _mm512_mul_ps(_mm512_loadu_ps(sc + i * KB + 16), sv));
        _mm512_storeu_ps(sc + i * KB, s0);
        _mm512_storeu_ps(sc + i * KB + 16, s1);
        bmax[i] = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
      }
      const __m512 m_old = _mm512_loadu_ps(mg), m_new = _mm512_max_ps(m_old, _mm512_loadu_ps(bmax));
      _mm512_storeu_ps(corr, exp16(_mm512_sub_ps(m_old, m_new)));
      _mm512_storeu_ps(mg, m_new);
      for (int i = 0; i < TILE; ++i) {
        const __m512 mx = _mm512_set1_ps(mg[i]);
        const __m512 p0 = _mm512_maskz_mov_ps(vis[i][0], exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + i * KB), mx)));
        const __m512 p1 = _mm512_maskz_mov_ps(vis[i][1], exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + i * KB + 16), mx)));
        float* ls = lsum + (g * TILE + i) * 16;
        _mm512_storeu_ps(ls, _mm512_fmadd_ps(_mm512_loadu_ps(ls), _mm512_set1_ps(corr[i]), _mm512_add_ps(p0, p1)));
        // exp16's results: never subnormal, so vcvtne2ps2bf16 rounds them as torch; keys 0-15 in the low half
        _mm512_storeu_si512(pt + i * KB, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
      }
      _tile_loadd(5, pt, 2 * KB);
      // P V, 16 of d a C tile, up to 4 at a time (tile numbers are literals in the instructions: a macro, not a loop)
#define KVF_PV_SLICE(ct, bt, c)                                   \
  do {                                                            \
    _tile_zero(ct);                                               \
    _tile_loadd(bt, vt + (c) * 16 * 32, 64);                      \
    _tile_dpbf16ps(ct, 5, bt);                                    \
    _tile_stored(ct, pv + 16 * (c), 4 * D);                       \
  } while (0)
      for (int c0 = 0; c0 < VC; c0 += 4) {
        KVF_PV_SLICE(0, 6, c0);
        if (c0 + 1 < VC) KVF_PV_SLICE(1, 7, c0 + 1);
        if (c0 + 2 < VC) KVF_PV_SLICE(2, 6, c0 + 2);
        if (c0 + 3 < VC) KVF_PV_SLICE(3, 7, c0 + 3);
      }
#undef KVF_PV_SLICE
      for (int i = 0; i < TILE; ++i) {
        const __m512 cv = _mm512_set1_ps(corr[i]);
        float* o = acc + (g * TILE + i) * D;
        for (int d = 0; d < D; d += 16)
          _mm512_storeu_ps(o + d, _mm512_fmadd_ps(_mm512_loadu_ps(o + d), cv, _mm512_loadu_ps(pv + i * D + d)));
      }
    }
  }
  for (int g = 0; g < g_size; ++g)
    for (int i = 0; i < rows; ++i) {
      const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(lsum + (g * TILE + i) * 16)));
      const float* o = acc + (g * TILE + i) * D;
      for (int d = 0; d < D; d += 16)
        store16(out + (int64_t(i0 + i) * hq + h * g_size + g) * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), inv));
    }
}
// floats of prefill_tile_amx's buffer
constexpr size_t prefill_amx_floats(int d, int g_size) {
  return size_t(g_size) * 16 * d + g_size * 16 * 16 + g_size * 16 + 16 * 32 + 16 * d + 32 +
         (size_t(g_size) * 16 * d + d / 32 * 2 * 16 * 32 + d / 16 * 16 * 32 + 16 * 32) / 2;
}
#endif

template <int C, typename T>
void prefill_attention_c(const T* q, const T* kc, const T* vc, const int32_t* table, int ctx, int q_len, int hq,
                         int hkv, const KVLayout& kv, float scale, T* out) {
  constexpr int D = 16 * C, TILE = 16;
  const int g_size = hq / hkv, tiles = (q_len + TILE - 1) / TILE, items = hkv * tiles;
  const size_t floats = size_t(2) * g_size * TILE * D + 2 * g_size * TILE + 2 * D * TILE + g_size * (TILE + 1) * TILE +
                        4 * TILE + g_size * TILE * TILE;  // the last: the bf16 kernel's scores
#if defined(KVF_AMX)
  const bool amx = std::is_same_v<T, uint16_t> && D % 32 == 0 && use_amx();
#endif
#pragma omp parallel if (items >= 4)
  {
#if defined(KVF_AMX)
    std::vector<float> buf(amx ? std::max(floats, prefill_amx_floats(D, g_size)) : floats);
    if (amx) amx_load_config();
#else
    std::vector<float> buf(floats);
#endif
#pragma omp for schedule(dynamic, 1)
    for (int w = 0; w < items; ++w) {  // longest tiles (the last queries) first
      const int i0 = (tiles - 1 - w / hkv) * TILE, h = w % hkv;
#if defined(KVF_AMX)
      if constexpr (std::is_same_v<T, uint16_t> && D % 32 == 0) {
        if (amx) {
          prefill_tile_amx<C>(q, kc, vc, table, ctx, q_len, i0, h, hq, g_size, kv, scale, buf.data(), out);
          continue;
        }
      }
#endif
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, uint16_t>) {
        prefill_tile_bf16<C>(q, kc, vc, table, ctx, q_len, i0, h, hq, hkv, g_size, kv, scale, buf.data(), out);
        continue;
      }
#endif
      prefill_tile<C>(q, kc, vc, table, ctx, q_len, i0, h, hq, hkv, g_size, kv, scale, buf.data(), out);
    }
#if defined(KVF_AMX)
    if (amx) _tile_release();
#endif
  }
}

template <typename T>
bool prefill_attention(const T* q, const T* kc, const T* vc, const int32_t* table, int ctx, int q_len, int hq,
                       int hkv, int d, int bs, int head_major, float scale, T* out) {
  const KVLayout kv(bs, hkv, d, head_major);
  switch (d) {
    case 16: prefill_attention_c<1>(q, kc, vc, table, ctx, q_len, hq, hkv, kv, scale, out); return true;
    case 32: prefill_attention_c<2>(q, kc, vc, table, ctx, q_len, hq, hkv, kv, scale, out); return true;
    case 64: prefill_attention_c<4>(q, kc, vc, table, ctx, q_len, hq, hkv, kv, scale, out); return true;
    case 128: prefill_attention_c<8>(q, kc, vc, table, ctx, q_len, hq, hkv, kv, scale, out); return true;
    default: return false;
  }
}
// the head dims the switch above covers
inline bool prefill_covers(int d) { return d == 16 || d == 32 || d == 64 || d == 128; }
#elif defined(KVF_AVX2)
// AVX2 (no AVX-512): the same algorithm as prefill_tile with 8 query rows per work item (a ymm's lanes) and key
// tiles of 8: 8 score registers, one query-column load per 8 FMAs with broadcast keys; the online softmax across
// registers; P V as a probability column times a broadcast value element, into the transposed output. bfloat16
// is read into float32 (load8) and computed in float32, with the probabilities rounded to bfloat16 before P V as
// in Hugging Face's bf16 attention.
template <int C, typename T>
void prefill_tile8(const T* __restrict q, const T* __restrict kc, const T* __restrict vc, const int32_t* table,
                   int ctx, int q_len, int i0, int h, int hq, int hkv, int g_size, const KVLayout& kv, float scale,
                   float* __restrict buf, T* __restrict out) {
  constexpr int D = 8 * C, TILE = 8;
  const int rows = std::min(TILE, q_len - i0), first_pos = ctx - q_len + i0, last_pos = first_pos + rows - 1;
  float* qt = buf;                      // [g][D][TILE]: each query head's 8 rows, transposed and scaled
  float* acc = qt + g_size * D * TILE;  // [g][D][TILE]: the output, transposed as the queries
  float* m = acc + g_size * TILE * D;   // [g][TILE]
  float* l = m + g_size * TILE;         // [g][TILE]
  float* kt = l + g_size * TILE;        // [TILE][D]: the key tile, contiguous (one base for the broadcasts)
  float* vt = kt + TILE * D;            // [TILE][D]
  float* pt = vt + TILE * D;            // [g][TILE keys][TILE rows]: probabilities
  float* corr = pt + g_size * TILE * TILE;  // [g][TILE]
  prefill_load_transposed<D, TILE>(q, rows, i0, h, hq, g_size, scale, qt);
  for (int g = 0; g < g_size; ++g) {
    for (int d = 0; d < D; ++d) _mm256_storeu_ps(acc + (g * D + d) * TILE, _mm256_setzero_ps());
    _mm256_storeu_ps(m + g * TILE, _mm256_set1_ps(-3.0e38f));
    _mm256_storeu_ps(l + g * TILE, _mm256_setzero_ps());
  }
  const __m256i row_pos = _mm256_add_epi32(_mm256_set1_epi32(first_pos), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256 neg = _mm256_set1_ps(-3.0e38f);
  for (int t0 = 0; t0 <= last_pos; t0 += TILE) {
    const int nk = std::min(TILE, last_pos + 1 - t0);  // keys t0 .. t0 + nk - 1
    for (int j = 0; j < TILE; ++j) {
      if (j < nk) {
        const int t = t0 + j;
        const T* kr = kc + kv.at(table, t, h);
        const T* vr = vc + kv.at(table, t, h);
        for (int c = 0; c < C; ++c) {
          _mm256_storeu_ps(kt + j * D + 8 * c, load8(kr + 8 * c));
          _mm256_storeu_ps(vt + j * D + 8 * c, load8(vr + 8 * c));
        }
      } else {  // scored (then masked); its value row is never read (P V stops at nk)
        for (int c = 0; c < C; ++c) _mm256_storeu_ps(kt + j * D + 8 * c, _mm256_setzero_ps());
      }
    }
    __m256 visible[TILE];  // lane i of visible[j]: row i is at or after key t0 + j
    for (int j = 0; j < TILE; ++j)
      visible[j] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(row_pos, _mm256_set1_epi32(t0 + j - 1)));
    for (int g = 0; g < g_size; ++g) {
      __m256 s[TILE];  // lane i of s[j] = row i . key j
      for (int j = 0; j < TILE; ++j) s[j] = _mm256_setzero_ps();
      const float* qg = qt + g * D * TILE;
      for (int d = 0; d < D; ++d) {
        const __m256 qv = _mm256_loadu_ps(qg + d * TILE);
        for (int j = 0; j < TILE; ++j) s[j] = _mm256_fmadd_ps(qv, _mm256_broadcast_ss(kt + j * D + d), s[j]);
      }
      const __m256 m_old = _mm256_loadu_ps(m + g * TILE);
      __m256 mt[TILE];  // the rows' max over the tile as a tree, not a chain
      for (int j = 0; j < TILE; ++j) {
        s[j] = _mm256_blendv_ps(neg, s[j], visible[j]);
        mt[j] = s[j];
      }
      for (int w = TILE / 2; w > 0; w /= 2)
        for (int j = 0; j < w; ++j) mt[j] = _mm256_max_ps(mt[j], mt[j + w]);
      const __m256 mx = _mm256_max_ps(m_old, mt[0]);
      __m256 sum = _mm256_setzero_ps();
      for (int j = 0; j < TILE; ++j) {
        const __m256 p = round8(_mm256_and_ps(visible[j], exp8(_mm256_sub_ps(s[j], mx))), q);
        sum = _mm256_add_ps(sum, p);
        _mm256_storeu_ps(pt + (g * TILE + j) * TILE, p);
      }
      const __m256 cv = exp8(_mm256_sub_ps(m_old, mx));
      _mm256_storeu_ps(l + g * TILE, _mm256_fmadd_ps(_mm256_loadu_ps(l + g * TILE), cv, sum));
      _mm256_storeu_ps(m + g * TILE, mx);
      _mm256_storeu_ps(corr + g * TILE, cv);
    }
    for (int g = 0; g < g_size; ++g) {  // P V, 8 output elements (accumulators) at a time
      const float* pg = pt + g * TILE * TILE;
      const __m256 cv = _mm256_loadu_ps(corr + g * TILE);
      for (int d0 = 0; d0 < D; d0 += 8) {
        float* ag = acc + (g * D + d0) * TILE;
        __m256 o[8];
        for (int e = 0; e < 8; ++e) o[e] = _mm256_mul_ps(_mm256_loadu_ps(ag + e * TILE), cv);
        for (int j = 0; j < nk; ++j) {
          const __m256 pj = _mm256_loadu_ps(pg + j * TILE);
          for (int e = 0; e < 8; ++e) o[e] = _mm256_fmadd_ps(pj, _mm256_broadcast_ss(vt + j * D + d0 + e), o[e]);
        }
        for (int e = 0; e < 8; ++e) _mm256_storeu_ps(ag + e * TILE, o[e]);
      }
    }
  }
  prefill_store_transposed<D, TILE>(acc, l, rows, i0, h, hq, g_size, out);
}

template <int C, typename T>
void prefill_attention_c8(const T* q, const T* kc, const T* vc, const int32_t* table, int ctx, int q_len, int hq,
                          int hkv, const KVLayout& kv, float scale, T* out) {
  constexpr int D = 8 * C, TILE = 8;
  const int g_size = hq / hkv, tiles = (q_len + TILE - 1) / TILE, items = hkv * tiles;
  const size_t floats = size_t(2) * g_size * TILE * D + 2 * g_size * TILE + 2 * D * TILE + g_size * (TILE + 1) * TILE +
                        4 * TILE + g_size * TILE * TILE;  // the last: the bf16 kernel's scores
#pragma omp parallel if (items >= 4)
  {
    std::vector<float> buf(floats);
#pragma omp for schedule(dynamic, 1)
    for (int w = 0; w < items; ++w) {  // longest tiles (the last queries) first
      const int i0 = (tiles - 1 - w / hkv) * TILE, h = w % hkv;
      prefill_tile8<C>(q, kc, vc, table, ctx, q_len, i0, h, hq, hkv, g_size, kv, scale, buf.data(), out);
    }
  }
}

template <typename T>
bool prefill_attention(const T* q, const T* kc, const T* vc, const int32_t* table, int ctx, int q_len, int hq,
                       int hkv, int d, int bs, int head_major, float scale, T* out) {
  const KVLayout kv(bs, hkv, d, head_major);
  switch (d) {
    case 16: prefill_attention_c8<2>(q, kc, vc, table, ctx, q_len, hq, hkv, kv, scale, out); return true;
    case 32: prefill_attention_c8<4>(q, kc, vc, table, ctx, q_len, hq, hkv, kv, scale, out); return true;
    case 64: prefill_attention_c8<8>(q, kc, vc, table, ctx, q_len, hq, hkv, kv, scale, out); return true;
    case 128: prefill_attention_c8<16>(q, kc, vc, table, ctx, q_len, hq, hkv, kv, scale, out); return true;
    default: return false;
  }
}
inline bool prefill_covers(int d) { return d == 16 || d == 32 || d == 64 || d == 128; }
#else
template <typename T>
bool prefill_attention(const T*, const T*, const T*, const int32_t*, int, int, int, int, int, int, int, float, T*) {
  return false;
}
inline bool prefill_covers(int) { return false; }
#endif

// KV store: token t's key and value rows (hkv heads of d elements, row strides given) into slot slots[t]
// (block * block size + offset) of a cache laid out as kv says; -1 skips.
template <typename T>
void store_kv(const T* __restrict k, int64_t k_stride, const T* __restrict v, int64_t v_stride, T* __restrict kc,
              T* __restrict vc, const int64_t* __restrict slots, int64_t n, int hkv, int d, const KVLayout& kv) {
  for (int64_t t = 0; t < n; ++t) {
    const int64_t s = slots[t];
    if (s < 0) continue;
    const int64_t at = s / kv.bs * kv.blk + s % kv.bs * kv.tok;
    if (kv.head == d) {  // token-major: the heads side by side
      std::memcpy(kc + at, k + t * k_stride, size_t(hkv) * d * sizeof(T));
      std::memcpy(vc + at, v + t * v_stride, size_t(hkv) * d * sizeof(T));
      continue;
    }
    for (int h = 0; h < hkv; ++h) {
      std::memcpy(kc + at + h * kv.head, k + t * k_stride + h * d, size_t(d) * sizeof(T));
      std::memcpy(vc + at + h * kv.head, v + t * v_stride + h * d, size_t(d) * sizeof(T));
    }
  }
}

// ---- greedy sampling ---------------------------------------------------------------------------------------
// argmax of each row of x [rows, cols] (row stride given), as torch's argmax picks: the first of tied maxima,
// the first NaN where a row has one. Each lane keeps the first index of its largest value (a strictly greater
// value replaces it); the row's first maximum is the smallest index among the lanes holding the maximum.
// false: no AVX-512 here (the caller keeps torch's argmax).
#if defined(__AVX512F__)
struct ArgmaxLanes {  // per lane: the largest value so far and the first index holding it
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i at = _mm512_setzero_si512();
  inline void take(__m512 v, __m512i idx) {
    const __mmask16 up = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, up, v);
    at = _mm512_mask_mov_epi32(at, up, idx);
  }
  inline void merge(const ArgmaxLanes& o) {  // lane by lane: the larger value; of equal ones, the first index
    const __mmask16 up = _mm512_cmp_ps_mask(o.best, best, _CMP_GT_OQ) |
                         (_mm512_cmp_ps_mask(o.best, best, _CMP_EQ_OQ) & _mm512_cmp_epi32_mask(o.at, at, _MM_CMPINT_LT));
    best = _mm512_mask_mov_ps(best, up, o.best);
    at = _mm512_mask_mov_epi32(at, up, o.at);
  }
};

inline int64_t argmax_row(const float* __restrict x, int64_t cols) {
  constexpr int U = 4;  // independent sets of lanes, so that their compare-and-move chains overlap
  ArgmaxLanes lanes[U];
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __mmask16 nan = 0;
  int64_t j = 0;
  for (; j + 16 * U <= cols; j += 16 * U)
    for (int u = 0; u < U; ++u) {
      const __m512 v = _mm512_loadu_ps(x + j + 16 * u);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      lanes[u].take(v, _mm512_add_epi32(iota, _mm512_set1_epi32(int(j + 16 * u))));
    }
  for (; j < cols; j += 16) {  // (lanes past the row load -inf: never taken)
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                          first_n_mask16(int(std::min<int64_t>(16, cols - j))), x + j);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    lanes[0].take(v, _mm512_add_epi32(iota, _mm512_set1_epi32(int(j))));
  }
  if (nan) {
    for (int64_t i = 0; i < cols; ++i)
      if (std::isnan(x[i])) return i;
  }
  for (int u = 1; u < U; ++u) lanes[0].merge(lanes[u]);
  const float top = _mm512_reduce_max_ps(lanes[0].best);
  const __mmask16 holds = _mm512_cmp_ps_mask(lanes[0].best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(holds, lanes[0].at);  // (an all -inf row: index 0, as no lane moved)
}

bool argmax_rows(const float* x, int64_t rows, int64_t cols, int64_t stride, int64_t* out) {
  if (cols >= (int64_t(1) << 31)) return false;
#pragma omp parallel for if (parallel_worth(rows, cols)) schedule(static)
  for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * stride, cols);
  return true;
}
#else
bool argmax_rows(const float*, int64_t, int64_t, int64_t, int64_t*) { return false; }
#endif

int g_gemm_blocking = 0;  // the float32 panel GEMM's blocking (gemm, kvf_gemm_blocking)

#if defined(__AVX2__) && defined(__FMA__)
// ---- float32 GEMM for few rows (decode steps) -----------------------------------------------------------
// out[m, n] = x[m, k] @ w[n, k]^T (+ bias): the weight packed once into panels of kGemmNR output columns, each
// panel [k][kGemmNR] contiguous, so the whole weight streams through memory in order, once per call. A
// kGemmMR x kGemmNR micro-tile keeps its accumulators, the panel's vectors for one k and a broadcast of x in
// registers: AVX-512 8 x 48 (24 accumulators, 3 + 8 loads per 24 FMAs, of 32 zmm registers), AVX2 4 x 24 (12
// accumulators, 3 + 4 loads per 12 FMAs, of 16 ymm). k is blocked so that a panel's slice of k stays in L1 while
// every row tile uses it; the next slice's lines are prefetched meanwhile, shared out over the row tiles. Two
// blockings, the faster one chosen at run time by measuring (linear.calibrate through kvf_gemm_blocking):
// 0: slices of kGemmKC, the next one prefetched into L1 (Zen 5, AVX-512: 256 measured best of 32-1,024);
// 1: slices of kGemmKC / 2, the next one prefetched into L2 only (2-core Xeon with AMX, a decode step's matmuls
//    streamed, 64 rows on 2 threads: 58.6-61.0 against 64.7 ms; one thread, 32 rows: 70.1 against 79.0 ms).
// Each output is one FMA chain over k in order (deterministic, independent of m, the thread count and the
// blocking).
#if defined(__AVX512F__)
constexpr int kGemmNR = 48, kGemmMR = 8, kGemmKC = 256;
#else
constexpr int kGemmNR = 24, kGemmMR = 4, kGemmKC = 128;
#endif

// A row tile's share of the weight lines ahead: pf_step lines a k, until its pf_lines have been asked for (the
// shares of all row tiles together cover the next block, spread over the time the tiles take).
template <bool ToL2 = false>
inline void gemm_prefetch_share(const char* pf, int pf_lines, int pf_step, int& pf_done) {
  for (int j = 0; j < pf_step; ++j, ++pf_done)
    if (pf_done < pf_lines) _mm_prefetch(pf + 64 * int64_t(pf_done), ToL2 ? _MM_HINT_T1 : _MM_HINT_T0);
}

void gemm_pack(const float* __restrict w, int64_t n, int64_t k, float* __restrict packed) {
  const int64_t panels = (n + kGemmNR - 1) / kGemmNR;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    float* dst = packed + p * k * kGemmNR;
    for (int c = 0; c < kGemmNR; ++c) {
      const int64_t row = p * kGemmNR + c;
      for (int64_t kk = 0; kk < k; ++kk) dst[kk * kGemmNR + c] = row < n ? w[row * k + kk] : 0.0f;
    }
  }
}

// rows [0, R) of one tile: acc (+)= x[:, kb:kb+kn] @ panel slice; first: start from bias (or 0), else from out
#if defined(__AVX512F__)

template <int R, bool Prefetch, bool ToL2>
inline void gemm_tile(const float* __restrict x, int64_t xs, const float* __restrict b, int64_t kn,
                      float* __restrict out, int64_t os, int ncols, const float* __restrict bias, bool first,
                      const char* pf, int pf_lines, int pf_step) {
  int pf_done = 0;
  const __mmask16 m0 = first_n_mask16(ncols), m1 = first_n_mask16(ncols - 16), m2 = first_n_mask16(ncols - 32);
  __m512 acc[R][3];
  for (int r = 0; r < R; ++r) {
    const float* src = first ? bias : out + r * os;
    if (src == nullptr) {
      acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();
    } else {
      acc[r][0] = _mm512_maskz_loadu_ps(m0, src), acc[r][1] = _mm512_maskz_loadu_ps(m1, src + 16);
      acc[r][2] = _mm512_maskz_loadu_ps(m2, src + 32);
    }
  }
  for (int64_t kk = 0; kk < kn; ++kk) {
    __m512 b0 = _mm512_loadu_ps(b + kk * kGemmNR), b1 = _mm512_loadu_ps(b + kk * kGemmNR + 16),
           b2 = _mm512_loadu_ps(b + kk * kGemmNR + 32);
    asm("" : "+v"(b0), "+v"(b1), "+v"(b2));  // in registers: g++ would fold each load into all R FMAs
    if (Prefetch) gemm_prefetch_share<ToL2>(pf, pf_lines, pf_step, pf_done);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * xs + kk]);
      acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(a, b2, acc[r][2]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* dst = out + r * os;
    _mm512_mask_storeu_ps(dst, m0, acc[r][0]), _mm512_mask_storeu_ps(dst + 16, m1, acc[r][1]);
    _mm512_mask_storeu_ps(dst + 32, m2, acc[r][2]);
  }
}
#else
template <int R, bool Prefetch, bool ToL2>
inline void gemm_tile(const float* __restrict x, int64_t xs, const float* __restrict b, int64_t kn,
                      float* __restrict out, int64_t os, int ncols, const float* __restrict bias, bool first,
                      const char* pf, int pf_lines, int pf_step) {
  int pf_done = 0;
  __m256 acc[R][3];
  const bool full = ncols == kGemmNR;
  for (int r = 0; r < R; ++r) {
    const __m256 m0 = first_n_mask8(ncols), m1 = first_n_mask8(ncols - 8), m2 = first_n_mask8(ncols - 16);
    const float* src = first ? bias : out + r * os;
    if (src == nullptr) {
      acc[r][0] = acc[r][1] = acc[r][2] = _mm256_setzero_ps();
    } else if (full) {
      acc[r][0] = _mm256_loadu_ps(src), acc[r][1] = _mm256_loadu_ps(src + 8), acc[r][2] = _mm256_loadu_ps(src + 16);
    } else {
      acc[r][0] = _mm256_maskload_ps(src, _mm256_castps_si256(m0));
      acc[r][1] = _mm256_maskload_ps(src + 8, _mm256_castps_si256(m1));
      acc[r][2] = _mm256_maskload_ps(src + 16, _mm256_castps_si256(m2));
    }
  }
  for (int64_t kk = 0; kk < kn; ++kk) {
    __m256 b0 = _mm256_loadu_ps(b + kk * kGemmNR), b1 = _mm256_loadu_ps(b + kk * kGemmNR + 8),
           b2 = _mm256_loadu_ps(b + kk * kGemmNR + 16);
    asm("" : "+x"(b0), "+x"(b1), "+x"(b2));  // in registers: g++ would fold each load into all R FMAs
    if (Prefetch) gemm_prefetch_share<ToL2>(pf, pf_lines, pf_step, pf_done);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * xs + kk);
      acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(a, b2, acc[r][2]);
    }
  }
  // (the masks are made here and above, not kept: the loop needs all 16 registers)
  const __m256 m0 = first_n_mask8(ncols), m1 = first_n_mask8(ncols - 8), m2 = first_n_mask8(ncols - 16);
  for (int r = 0; r < R; ++r) {
    float* dst = out + r * os;
    if (full) {
      _mm256_storeu_ps(dst, acc[r][0]), _mm256_storeu_ps(dst + 8, acc[r][1]), _mm256_storeu_ps(dst + 16, acc[r][2]);
    } else {
      _mm256_maskstore_ps(dst, _mm256_castps_si256(m0), acc[r][0]);
      _mm256_maskstore_ps(dst + 8, _mm256_castps_si256(m1), acc[r][1]);
      _mm256_maskstore_ps(dst + 16, _mm256_castps_si256(m2), acc[r][2]);
    }
  }
}

#endif

// gemm_tile<rows> for rows in [1, R]
template <int R>
inline void gemm_rows(int rows, const float* x, int64_t xs, const float* b, int64_t kn, float* out, int64_t os,
                      int ncols, const float* bias, bool first, const char* pf, int pf_lines, int pf_step,
                      bool to_l2) {
  if constexpr (R > 1) {
    if (rows < R)
      return gemm_rows<R - 1>(rows, x, xs, b, kn, out, os, ncols, bias, first, pf, pf_lines, pf_step, to_l2);
  }
  if (pf_lines > 0 && to_l2) {
    gemm_tile<R, true, true>(x, xs, b, kn, out, os, ncols, bias, first, pf, pf_lines, pf_step);
  } else if (pf_lines > 0) {
    gemm_tile<R, true, false>(x, xs, b, kn, out, os, ncols, bias, first, pf, pf_lines, pf_step);
  } else {
    gemm_tile<R, false, false>(x, xs, b, kn, out, os, ncols, bias, first, pf, pf_lines, pf_step);
  }
}

void gemm(const float* __restrict x, int64_t xs, int64_t m, int64_t k, const float* __restrict packed, int64_t n,
          const float* __restrict bias, float* __restrict out, int64_t os) {
  if (m <= 0) return;
  const int64_t panels = (n + kGemmNR - 1) / kGemmNR;
  const bool to_l2 = g_gemm_blocking == 1;
  const int64_t kc = to_l2 ? kGemmKC / 2 : kGemmKC;
  // panels split across threads only where the caller has several (the model runner's part threads have one)
  // and the weight is big enough (>= 1 MiB) to pay for the parallel region's barrier
#pragma omp parallel for schedule(static) if (omp_get_max_threads() > 1 && n * k >= (int64_t(1) << 18))
  for (int64_t p = 0; p < panels; ++p) {
    const float* bp = packed + p * k * kGemmNR;
    const int ncols = int(std::min<int64_t>(kGemmNR, n - p * kGemmNR));
    const float* pb = bias == nullptr ? nullptr : bias + p * kGemmNR;
    float* po = out + p * kGemmNR;
    for (int64_t kb = 0; kb < k; kb += kc) {
      const int64_t kn = std::min<int64_t>(kc, k - kb);
      // the next block (after the last, the next panel's first: panels lie one after another), its lines
      // shared out over the row tiles, so that the loads spread over the block's whole time
      const char* pf = (const char*)(bp + (kb + kn) * kGemmNR);
      const int lines = int(kc * kGemmNR * 4 / 64), tiles = int((m + kGemmMR - 1) / kGemmMR);
      const int per_tile = (lines + tiles - 1) / tiles, step = int((per_tile + kn - 1) / kn);
      for (int64_t r0 = 0, t = 0; r0 < m; r0 += kGemmMR, ++t) {
        const int rows = int(std::min<int64_t>(kGemmMR, m - r0));
        const int pf_lines = int(std::max<int64_t>(0, std::min<int64_t>(per_tile, lines - t * per_tile)));
        gemm_rows<kGemmMR>(rows, x + r0 * xs + kb, xs, bp + kb * kGemmNR, kn, po + r0 * os, os, ncols, pb, kb == 0,
                           pf + 64 * t * per_tile, pf_lines, step, to_l2);
      }
    }
  }
}
#define KVF_GEMM 1
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// ---- bfloat16 GEMM for few rows (decode steps), AVX512_BF16 ----------------------------------------------
// The float32 panel GEMM's tiling with vdpbf16ps: the weight packed once into panels of 48 output columns, each
// [3][ceil(k / 2)][16][2]: three groups of 16 columns, each group's k pairs in turn (a k pair of a column in one
// 32-bit lane), so that 16 pairs of k of a group are 1 KiB in one run: an AMX B tile (gemm_bf16_amx); x's pairs
// (x[2p], x[2p + 1]) are one 32-bit broadcast. An 8 x 48 tile: 24 fp32 accumulators, 3 + 8 loads per 24 dot
// products of pairs. No k blocks (a panel is 576 x 48 x 2 bytes = 55 KB at K = 576: it stays in L2 while every
// row tile uses it); the next panel's lines are prefetched, spread over the row tiles. Accumulated in fp32 from
// the bias, rounded to bfloat16 once at the end, as oneDNN's bf16 GEMM does.
constexpr int kGemmBf16NR = 48, kGemmBf16MR = 8;

void gemm_pack_bf16(const uint16_t* __restrict w, int64_t n, int64_t k, uint16_t* __restrict packed) {
  const int64_t panels = (n + kGemmBf16NR - 1) / kGemmBf16NR, pairs = (k + 1) / 2;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    uint16_t* dst = packed + p * pairs * kGemmBf16NR * 2;
    for (int c = 0; c < kGemmBf16NR; ++c) {
      const int64_t row = p * kGemmBf16NR + c;
      for (int64_t kk = 0; kk < 2 * pairs; ++kk)
        dst[((c / 16 * pairs + kk / 2) * 16 + c % 16) * 2 + kk % 2] = row < n && kk < k ? w[row * k + kk] : uint16_t(0);
    }
  }
}

// A tile's results rounded to bfloat16, stored as bfloat16 or (the logits) as float32: the same values, without a
// pass that widens a bfloat16 output afterwards (0.55 ms a decode step of 64 rows over a 49,152-token vocabulary).
inline void store_rounded(uint16_t* dst, __mmask16 m, __m512 v) { _mm256_mask_storeu_epi16(dst, m, bf16_bits(v)); }
inline void store_rounded(float* dst, __mmask16 m, __m512 v) {
  _mm512_mask_storeu_ps(dst, m, round16(v, static_cast<const uint16_t*>(nullptr)));
}

template <int R, typename O>
inline void gemm_tile_bf16(const uint16_t* __restrict x, int64_t xs, int64_t k, const uint16_t* __restrict b,
                           O* __restrict out, int64_t os, int ncols, const uint16_t* __restrict bias,
                           const char* pf, int pf_lines, int pf_step) {
  const __mmask16 m0 = first_n_mask16(ncols), m1 = first_n_mask16(ncols - 16), m2 = first_n_mask16(ncols - 32);
  __m512 acc[R][3];
  if (bias == nullptr) {
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();
  } else {
    const __m512 b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m0, bias)), 16));
    const __m512 b1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m1, bias + 16)), 16));
    const __m512 b2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m2, bias + 32)), 16));
    for (int r = 0; r < R; ++r) acc[r][0] = b0, acc[r][1] = b1, acc[r][2] = b2;
  }
  const int64_t full = k / 2;  // whole pairs of x; an odd k's last element pairs with a zero
  int pf_done = 0;
  const int64_t group = (k + 1) / 2 * 32;  // elements of a group of 16 columns
  for (int64_t p = 0; p < (k + 1) / 2; ++p) {
    const uint16_t* bp = b + p * 32;
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(bp), w1 = (__m512bh)_mm512_loadu_si512(bp + group),
             w2 = (__m512bh)_mm512_loadu_si512(bp + 2 * group);
    asm("" : "+v"(w0), "+v"(w1), "+v"(w2));  // in registers: g++ would fold each load into all R products
    gemm_prefetch_share(pf, pf_lines, pf_step, pf_done);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      if (p < full) {
        std::memcpy(&pair, x + r * xs + 2 * p, 4);
      } else {
        pair = x[r * xs + 2 * p];
      }
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, w2);
    }
  }
  for (int r = 0; r < R; ++r) {
    O* dst = out + r * os;
    store_rounded(dst, m0, acc[r][0]);
    store_rounded(dst + 16, m1, acc[r][1]);
    store_rounded(dst + 32, m2, acc[r][2]);
  }
}

template <int R, typename O>
inline void gemm_rows_bf16(int rows, const uint16_t* x, int64_t xs, int64_t k, const uint16_t* b, O* out,
                           int64_t os, int ncols, const uint16_t* bias, const char* pf, int pf_lines, int pf_step) {
  if constexpr (R > 1) {
    if (rows < R) return gemm_rows_bf16<R - 1>(rows, x, xs, k, b, out, os, ncols, bias, pf, pf_lines, pf_step);
  }
  gemm_tile_bf16<R>(x, xs, k, b, out, os, ncols, bias, pf, pf_lines, pf_step);
}

#if defined(KVF_AMX)
// ---- the same bfloat16 GEMM on AMX tiles (Sapphire Rapids and later) ----------------------------------------
// The packed panels above are what a tile multiply wants: [3][pairs][16][2] holds, for 16 pairs of k and a group of
// 16 columns, 16 rows of 64 bytes in one run (a B tile, k pairs side by side as tdpbf16ps reads them). With the rows
// 192 bytes apart ([pairs][48][2]), a decode step's matmuls streamed from memory took 21.9 against 18.0 ms (the
// cache emptied before the step) and 19.6-19.9 against 17.9-18.1 (a step's KV reads between the layers).
// An A tile is 16 rows of x, 32 values of k each, read where x lies. Per 16 output columns, up to 4 C tiles (64
// rows) accumulate fp32 from the bias, over k in steps of 32 (one B tile, then each row group's A tile and
// tdpbf16ps); then each is stored, rounded to bfloat16 once, as gemm_tile_bf16 does. Tiles: C 0-3, B 4, A 5 and
// 6 (alternating, so that a load overlaps the previous multiply). The next panel is prefetched into L2 (T1; T0
// measured ~1.5x slower: a panel outgrows L1), a third during each column tile of the first row block. Needs k %
// 32 == 0 (every model here; else gemm_bf16 takes the vdpbf16ps kernel) and Linux's permission for the tile
// state, asked once per process (amx_permitted). 2-core Xeon with AMX (family 6 model 167), a decode step's
// matmuls (the model's 30 layers and lm_head, 30 copies of each weight, 64 rows on 2 threads; the rows still 192
// bytes apart): 12.6 ms, where oneDNN's AMX GEMM took 13.4 and the vdpbf16ps kernel 74.5 (one port's dot
// products: the float32 FMA rate there). For prefill-sized inputs oneDNN's blocking is ~1.8x faster (512 rows,
// one thread): the calibration gives it those.

// Groups (1-4: a constant, as the tile registers are named in the instructions) row groups of 16 x 16 output
// columns over all of k: a[g] the group's first row of x (row stride `as` bytes), b the column group's packed pairs
// (a B tile every 1 KiB), c the fp32 results (16 x 16 per group, 64 bytes a row); init: 16 rows of the bias, or null
template <int Groups>
inline void amx_column_tile(const uint16_t* const* a, int64_t as, int64_t k, const uint16_t* b, const float* init,
                            float* c, const char* pf, int pf_lines) {
  if (init) {
    _tile_loadd(0, init, 64);
    if constexpr (Groups > 1) _tile_loadd(1, init, 64);
    if constexpr (Groups > 2) _tile_loadd(2, init, 64);
    if constexpr (Groups > 3) _tile_loadd(3, init, 64);
  } else {
    _tile_zero(0);
    if constexpr (Groups > 1) _tile_zero(1);
    if constexpr (Groups > 2) _tile_zero(2);
    if constexpr (Groups > 3) _tile_zero(3);
  }
  for (int64_t k0 = 0; k0 < k; k0 += 32) {
    _tile_loadd(4, b + k0 * 16, 64);  // pairs k0 / 2 .. + 16 of the column group
    for (int l = 0; l < pf_lines; ++l) _mm_prefetch(pf + 64 * l, _MM_HINT_T1);
    pf += 64 * pf_lines;
    _tile_loadd(5, a[0] + k0, as);
    _tile_dpbf16ps(0, 5, 4);
    if constexpr (Groups > 1) {
      _tile_loadd(6, a[1] + k0, as);
      _tile_dpbf16ps(1, 6, 4);
    }
    if constexpr (Groups > 2) {
      _tile_loadd(5, a[2] + k0, as);
      _tile_dpbf16ps(2, 5, 4);
    }
    if constexpr (Groups > 3) {
      _tile_loadd(6, a[3] + k0, as);
      _tile_dpbf16ps(3, 6, 4);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (Groups > 1) _tile_stored(1, c + 256, 64);
  if constexpr (Groups > 2) _tile_stored(2, c + 512, 64);
  if constexpr (Groups > 3) _tile_stored(3, c + 768, 64);
}

template <typename O>
void gemm_bf16_amx(const uint16_t* __restrict x, int64_t xs, int64_t m, int64_t k, const uint16_t* __restrict packed,
                   int64_t n, const uint16_t* __restrict bias, O* __restrict out, int64_t os) {
  const int64_t panels = (n + kGemmBf16NR - 1) / kGemmBf16NR, panel_elems = k / 2 * kGemmBf16NR * 2;
  const int64_t full_rows = m / 16 * 16;  // a last group of fewer rows is read from a zero-padded copy
  const int64_t pf_third = panel_elems * 2 / 3;  // bytes
  const int pf_per_step = int((pf_third / 64 + k / 32 - 1) / (k / 32));  // lines a k step
#pragma omp parallel if (omp_get_max_threads() > 1 && n * k >= (int64_t(1) << 18))
  {
    amx_load_config();
    thread_local std::vector<uint16_t> tail;  // the last rows (m % 16 of them), zero-padded to 16
    if (full_rows < m) {
      tail.assign(16 * k, 0);
      for (int64_t r = full_rows; r < m; ++r) std::memcpy(&tail[(r - full_rows) * k], x + r * xs, 2 * k);
    }
    alignas(64) float c[4 * 256], init[256];
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      for (int j = 0; j < kGemmBf16NR / 16 && p * kGemmBf16NR + 16 * j < n; ++j) {
        const int64_t col = p * kGemmBf16NR + 16 * j;
        const __mmask16 mask = first_n_mask16(int(std::min<int64_t>(16, n - col)));
        if (bias) {
          const __m512 bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
              _mm256_maskz_loadu_epi16(mask, bias + col)), 16));
          for (int r = 0; r < 16; ++r) _mm512_store_ps(init + 16 * r, bv);
        }
        const float* ini = bias ? init : nullptr;
        int pf_lines = p + 1 < panels ? pf_per_step : 0;
        const uint16_t* b = packed + p * panel_elems + j * (k / 2) * 32;
        // the next panel's lines, prefetched over this panel's first row block: a third during each column tile
        const char* pf = (const char*)(packed + (p + 1) * panel_elems) + j * pf_third;
        for (int64_t r0 = 0; r0 < m; r0 += 64, pf_lines = 0) {
          const int64_t rows = std::min<int64_t>(64, m - r0);
          const int groups = int((rows + 15) / 16), full = int(rows / 16);
          const uint16_t* a[4];
          for (int g = 0; g < full; ++g) a[g] = x + (r0 + 16 * g) * xs;
          switch (full) {  // whole groups from x; a partial last one from the tail copy (its own row stride)
            case 4: amx_column_tile<4>(a, 2 * xs, k, b, ini, c, pf, pf_lines); break;
            case 3: amx_column_tile<3>(a, 2 * xs, k, b, ini, c, pf, pf_lines); break;
            case 2: amx_column_tile<2>(a, 2 * xs, k, b, ini, c, pf, pf_lines); break;
            case 1: amx_column_tile<1>(a, 2 * xs, k, b, ini, c, pf, pf_lines); break;
            default: break;
          }
          const uint16_t* t = tail.data();
          if (full < groups) amx_column_tile<1>(&t, 2 * k, k, b, ini, c + 256 * full, pf, full ? 0 : pf_lines);
          for (int64_t r = 0; r < rows; ++r)
            store_rounded(out + (r0 + r) * os + col, mask, _mm512_load_ps(c + 16 * r));
        }
      }
    }
    _tile_release();
  }
}
#define KVF_GEMM_BF16_AMX 1
#endif

// out: bfloat16, or float32 holding the bfloat16-rounded results (O = float)
template <typename O>
void gemm_bf16(const uint16_t* __restrict x, int64_t xs, int64_t m, int64_t k, const uint16_t* __restrict packed,
               int64_t n, const uint16_t* __restrict bias, O* __restrict out, int64_t os) {
  if (m <= 0) return;
#ifdef KVF_GEMM_BF16_AMX
  if (k % 32 == 0 && use_amx()) return gemm_bf16_amx(x, xs, m, k, packed, n, bias, out, os);
#endif
  const int64_t panels = (n + kGemmBf16NR - 1) / kGemmBf16NR, panel_elems = (k + 1) / 2 * kGemmBf16NR * 2;
  const int lines = int(panel_elems * 2 / 64), tiles = int((m + kGemmBf16MR - 1) / kGemmBf16MR);
  const int per_tile = (lines + tiles - 1) / tiles, step = int((per_tile + (k + 1) / 2 - 1) / ((k + 1) / 2));
#pragma omp parallel for schedule(static) if (omp_get_max_threads() > 1 && n * k >= (int64_t(1) << 18))
  for (int64_t p = 0; p < panels; ++p) {
    const uint16_t* bp = packed + p * panel_elems;
    const char* pf = (const char*)(bp + panel_elems);  // the next panel
    const int ncols = int(std::min<int64_t>(kGemmBf16NR, n - p * kGemmBf16NR));
    const uint16_t* pb = bias == nullptr ? nullptr : bias + p * kGemmBf16NR;
    for (int64_t r0 = 0, t = 0; r0 < m; r0 += kGemmBf16MR, ++t) {
      const int rows = int(std::min<int64_t>(kGemmBf16MR, m - r0));
      const int pf_lines = int(std::max<int64_t>(0, std::min<int64_t>(per_tile, lines - t * per_tile)));
      gemm_rows_bf16<kGemmBf16MR>(rows, x + r0 * xs, xs, k, bp, out + r0 * os + p * kGemmBf16NR, os, ncols, pb,
                                  pf + 64 * t * per_tile, pf_lines, step);
    }
  }
}
#define KVF_GEMM_BF16 1
#endif

#ifdef KVF_GEMM
constexpr int kGemmCompiled = 1;
#else
constexpr int kGemmCompiled = 0, kGemmNR = 24;
void gemm_pack(const float*, int64_t, int64_t, float*) {}
void gemm(const float*, int64_t, int64_t, int64_t, const float*, int64_t, const float*, float*, int64_t) {}
#endif
#ifdef KVF_GEMM_BF16
constexpr int kGemmBf16Compiled = 1;
#else
constexpr int kGemmBf16Compiled = 0, kGemmBf16NR = 48;
void gemm_pack_bf16(const uint16_t*, int64_t, int64_t, uint16_t*) {}
template <typename O>
void gemm_bf16(const uint16_t*, int64_t, int64_t, int64_t, const uint16_t*, int64_t, const uint16_t*, O*, int64_t) {}
#endif

// ---- a decode step's decoder layers, in one call ---------------------------------------------------------
// Every layer of a Llama-style decoder over a batch of decode tokens (row t: sequence t's one new token): the
// kernels above in the order and with the rounding of the model's Python forward (models/llama.py), so the
// results are bit for bit the same; what goes is the Python between the ops (~60 us a layer: dozens of calls,
// views and allocations, while the other threads wait in their barrier). The matmuls are the panel GEMMs
// (the path for few rows), the elementwise ops and decode attention the native ones; decode_stack.py decides
// when this applies.
struct DecodeLayer {  // one layer's weights (panel-packed matmuls; a bias or q/k norm pointer may be null), KV cache
  const void *input_norm, *post_norm, *qkv, *o, *gate_up, *down;
  const void *qkv_bias, *o_bias, *gate_up_bias, *down_bias, *q_norm, *k_norm;
  void *key_cache, *value_cache;
};
struct DecodeShape {
  int64_t hidden, inter;
  int hq, hkv, d, block_size, head_major;
  float eps, scale;
};
enum DecodeOp { kOpRmsNorm, kOpLinear, kOpRotary, kOpStoreKv, kOpAttention, kOpSilu };  // decode_stack.OP_NAMES

inline void panel_gemm(const float* x, int64_t m, int64_t k, const void* w, int64_t n, const void* bias, float* out) {
  gemm(x, k, m, k, (const float*)w, n, (const float*)bias, out, n);
}
inline void panel_gemm(const uint16_t* x, int64_t m, int64_t k, const void* w, int64_t n, const void* bias,
                       uint16_t* out) {
  gemm_bf16(x, k, m, k, (const uint16_t*)w, n, (const uint16_t*)bias, out, n);
}

// hidden [n, H]: the embeddings in, the last layer's output out; residual [n, H]: the last layer's residual out.
// seconds (or null): each op kind's wall seconds are added to seconds[DecodeOp].
template <typename T>
void decode_layers(const DecodeLayer* layers, int num_layers, const DecodeShape& sh, T* hidden, T* residual,
                   int64_t n, const int64_t* positions, const T* cos_sin, const int64_t* slots, const int32_t* tables,
                   int64_t table_stride, const int32_t* lens, double* seconds) {
  const int64_t H = sh.hidden, I = sh.inter, qs = int64_t(sh.hq) * sh.d, kvs = int64_t(sh.hkv) * sh.d;
  const int64_t qkv_n = qs + 2 * kvs;
  thread_local std::vector<T> normed, qkv, q_rot, k_rot, attn, o_out, gate_up, act;  // kept from step to step
  thread_local std::vector<T> q_in, k_in, q_normed, k_normed;  // (Qwen3's q/k RMSNorm)
  thread_local std::vector<int64_t> rows;
  normed.resize(n * H), qkv.resize(n * qkv_n), q_rot.resize(n * qs), k_rot.resize(n * kvs), attn.resize(n * qs);
  o_out.resize(n * H), gate_up.resize(n * 2 * I), act.resize(n * I), rows.resize(n);
  for (int64_t t = 0; t < n; ++t) rows[t] = t;
  double t0 = seconds ? omp_get_wtime() : 0.0;
  auto lap = [&](DecodeOp op) {
    if (seconds) { const double t = omp_get_wtime(); seconds[op] += t - t0; t0 = t; }
  };
  for (int l = 0; l < num_layers; ++l) {
    const DecodeLayer& w = layers[l];
    const T *in_norm = (const T*)w.input_norm, *post_norm = (const T*)w.post_norm;
    if (l == 0) {
      std::memcpy(residual, hidden, size_t(n * H) * sizeof(T));
      rms_norm<T>(hidden, nullptr, in_norm, normed.data(), nullptr, n, H, sh.eps);
    } else {
      rms_norm<T>(hidden, residual, in_norm, normed.data(), residual, n, H, sh.eps);  // (in place: per element)
    }
    lap(kOpRmsNorm);
    panel_gemm(normed.data(), n, H, w.qkv, qkv_n, w.qkv_bias, qkv.data());
    lap(kOpLinear);
    const T *q = qkv.data(), *k = qkv.data() + qs;
    int64_t q_stride = qkv_n, k_stride = qkv_n;
    if (w.q_norm != nullptr) {  // per head, each head's row copied out first (as the Python path's reshape does)
      q_in.resize(n * qs), k_in.resize(n * kvs), q_normed.resize(n * qs), k_normed.resize(n * kvs);
      for (int64_t t = 0; t < n; ++t) {
        std::memcpy(q_in.data() + t * qs, q + t * qkv_n, size_t(qs) * sizeof(T));
        std::memcpy(k_in.data() + t * kvs, k + t * qkv_n, size_t(kvs) * sizeof(T));
      }
      rms_norm<T>(q_in.data(), nullptr, (const T*)w.q_norm, q_normed.data(), nullptr, n * sh.hq, sh.d, sh.eps);
      rms_norm<T>(k_in.data(), nullptr, (const T*)w.k_norm, k_normed.data(), nullptr, n * sh.hkv, sh.d, sh.eps);
      q = q_normed.data(), k = k_normed.data(), q_stride = qs, k_stride = kvs;
      lap(kOpRmsNorm);
    }
    rotary<T>(positions, q, q_stride, k, k_stride, cos_sin, q_rot.data(), k_rot.data(), n, sh.hq, sh.hkv, sh.d, 1);
    lap(kOpRotary);
    T *kc = (T*)w.key_cache, *vc = (T*)w.value_cache;
    const KVLayout kv(sh.block_size, sh.hkv, sh.d, sh.head_major);
    store_kv<T>(k_rot.data(), kvs, qkv.data() + qs + kvs, qkv_n, kc, vc, slots, n, sh.hkv, sh.d, kv);
    lap(kOpStoreKv);
    decode_attention<T>(q_rot.data(), kc, vc, tables, table_stride, lens, rows.data(), int(n), sh.hq, sh.hkv, sh.d,
                        sh.block_size, sh.head_major, sh.scale, 0, attn.data(), 1);  // (max_ctx: unused there)
    lap(kOpAttention);
    panel_gemm(attn.data(), n, qs, w.o, H, w.o_bias, o_out.data());
    lap(kOpLinear);
    rms_norm<T>(o_out.data(), residual, post_norm, normed.data(), residual, n, H, sh.eps);
    lap(kOpRmsNorm);
    panel_gemm(normed.data(), n, H, w.gate_up, 2 * I, w.gate_up_bias, gate_up.data());
    lap(kOpLinear);
    silu_and_mul<T>(gate_up.data(), act.data(), n, I);
    lap(kOpSilu);
    panel_gemm(act.data(), n, I, w.down, H, w.down_bias, hidden);
    lap(kOpLinear);
  }
}

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
