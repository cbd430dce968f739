// prefill_attention.h: prefill attention: the tile kernel for the CPU and dtype, over OpenMP; AVX2's own tile.
// Part of cpu_kernels.cpp: included in order inside its anonymous namespace (kernels.py expands the
// includes into one translation unit), so it uses what the parts before it define.

#if defined(__AVX512F__)

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
