// elementwise.h: RMSNorm (with residual), SiLU-and-mul, rotary embedding, KV store.
// Part of cpu_kernels.cpp: included in order inside its anonymous namespace (kernels.py expands the
// includes into one translation unit), so it uses what the parts before it define.

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
