#pragma once
// The quantized weight types' kernels for the AVX2 and AVX-512 tables
// (included by kernels_avx2.cpp and kernels_avx512.cpp after x86_common.h,
// under each file's flags). Every product computes the integer sums and then
// the float steps of quant_types.h, so the results equal the generic row's
// bit for bit:
// - Q4_0, Q5_0, IQ4_NL weights are d * int8, exactly Q8_0 blocks once their
//   values are unpacked: decode unpacks each block in registers (Q4_0Src ..
//   for x86_common.h's q8x_row), prefill converts a panel of rows to Q8_0
//   blocks in scratch; both then take the Q8_0 kernels' steps.
// - Q4_K, Q5_K, Q6_K, IQ4_XS take their super-block's sums with byte
//   multiply-adds, scales applied by the pair multiply-add, for up to four
//   tokens per pass over a weight row; in the AVX-512 tables Q2_K..Q6_K do
//   so two sub-blocks a 512-bit register (kquant_rows512).
// - Q4_1, Q5_1 are d * q + m: their q read as Q8_0 blocks as above, each
//   block's m beside them for the second float step.
// - Other types use the generic row (matmul_rows_quantized_generic).
// x86_type_table (at the end) registers these per type.

namespace ds4::cpu {
namespace {

// ---- activations for K-quant products --------------------------------------

void quantize_q8k_x86(const float* x, int64_t K, BlockQ8K* out) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < K / 256; ++b) {
    const float* v = x + b * 256;
    __m256 mx = _mm256_setzero_ps();
    for (int j = 0; j < 32; ++j) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(v + 8 * j), abs_mask));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    const bool zero = !(amax >= kQ8ActTiny);
    const __m256 id = _mm256_set1_ps(zero ? 0.0f : 127.0f / amax);
    out[b].d = zero ? 0.0f : 1.0f / (127.0f / amax);
    std::memset(out[b].pad, 0, sizeof out[b].pad);
    for (int g = 0; g < 8; ++g) {
      __m256i q[4];
      for (int j = 0; j < 4; ++j)
        q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + 32 * g + 8 * j), id),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      const __m256i qs = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].qs + 32 * g), qs);
      // Sums of each 16: widen to int16 and add pairs down to one value per half.
      const __m256i ones = _mm256_set1_epi8(1);
      const __m256i s16 = _mm256_maddubs_epi16(ones, qs);  // 16 pair sums
      const __m256i s32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));  // 8 quad sums
      const __m128i lo = _mm256_castsi256_si128(s32), hi = _mm256_extracti128_si256(s32, 1);
      const __m128i h = _mm_hadd_epi32(lo, hi);  // lo: 0-7, 8-15; hi: 16-23, 24-31 (pairs of quads)
      const __m128i h2 = _mm_hadd_epi32(h, h);
      out[b].bsums[2 * g] = int16_t(_mm_cvtsi128_si32(h2));
      out[b].bsums[2 * g + 1] = int16_t(_mm_extract_epi32(h2, 1));
      out[b].bsums32[g] = int16_t(_mm_cvtsi128_si32(h2) + _mm_extract_epi32(h2, 1));
    }
  }
}

// ---- Q4_0, Q5_0, IQ4_NL as Q8_0 blocks -------------------------------------

inline __m256i nibbles32(const uint8_t* qs) {  // positions 0..15 low nibbles, 16..31 high
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}

// Byte i of the result: 0xFF when bit i of `bits` is set.
inline __m256i bits_to_bytes(uint32_t bits) {
  const __m256i shuf = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202,
                                          0x0303030303030303);
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)), shuf);
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ull));
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

inline void store_q8_block(BlockQ8_0& o, uint16_t d, __m256i q) {
  o.d = d;
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.qs), q);
}

// Q5_0's / Q5_1's 32 values, 0..31: the nibbles and each high bit as 16.
inline __m256i q5_values(const uint8_t* qs, const uint8_t* qh_bytes) {  // 0..31
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  return _mm256_or_si256(nibbles32(qs), _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
}

// Rows [r0, r0 + rows) of a weight matrix as Q8_0 blocks, row by row (and
// the offset types' m to mh).
void to_q8_0_rows(const MatmulArgs& a, int64_t r0, int64_t rows, BlockQ8_0* out, uint16_t* mh) {
  const int64_t nb = a.K / 32, n = rows * nb;
  // The rows stream from memory (a prefill panel): each block asks for the
  // line kQ8RowAhead bytes on.
  const auto ahead = [](const void* p) { _mm_prefetch(static_cast<const char*>(p) + kQ8RowAhead, _MM_HINT_T0); };
  switch (a.type) {
    case GgmlType::Q4_1: {
      const auto* w = static_cast<const BlockQ4_1*>(a.w) + r0 * nb;
      for (int64_t i = 0; i < n; ++i) {
        ahead(w + i);
        store_q8_block(out[i], w[i].d, nibbles32(w[i].qs));
        mh[i] = w[i].m;
      }
      break;
    }
    case GgmlType::Q5_1: {
      const auto* w = static_cast<const BlockQ5_1*>(a.w) + r0 * nb;
      for (int64_t i = 0; i < n; ++i) {
        ahead(w + i);
        store_q8_block(out[i], w[i].d, q5_values(w[i].qs, w[i].qh));
        mh[i] = w[i].m;
      }
      break;
    }
    case GgmlType::Q4_0: {
      const auto* w = static_cast<const BlockQ4_0*>(a.w) + r0 * nb;
      for (int64_t i = 0; i < n; ++i)
        store_q8_block(out[i], w[i].d, _mm256_sub_epi8(nibbles32(w[i].qs), _mm256_set1_epi8(8)));
      break;
    }
    case GgmlType::Q5_0: {
      const auto* w = static_cast<const BlockQ5_0*>(a.w) + r0 * nb;
      for (int64_t i = 0; i < n; ++i) {
        ahead(w + i);
        store_q8_block(out[i], w[i].d, _mm256_sub_epi8(q5_values(w[i].qs, w[i].qh), _mm256_set1_epi8(16)));
      }
      break;
    }
    case GgmlType::IQ4_NL: {
      const auto* w = static_cast<const BlockIQ4NL*>(a.w) + r0 * nb;
      const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
      for (int64_t i = 0; i < n; ++i) ahead(w + i), store_q8_block(out[i], w[i].d, _mm256_shuffle_epi8(table, nibbles32(w[i].qs)));
      break;
    }
    default:
      std::abort();
  }
}

// The same types read in registers, for decode (x86_common.h's Q8Src).
// Lower half: the low nibbles; upper half: the high nibbles in place (Q8Src's kSplit).
inline __m256i split_nibbles(const uint8_t* qs) {
  const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return _mm256_and_si256(q, _mm256_set_m128i(_mm_set1_epi8(char(0xF0)), _mm_set1_epi8(0x0F)));
}
struct Q4_0Src {
  using Block = BlockQ4_0;
  static constexpr bool kUnsigned = true, kOffset = false, kSplit = kVnni;
  static constexpr int kBias = 8;
  static __m256i q(const Block& b) { return kSplit ? split_nibbles(b.qs) : nibbles32(b.qs); }
};
struct Q5_0Src {
  using Block = BlockQ5_0;
  static constexpr bool kUnsigned = true, kOffset = false, kSplit = false;
  static constexpr int kBias = 16;
  static __m256i q(const Block& b) { return q5_values(b.qs, b.qh); }
};
struct Q4_1Src {
  using Block = BlockQ4_1;
  static constexpr bool kUnsigned = true, kOffset = true, kSplit = kVnni;
  static constexpr int kBias = 0;
  static __m256i q(const Block& b) { return kSplit ? split_nibbles(b.qs) : nibbles32(b.qs); }
};
struct Q5_1Src {
  using Block = BlockQ5_1;
  static constexpr bool kUnsigned = true, kOffset = true, kSplit = false;
  static constexpr int kBias = 0;
  static __m256i q(const Block& b) { return q5_values(b.qs, b.qh); }
};
struct IQ4NLSrc {
  using Block = BlockIQ4NL;
  static constexpr bool kUnsigned = false, kOffset = false, kSplit = false;
  static constexpr int kBias = 0;
  static __m256i q(const Block& b) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
    return _mm256_shuffle_epi8(table, nibbles32(b.qs));
  }
};

// MXFP4 as IQ4_NL is read (a table of 16 signed values), its scale the
// E8M0 byte (e8m0_half, eight at once in d8).
struct MXFP4Src {
  using Block = BlockMXFP4;
  static constexpr bool kUnsigned = false, kOffset = false, kSplit = false;
  static constexpr int kBias = 0;
  static __m256i q(const Block& b) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMXFP4Values)));
    return _mm256_shuffle_epi8(table, nibbles32(b.qs));
  }
  static float d(const Block& b) { return e8m0_half(b.e); }
  static __m256 d8(const Block* w) {
    const __m256i e = _mm256_setr_epi32(w[0].e, w[1].e, w[2].e, w[3].e, w[4].e, w[5].e, w[6].e, w[7].e);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, small, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
  }
};

// MXFP4 for any batch: each row's blocks read in registers against every
// token (its scales do not fit the f16 d of the Q8_0 panels of prefill).
void matmul_rows_mxfp4_x86(const MatmulArgs& a, int64_t n0, int64_t n1, float* scratch) {
  q8x_decode<MXFP4Src>(a, n0, n1, scratch);  // no bias nor offset: the block sums are not read
}

void q8x_decode_other(const MatmulArgs& a, int64_t n0, int64_t n1, const float* ux) {
  switch (a.type) {
    case GgmlType::Q4_0: return q8x_decode<Q4_0Src>(a, n0, n1, ux);
    case GgmlType::Q5_0: return q8x_decode<Q5_0Src>(a, n0, n1, ux);
    case GgmlType::Q4_1: return q8x_decode<Q4_1Src>(a, n0, n1, ux);
    case GgmlType::Q5_1: return q8x_decode<Q5_1Src>(a, n0, n1, ux);
    case GgmlType::IQ4_NL: return q8x_decode<IQ4NLSrc>(a, n0, n1, ux);
    default: std::abort();
  }
}


// ---- K-quants ----------------------------------------------------------------

inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }


// Q4_K's / Q5_K's eight 6-bit scales and mins (scale_min_k4 for j = 0..7),
// as bytes, from the 12 packed bytes taken as three 32-bit words: sub-blocks
// 0-3 keep their low six bits, 4-7 take four bits of the third word and the
// top two bits of the first (scales) or second (mins) as bits 4-5.
inline void scales_mins_k4(const uint8_t* q, uint8_t sc[8], uint8_t mn[8]) {
  uint32_t a, b, c;
  std::memcpy(&a, q, 4);
  std::memcpy(&b, q + 4, 4);
  std::memcpy(&c, q + 8, 4);
  const uint32_t sc_lo = a & 0x3f3f3f3fu, mn_lo = b & 0x3f3f3f3fu;
  const uint32_t sc_hi = (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);
  const uint32_t mn_hi = ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4);
  std::memcpy(sc, &sc_lo, 4);
  std::memcpy(sc + 4, &sc_hi, 4);
  std::memcpy(mn, &mn_lo, 4);
  std::memcpy(mn + 4, &mn_hi, 4);
}

// The totals of C tokens' two sums of a K-quant block (the scaled products
// and the min or offset products), all at once: one transposing sum instead
// of two reductions per token. Integer totals: exact in any grouping.
template <int C>
inline void pair_totals(const __m256i a[C], const __m256i b[C], int32_t ta[C], int32_t tb[C]) {
  if constexpr (C == 1) {
    const __m256i h = _mm256_hadd_epi32(a[0], b[0]);  // a01 a23 b01 b23 | a45 a67 b45 b67
    const __m256i h2 = _mm256_hadd_epi32(h, h);       // a0-3 b0-3 . . | a4-7 b4-7 . .
    const __m128i t = _mm_add_epi32(_mm256_castsi256_si128(h2), _mm256_extracti128_si256(h2, 1));
    ta[0] = _mm_cvtsi128_si32(t);
    tb[0] = _mm_extract_epi32(t, 1);
  } else {
    __m256i v[8];
    for (int c = 0; c < 4; ++c) {
      v[c] = c < C ? a[c] : _mm256_setzero_si256();
      v[4 + c] = c < C ? b[c] : _mm256_setzero_si256();
    }
    alignas(32) int32_t t[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), totals8_i32(v));
    for (int c = 0; c < C; ++c) ta[c] = t[c], tb[c] = t[4 + c];
  }
}

// How far ahead in a row the K-quant products prefetch, in blocks. A row
// streams from memory, and an out-of-order window holds only ~4 blocks of a
// K-quant product's work: without it 1B Q4_K_M decoded 29-33 tok/s on two
// Zen 4 cores, with it 38-41 (4 and 16 blocks ahead: 35-38). The 512-bit
// kernels below prefetch kKquantAhead bytes on instead.
constexpr int64_t kPrefetchBlocks = 8;

// Asks for every cache line of the block at p (a prefetch never faults,
// past the row's end included).
template <typename Block>
inline void prefetch_block(const Block* p) {
  const char* c = reinterpret_cast<const char*>(p);
  for (size_t at = 0; at < sizeof(Block); at += 64) _mm_prefetch(c + at, _MM_HINT_T0);
}

// The same for `bytes` at p.
inline void prefetch_block(const char* p, size_t bytes) {
  for (size_t at = 0; at < bytes; at += 64) _mm_prefetch(p + at, _MM_HINT_T0);
}

// The integer sums of a Q4_K / Q5_K block b (block i of the row) against C
// tokens' activation blocks x[c][i]: the scaled products' eight int32 lanes
// in sum[c], the mins against the 16-sums in mprod[c] (totals to be taken).
template <bool Q5, int C>
inline void q45k_sums_x86(const std::conditional_t<Q5, BlockQ5K, BlockQ4K>& b, const BlockQ8K* const x[C], int64_t i,
                          __m256i sum[C], __m256i mprod[C]) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  alignas(16) uint8_t sc[8], mn[8];
  scales_mins_k4(b.scales, sc, mn);
  // Each min twice (it covers two 16-value sums of bsums), as int16.
  const __m128i m8 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
  const __m256i mv = _mm256_set_m128i(_mm_unpackhi_epi16(m8, m8), _mm_unpacklo_epi16(m8, m8));
  for (int c = 0; c < C; ++c) sum[c] = _mm256_setzero_si256();
  __m256i hbits = _mm256_setzero_si256();
  if constexpr (Q5) hbits = load256(b.qh);
  const auto sub_blocks = [&](int j) __attribute__((always_inline)) {
    const __m256i q = load256(b.qs + 32 * j);
    __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    if constexpr (Q5) {
      const __m256i one = _mm256_set1_epi8(1);
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j), one), 4));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j + 1), one), 4));
    }
    const __m256i s_lo = _mm256_set1_epi16(sc[2 * j]), s_hi = _mm256_set1_epi16(sc[2 * j + 1]);
    for (int c = 0; c < C; ++c) {
      sum[c] = madd_acc(sum[c], _mm256_maddubs_epi16(lo, load256(x[c][i].qs + 64 * j)), s_lo);
      sum[c] = madd_acc(sum[c], _mm256_maddubs_epi16(hi, load256(x[c][i].qs + 64 * j + 32)), s_hi);
    }
  };
  if constexpr (C >= 4) {
    // Not unrolled for four tokens: unrolled, GCC computed all 32 byte
    // products of the block before adding any and spilled them (16 vector
    // registers on AVX2).
#pragma GCC unroll 1
    for (int j = 0; j < 4; ++j) sub_blocks(j);
  } else {
    for (int j = 0; j < 4; ++j) sub_blocks(j);
  }
  for (int c = 0; c < C; ++c) mprod[c] = _mm256_madd_epi16(load256(x[c][i].bsums), mv);
}

// One weight row of nb Q4_K / Q5_K blocks times C tokens' activations.
template <bool Q5, int C>
void dot_q45k_x86(const void* wrow, const BlockQ8K* const x[C], int64_t nb, float out[C]) {
  using Block = std::conditional_t<Q5, BlockQ5K, BlockQ4K>;
  const auto* w = static_cast<const Block*>(wrow);
  BlockLanes lanes[C];
  // C = 4 or 8: four tokens' lanes 2p and 2p + 1 (quant_types.h) in the lanes of accS[h][p] and accM[h][p].
  __m128 accS[2][8], accM[2][8];
  for (int h = 0; h < 2; ++h)
    for (int p = 0; p < 8; ++p) accS[h][p] = accM[h][p] = _mm_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const Block& b = w[i];
    prefetch_block(w + i + kPrefetchBlocks);
    __m256i sum[C], mprod[C];
    q45k_sums_x86<Q5, C>(b, x, i, sum, mprod);
    const float d = _cvtsh_ss(b.d), dmin = _cvtsh_ss(b.dmin);
    if constexpr (C % 4 == 0) {
      // Lane c: token 4h + c's steps (S in lanes 0-3 of the totals, M in 4-7).
      const int p = int(i & 7);
      for (int h = 0; h < C / 4; ++h) {
        const __m256i v[8] = {sum[4 * h],   sum[4 * h + 1],   sum[4 * h + 2],   sum[4 * h + 3],
                              mprod[4 * h], mprod[4 * h + 1], mprod[4 * h + 2], mprod[4 * h + 3]};
        const __m256 tf = _mm256_cvtepi32_ps(totals8_i32(v));
        const __m128 dx = _mm_setr_ps(x[4 * h][i].d, x[4 * h + 1][i].d, x[4 * h + 2][i].d, x[4 * h + 3][i].d);
        accS[h][p] = _mm_fmadd_ps(_mm256_castps256_ps128(tf), _mm_mul_ps(_mm_set1_ps(d), dx), accS[h][p]);
        accM[h][p] = _mm_fnmadd_ps(_mm256_extractf128_ps(tf, 1), _mm_mul_ps(_mm_set1_ps(dmin), dx), accM[h][p]);
      }
    } else {
      int32_t S[C], M[C];
      pair_totals<C>(sum, mprod, S, M);
      for (int c = 0; c < C; ++c) {  // the generic row's float steps
        lanes[c].first(i, float(S[c]), d * x[c][i].d);
        lanes[c].second(i, -float(M[c]), dmin * x[c][i].d);
      }
    }
  }
  if constexpr (C % 4 == 0) {
    for (int h = 0; h < C / 4; ++h) _mm_storeu_ps(out + 4 * h, lanes_total4(accS[h], accM[h]));
  } else {
    for (int c = 0; c < C; ++c) out[c] = lanes[c].total();
  }
}

// Q2_K's sixteen 4-bit group scales (shift 0) or mins (shift 4), as int16.
inline __m256i q2k_nibbles(const BlockQ2K& b, int shift) {
  const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.scales));
  return _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, shift), _mm_set1_epi8(0x0F)));
}

// Q3_K's 6-bit group scales (low four bits in the first 8 bytes' nibbles, the
// top two in the last 4 bytes' bit pairs) minus 32, as int16.
inline __m256i q3k_scales16(const BlockQ3K& b) {
  uint32_t a0, a1, a2;
  std::memcpy(&a0, b.scales, 4);
  std::memcpy(&a1, b.scales + 4, 4);
  std::memcpy(&a2, b.scales + 8, 4);
  constexpr uint32_t m4 = 0x0f0f0f0f, m2 = 0x03030303;
  const __m128i v = _mm_setr_epi32(int((a0 & m4) | ((a2 & m2) << 4)), int((a1 & m4) | (((a2 >> 2) & m2) << 4)),
                                   int(((a0 >> 4) & m4) | (((a2 >> 4) & m2) << 4)),
                                   int(((a1 >> 4) & m4) | (((a2 >> 6) & m2) << 4)));
  return _mm256_cvtepi8_epi16(_mm_sub_epi8(v, _mm_set1_epi8(32)));
}

// Q2_K and Q3_K for dot_k16_x86 and dot_k16_512 (their comments say how):
// the groups' scales and the words that multiply the activations' 16-sums
// as 16 int16, and the values as unsigned bytes, a half block's four
// quarters in 256-bit registers (quarters) or two 512-bit ones (values).
#ifdef __AVX512F__
// Two bits of qs a value, quarters s = 0..3 of half n at bits 2s.
inline void two_bit_values(const uint8_t* qs32, __m512i q[2]) {
  const __m512i m3 = _mm512_set1_epi8(3);
  const __m512i sh01 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  const __m512i sh23 = _mm512_add_epi16(sh01, _mm512_set1_epi16(4));
  const __m512i b = _mm512_broadcast_i64x4(load256(qs32));
  q[0] = _mm512_and_si512(_mm512_srlv_epi16(b, sh01), m3);
  q[1] = _mm512_and_si512(_mm512_srlv_epi16(b, sh23), m3);
}
#endif

struct Q2KGroups {
  using Block = BlockQ2K;
  static constexpr bool kMin = true;
  static constexpr int kOffsetShift = 0;
  static __m256i scales(const Block& b) { return q2k_nibbles(b, 0); }
  static __m256i offsets(const Block& b) { return q2k_nibbles(b, 4); }  // the mins
  static void quarters(const Block& b, int n, __m256i q[4]) {
    const __m256i m3 = _mm256_set1_epi8(3), v = load256(b.qs + 32 * n);
    for (int k = 0; k < 4; ++k) q[k] = _mm256_and_si256(_mm256_srli_epi16(v, 2 * k), m3);
  }
#ifdef __AVX512F__
  static void values(const Block& b, int n, __m512i q[2]) { two_bit_values(b.qs + 32 * n, q); }
#endif
  static float d(const Block& b) { return _cvtsh_ss(b.d); }
  static float dmin(const Block& b) { return _cvtsh_ss(b.dmin); }
};

struct Q3KGroups {
  using Block = BlockQ3K;
  static constexpr bool kMin = false;
  static constexpr int kOffsetShift = 2;  // q + 4: two bits, and 4 where hmask's bit is set
  static __m256i scales(const Block& b) { return q3k_scales16(b); }
  static __m256i offsets(const Block& b) { return scales(b); }
  static void quarters(const Block& b, int n, __m256i q[4]) {
    const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    const __m256i v = load256(b.qs + 32 * n), h = load256(b.hmask);
    // hmask bit 4n + k of byte l: quarter k's high bit (shifts stay within each byte's bits).
    for (int k = 0; k < 4; ++k)
      q[k] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 2 * k), m3),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4 * n + k), one), 2));
  }
#ifdef __AVX512F__
  static void values(const Block& b, int n, __m512i q[2]) {
    two_bit_values(b.qs + 32 * n, q);
    // hmask bit 4n + s of byte l: quarter s's high bit.
    const __m512i h = _mm512_broadcast_i64x4(load256(b.hmask));
    const __m512i sh01 = _mm512_inserti64x4(_mm512_set1_epi16(int16_t(4 * n)), _mm256_set1_epi16(int16_t(4 * n + 1)), 1);
    const __m512i sh23 = _mm512_add_epi16(sh01, _mm512_set1_epi16(2));
    const __m512i one = _mm512_set1_epi8(1);
    q[0] = _mm512_or_si512(q[0], _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, sh01), one), 2));
    q[1] = _mm512_or_si512(q[1], _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, sh23), one), 2));
  }
  // values() for the decode row (K16Unit): the high bit taken to bit 2 of
  // its byte by one shift (quarters 0 / 1 of half 0 left by 2 / 1, the others
  // right by 4n + s - 2; what a 16-bit shift carries over from the next byte
  // lands outside bit 2) and joined by one ternary-logic operation. One token,
  // 64 rows from L2, K 2048: 4.6-4.7 -> 4.1-4.2 us. The prefill tiles keep
  // values(): there it was no faster, and at K 256 25% slower.
  static void row_values(const Block& b, int n, __m512i q[2]) {
    two_bit_values(b.qs + 32 * n, q);
    const __m512i h = _mm512_broadcast_i64x4(load256(b.hmask));
    const __m512i half = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1);  // 0 | 1
    const __m512i h01 = n == 0 ? _mm512_sllv_epi16(h, _mm512_sub_epi16(_mm512_set1_epi16(2), half))
                               : _mm512_srlv_epi16(h, _mm512_add_epi16(_mm512_set1_epi16(int16_t(4 * n - 2)), half));
    const __m512i h23 = _mm512_srlv_epi16(h, _mm512_add_epi16(_mm512_set1_epi16(int16_t(4 * n)), half));
    const __m512i bit2 = _mm512_set1_epi8(4);
    q[0] = _mm512_ternarylogic_epi32(q[0], h01, bit2, 0xF8);  // A | (B & C)
    q[1] = _mm512_ternarylogic_epi32(q[1], h23, bit2, 0xF8);
  }
#endif
  static float d(const Block& b) { return _cvtsh_ss(b.d); }
  static float dmin(const Block&) { return 0; }
};

// ---- K-quant decode: one row, one token, eight blocks a pass ----------------
//
// The lane steps of quant_types.h let eight blocks go at once: their S and M
// totals come out of two transposing sums (lane k: block b + k) and take one
// vector step each, into the lanes that are the contract's 2k and 2k + 1.
// Bit for bit the generic row's (test_kernel_bench, test_quants). Lanes of a
// last, partial group take fma(0, 0, lane): a lane is never -0, so it stays
// as it is. A Unit is one type's block work in one table (Q45KUnit and
// K16Unit in 512-bit registers, Q45KUnitX86, Q6KUnitX86 and K16UnitX86 in
// 256-bit ones): S and M (or the offset sums) as eight int32 lanes to be
// totalled, and how far on to prefetch.

// A K-quant block's d, and its dmin where it has one, as fp16 bits (dmin in the high half).
inline uint32_t block_dm16(const BlockQ4K& b) { return uint32_t(b.d) | uint32_t(b.dmin) << 16; }
inline uint32_t block_dm16(const BlockQ5K& b) { return uint32_t(b.d) | uint32_t(b.dmin) << 16; }
inline uint32_t block_dm16(const BlockQ2K& b) { return uint32_t(b.d) | uint32_t(b.dmin) << 16; }
inline uint32_t block_dm16(const BlockQ3K& b) { return b.d; }
inline uint32_t block_dm16(const BlockQ6K& b) { return b.d; }

// The eight fp16 values in the low halves of h's 32-bit lanes, as f32.
inline __m256 fp16_low8(__m256i h) {
  const __m256i lo = _mm256_and_si256(h, _mm256_set1_epi32(0xFFFF));
  return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1)));
}

// Eight blocks' integer totals and scales, block p in lane p (a row's group
// of eight in kquant_row, several short rows' blocks in kquant_rows_few),
// and the operands of their float steps: first fma(s, dd, .), second
// fnmadd(m, dm, .) for the types with a min (quant_types.h). d * dx and
// dmin * dx are the generic row's products, built in registers: a vector
// load of eight scalar stores waits for them to retire (a row of few blocks
// paid that on every row).
template <class Unit>
struct BlockGroup {
  __m256i sv[8], mv[8];
  uint32_t dm16[8];  // each block's d and dmin, fp16
  float dx[8];
  void take(int p, const typename Unit::Block& blk, const BlockQ8K& x) {
    Unit::totals(blk, x, sv[p], mv[p]);
    dm16[p] = block_dm16(blk);
    dx[p] = x.d;
  }
  // A lane without a block: its steps are fma(0, 0, lane), which leave it as it is.
  void none(int p) {
    sv[p] = mv[p] = _mm256_setzero_si256();
    dm16[p] = 0;
    dx[p] = 0;
  }
  void steps(__m256& s, __m256& dd, __m256& m, __m256& dm) const {
    const __m256i h = _mm256_setr_epi32(int(dm16[0]), int(dm16[1]), int(dm16[2]), int(dm16[3]), int(dm16[4]),
                                        int(dm16[5]), int(dm16[6]), int(dm16[7]));
    const __m256 dxv = _mm256_setr_ps(dx[0], dx[1], dx[2], dx[3], dx[4], dx[5], dx[6], dx[7]);
    dd = _mm256_mul_ps(fp16_low8(h), dxv);
    if constexpr (Unit::kMin) {
      s = _mm256_cvtepi32_ps(totals8_i32(sv));
      m = _mm256_cvtepi32_ps(totals8_i32(mv));
      dm = _mm256_mul_ps(fp16_low8(_mm256_srli_epi32(h, 16)), dxv);
    } else {
      s = _mm256_cvtepi32_ps(_mm256_sub_epi32(totals8_i32(sv), _mm256_slli_epi32(totals8_i32(mv), Unit::kOffsetShift)));
      m = dm = _mm256_setzero_ps();
    }
  }
};

template <class Unit>
float kquant_row(const uint8_t* w0, const BlockQ8K* x, int64_t nb) {
  const auto* w = reinterpret_cast<const typename Unit::Block*>(w0);
  __m256 accS = _mm256_setzero_ps(), accM = _mm256_setzero_ps();
  // Blocks b..b+n (n <= 8) into lanes 0..n-1.
  const auto group = [&](int64_t b, int n) __attribute__((always_inline)) {
    BlockGroup<Unit> g;
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      if (k < n) {
        prefetch_block(reinterpret_cast<const char*>(&w[b + k]) + Unit::kAhead, sizeof(w[b + k]));
        g.take(k, w[b + k], x[b + k]);
      } else {
        g.none(k);
      }
    }
    __m256 s, dd, m, dm;
    g.steps(s, dd, m, dm);
    accS = _mm256_fmadd_ps(s, dd, accS);
    if constexpr (Unit::kMin) accM = _mm256_fnmadd_ps(m, dm, accM);
  };
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) group(b, 8);
  if (b < nb) group(b, int(nb - b));
  // reduce16 of lanes 2p = accS[p], 2p + 1 = accM[p]: m_2k = S_k + S_k+4,
  // m_2k+1 = M_k + M_k+4, then ((m0 + m4) + (m2 + m6)) + ((m1 + m5) + (m3 + m7)).
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(accS), _mm256_extractf128_ps(accS, 1));
  const __m128 t = _mm_add_ps(_mm256_castps256_ps128(accM), _mm256_extractf128_ps(accM, 1));
  const __m128 u = _mm_add_ps(s, _mm_movehl_ps(s, s)), v = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return (_mm_cvtss_f32(u) + _mm_cvtss_f32(_mm_movehdup_ps(u))) + (_mm_cvtss_f32(v) + _mm_cvtss_f32(_mm_movehdup_ps(v)));
}

// Rows of at most kFewBlocks blocks are taken several at a time: the blocks
// of 8 / s rows (s = 1, 2 or 4 lanes a row, nb <= s) share one transposing
// sum and one vector of float steps, and each row's lanes are reduced in the
// register. The contract's reduce16 of such a row is exact to write in its
// own lanes: lanes past the row's blocks are +0, and a step fma(., ., +0) is
// never -0, so adding them changes nothing; what is left is
// ((A0 + A2) + (A1 + A3)) + ((B0 + B2) + (B1 + B3)), A the first steps, B the
// second ones (+0 where a type has none). A row of few blocks alone paid for
// its own transposing sum, reduction and call (Q4_K, rows from L2, one
// token: 48 cycles a block at K 256, 39 at 512, 31 at 1024, against 22 for
// long rows): a mixture of experts' rows are that short (expert width 512).
// Each block asks for the line kAhead bytes on, as kquant_row does: a
// thread's chunk of an expert is a short run of lines that the hardware
// prefetcher starts on late (small qwen3moe Q4_K_M, Zen 4, 2 threads, tg
// alternated: 443-497 -> 508-549 tok/s; 2048 bytes on 519-530, 8192 504-537).
constexpr int64_t kFewBlocks = 4;
template <class Unit>
void kquant_rows_few(const uint8_t* w0, int64_t rb, const BlockQ8K* x, int64_t nb, int64_t rows, float* y) {
  using Block = typename Unit::Block;
  // s = 1 << ls lanes a row, G rows a group (shifts, not divisions: s is
  // not known at compile time, and p / s was an idiv per lane).
  const int ls = nb <= 1 ? 0 : nb <= 2 ? 1 : 2, s = 1 << ls, G = 8 >> ls;
  int64_t r = 0;
  for (; r + G <= rows; r += G) {
    BlockGroup<Unit> bg;
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {
      const int g = p >> ls, k = p & (s - 1);
      if (k < nb) {
        const Block& blk = reinterpret_cast<const Block*>(w0 + (r + g) * rb)[k];
        prefetch_block(reinterpret_cast<const char*>(&blk) + Unit::kAhead, sizeof(Block));
        bg.take(p, blk, x[k]);
      } else
        bg.none(p);
    }
    const __m256 zero = _mm256_setzero_ps();
    __m256 S, dd, M, dm;
    bg.steps(S, dd, M, dm);
    __m256 A = _mm256_fmadd_ps(S, dd, zero), B = zero;
    if constexpr (Unit::kMin) B = _mm256_fnmadd_ps(M, dm, zero);
    // Lane g * s of each: the row's (A0 + A2) + (A1 + A3) and the same of B.
    if (s == 4) {
      A = _mm256_add_ps(A, _mm256_permute_ps(A, 0x4E));  // a0 + a2, a1 + a3
      B = _mm256_add_ps(B, _mm256_permute_ps(B, 0x4E));
    }
    if (s >= 2) {
      A = _mm256_add_ps(A, _mm256_permute_ps(A, 0xB1));
      B = _mm256_add_ps(B, _mm256_permute_ps(B, 0xB1));
    }
    alignas(32) float o[8];
    _mm256_store_ps(o, _mm256_add_ps(A, B));
    for (int g = 0; g < G; ++g) y[r + g] = o[g * s];
  }
  for (; r < rows; ++r) y[r] = kquant_row<Unit>(w0 + r * rb, x, nb);
}

// Rows [0, rows) of a K-quant type times one token, row r's result in y[r]:
// rows of few blocks several at a time, longer ones by kquant_row.
template <class Unit>
void kquant_rows(const uint8_t* w0, int64_t rb, const BlockQ8K* x, int64_t nb, int64_t rows, float* y) {
  if (nb <= kFewBlocks) return kquant_rows_few<Unit>(w0, rb, x, nb, rows, y);
  for (int64_t r = 0; r < rows; ++r) y[r] = kquant_row<Unit>(w0 + r * rb, x, nb);
}
using KRows = void (*)(const uint8_t*, int64_t, const BlockQ8K*, int64_t, int64_t, float*);

#ifdef __AVX512F__
// ---- K-quants in 512-bit registers (the AVX-512 tables) --------------------
//
// One register holds two sub-blocks of 32 weights side by side, each against
// its own 32 activation bytes: a byte multiply-add and a pair multiply-add
// by the two sub-blocks' scales take 64 weights of one row and one token
// (four 256-bit operations in dot_q45k_x86). R rows share each token's
// loads, C tokens each row's unpacked weights. The integer totals (exact in
// any grouping) and the float steps are dot_q45k_x86's / dot_q6k_x86's, so
// are the results, bit for bit. On Zen 5 (full-width AVX-512), 2 threads,
// 1B Q4_K_M pp128 went 126 -> 158-185 tok/s (0.75x -> 1.08-1.23x llama.cpp);
// tiles of 4 x 4 and 2 x 8 ran at 116-124 (spills). The float steps of a
// tile's eight outputs go in one vector (the scalar steps lane by lane).

inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }

// How far ahead in a row these kernels prefetch, in bytes (~28 Q4_K blocks):
// 1B Q4_K_M decode on two Zen 5 cores, 8 blocks ahead 56-57 tok/s, 2048 bytes
// 57-58, 4096 59-60, 8192 58-60; two rows side by side did no better.
constexpr int64_t kKquantAhead = 4096;

// madd_acc (x86_common.h) in 512-bit registers.
inline __m512i madd_acc(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// The 256-bit register of v's two halves added (an exact integer total's
// partial sums, in the lanes totals8_i32 and pair_totals take).
inline __m256i fold512(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

// Integer totals of R rows x C tokens of one block (S: the scaled products,
// M: the min / offset products), then the float steps of the generic row.
template <int R, int C>
inline void kquant_block_totals(const __m512i sum[R][C], const __m256i mprod[R][C], int32_t S[R][C], int32_t M[R][C]) {
  static_assert(C <= 4);
  for (int r = 0; r < R; ++r) {
    __m256i s[C];
    for (int c = 0; c < C; ++c) s[c] = fold512(sum[r][c]);
    pair_totals<C>(s, mprod[r], S[r], M[r]);
  }
}

// The lanes (quant_types.h) of a tile's R x C outputs. With R * C a multiple
// of 8 the float steps are vectors: eight outputs in the vector lanes of
// s[g][p] (their lane 2p) and m[g][p] (2p + 1), p the block's lane pair;
// otherwise each output's own BlockLanes.
template <int R, int C>
struct TileLanes {
  static constexpr bool kVector = R * C % 8 == 0;
  static constexpr int G = kVector ? R * C / 8 : 1;
  __m256 s[G][8], m[G][8];
  BlockLanes lanes[R][C];
  TileLanes() {
    if constexpr (kVector)
      for (int g = 0; g < G; ++g)
        for (int p = 0; p < 8; ++p) s[g][p] = m[g][p] = _mm256_setzero_ps();
  }
  // reduce16 of each output's lanes.
  void finish(float out[R][C]) const {
    if constexpr (kVector) {
      for (int g = 0; g < G; ++g) {
        alignas(32) float o[8];
        _mm256_store_ps(o, lanes_total8(s[g], m[g]));
        for (int k = 0; k < 8; ++k) out[(8 * g + k) / C][(8 * g + k) % C] = o[k];
      }
    } else {
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) out[r][c] = lanes[r][c].total();
    }
  }
};

// R weight rows (rb bytes apart) of nb Q4_K / Q5_K blocks times C tokens.
template <bool Q5, int R, int C>
void dot_q45k_512(const uint8_t* w0, int64_t rb, const BlockQ8K* const x[C], int64_t nb, float out[R][C]) {
  using Block = std::conditional_t<Q5, BlockQ5K, BlockQ4K>;
  const Block* w[R];
  for (int r = 0; r < R; ++r) w[r] = reinterpret_cast<const Block*>(w0 + r * rb);
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  // Word lanes 0-15 take sub-block 2j's scale, 16-31 sub-block 2j+1's.
  const __m512i pick = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1);
  TileLanes<R, C> t;
  auto& lanes = t.lanes;
  auto& accS = t.s;
  auto& accM = t.m;
  for (int64_t i = 0; i < nb; ++i) {
    __m512i sc[R], sum[R][C];
    __m256i mv[R], hbits[R];
    for (int r = 0; r < R; ++r) {
      prefetch_block(reinterpret_cast<const char*>(w[r] + i) + kKquantAhead, sizeof(Block));
      alignas(16) uint8_t s8[8], m8[8];
      scales_mins_k4(w[r][i].scales, s8, m8);
      sc[r] = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s8))));
      const __m128i mn = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m8)));
      mv[r] = _mm256_set_m128i(_mm_unpackhi_epi16(mn, mn), _mm_unpacklo_epi16(mn, mn));
      if constexpr (Q5) hbits[r] = load256(w[r][i].qh);
      for (int c = 0; c < C; ++c) sum[r][c] = _mm512_setzero_si512();
    }
    const auto sub_blocks = [&](int j) __attribute__((always_inline)) {
      const __m512i idx = _mm512_add_epi16(pick, _mm512_set1_epi16(int16_t(2 * j)));
      __m512i q[R], sv[R];
      for (int r = 0; r < R; ++r) {
        // [low nibbles | high nibbles] of the 32 bytes: sub-blocks 2j, 2j+1.
        const __m512i b2 = _mm512_broadcast_i64x4(load256(w[r][i].qs + 32 * j));
        q[r] = _mm512_and_si512(_mm512_mask_srli_epi16(b2, __mmask32(0xFFFF0000u), b2, 4), m4);
        if constexpr (Q5) {
          const __m512i h2 = _mm512_broadcast_i64x4(hbits[r]);
          const __m512i bit = _mm512_srlv_epi16(h2, idx);  // bit 2j (2j+1) of each byte at bit 0
          q[r] = _mm512_or_si512(q[r], _mm512_and_si512(_mm512_slli_epi16(bit, 4), _mm512_set1_epi8(0x10)));
        }
        sv[r] = _mm512_permutexvar_epi16(idx, sc[r]);
      }
      for (int c = 0; c < C; ++c) {
        const __m512i xv = load512(x[c][i].qs + 64 * j);
        for (int r = 0; r < R; ++r) sum[r][c] = madd_acc(sum[r][c], _mm512_maddubs_epi16(q[r], xv), sv[r]);
      }
    };
    if constexpr (R * C >= 4) {
      // Not unrolled: GCC would compute every product of the block before
      // adding any (as dot_q45k_x86's four tokens).
#pragma GCC unroll 1
      for (int j = 0; j < 4; ++j) sub_blocks(j);
    } else {
      for (int j = 0; j < 4; ++j) sub_blocks(j);
    }
    __m256i mprod[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) mprod[r][c] = _mm256_madd_epi16(load256(x[c][i].bsums), mv[r]);
    if constexpr (R * C % 8 == 0) {
      // Lane p of group g: row (8g + p) / C, token (8g + p) % C; each lane
      // takes the scalar steps below.
      for (int g = 0; g < R * C / 8; ++g) {
        __m256i sv[8], mvv[8];
        alignas(32) float d[8], dmin[8], dx[8];
        for (int p = 0; p < 8; ++p) {
          const int r = (8 * g + p) / C, c = (8 * g + p) % C;
          sv[p] = fold512(sum[r][c]);
          mvv[p] = mprod[r][c];
          d[p] = _cvtsh_ss(w[r][i].d);
          dmin[p] = _cvtsh_ss(w[r][i].dmin);
          dx[p] = x[c][i].d;
        }
        const __m256 S = _mm256_cvtepi32_ps(totals8_i32(sv)), M = _mm256_cvtepi32_ps(totals8_i32(mvv));
        const __m256 dxv = _mm256_load_ps(dx);
        const int p = int(i & 7);
        accS[g][p] = _mm256_fmadd_ps(S, _mm256_mul_ps(_mm256_load_ps(d), dxv), accS[g][p]);
        accM[g][p] = _mm256_fnmadd_ps(M, _mm256_mul_ps(_mm256_load_ps(dmin), dxv), accM[g][p]);
      }
    } else {
      int32_t S[R][C], M[R][C];
      kquant_block_totals<R, C>(sum, mprod, S, M);
      for (int r = 0; r < R; ++r) {
        const float d = _cvtsh_ss(w[r][i].d), dmin = _cvtsh_ss(w[r][i].dmin);
        for (int c = 0; c < C; ++c) {  // the generic row's float steps
          lanes[r][c].first(i, float(S[r][c]), d * x[c][i].d);
          lanes[r][c].second(i, -float(M[r][c]), dmin * x[c][i].d);
        }
      }
    }
  }
  t.finish(out);
}

// The K-quants of sixteen 16-value groups (Q2_K, Q3_K, Q6_K), by type: the
// block's values as unsigned bytes (quarters 128n..128n+63 and
// 128n+64..128n+127 of the block for half n, each register's 128-bit lane one
// group), the groups' scales and the words that multiply the activations'
// 16-sums, as 16 int16, and how S and M make the float steps:
// - kMin: S = sum sc_j (q . x)_j, M = sum m_j bsum_j; steps fma(S, d dx) and
//   fma(-M, dmin dx) into the block's two lanes (quant_types.h) (Q2_K);
// - otherwise the values are stored as q + kOffset: S = sum sc_j (q . x)_j -
//   kOffset * sum sc_j bsum_j; step fma(S, d dx) (Q3_K, Q6_K).
// Exact integer sums, the generic row's float steps: its results bit for bit.
// 1B Llama-3-shaped, Zen 5, 2 threads, against llama.cpp: Q2_K pp128 189 /
// 100 tok/s, tg64 69 / 56; Q3_K_M 178 / 80, 58-62 / 41-42 (the generic row
// before: 8 tok/s both).
struct Q6KGroups {
  using Block = BlockQ6K;
  static constexpr bool kMin = false;
  static constexpr int kOffsetShift = 5;  // 32
  static __m256i scales(const Block& b) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.scales)));
  }
  static __m256i offsets(const Block& b) { return scales(b); }
  // [q0 | q1] and [q2 | q3] of dot_q6k_x86: low nibbles of ql, two bits of qh each.
  // qh's two bits of each value are moved to bits 4-5 of its byte in one
  // shift (the halves' bits 0-1 / 2-3 left by 4 / 2, bits 4-5 / 6-7 right by
  // 0 / 2; what a 16-bit shift carries over from the next byte lands outside
  // bits 4-5) and joined to the low nibble by one ternary-logic operation.
  static void values(const Block& b, int n, __m512i q[2]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i half = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1);  // 0 | 1
    const __m512i l = load512(b.ql + 64 * n);
    const __m512i h = _mm512_broadcast_i64x4(load256(b.qh + 32 * n));
    const __m512i h01 = _mm512_sllv_epi16(h, _mm512_sub_epi16(_mm512_set1_epi16(4), _mm512_add_epi16(half, half)));
    const __m512i h23 = _mm512_srlv_epi16(h, _mm512_add_epi16(half, half));
    // A | (B & C): 0xF0 | (0xCC & 0xAA).
    q[0] = _mm512_ternarylogic_epi32(_mm512_and_si512(l, m4), h01, m30, 0xF8);
    q[1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4), h23, m30, 0xF8);
  }
  static float d(const Block& b) { return _cvtsh_ss(b.d); }
  static float dmin(const Block&) { return 0; }
};

// R weight rows of nb blocks of a 16-value-group type (Ty above) times C tokens.
template <typename Ty, int R, int C>
void dot_k16_512(const uint8_t* w0, int64_t rb, const BlockQ8K* const x[C], int64_t nb, float out[R][C]) {
  using Block = typename Ty::Block;
  const Block* w[R];
  for (int r = 0; r < R; ++r) w[r] = reinterpret_cast<const Block*>(w0 + r * rb);
  // Word k of a register is in group k / 8 of its four.
  const __m512i group = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 0,
                                         0, 0, 0, 0, 0, 0, 0);
  TileLanes<R, C> t;
  auto& lanes = t.lanes;
  auto& accS = t.s;
  auto& accM = t.m;
  for (int64_t i = 0; i < nb; ++i) {
    __m512i sc[R], sum[R][C];
    __m256i offw[R];
    for (int r = 0; r < R; ++r) {
      prefetch_block(reinterpret_cast<const char*>(w[r] + i) + kKquantAhead, sizeof(Block));
      sc[r] = _mm512_castsi256_si512(Ty::scales(w[r][i]));
      offw[r] = Ty::offsets(w[r][i]);
      for (int c = 0; c < C; ++c) sum[r][c] = _mm512_setzero_si512();
    }
    for (int n = 0; n < 2; ++n) {
      __m512i q[R][2], sv[R][2];
      for (int r = 0; r < R; ++r) {
        Ty::values(w[r][i], n, q[r]);
        const __m512i g = _mm512_add_epi16(group, _mm512_set1_epi16(int16_t(8 * n)));
        sv[r][0] = _mm512_permutexvar_epi16(g, sc[r]);
        sv[r][1] = _mm512_permutexvar_epi16(_mm512_add_epi16(g, _mm512_set1_epi16(4)), sc[r]);
      }
      for (int k = 0; k < 2; ++k)
        for (int c = 0; c < C; ++c) {
          const __m512i xv = load512(x[c][i].qs + 128 * n + 64 * k);
          for (int r = 0; r < R; ++r) sum[r][c] = madd_acc(sum[r][c], _mm512_maddubs_epi16(q[r][k], xv), sv[r][k]);
        }
    }
    __m256i offs[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) offs[r][c] = _mm256_madd_epi16(load256(x[c][i].bsums), offw[r]);
    if constexpr (R * C % 8 == 0) {
      // Lane p of group g: row (8g + p) / C, token (8g + p) % C; each lane
      // takes the scalar steps below.
      for (int g = 0; g < R * C / 8; ++g) {
        __m256i tv[8], ov[8];
        alignas(32) float d[8], dmin[8], dx[8];
        for (int p = 0; p < 8; ++p) {
          const int r = (8 * g + p) / C, c = (8 * g + p) % C;
          tv[p] = fold512(sum[r][c]);
          ov[p] = offs[r][c];
          d[p] = Ty::d(w[r][i]);
          dmin[p] = Ty::dmin(w[r][i]);
          dx[p] = x[c][i].d;
        }
        const __m256 dxv = _mm256_load_ps(dx);
        const int p = int(i & 7);
        if constexpr (Ty::kMin) {
          accS[g][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals8_i32(tv)), _mm256_mul_ps(_mm256_load_ps(d), dxv), accS[g][p]);
          accM[g][p] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(totals8_i32(ov)), _mm256_mul_ps(_mm256_load_ps(dmin), dxv), accM[g][p]);
        } else {
          const __m256i q = _mm256_sub_epi32(totals8_i32(tv), _mm256_slli_epi32(totals8_i32(ov), Ty::kOffsetShift));
          accS[g][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_mul_ps(_mm256_load_ps(d), dxv), accS[g][p]);
        }
      }
    } else {
      int32_t T[R][C], O[R][C];
      kquant_block_totals<R, C>(sum, offs, T, O);
      for (int r = 0; r < R; ++r) {
        const float d = Ty::d(w[r][i]);
        for (int c = 0; c < C; ++c) {  // the generic row's float steps
          if constexpr (Ty::kMin) {
            lanes[r][c].first(i, float(T[r][c]), d * x[c][i].d);
            lanes[r][c].second(i, -float(O[r][c]), Ty::dmin(w[r][i]) * x[c][i].d);
          } else {
            lanes[r][c].first(i, float(T[r][c] - (O[r][c] << Ty::kOffsetShift)), d * x[c][i].d);
          }
        }
      }
    }
  }
  t.finish(out);
}

template <int R, int C>
using KDot512 = void (*)(const uint8_t*, int64_t, const BlockQ8K* const[C], int64_t, float[R][C]);

template <int R, int C>
KDot512<R, C> kquant_dot512(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_K: return dot_q45k_512<false, R, C>;
    case GgmlType::Q5_K: return dot_q45k_512<true, R, C>;
    case GgmlType::Q6_K: return dot_k16_512<Q6KGroups, R, C>;
    case GgmlType::Q2_K: return dot_k16_512<Q2KGroups, R, C>;
    case GgmlType::Q3_K: return dot_k16_512<Q3KGroups, R, C>;
    default: return nullptr;
  }
}

// ---- K-quant decode rows in 512-bit registers (kquant_row's units) ---------
// A block's integer work is dot_q45k_512's / dot_k16_512's for one row and one token.

template <bool Q5>
inline void q45k_block_totals(const std::conditional_t<Q5, BlockQ5K, BlockQ4K>& b, const BlockQ8K& x, __m256i& s,
                              __m256i& m) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i pick = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1);
  alignas(16) uint8_t s8[8], m8[8];
  scales_mins_k4(b.scales, s8, m8);
  const __m512i sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s8))));
  const __m128i mn = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m8)));
  __m256i hbits = _mm256_setzero_si256();
  if constexpr (Q5) hbits = load256(b.qh);
  __m512i sum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};  // two shorter chains
  for (int j = 0; j < 4; ++j) {
    const __m512i idx = _mm512_add_epi16(pick, _mm512_set1_epi16(int16_t(2 * j)));
    // [low nibbles | high nibbles] of the 32 bytes: sub-blocks 2j, 2j+1.
    const __m512i b2 = _mm512_broadcast_i64x4(load256(b.qs + 32 * j));
    __m512i q = _mm512_and_si512(_mm512_mask_srli_epi16(b2, __mmask32(0xFFFF0000u), b2, 4), m4);
    if constexpr (Q5) {
      const __m512i bit = _mm512_srlv_epi16(_mm512_broadcast_i64x4(hbits), idx);
      q = _mm512_or_si512(q, _mm512_and_si512(_mm512_slli_epi16(bit, 4), _mm512_set1_epi8(0x10)));
    }
    sum[j & 1] = madd_acc(sum[j & 1], _mm512_maddubs_epi16(q, load512(x.qs + 64 * j)), _mm512_permutexvar_epi16(idx, sc));
  }
  s = fold512(_mm512_add_epi32(sum[0], sum[1]));
  // The mins against the sums of 32: four lanes, the upper four zero.
  m = _mm256_zextsi128_si256(_mm_madd_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x.bsums32)), mn));
}

// The per-block work of kquant_row512, by type: S and M (or the offset
// sums) as eight int32 lanes each, and the block's d and dmin as fp16 bits.
template <bool Q5>
struct Q45KUnit {
  using Block = std::conditional_t<Q5, BlockQ5K, BlockQ4K>;
  static constexpr bool kMin = true;
  static constexpr int kOffsetShift = 0;
  static constexpr int64_t kAhead = kKquantAhead;
  static void totals(const Block& b, const BlockQ8K& x, __m256i& s, __m256i& m) { q45k_block_totals<Q5>(b, x, s, m); }
};

// Q2_K, Q3_K, Q6_K (Ty: the groups of dot_k16_512, whose block work this is).
template <typename Ty>
struct K16Unit {
  using Block = typename Ty::Block;
  static constexpr bool kMin = Ty::kMin;
  static constexpr int kOffsetShift = Ty::kOffsetShift;
  static constexpr int64_t kAhead = kKquantAhead;
  static void totals(const Block& b, const BlockQ8K& x, __m256i& s, __m256i& m) {
    // Word k of a register is in group k / 8 of its four.
    const __m512i group = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1,
                                           0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i sc = _mm512_castsi256_si512(Ty::scales(b));
    __m512i sum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int n = 0; n < 2; ++n) {
      __m512i q[2];
      if constexpr (requires { Ty::row_values(b, n, q); })
        Ty::row_values(b, n, q);
      else
        Ty::values(b, n, q);
      const __m512i g = _mm512_add_epi16(group, _mm512_set1_epi16(int16_t(8 * n)));
      for (int k = 0; k < 2; ++k) {
        const __m512i sv = _mm512_permutexvar_epi16(_mm512_add_epi16(g, _mm512_set1_epi16(int16_t(4 * k))), sc);
        sum[k] = madd_acc(sum[k], _mm512_maddubs_epi16(q[k], load512(x.qs + 128 * n + 64 * k)), sv);
      }
    }
    s = fold512(_mm512_add_epi32(sum[0], sum[1]));
    m = _mm256_madd_epi16(load256(x.bsums), Ty::offsets(b));
  }
};

// The decode rows of a type that has them here, else nullptr (the 1 x 1 tile).
KRows kquant_rows512_of(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_K: return kquant_rows<Q45KUnit<false>>;
    case GgmlType::Q5_K: return kquant_rows<Q45KUnit<true>>;
    case GgmlType::Q6_K: return kquant_rows<K16Unit<Q6KGroups>>;
    case GgmlType::Q2_K: return kquant_rows<K16Unit<Q2KGroups>>;
    case GgmlType::Q3_K: return kquant_rows<K16Unit<Q3KGroups>>;
    default: return nullptr;
  }
}
#endif

// The integer sums of a Q6_K block b (block i) against C tokens: the scaled
// products of the values as stored (q + 32) in sum[c], the scales against
// the 16-sums in offs[c] (S = total(sum) - 32 total(offs)).
template <int C>
inline void q6k_sums_x86(const BlockQ6K& b, const BlockQ8K* const x[C], int64_t i, __m256i sum[C], __m256i offs[C]) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
  const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.scales)));
  for (int c = 0; c < C; ++c) sum[c] = _mm256_setzero_si256();
  for (int n = 0; n < 2; ++n) {
    const __m256i l0 = load256(b.ql + 64 * n), l1 = load256(b.ql + 64 * n + 32), h = load256(b.qh + 32 * n);
    __m256i q[4];
    q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4));
    q[1] =
        _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4));
    for (int k = 0; k < 4; ++k) {
      const int s = 8 * n + 2 * k;
      const __m256i sv = _mm256_set_m128i(_mm_set1_epi16(b.scales[s + 1]), _mm_set1_epi16(b.scales[s]));
      for (int c = 0; c < C; ++c)
        sum[c] = madd_acc(sum[c], _mm256_maddubs_epi16(q[k], load256(x[c][i].qs + 128 * n + 32 * k)), sv);
    }
  }
  for (int c = 0; c < C; ++c) offs[c] = _mm256_madd_epi16(load256(x[c][i].bsums), sc16);
}

template <int C>
void dot_q6k_x86(const void* wrow, const BlockQ8K* const x[C], int64_t nb, float out[C]) {
  const auto* w = static_cast<const BlockQ6K*>(wrow);
  BlockLanes lanes[C];
  __m128 acc4[8];  // C == 4: token c's lane 2p in lane c of acc4[p]
  for (__m128& v : acc4) v = _mm_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const BlockQ6K& b = w[i];
    prefetch_block(w + i + kPrefetchBlocks);
    __m256i sum[C], offs[C];
    q6k_sums_x86<C>(b, x, i, sum, offs);
    const float d = _cvtsh_ss(b.d);
    if constexpr (C == 4) {  // lane c: token c's scalar step below
      const __m256i v[8] = {sum[0], sum[1], sum[2], sum[3], offs[0], offs[1], offs[2], offs[3]};
      const __m256i t = totals8_i32(v);
      const __m128i q = _mm_sub_epi32(_mm256_castsi256_si128(t), _mm_slli_epi32(_mm256_extracti128_si256(t, 1), 5));
      const __m128 dx = _mm_setr_ps(x[0][i].d, x[1][i].d, x[2][i].d, x[3][i].d);
      acc4[i & 7] = _mm_fmadd_ps(_mm_cvtepi32_ps(q), _mm_mul_ps(_mm_set1_ps(d), dx), acc4[i & 7]);
    } else {
      int32_t T[C], O[C];
      pair_totals<C>(sum, offs, T, O);
      for (int c = 0; c < C; ++c)  // q - 32: subtract 32 * sum_j sc_j * bsum_j
        lanes[c].first(i, float(T[c] - 32 * O[c]), d * x[c][i].d);
    }
  }
  if constexpr (C == 4) {
    const __m128 zero[8] = {};
    _mm_storeu_ps(out, lanes_total4(acc4, zero));
  } else {
    for (int c = 0; c < C; ++c) out[c] = lanes[c].total();
  }
}

// Q2_K and Q3_K in 256-bit registers (the avx2 table; the AVX-512 tables take
// dot_k16_512): per half n of a block, register k holds quarter k's 32 values
// as unsigned bytes, two 16-value groups, one a 128-bit lane, against the
// activations' 32 bytes, with the two groups' scales in the lanes' words; the
// generic row's float steps after (Q2_K: its mins against the 16-sums; Q3_K:
// the values stored as q + 4, so 4 times the scales against the 16-sums come
// off). Its results bit for bit.
// The integer sums of a Q2_K / Q3_K block b (block i) against C tokens: the
// scaled products in sum[c], the offsets (Q2_K: mins) against the 16-sums in offs[c].
template <typename Ty, int C>
inline void k16_sums_x86(const typename Ty::Block& b, const BlockQ8K* const x[C], int64_t i, __m256i sum[C],
                         __m256i offs[C]) {
  // Words 0-7 take the dword's low word, 8-15 its high word (one 128-bit lane each).
  const __m256i split =
      _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  const __m256i sc16 = Ty::scales(b);
  for (int c = 0; c < C; ++c) sum[c] = _mm256_setzero_si256();
  for (int n = 0; n < 2; ++n) {
    __m256i q[4];
    Ty::quarters(b, n, q);
    for (int k = 0; k < 4; ++k) {
      // Groups 8n + 2k and 8n + 2k + 1: dword 4n + k of the scales, one word a lane.
      const __m256i sv = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(4 * n + k)), split);
      for (int c = 0; c < C; ++c)
        sum[c] = madd_acc(sum[c], _mm256_maddubs_epi16(q[k], load256(x[c][i].qs + 128 * n + 32 * k)), sv);
    }
  }
  const __m256i offw = Ty::offsets(b);
  for (int c = 0; c < C; ++c) offs[c] = _mm256_madd_epi16(load256(x[c][i].bsums), offw);
}

template <typename Ty, int C>
void dot_k16_x86(const void* wrow, const BlockQ8K* const x[C], int64_t nb, float out[C]) {
  using Block = typename Ty::Block;
  const auto* w = static_cast<const Block*>(wrow);
  BlockLanes lanes[C];
  __m128 accS[8], accM[8];  // C == 4: token c's lanes 2p and 2p + 1 in lane c of accS[p] and accM[p]
  for (int p = 0; p < 8; ++p) accS[p] = accM[p] = _mm_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const Block& b = w[i];
    prefetch_block(w + i + kPrefetchBlocks);
    __m256i sum[C], offs[C];
    k16_sums_x86<Ty, C>(b, x, i, sum, offs);
    const float d = Ty::d(b);
    if constexpr (C == 4) {
      const __m256i v[8] = {sum[0], sum[1], sum[2], sum[3], offs[0], offs[1], offs[2], offs[3]};
      const __m256i t = totals8_i32(v);  // T of tokens 0-3, then O
      const __m128i tl = _mm256_castsi256_si128(t), th = _mm256_extracti128_si256(t, 1);
      const __m128 dx = _mm_setr_ps(x[0][i].d, x[1][i].d, x[2][i].d, x[3][i].d);
      const int p = int(i & 7);
      if constexpr (Ty::kMin) {
        accS[p] = _mm_fmadd_ps(_mm_cvtepi32_ps(tl), _mm_mul_ps(_mm_set1_ps(d), dx), accS[p]);
        accM[p] = _mm_fnmadd_ps(_mm_cvtepi32_ps(th), _mm_mul_ps(_mm_set1_ps(Ty::dmin(b)), dx), accM[p]);
      } else {
        const __m128i q = _mm_sub_epi32(tl, _mm_slli_epi32(th, Ty::kOffsetShift));
        accS[p] = _mm_fmadd_ps(_mm_cvtepi32_ps(q), _mm_mul_ps(_mm_set1_ps(d), dx), accS[p]);
      }
    } else {
      int32_t T[C], O[C];
      pair_totals<C>(sum, offs, T, O);
      for (int c = 0; c < C; ++c) {  // the generic row's float steps
        if constexpr (Ty::kMin) {
          lanes[c].first(i, float(T[c]), d * x[c][i].d);
          lanes[c].second(i, -float(O[c]), Ty::dmin(b) * x[c][i].d);
        } else {
          lanes[c].first(i, float(T[c] - (O[c] << Ty::kOffsetShift)), d * x[c][i].d);
        }
      }
    }
  }
  if constexpr (C == 4) {
    _mm_storeu_ps(out, lanes_total4(accS, accM));
  } else {
    for (int c = 0; c < C; ++c) out[c] = lanes[c].total();
  }
}

// kquant_row's units in 256-bit registers (the avx2 table's decode rows):
// the block sums of dot_q45k_x86, dot_q6k_x86 and dot_k16_x86 for one token.
template <bool Q5>
struct Q45KUnitX86 {
  using Block = std::conditional_t<Q5, BlockQ5K, BlockQ4K>;
  static constexpr bool kMin = true;
  static constexpr int kOffsetShift = 0;
  static constexpr int64_t kAhead = kPrefetchBlocks * int64_t(sizeof(Block));
  static void totals(const Block& b, const BlockQ8K& x, __m256i& s, __m256i& m) {
    const BlockQ8K* const xs[1] = {&x};
    q45k_sums_x86<Q5, 1>(b, xs, 0, &s, &m);
  }
};

struct Q6KUnitX86 {
  using Block = BlockQ6K;
  static constexpr bool kMin = false;
  static constexpr int kOffsetShift = 5;  // the values are stored as q + 32
  static constexpr int64_t kAhead = kPrefetchBlocks * int64_t(sizeof(Block));
  static void totals(const Block& b, const BlockQ8K& x, __m256i& s, __m256i& m) {
    const BlockQ8K* const xs[1] = {&x};
    q6k_sums_x86<1>(b, xs, 0, &s, &m);
  }
};

template <typename Ty>
struct K16UnitX86 {
  using Block = typename Ty::Block;
  static constexpr bool kMin = Ty::kMin;
  static constexpr int kOffsetShift = Ty::kOffsetShift;
  static constexpr int64_t kAhead = kPrefetchBlocks * int64_t(sizeof(Block));
  static void totals(const Block& b, const BlockQ8K& x, __m256i& s, __m256i& m) {
    const BlockQ8K* const xs[1] = {&x};
    k16_sums_x86<Ty, 1>(b, xs, 0, &s, &m);
  }
};

// The 256-bit decode rows of a type, else nullptr.
KRows kquant_rows_x86_of(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_K: return kquant_rows<Q45KUnitX86<false>>;
    case GgmlType::Q5_K: return kquant_rows<Q45KUnitX86<true>>;
    case GgmlType::Q6_K: return kquant_rows<Q6KUnitX86>;
    case GgmlType::Q2_K: return kquant_rows<K16UnitX86<Q2KGroups>>;
    case GgmlType::Q3_K: return kquant_rows<K16UnitX86<Q3KGroups>>;
    default: return nullptr;
  }
}

template <int C>
void dot_iq4xs_x86(const void* wrow, const BlockQ8K* const x[C], int64_t nb, float out[C]) {
  const auto* w = static_cast<const BlockIQ4XS*>(wrow);
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
  BlockLanes lanes[C];
  for (int64_t i = 0; i < nb; ++i) {
    const BlockIQ4XS& b = w[i];
    prefetch_block(w + i + kPrefetchBlocks);
    __m256i sum[C];
    for (int c = 0; c < C; ++c) sum[c] = _mm256_setzero_si256();
    for (int ib = 0; ib < 8; ++ib) {
      const int ls = ((b.scales_l[ib / 2] >> 4 * (ib % 2)) & 0xf) | (((b.scales_h >> 2 * ib) & 3) << 4);
      const __m256i q = _mm256_shuffle_epi8(table, nibbles32(b.qs + 16 * ib));
      const __m256i qa = _mm256_sign_epi8(q, q);
      const __m256i sv = _mm256_set1_epi16(int16_t(ls - 32));
      for (int c = 0; c < C; ++c) {
        const __m256i xv = load256(x[c][i].qs + 32 * ib);
        sum[c] = madd_acc(sum[c], _mm256_maddubs_epi16(qa, _mm256_sign_epi8(xv, q)), sv);
      }
    }
    const float d = _cvtsh_ss(b.d);
    for (int c = 0; c < C; ++c) lanes[c].first(i, float(total_i32(sum[c])), d * x[c][i].d);
  }
  for (int c = 0; c < C; ++c) out[c] = lanes[c].total();
}

// A K-quant kernel for C tokens, by type; nullptr when the table has none.
template <int C>
using KDot = void (*)(const void*, const BlockQ8K* const[C], int64_t, float[C]);

template <int C>
KDot<C> kquant_dot(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_K: return dot_q45k_x86<false, C>;
    case GgmlType::Q5_K: return dot_q45k_x86<true, C>;
    case GgmlType::Q6_K: return dot_q6k_x86<C>;
    case GgmlType::Q2_K: return dot_k16_x86<Q2KGroups, C>;
    case GgmlType::Q3_K: return dot_k16_x86<Q3KGroups, C>;
    case GgmlType::IQ4_XS: return dot_iq4xs_x86<C>;
    default: return nullptr;
  }
}

#ifdef __AVX512VNNI__
// ---- K-quant prefill with VNNI: sixteen tokens a 512-bit register -----------
//
// Q2_K to Q6_K. A panel of rows is unpacked first: each block's 256 values
// as bytes (Q2_K 0..3, Q3_K 0..7 as stored, q + 4, Q4_K 0..15, Q5_K 0..31,
// Q6_K 0..63 as stored, q + 32),
// its groups' scales, the words that meet the activations' 16-sums, and its
// d (and dmin). The tokens go in groups of sixteen, transposed so that one
// 512-bit register holds four activations of each; four values of a row,
// broadcast, meet sixteen tokens in one vpdpbusd. A group's products
// (eight words of a 32-value sub-block, four of a 16-value Q6_K group) are
// its (q . x) for each token, scaled by one 32-bit multiply; the mins (Q6_K:
// the offsets) meet the 16-sums by vpdpwssd. S and M (Q6_K: T and O) are
// the exact integers of dot_q45k_512 / dot_k16_512 in another grouping, the
// float steps theirs: the same bits. Against the one row times eight tokens
// of those tiles, where an activation register serves one token, the
// weights' broadcast serves sixteen, and each activation register four rows.
struct Q8KGroup16 {  // sixteen tokens' block i, transposed
  float d[16];
  int32_t bsum2[8][16];  // pair j: the token's 16-sums 2j and 2j + 1, as int16 halves
  int8_t qs[64][64];     // qs[k]: activations 4k..4k+3 of tokens 0..15
};
static_assert(sizeof(Q8KGroup16) % 64 == 0);

// One row's block, unpacked (Q4_K / Q5_K: eight 32-value sub-blocks).
struct Q45KPanelBlock {
  static constexpr int kGroups = 8;
  static constexpr bool kMin = true;
  static constexpr int kOffsetShift = 0;
  uint8_t v[256];    // the values, in order
  int32_t sc[8];     // each sub-block's scale
  int32_t pair[8];   // sub-block j's min twice (int16 halves): against 16-sums 2j, 2j + 1
  float d, dmin;
  uint8_t pad[56];
};
// Q6_K: sixteen 16-value groups, values stored as q + 32.
struct Q6KPanelBlock {
  static constexpr int kGroups = 16;
  static constexpr bool kMin = false;
  static constexpr int kOffsetShift = 5;  // T - 32 O
  uint8_t v[256];
  int32_t sc[16];   // each group's scale
  int32_t pair[8];  // scales 2j and 2j + 1 (int16 halves): against 16-sums 2j, 2j + 1
  float d, dmin;    // dmin unused
  uint8_t pad[24];
};
// Q2_K and Q3_K (Ty: their groups above): sixteen 16-value groups, the
// values, scales and offsets (Q2_K's mins, Q3_K's scales) as Ty gives them.
template <class Ty>
struct K16PanelBlock {
  using Groups = Ty;
  static constexpr int kGroups = 16;
  static constexpr bool kMin = Ty::kMin;
  static constexpr int kOffsetShift = Ty::kOffsetShift;
  uint8_t v[256];
  int32_t sc[16];   // each group's scale
  int32_t pair[8];  // offsets 2j and 2j + 1 (int16 halves): against 16-sums 2j, 2j + 1
  float d, dmin;
  uint8_t pad[24];
};
static_assert(sizeof(Q45KPanelBlock) % 64 == 0 && sizeof(Q6KPanelBlock) % 64 == 0 &&
              sizeof(K16PanelBlock<Q2KGroups>) % 64 == 0);

inline int32_t int16_pair(int lo, int hi) { return int32_t(uint16_t(int16_t(lo))) | int32_t(uint32_t(uint16_t(int16_t(hi))) << 16); }

template <class Block>
void unpack_block(const Block& b, Q45KPanelBlock& o) {
  constexpr bool Q5 = std::is_same_v<Block, BlockQ5K>;
  const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  for (int j = 0; j < 4; ++j) {
    const __m256i q = load256(b.qs + 32 * j);
    __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    if constexpr (Q5) {
      const __m256i h = load256(b.qh);
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * j), one), 4));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * j + 1), one), 4));
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(o.v + 64 * j), lo);
    _mm256_store_si256(reinterpret_cast<__m256i*>(o.v + 64 * j + 32), hi);
  }
  alignas(16) uint8_t s8[8], m8[8];
  scales_mins_k4(b.scales, s8, m8);
  for (int j = 0; j < 8; ++j) o.sc[j] = s8[j], o.pair[j] = int16_pair(m8[j], m8[j]);
  o.d = _cvtsh_ss(b.d);
  o.dmin = _cvtsh_ss(b.dmin);
}

// Q6_K's values in order: half n, quarter m, position l at 128n + 32m + l.
inline void unpack_block(const BlockQ6K& b, Q6KPanelBlock& o) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
  for (int n = 0; n < 2; ++n) {
    const __m256i l0 = load256(b.ql + 64 * n), l1 = load256(b.ql + 64 * n + 32), h = load256(b.qh + 32 * n);
    const __m256i q[4] = {
        _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4)),
        _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4))};
    for (int m = 0; m < 4; ++m) _mm256_store_si256(reinterpret_cast<__m256i*>(o.v + 128 * n + 32 * m), q[m]);
  }
  for (int g = 0; g < 16; ++g) o.sc[g] = b.scales[g];
  for (int j = 0; j < 8; ++j) o.pair[j] = int16_pair(b.scales[2 * j], b.scales[2 * j + 1]);
  o.d = _cvtsh_ss(b.d);
  o.dmin = 0.0f;
}

// Q2_K, Q3_K: quarter k of half n holds positions 128n + 32k .. + 31, in order.
template <class Ty>
void unpack_block(const typename Ty::Block& b, K16PanelBlock<Ty>& o) {
  for (int n = 0; n < 2; ++n) {
    __m256i q[4];
    Ty::quarters(b, n, q);
    for (int k = 0; k < 4; ++k) _mm256_store_si256(reinterpret_cast<__m256i*>(o.v + 128 * n + 32 * k), q[k]);
  }
  alignas(32) int16_t sc[16], off[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(sc), Ty::scales(b));
  _mm256_store_si256(reinterpret_cast<__m256i*>(off), Ty::offsets(b));
  for (int g = 0; g < 16; ++g) o.sc[g] = sc[g];
  for (int j = 0; j < 8; ++j) o.pair[j] = int16_pair(off[2 * j], off[2 * j + 1]);
  o.d = Ty::d(b);
  o.dmin = Ty::dmin(b);
}

// Tokens t0..t0+n (n <= 16) of the activations into groups, missing tokens as zeros.
inline void q8k_transpose_tokens16(const MatmulArgs& a, int64_t t0, int64_t n, int64_t nb, Q8KGroup16* g) {
  for (int64_t i = 0; i < nb; ++i) {
    Q8KGroup16& gi = g[i];
    for (int t = 0; t < 16; ++t) {
      const bool real = t < n;
      const BlockQ8K& xb = a.xk[(t0 + (real ? t : 0)) * a.ldxk + i];
      gi.d[t] = real ? xb.d : 0.0f;
      for (int j = 0; j < 8; ++j) {
        int32_t pair = 0;
        if (real) std::memcpy(&pair, xb.bsums + 2 * j, 4);
        gi.bsum2[j][t] = pair;
      }
    }
    for (int c = 0; c < 8; ++c)  // 32 activations a pass
      for (int h = 0; h < 2; ++h) {
        __m256i v[8];
        for (int t = 0; t < 8; ++t) {
          const int64_t tt = 8 * h + t;
          v[t] = tt < n ? load256(a.xk[(t0 + tt) * a.ldxk + i].qs + 32 * c) : _mm256_setzero_si256();
        }
        __m256i out[8];
        transpose_blocks8(v, out);
        for (int k = 0; k < 8; ++k) _mm256_store_si256(reinterpret_cast<__m256i*>(gi.qs[8 * c + k] + 32 * h), out[k]);
      }
  }
}

// R unpacked rows (nb blocks each, one after the other) times a group of
// sixteen tokens: out[r] lane t = y[t][r]. Each activation register serves
// R rows (R independent chains); the lanes' accumulators live in memory,
// touched once a block.
template <class PB, int R>
inline void kquant_rows_tokens16_tile(const PB* w, const Q8KGroup16* g, int64_t nb, __m512 out[R]) {
  constexpr int kWords = 64 / PB::kGroups;  // four-value words a group
  alignas(64) float acc[R][2][8][16];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h)
      for (int q = 0; q < 8; ++q) _mm512_store_ps(acc[r][h][q], _mm512_setzero_ps());
  for (int64_t i = 0; i < nb; ++i) {
    const Q8KGroup16& x = g[i];
    __m512i S[R], M[R];
    for (int r = 0; r < R; ++r) S[r] = M[r] = _mm512_setzero_si512();
    for (int j = 0; j < PB::kGroups; ++j) {
      __m512i sj[R];
      for (int r = 0; r < R; ++r) sj[r] = _mm512_setzero_si512();
      for (int k = 0; k < kWords; ++k) {
        const __m512i xv = _mm512_load_si512(x.qs[kWords * j + k]);
        for (int r = 0; r < R; ++r) {
          int32_t v4;
          std::memcpy(&v4, w[r * nb + i].v + 4 * (kWords * j + k), 4);
          sj[r] = _mm512_dpbusd_epi32(sj[r], _mm512_set1_epi32(v4), xv);
        }
      }
      for (int r = 0; r < R; ++r)
        S[r] = _mm512_add_epi32(S[r], _mm512_mullo_epi32(sj[r], _mm512_set1_epi32(w[r * nb + i].sc[j])));
    }
    for (int j = 0; j < 8; ++j) {
      const __m512i xb = _mm512_load_si512(x.bsum2[j]);
      for (int r = 0; r < R; ++r) M[r] = _mm512_dpwssd_epi32(M[r], xb, _mm512_set1_epi32(w[r * nb + i].pair[j]));
    }
    const __m512 dx = _mm512_load_ps(x.d);
    const int q = int(i & 7);
    for (int r = 0; r < R; ++r) {
      const PB& b = w[r * nb + i];
      if constexpr (PB::kMin) {
        _mm512_store_ps(acc[r][0][q], _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[r]), _mm512_mul_ps(_mm512_set1_ps(b.d), dx),
                                                      _mm512_load_ps(acc[r][0][q])));
        _mm512_store_ps(acc[r][1][q], _mm512_fnmadd_ps(_mm512_cvtepi32_ps(M[r]), _mm512_mul_ps(_mm512_set1_ps(b.dmin), dx),
                                                       _mm512_load_ps(acc[r][1][q])));
      } else {
        const __m512i t = _mm512_sub_epi32(S[r], _mm512_slli_epi32(M[r], PB::kOffsetShift));
        _mm512_store_ps(acc[r][0][q], _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(_mm512_set1_ps(b.d), dx),
                                                      _mm512_load_ps(acc[r][0][q])));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 sv[8], mv[8];
    for (int q = 0; q < 8; ++q) sv[q] = _mm512_load_ps(acc[r][0][q]), mv[q] = _mm512_load_ps(acc[r][1][q]);
    out[r] = lanes_total16(sv, mv);
  }
}

constexpr int64_t kK16PanelRows = 16;
// Four rows a tile (Zen 4, Q4_K, 64 rows of K 2048, 128 tokens: one row
// 232 us, two 192-201, four 143-150, eight 146-154).
constexpr int kK16TileRows = 4;

// Rows [n0, n1) of a Q4_K / Q5_K / Q6_K product (Block, PB: its block and
// unpacked block) over groups of sixteen tokens.
template <class Block, class PB>
void kquant_rows_tokens16(const MatmulArgs& a, int64_t n0, int64_t n1, float* scratch) {
  const int64_t nb = a.K / 256, rb = nb * int64_t(sizeof(Block));
  assert(nb * int64_t(sizeof(Q8KGroup16) + kK16PanelRows * sizeof(PB)) + 64 <= matmul_scratch_floats(a.K) * 4);
  auto* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(scratch) + 63) / 64 * 64);
  auto* g = reinterpret_cast<Q8KGroup16*>(base);
  auto* panel = reinterpret_cast<PB*>(g + nb);
  const auto* wb = static_cast<const uint8_t*>(a.w);
  for (int64_t p0 = n0; p0 < n1; p0 += kK16PanelRows) {
    const int64_t rows = std::min(kK16PanelRows, n1 - p0);
    for (int64_t r = 0; r < rows; ++r) {
      const auto* w = reinterpret_cast<const Block*>(wb + (p0 + r) * rb);
      for (int64_t i = 0; i < nb; ++i) {
        if constexpr (requires { typename PB::Groups; }) unpack_block<typename PB::Groups>(w[i], panel[r * nb + i]);
        else unpack_block(w[i], panel[r * nb + i]);
      }
    }
    for (int64_t t0 = 0; t0 < a.T; t0 += 16) {
      const int64_t n = std::min<int64_t>(16, a.T - t0);
      q8k_transpose_tokens16(a, t0, n, nb, g);
      token16_row_tiles<kK16TileRows>(a, t0, n, p0, rows, [&](auto R, int64_t r, __m512* out) {
        kquant_rows_tokens16_tile<PB, R>(panel + r * nb, g, nb, out);
      });
    }
  }
}
#endif

#ifdef __AVX512F__
// Rows [n0, n1) of a Q2_K..Q6_K product in 512-bit registers: in
// panels of rows (~128 KiB of weights, in L2, as the loop of
// matmul_rows_kquant_x86, why: there), one row times eight tokens or two
// rows times four a pass as the core wants (kquant_prefill_rows(),
// kernels.h), then groups of four, and the batch's last 1-3 tokens (all of a
// decode step) several rows at a time. With VNNI, batches of twelve tokens or
// more go sixteen tokens a register instead
// (kquant_rows_tokens16).

template <GgmlType TY>
void kquant_rows512(const MatmulArgs& a, int64_t n0, int64_t n1, float* scratch) {
#ifdef __AVX512VNNI__
  // From twelve tokens on (Zen 4, Q4_K, 64 rows of K 2048: T = 9 20.2 us
  // against 18.2 for the one-row tile, T = 12 20.2 / 23.4, T = 32 41 / 59,
  // T = 128 143-150 / 238-243).
  if (a.T >= 12) {
    if constexpr (TY == GgmlType::Q4_K) return kquant_rows_tokens16<BlockQ4K, Q45KPanelBlock>(a, n0, n1, scratch);
    if constexpr (TY == GgmlType::Q5_K) return kquant_rows_tokens16<BlockQ5K, Q45KPanelBlock>(a, n0, n1, scratch);
    if constexpr (TY == GgmlType::Q6_K) return kquant_rows_tokens16<BlockQ6K, Q6KPanelBlock>(a, n0, n1, scratch);
    if constexpr (TY == GgmlType::Q2_K)
      return kquant_rows_tokens16<BlockQ2K, K16PanelBlock<Q2KGroups>>(a, n0, n1, scratch);
    if constexpr (TY == GgmlType::Q3_K)
      return kquant_rows_tokens16<BlockQ3K, K16PanelBlock<Q3KGroups>>(a, n0, n1, scratch);
  }
#endif
  const int64_t nb = a.K / 256, rb = nb * int64_t(type_row(TY)->block_bytes);
  const auto* wb = static_cast<const uint8_t*>(a.w);
  const KRows rows1 = kquant_rows512_of(TY);
  const bool one_row = kquant_prefill_rows() == 1;
  // Rows r..r+R times tokens t..t+C.
  const auto tile = [&]<int R, int C>(int64_t r, int64_t t) {
    const BlockQ8K* x[C];
    for (int c = 0; c < C; ++c) x[c] = a.xk + (t + c) * a.ldxk;
    float o[R][C];
    kquant_dot512<R, C>(TY)(wb + r * rb, rb, x, nb, o);
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < C; ++c) a.y[(t + c) * a.ldy + r + i] = o[i][c];
  };
  // Rows [r0, r1) times tokens t..t+C, R rows a pass and the rest one by one.
  const auto rows = [&]<int R, int C>(int64_t r0, int64_t r1, int64_t t) {
    int64_t r = r0;
    for (; r + R <= r1; r += R) tile.template operator()<R, C>(r, t);
    for (; r < r1; ++r) tile.template operator()<1, C>(r, t);
  };
  const int64_t panel = std::clamp<int64_t>((128 << 10) / std::max<int64_t>(rb, 1), 2, 64) / 2 * 2;
  for (int64_t p0 = n0; p0 < n1; p0 += panel) {
    const int64_t pe = std::min(n1, p0 + panel);
    int64_t t = 0;
    if (one_row)
      for (; t + 8 <= a.T; t += 8) rows.template operator()<1, 8>(p0, pe, t);
    for (; t + 4 <= a.T; t += 4) rows.template operator()<2, 4>(p0, pe, t);
    switch (a.T - t) {
      case 3: rows.template operator()<1, 3>(p0, pe, t); break;
      case 2: rows.template operator()<1, 2>(p0, pe, t); break;
      case 1:
        if (!rows1) {
          rows.template operator()<1, 1>(p0, pe, t);
          break;
        }
        rows1(wb + p0 * rb, rb, a.xk + t * a.ldxk, nb, pe - p0, a.y + t * a.ldy + p0);
        break;
      default: break;
    }
  }
}
#endif

// Rows [n0, n1) of a K-quant product: each weight row against four tokens at a time.
template <GgmlType TY>
void matmul_rows_kquant_x86(const MatmulArgs& a, int64_t n0, int64_t n1, float*) {
  const int64_t nb = a.K / 256, rb = nb * int64_t(type_row(TY)->block_bytes);
  const KDot<4> d4 = kquant_dot<4>(TY);
  const KDot<1> d1 = kquant_dot<1>(TY);
  const KDot<2> d2 = kquant_dot<2>(TY);
  const KDot<3> d3 = kquant_dot<3>(TY);
  // Eight tokens a pass where the type has it (Q4_K, Q5_K: the unpacked
  // weights and the block's scales serve twice as many tokens).
  constexpr bool kEight = TY == GgmlType::Q4_K || TY == GgmlType::Q5_K;
  [[maybe_unused]] const KDot<8> d8 = TY == GgmlType::Q5_K ? dot_q45k_x86<true, 8> : dot_q45k_x86<false, 8>;
  // Row r against tokens t.. (the last 1-3 of the batch).
  const auto tail = [&](int64_t r, int64_t t) {
    const uint8_t* w = static_cast<const uint8_t*>(a.w) + r * rb;
    const BlockQ8K* x[3] = {a.xk + t * a.ldxk, a.xk + (t + 1) * a.ldxk, a.xk + (t + 2) * a.ldxk};
    float o[3];
    switch (a.T - t) {
      case 3: d3(w, x, nb, o); break;
      case 2: d2(w, x, nb, o); break;
      case 1: d1(w, x, nb, o); break;
      default: return;
    }
    for (int64_t c = 0; c < a.T - t; ++c) a.y[(t + c) * a.ldy + r] = o[c];
  };
  int64_t n = n0;
  // Prefill in panels of rows whose weights stay in L2 (~128 KiB), each
  // four tokens' activations taken by every row of the panel in turn: row by
  // row, every row read all T tokens' activations again (a 128-token prompt's
  // are 300-800 KiB, from L3), which cost more than the products.
  const int64_t panel = std::clamp<int64_t>((128 << 10) / std::max<int64_t>(rb, 1), 1, 64);
  for (; a.T >= 4 && n < n1; n += panel) {
    const int64_t pe = std::min(n1, n + panel);
    int64_t t = 0;
    if constexpr (kEight) {
      for (; t + 8 <= a.T; t += 8) {
        const BlockQ8K* x[8];
        for (int c = 0; c < 8; ++c) x[c] = a.xk + (t + c) * a.ldxk;
        for (int64_t r = n; r < pe; ++r) {
          float o[8];
          d8(static_cast<const uint8_t*>(a.w) + r * rb, x, nb, o);
          for (int c = 0; c < 8; ++c) a.y[(t + c) * a.ldy + r] = o[c];
        }
      }
    }
    for (; t + 4 <= a.T; t += 4) {
      const BlockQ8K* x[4] = {a.xk + t * a.ldxk, a.xk + (t + 1) * a.ldxk, a.xk + (t + 2) * a.ldxk,
                              a.xk + (t + 3) * a.ldxk};
      for (int64_t r = n; r < pe; ++r) {
        float o[4];
        d4(static_cast<const uint8_t*>(a.w) + r * rb, x, nb, o);
        for (int c = 0; c < 4; ++c) a.y[(t + c) * a.ldy + r] = o[c];
      }
    }
    for (int64_t r = n; r < pe; ++r) tail(r, a.T / 4 * 4);
  }
  // Decode (T < 4): one token, the row eight blocks a pass where the type has one.
  if (const KRows rows1 = a.T == 1 ? kquant_rows_x86_of(TY) : nullptr)
    return rows1(static_cast<const uint8_t*>(a.w) + n * rb, rb, a.xk, nb, n1 - n, a.y + n);
  for (; n < n1; ++n) tail(n, 0);
}

// A table's kernels (AVX2 or AVX-512, by the flags this file is compiled
// under), registered against the types' rows: `f32_rows` for the types
// x86_common.h converts to f32 (kSimdF32Types), and the quantized products;
// the types not named keep the generic row's (matmul_rows_quantized_generic).
// Each table builds it once and looks a type up once per product.
TypeKernelTable x86_type_table(MatmulRows f32_rows) {
  TypeKernelTable t;
  for (GgmlType ty : kSimdF32Types) t.set_f32(ty, f32_rows);
  for (GgmlType ty : {GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q5_0, GgmlType::IQ4_NL})
    t.set_quantized(ty, matmul_rows_q8x_as<false>);
  for (GgmlType ty : {GgmlType::Q4_1, GgmlType::Q5_1}) t.set_quantized(ty, matmul_rows_q8x_as<true>);
#ifdef __AVX512F__
  t.set_quantized(GgmlType::Q4_K, kquant_rows512<GgmlType::Q4_K>);
  t.set_quantized(GgmlType::Q5_K, kquant_rows512<GgmlType::Q5_K>);
  t.set_quantized(GgmlType::Q6_K, kquant_rows512<GgmlType::Q6_K>);
  t.set_quantized(GgmlType::Q2_K, kquant_rows512<GgmlType::Q2_K>);
  t.set_quantized(GgmlType::Q3_K, kquant_rows512<GgmlType::Q3_K>);
#else
  t.set_quantized(GgmlType::Q4_K, matmul_rows_kquant_x86<GgmlType::Q4_K>);
  t.set_quantized(GgmlType::Q5_K, matmul_rows_kquant_x86<GgmlType::Q5_K>);
  t.set_quantized(GgmlType::Q6_K, matmul_rows_kquant_x86<GgmlType::Q6_K>);
  t.set_quantized(GgmlType::Q2_K, matmul_rows_kquant_x86<GgmlType::Q2_K>);
  t.set_quantized(GgmlType::Q3_K, matmul_rows_kquant_x86<GgmlType::Q3_K>);
#endif
  t.set_quantized(GgmlType::IQ4_XS, matmul_rows_kquant_x86<GgmlType::IQ4_XS>);
  t.set_quantized(GgmlType::MXFP4, matmul_rows_mxfp4_x86);
  return t;
}

}  // namespace
}  // namespace ds4::cpu
