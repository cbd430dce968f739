// common.h: bfloat16 <-> float, exp, the paged KV cache's layout, AMX tile state.
// Part of cpu_kernels.cpp: included in order inside its anonymous namespace (kernels.py expands the
// includes into one translation unit), so it uses what the parts before it define.

inline float to_f(float x) { return x; }
inline float to_f(uint16_t b) { uint32_t u = uint32_t(b) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline void from_f(float x, float* o) { *o = x; }
inline void from_f(float x, uint16_t* o) {  // round to nearest even, as torch does
  uint32_t u; std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) { *o = uint16_t((u >> 16) | 0x40); return; }  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  *o = uint16_t(u >> 16);
}

// Cephes' expf: exp(x) = 2^n * e^r with n = round(x log2 e), r = x - n ln 2 (ln 2 split in two parts), e^r
// from a degree-5 polynomial; about 1 ulp. The scalar and the vector versions below share these constants.
constexpr float kExpMin = -87.0f, kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = 2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// exp(x) for x <= 0; written so that the loop around it vectorizes
inline float exp_neg(float x) {
  x = x < kExpMin ? kExpMin : x;
  float fx = x * kLog2e;
  fx = float(int(fx - 0.5f));  // round to nearest (x <= 0; int() truncates toward 0)
  float r = x - fx * kLn2Hi + fx * kLn2Lo;
  float y = kExpPoly[0];
  for (int i = 1; i < 6; ++i) y = y * r + kExpPoly[i];
  y = y * r * r + r + 1.0f;
  int32_t bits = (int32_t(fx) + 127) << 23;
  float scale; std::memcpy(&scale, &bits, 4);
  return y * scale;
}

// Where a KV head's row of a block slot lies in a layer's paged cache, in elements. Blocks are dense either
// way: token-major [block, slot, kv head, d] (every backend's logical layout, and the GPU's memory) or head-major
// [block, kv head, slot, d] (the CPU worker's memory: each head's keys of a block contiguous, 2 KiB at head dim
// 64 in bfloat16, so decode attention reads it as one run instead of 16 runs of 128 bytes).
struct KVLayout {
  int bs;
  int64_t blk, tok, head;
  KVLayout(int block_size, int hkv, int d, int head_major)
      : bs(block_size), blk(int64_t(block_size) * hkv * d), tok(head_major ? d : int64_t(hkv) * d),
        head(head_major ? int64_t(block_size) * d : d) {}
  // token t of a sequence (its block table given), kv head h
  int64_t at(const int32_t* table, int t, int h) const { return int64_t(table[t / bs]) * blk + (t % bs) * tok + h * head; }
};

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// AMX tiles (Sapphire Rapids and later): the bf16 panel GEMM and bf16 prefill attention use them where the CPU has
// them and Linux lends the process the tile state (asked once per process); kvf_amx turns them off and on, to
// compare with the vdpbf16ps kernels.
#define KVF_AMX 1
struct AmxTileConfig {  // LDTILECFG's 64 bytes, palette 1
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}
bool g_amx = true;  // kvf_amx(0): the vdpbf16ps kernels instead
inline bool use_amx() { return g_amx && amx_permitted(); }

inline void amx_load_config() {  // every tile 16 rows of 64 bytes; per thread, and per call (oneDNN sets its own)
  AmxTileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

#endif
