// gemm_f32.h: the float32 panel GEMM for few rows (decode steps).
// Part of cpu_kernels.cpp: included in order inside its anonymous namespace (kernels.py expands the
// includes into one translation unit), so it uses what the parts before it define.

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
// From kGemmManyRows rows on (a prefill chunk, where the calibration may pick this GEMM), the rows go in blocks of
// kGemmMC, each block through every panel: a block's x stays in L2 while the panels stream past it, where all the
// rows' x (1,024 x 576 floats: 2.4 MB) would come from L3 for each panel. 2-core Xeon with AMX, one thread, 1,024
// rows, the model's four shapes: 132.5 against 112.8 GFLOP/s (blocks of 256: 127.0, 512: 116.3).
// Each output is one FMA chain over k in order (deterministic, independent of m, the thread count and the
// blockings).
#if defined(__AVX512F__)
constexpr int kGemmNR = 48, kGemmMR = 8, kGemmKC = 256;
#else
constexpr int kGemmNR = 24, kGemmMR = 4, kGemmKC = 128;
#endif
constexpr int64_t kGemmMC = 128, kGemmManyRows = 256;
inline int gemm_slice(int blocking) { return blocking == 1 ? kGemmKC / 2 : kGemmKC; }  // k per slice

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
  if (m >= kGemmManyRows) {
    for (int64_t r = 0; r < m; r += kGemmMC)
      gemm(x + r * xs, xs, std::min(kGemmMC, m - r), k, packed, n, bias, out + r * os, os);
    return;
  }
  const int64_t panels = (n + kGemmNR - 1) / kGemmNR;
  const bool to_l2 = g_gemm_blocking == 1;
  const int64_t kc = gemm_slice(g_gemm_blocking);
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

#ifdef KVF_GEMM
constexpr int kGemmCompiled = 1;
#else
constexpr int kGemmCompiled = 0, kGemmNR = 24;
inline int gemm_slice(int) { return 0; }
void gemm_pack(const float*, int64_t, int64_t, float*) {}
void gemm(const float*, int64_t, int64_t, int64_t, const float*, int64_t, const float*, float*, int64_t) {}
#endif
