// argmax.h: greedy sampling: argmax of each row of the logits.
// Part of cpu_kernels.cpp: included in order inside its anonymous namespace (kernels.py expands the
// includes into one translation unit), so it uses what the parts before it define.

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
