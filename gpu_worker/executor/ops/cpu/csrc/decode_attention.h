// decode_attention.h: decode attention over the paged KV cache (one new token a sequence).
// Part of cpu_kernels.cpp: included in order inside its anonymous namespace (kernels.py expands the
// includes into one translation unit), so it uses what the parts before it define.

#if defined(__AVX2__)
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

#if defined(KVF_AVX2)
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
