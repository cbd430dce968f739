// prefill_tiles_bf16.h: prefill attention's bfloat16 tiles: vdpbf16ps (AVX512_BF16) and AMX.
// Part of cpu_kernels.cpp: included in order inside its anonymous namespace (kernels.py expands the
// includes into one translation unit), so it uses what the parts before it define.

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
