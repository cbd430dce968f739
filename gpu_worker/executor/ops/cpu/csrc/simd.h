// simd.h: vector helpers shared by the kernels: masks, loads and stores of float32 / bfloat16, exp, sums.
// Part of cpu_kernels.cpp: included in order inside its anonymous namespace (kernels.py expands the
// includes into one translation unit), so it uses what the parts before it define.

#if defined(__AVX2__)
inline __m256 first_n_mask8(int n) {  // lanes < n all ones
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx));
}

#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA (CPUs without AVX-512, e.g. AMD Zen 2/3): 8 lanes. The same algorithms as the AVX-512 code.
#define KVF_AVX2 1

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

#endif

#if defined(__AVX512F__)

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
#endif
