// gemm_bf16.h: the bfloat16 panel GEMM for few rows: vdpbf16ps (AVX512_BF16) and AMX tiles.
// Part of cpu_kernels.cpp: included in order inside its anonymous namespace (kernels.py expands the
// includes into one translation unit), so it uses what the parts before it define.

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

#ifdef KVF_GEMM_BF16
constexpr int kGemmBf16Compiled = 1;
#else
constexpr int kGemmBf16Compiled = 0, kGemmBf16NR = 48;
void gemm_pack_bf16(const uint16_t*, int64_t, int64_t, uint16_t*) {}
template <typename O>
void gemm_bf16(const uint16_t*, int64_t, int64_t, int64_t, const uint16_t*, int64_t, const uint16_t*, O*, int64_t) {}
#endif
