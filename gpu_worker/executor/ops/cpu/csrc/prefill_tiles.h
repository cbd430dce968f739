// prefill_tiles.h: prefill attention's pieces and its float32 tile (AVX-512).
// Part of cpu_kernels.cpp: included in order inside its anonymous namespace (kernels.py expands the
// includes into one translation unit), so it uses what the parts before it define.

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

#endif  // __AVX512F__
