// decode_layers.h: a decode step's decoder layers in one call.
// Part of cpu_kernels.cpp: included in order inside its anonymous namespace (kernels.py expands the
// includes into one translation unit), so it uses what the parts before it define.

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
