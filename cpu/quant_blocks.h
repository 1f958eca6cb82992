// The packed GGUF block formats and the per-row matmul kernel of quant_matmul.cpp (layouts,
// values, instruction sets and the work split: its header comment), kept free of torch so that
// cpu/tests/quant_blocks_check.cpp can test them where there is no torch for the target: aarch64
// under qemu-user (make neon-check), with NEON's int8-activation kernels. Everything is in an
// anonymous namespace, as it was inside quant_matmul.cpp: each source that includes it has its
// own copy. The fp16 conversion is kv_rows.h's.
#pragma once

#include "kv_rows.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDRS_QUANT_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
// Without AVX-512: every format dequantizes 32 weights at a time into four 8-lane registers.
#define PAGEDRS_QUANT_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_NEON)
// aarch64: into eight 4-lane registers.
#define PAGEDRS_QUANT_NEON 1
#include <arm_neon.h>
#endif

namespace {

constexpr int kBlockSize = 32;   // weights one dequant call makes: a block, or 1/8 of a k-quant superblock
constexpr int kTokenTile = 8;    // tokens that share one dequantization of a weight block
constexpr int kRowChunk = 64;    // weight rows walked by every token tile before the next rows
constexpr int kSegmentWeights = 768;  // input features a tile of many tokens walks at a time

using pagedrs_cpu::fp16_bits_to_float;  // kv_rows.h: the conversions shared with the KV cache's rows

// A block's fp16 field (unaligned) as a float.
inline float fp16_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return pagedrs_cpu::fp16_value(bits);
}

#ifdef PAGEDRS_QUANT_NEON
// 16 signed bytes as four 4-lane float registers. Every format's quants (centred or not) fit a
// signed byte, so one widening serves them all.
inline void bytes_to_float_neon(int8x16_t bytes, float32x4_t* q) {
  const int16x8_t lo = vmovl_s8(vget_low_s8(bytes)), hi = vmovl_high_s8(bytes);
  q[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
  q[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
  q[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
  q[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
}

// The 32 nibbles of a Q4 block less `zero` as signed bytes, weights in order: the low halves of
// bytes 0..15 (lo), then their high halves (hi).
inline void nibble_bytes_neon(const uint8_t* qs, int8_t zero, int8x16_t& lo, int8x16_t& hi) {
  const uint8x16_t bytes = vld1q_u8(qs);
  const int8x16_t z = vdupq_n_s8(zero);
  lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(bytes, vdupq_n_u8(0x0F))), z);
  hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(bytes, 4)), z);
}

// The same as floats.
inline void nibbles_to_float_neon(const uint8_t* qs, int8_t zero, float32x4_t (&q)[8]) {
  int8x16_t lo, hi;
  nibble_bytes_neon(qs, zero, lo, hi);
  bytes_to_float_neon(lo, q);
  bytes_to_float_neon(hi, q + 4);
}
#endif

// Each format: the weights (kWeights) and bytes (kBytes) of a stored block, and how weights
// sub * 32 .. sub * 32 + 31 of a block become floats (scalar, always; and in registers, weights in
// order, where a vector path is compiled in: two of 16 lanes with AVX-512, four of 8 with AVX2
// (dequant_avx2), eight of 4 with NEON (dequant_neon)), each rounded as the scalar code rounds it.
// Formats with 32-weight blocks take sub = 0 only.
struct Q8_0 {
  static constexpr int kWeights = 32;
  static constexpr int kBytes = 34;
  static void dequant(const uint8_t* block, int /*sub*/, float* w) {
    const float d = fp16_to_float(block);
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
    for (int j = 0; j < kBlockSize; ++j) w[j] = static_cast<float>(q[j]) * d;
  }
#ifdef PAGEDRS_QUANT_AVX512
  static void dequant(const uint8_t* block, int /*sub*/, __m512& lo, __m512& hi) {
    const __m512 d = _mm512_set1_ps(fp16_to_float(block));
    const __m128i q_lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
    const __m128i q_hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 18));
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q_lo)), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q_hi)), d);
  }
#endif
#ifdef PAGEDRS_QUANT_AVX2
  static void dequant_avx2(const uint8_t* block, int /*sub*/, __m256 (&w)[4]) {
    const __m256 d = _mm256_set1_ps(fp16_to_float(block));
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * i));
      w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
  }
#endif
#ifdef PAGEDRS_QUANT_NEON
  static void dequant_neon(const uint8_t* block, int /*sub*/, float32x4_t (&w)[8]) {
    const float32x4_t d = vdupq_n_f32(fp16_to_float(block));
    bytes_to_float_neon(vld1q_s8(reinterpret_cast<const int8_t*>(block + 2)), w);
    bytes_to_float_neon(vld1q_s8(reinterpret_cast<const int8_t*>(block + 18)), w + 4);
    for (int i = 0; i < 8; ++i) w[i] = vmulq_f32(w[i], d);
  }
#endif
};

#ifdef PAGEDRS_QUANT_AVX2
// 16 byte values (0..255) as two 8-lane float registers: bytes 0..7, then 8..15.
inline void bytes_to_float_avx2(__m128i bytes, __m256 (&q)[2]) {
  q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
}

// The 32 nibbles of a Q4 block as four 8-lane int32 registers: weights 0..7, 8..15 (the low
// halves of bytes 0..15), 16..23, 24..31 (their high halves). The 16 bytes go to both halves of
// a register, and one in-lane byte shuffle puts bytes 0..7 (8..15) one to a 32-bit lane, the
// lane's other bytes zero: on Zen 3 a single token's Q4_1 dot product ran 8.4 G weights/s a
// thread with four zero-extensions across lanes (and two byte shifts) a block, 11.3 with these
// two shuffles (a one-off timing, 576 -> 1536 from cache; the same values).
inline void unpack_nibbles_avx2(const uint8_t* qs, __m256i (&q)[4]) {
  const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  constexpr char z = -1;  // a zero byte
  const __m256i first = _mm256_shuffle_epi8(bytes, _mm256_setr_epi8(0, z, z, z, 1, z, z, z, 2, z, z, z, 3, z, z, z,  //
                                                                    4, z, z, z, 5, z, z, z, 6, z, z, z, 7, z, z, z));
  const __m256i second = _mm256_shuffle_epi8(bytes, _mm256_setr_epi8(8, z, z, z, 9, z, z, z, 10, z, z, z, 11, z, z, z,  //
                                                                     12, z, z, z, 13, z, z, z, 14, z, z, z, 15, z, z, z));
  const __m256i mask = _mm256_set1_epi32(0x0F);
  q[0] = _mm256_and_si256(first, mask);
  q[1] = _mm256_and_si256(second, mask);
  q[2] = _mm256_srli_epi32(first, 4);  // a lane holds one byte: its high nibble
  q[3] = _mm256_srli_epi32(second, 4);
}
#endif

#ifdef PAGEDRS_QUANT_AVX512
// A 4-bit block's 16 possible weights, value v in lane v (`table` = f(0, 1, ..., 15) lane by lane,
// with the same roundings as the weight-by-weight formula), and its 32 nibbles looked up in it:
// one permute per 16 weights instead of a conversion, a multiply and an add. The permute reads
// the low 4 bits of each index lane, so neither half needs masking.
inline __m512 nibble_values() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }

inline void look_up_nibbles(const uint8_t* qs, int shift, __m512 table, __m512& lo, __m512& hi) {
  const __m128i lo_bytes = _mm_srli_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), shift);
  const __m128i hi_bytes = _mm_srli_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)), shift);
  lo = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(lo_bytes), table);
  hi = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(hi_bytes), table);
}

inline void look_up_nibbles(const uint8_t* qs, __m512 table, __m512& lo, __m512& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  lo = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(bytes), table);
  hi = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_srli_epi16(bytes, 4)), table);
}
#endif

struct Q4_0 {
  static constexpr int kWeights = 32;
  static constexpr int kBytes = 18;
  static void dequant(const uint8_t* block, int /*sub*/, float* w) {
    const float d = fp16_to_float(block);
    const uint8_t* qs = block + 2;
    for (int j = 0; j < kBlockSize / 2; ++j) {
      w[j] = d * static_cast<float>((qs[j] & 0x0F) - 8);
      w[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
    }
  }
#ifdef PAGEDRS_QUANT_AVX512
  static void dequant(const uint8_t* block, int /*sub*/, __m512& lo, __m512& hi) {
    const __m512 d = _mm512_set1_ps(fp16_to_float(block));
    const __m512 table = _mm512_mul_ps(d, _mm512_sub_ps(nibble_values(), _mm512_set1_ps(8.f)));  // q - 8 is exact
    look_up_nibbles(block + 2, table, lo, hi);
  }
#endif
#ifdef PAGEDRS_QUANT_AVX2
  static void dequant_avx2(const uint8_t* block, int /*sub*/, __m256 (&w)[4]) {
    const __m256 d = _mm256_set1_ps(fp16_to_float(block));
    const __m256i eight = _mm256_set1_epi32(8);
    __m256i q[4];
    unpack_nibbles_avx2(block + 2, q);
    for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[i], eight)));
  }
#endif
#ifdef PAGEDRS_QUANT_NEON
  static void dequant_neon(const uint8_t* block, int /*sub*/, float32x4_t (&w)[8]) {
    const float32x4_t d = vdupq_n_f32(fp16_to_float(block));
    nibbles_to_float_neon(block + 2, 8, w);
    for (int i = 0; i < 8; ++i) w[i] = vmulq_f32(d, w[i]);
  }
#endif
};

struct Q4_1 {
  static constexpr int kWeights = 32;
  static constexpr int kBytes = 20;
  static void dequant(const uint8_t* block, int /*sub*/, float* w) {
    const float d = fp16_to_float(block), m = fp16_to_float(block + 2);
    const uint8_t* qs = block + 4;
    for (int j = 0; j < kBlockSize / 2; ++j) {
      w[j] = d * static_cast<float>(qs[j] & 0x0F) + m;
      w[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
    }
  }
#ifdef PAGEDRS_QUANT_AVX512
  static void dequant(const uint8_t* block, int /*sub*/, __m512& lo, __m512& hi) {
    const __m512 d = _mm512_set1_ps(fp16_to_float(block));
    const __m512 m = _mm512_set1_ps(fp16_to_float(block + 2));
    look_up_nibbles(block + 4, _mm512_add_ps(_mm512_mul_ps(d, nibble_values()), m), lo, hi);
  }
#endif
#ifdef PAGEDRS_QUANT_AVX2
  static void dequant_avx2(const uint8_t* block, int /*sub*/, __m256 (&w)[4]) {
    uint32_t halves;  // d and m, converted together
    std::memcpy(&halves, block, sizeof(halves));
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(halves)));
    const __m256 d = _mm256_broadcastss_ps(dm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
    __m256i q[4];
    unpack_nibbles_avx2(block + 4, q);
    // d * q + m: d * q is exact in float32 (11 by 4 bits), so one fused multiply-add rounds as
    // gguf's dequantize does (once, the sum)
    for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q[i]), m);
  }
#endif
#ifdef PAGEDRS_QUANT_NEON
  static void dequant_neon(const uint8_t* block, int /*sub*/, float32x4_t (&w)[8]) {
    const float32x4_t d = vdupq_n_f32(fp16_to_float(block)), m = vdupq_n_f32(fp16_to_float(block + 2));
    nibbles_to_float_neon(block + 4, 0, w);
    for (int i = 0; i < 8; ++i) w[i] = vfmaq_f32(m, d, w[i]);  // one rounding, as above
  }
#endif
};


// Q4_K: a 256-weight superblock of eight 32-weight sub-blocks, sub-block s weighing
// (d * sc[s]) * q - dmin * m[s] with 6-bit sc and m packed in 12 bytes (ggml's
// get_scale_min_k4); sub-blocks 2g and 2g + 1 take the low and high nibbles of bytes
// 32g .. 32g + 31 of the quants. d * sc and dmin * m are exact in float32 (11 by 6 bits), and so
// is their product with a 4-bit q, so one fused multiply-add rounds as gguf's d * q - dm does.
struct Q4_K {
  static constexpr int kWeights = 256;
  static constexpr int kBytes = 144;
  static void scale_min(const uint8_t* block, int sub, float& scale, float& min) {
    const uint8_t* scales = block + 4;
    int sc, m;
    if (sub < 4) {
      sc = scales[sub] & 63;
      m = scales[sub + 4] & 63;
    } else {
      sc = (scales[sub + 4] & 0x0F) | ((scales[sub - 4] >> 6) << 4);
      m = (scales[sub + 4] >> 4) | ((scales[sub] >> 6) << 4);
    }
    scale = fp16_to_float(block) * static_cast<float>(sc);
    min = fp16_to_float(block + 2) * static_cast<float>(m);
  }
  static void dequant(const uint8_t* block, int sub, float* w) {
    float scale, min;
    scale_min(block, sub, scale, min);
    const uint8_t* qs = block + 16 + 32 * (sub / 2);
    const int shift = 4 * (sub % 2);
    for (int j = 0; j < kBlockSize; ++j) w[j] = scale * static_cast<float>((qs[j] >> shift) & 0x0F) - min;
  }
#ifdef PAGEDRS_QUANT_AVX512
  static void dequant(const uint8_t* block, int sub, __m512& lo, __m512& hi) {
    float scale, min;
    scale_min(block, sub, scale, min);
    const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(scale), nibble_values(), _mm512_set1_ps(-min));
    look_up_nibbles(block + 16 + 32 * (sub / 2), 4 * (sub % 2), table, lo, hi);
  }
#endif
#ifdef PAGEDRS_QUANT_AVX2
  static void dequant_avx2(const uint8_t* block, int sub, __m256 (&w)[4]) {
    float scale, min;
    scale_min(block, sub, scale, min);
    const __m256 d = _mm256_set1_ps(scale), neg_m = _mm256_set1_ps(-min);
    const uint8_t* qs = block + 16 + 32 * (sub / 2);
    const __m128i shift = _mm_cvtsi32_si128(4 * (sub % 2));
    for (int h = 0; h < 2; ++h) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * h));
      __m256 q[2];
      bytes_to_float_avx2(_mm_and_si128(_mm_srl_epi16(bytes, shift), _mm_set1_epi8(0x0F)), q);
      w[2 * h] = _mm256_fmadd_ps(d, q[0], neg_m);
      w[2 * h + 1] = _mm256_fmadd_ps(d, q[1], neg_m);
    }
  }
#endif
#ifdef PAGEDRS_QUANT_NEON
  static void dequant_neon(const uint8_t* block, int sub, float32x4_t (&w)[8]) {
    float scale, min;
    scale_min(block, sub, scale, min);
    const float32x4_t d = vdupq_n_f32(scale), neg_m = vdupq_n_f32(-min);
    const uint8_t* qs = block + 16 + 32 * (sub / 2);
    const int8x16_t shift = vdupq_n_s8(static_cast<int8_t>(-4 * (sub % 2)));  // negative: right
    for (int h = 0; h < 2; ++h) {
      const uint8x16_t q = vandq_u8(vshlq_u8(vld1q_u8(qs + 16 * h), shift), vdupq_n_u8(0x0F));
      bytes_to_float_neon(vreinterpretq_s8_u8(q), w + 4 * h);
      for (int i = 4 * h; i < 4 * h + 4; ++i) w[i] = vfmaq_f32(neg_m, d, w[i]);
    }
  }
#endif
};

// Q6_K: a 256-weight superblock in two halves of 128; weight 32k + l of half n (k < 4, l < 32)
// is q - 32 with q's low 4 bits from byte 64n + 32 (k % 2) + l of ql (low nibble for k < 2,
// high for k >= 2) and its high 2 bits from bits 2k, 2k + 1 of byte 32n + l of qh, weighing
// (d * sc) * (q - 32) with the int8 scale sc[(128n + 32k + l) / 16]. d * sc is exact in
// float32 (11 by 8 bits); the product with q - 32 rounds once, as in gguf.
struct Q6_K {
  static constexpr int kWeights = 256;
  static constexpr int kBytes = 210;
  static int quant(const uint8_t* block, int sub, int l) {
    const int n = sub / 4, k = sub % 4;
    const int low = (block[64 * n + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0F;
    const int high = (block[128 + 32 * n + l] >> (2 * k)) & 0x03;
    return (low | (high << 4)) - 32;
  }
  static float scale(const uint8_t* block, int sub, int half) {
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
    return fp16_to_float(block + 208) * static_cast<float>(scales[2 * sub + half]);
  }
  static void dequant(const uint8_t* block, int sub, float* w) {
    for (int j = 0; j < kBlockSize; ++j) w[j] = scale(block, sub, j / 16) * static_cast<float>(quant(block, sub, j));
  }
#ifdef PAGEDRS_QUANT_AVX512
  // Weights 16h .. 16h + 15 of sub-block sub.
  static __m512 half_of(const uint8_t* block, int sub, int h) {
    const int n = sub / 4, k = sub % 4;
    const __m128i low_bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 64 * n + 32 * (k % 2) + 16 * h));
    const __m128i high_bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 128 + 32 * n + 16 * h));
    const __m128i low = _mm_and_si128(_mm_srl_epi16(low_bytes, _mm_cvtsi32_si128(4 * (k / 2))), _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srl_epi16(high_bytes, _mm_cvtsi32_si128(2 * k)), _mm_set1_epi8(0x03));
    const __m128i q = _mm_or_si128(low, _mm_slli_epi16(high, 4));  // high <= 3: no bit crosses a byte
    const __m512i centered = _mm512_sub_epi32(_mm512_cvtepu8_epi32(q), _mm512_set1_epi32(32));
    return _mm512_mul_ps(_mm512_set1_ps(scale(block, sub, h)), _mm512_cvtepi32_ps(centered));
  }
  static void dequant(const uint8_t* block, int sub, __m512& lo, __m512& hi) {
    lo = half_of(block, sub, 0);
    hi = half_of(block, sub, 1);
  }
#endif
#ifdef PAGEDRS_QUANT_AVX2
  static void dequant_avx2(const uint8_t* block, int sub, __m256 (&w)[4]) {
    const int n = sub / 4, k = sub % 4;
    for (int h = 0; h < 2; ++h) {
      const __m128i low_bytes =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 64 * n + 32 * (k % 2) + 16 * h));
      const __m128i high_bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 128 + 32 * n + 16 * h));
      const __m128i low = _mm_and_si128(_mm_srl_epi16(low_bytes, _mm_cvtsi32_si128(4 * (k / 2))), _mm_set1_epi8(0x0F));
      const __m128i high = _mm_and_si128(_mm_srl_epi16(high_bytes, _mm_cvtsi32_si128(2 * k)), _mm_set1_epi8(0x03));
      __m256 q[2];
      bytes_to_float_avx2(_mm_or_si128(low, _mm_slli_epi16(high, 4)), q);  // high <= 3: no bit crosses a byte
      const __m256 d = _mm256_set1_ps(scale(block, sub, h)), thirty_two = _mm256_set1_ps(32.f);
      w[2 * h] = _mm256_mul_ps(d, _mm256_sub_ps(q[0], thirty_two));  // q - 32 is exact in float
      w[2 * h + 1] = _mm256_mul_ps(d, _mm256_sub_ps(q[1], thirty_two));
    }
  }
#endif
#ifdef PAGEDRS_QUANT_NEON
  static void dequant_neon(const uint8_t* block, int sub, float32x4_t (&w)[8]) {
    const int n = sub / 4, k = sub % 4;
    const int8x16_t low_shift = vdupq_n_s8(static_cast<int8_t>(-4 * (k / 2)));  // negative: right
    const int8x16_t high_shift = vdupq_n_s8(static_cast<int8_t>(-2 * k));
    for (int h = 0; h < 2; ++h) {
      const uint8x16_t low_bytes = vld1q_u8(block + 64 * n + 32 * (k % 2) + 16 * h);
      const uint8x16_t high_bytes = vld1q_u8(block + 128 + 32 * n + 16 * h);
      const uint8x16_t low = vandq_u8(vshlq_u8(low_bytes, low_shift), vdupq_n_u8(0x0F));
      const uint8x16_t high = vandq_u8(vshlq_u8(high_bytes, high_shift), vdupq_n_u8(0x03));
      const uint8x16_t q = vorrq_u8(low, vshlq_n_u8(high, 4));
      bytes_to_float_neon(vsubq_s8(vreinterpretq_s8_u8(q), vdupq_n_s8(32)), w + 4 * h);
      const float32x4_t d = vdupq_n_f32(scale(block, sub, h));
      for (int i = 4 * h; i < 4 * h + 4; ++i) w[i] = vmulq_f32(d, w[i]);
    }
  }
#endif
};

#ifdef PAGEDRS_QUANT_AVX2
// Whether a format dequantizes a block into four 8-lane registers (Format::dequant_avx2).
template <class Format, class = void>
struct HasAvx2Dequant : std::false_type {};
template <class Format>
struct HasAvx2Dequant<Format, std::void_t<decltype(&Format::dequant_avx2)>> : std::true_type {};
#endif

// out[t * out_stride] = sum_k x[t, k] * w[k] (+= with accumulate) for the kTokens tokens of x
// (rows x_stride apart) and one packed weight row of num_blocks blocks.
template <class Format, int kTokens>
inline void dot_row(const float* __restrict__ x, int64_t x_stride, const uint8_t* __restrict__ row,
                    int64_t num_blocks, float* __restrict__ out, int64_t out_stride, bool accumulate = false) {
  const auto put = [&](int t, float sum) { out[t * out_stride] = accumulate ? out[t * out_stride] + sum : sum; };
#ifdef PAGEDRS_QUANT_AVX512
  // Two accumulators per token (weights 0..15 and 16..31 of a block): two independent FMA chains
  // even for a single token.
  __m512 acc_lo[kTokens], acc_hi[kTokens];
  for (int t = 0; t < kTokens; ++t) acc_lo[t] = acc_hi[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int sub = 0; sub < Format::kWeights / kBlockSize; ++sub) {
      __m512 w_lo, w_hi;
      Format::dequant(row + b * Format::kBytes, sub, w_lo, w_hi);
      const float* xb = x + b * Format::kWeights + sub * kBlockSize;
      for (int t = 0; t < kTokens; ++t) {
        acc_lo[t] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + t * x_stride), w_lo, acc_lo[t]);
        acc_hi[t] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + t * x_stride + 16), w_hi, acc_hi[t]);
      }
    }
  }
  for (int t = 0; t < kTokens; ++t) put(t, _mm512_reduce_add_ps(_mm512_add_ps(acc_lo[t], acc_hi[t])));
#elif defined(PAGEDRS_QUANT_NEON)
  // Accumulators as AVX2's below: two per token up to 4 tokens (two independent FMA chains even
  // for one), one each beyond.
  constexpr int kAcc = kTokens <= 4 ? 2 : 1;
  float32x4_t acc[kTokens][kAcc];
  for (int t = 0; t < kTokens; ++t)
    for (int a = 0; a < kAcc; ++a) acc[t][a] = vdupq_n_f32(0.f);
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int sub = 0; sub < Format::kWeights / kBlockSize; ++sub) {
      float32x4_t w[8];
      Format::dequant_neon(row + b * Format::kBytes, sub, w);
      const float* xb = x + b * Format::kWeights + sub * kBlockSize;
      for (int t = 0; t < kTokens; ++t) {
        for (int i = 0; i < 8; ++i) {
          acc[t][i % kAcc] = vfmaq_f32(acc[t][i % kAcc], vld1q_f32(xb + t * x_stride + 4 * i), w[i]);
        }
      }
    }
  }
  for (int t = 0; t < kTokens; ++t) {
    put(t, vaddvq_f32(kAcc == 2 ? vaddq_f32(acc[t][0], acc[t][kAcc - 1]) : acc[t][0]));
  }
#else
#ifdef PAGEDRS_QUANT_AVX2
  if constexpr (HasAvx2Dequant<Format>::value) {
    // Accumulators a token: one a weight register (four independent FMA chains) for one token;
    // two each up to 4 tokens; one each beyond (16 registers hold 8 accumulators and the 4
    // weight registers). A single token with two chains waited on the FMA's latency.
    constexpr int kAcc = kTokens == 1 ? 4 : kTokens <= 4 ? 2 : 1;
    __m256 acc[kTokens][kAcc];
    for (int t = 0; t < kTokens; ++t)
      for (int a = 0; a < kAcc; ++a) acc[t][a] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; ++b) {
      for (int sub = 0; sub < Format::kWeights / kBlockSize; ++sub) {
        __m256 w[4];
        Format::dequant_avx2(row + b * Format::kBytes, sub, w);
        const float* xb = x + b * Format::kWeights + sub * kBlockSize;
        for (int t = 0; t < kTokens; ++t) {
          for (int i = 0; i < 4; ++i) {
            acc[t][i % kAcc] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + t * x_stride + 8 * i), w[i], acc[t][i % kAcc]);
          }
        }
      }
    }
    for (int t = 0; t < kTokens; ++t) {
      __m256 sum = acc[t][0];
      if constexpr (kAcc == 4) {
        sum = _mm256_add_ps(_mm256_add_ps(acc[t][0], acc[t][1]), _mm256_add_ps(acc[t][2], acc[t][3]));
      } else if constexpr (kAcc == 2) {
        sum = _mm256_add_ps(acc[t][0], acc[t][1]);
      }
      const __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
      const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
      put(t, _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1))));
    }
    return;
  }
#endif
  float acc[kTokens][kBlockSize] = {};
  float w[kBlockSize];
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int sub = 0; sub < Format::kWeights / kBlockSize; ++sub) {
      Format::dequant(row + b * Format::kBytes, sub, w);
      const float* xb = x + b * Format::kWeights + sub * kBlockSize;
      for (int t = 0; t < kTokens; ++t) {
#pragma omp simd
        for (int j = 0; j < kBlockSize; ++j) acc[t][j] += xb[t * x_stride + j] * w[j];
      }
    }
  }
  for (int t = 0; t < kTokens; ++t) {
    float sum = 0.f;
    for (int j = 0; j < kBlockSize; ++j) sum += acc[t][j];
    put(t, sum);
  }
#endif
}

// Weight rows are read once a step, from memory, in order. Hardware prefetchers do not always
// follow that stream: on a Sapphire Rapids VM the exact kernel read 1.8 GB/s a thread from
// memory, each row waiting on its own misses, 3.4x slower than from cache, and single-stream
// decode ran at half its speed. So the walk asks for the bytes kPrefetchAhead past each row
// before it reads the row, never past `end` (1 KB measured best of 0.5-4 KB there).
constexpr int64_t kPrefetchAhead = 1024;

inline void prefetch_ahead(const uint8_t* begin, int64_t bytes, const uint8_t* end) {
  const uint8_t* to = std::min(begin + kPrefetchAhead + bytes, end);
  for (const uint8_t* p = begin + kPrefetchAhead; p < to; p += 64) __builtin_prefetch(p, 0, 3);
}

// The token count of a tile as a compile-time constant, so the accumulators live in registers.
template <class Format>
inline void dot_row_tokens(int num_tokens, const float* x, int64_t x_stride, const uint8_t* row, int64_t num_blocks,
                           float* out, int64_t out_stride, bool accumulate = false) {
  static_assert(kTokenTile == 8);
  switch (num_tokens) {
    case 1: return dot_row<Format, 1>(x, x_stride, row, num_blocks, out, out_stride, accumulate);
    case 2: return dot_row<Format, 2>(x, x_stride, row, num_blocks, out, out_stride, accumulate);
    case 3: return dot_row<Format, 3>(x, x_stride, row, num_blocks, out, out_stride, accumulate);
    case 4: return dot_row<Format, 4>(x, x_stride, row, num_blocks, out, out_stride, accumulate);
    case 5: return dot_row<Format, 5>(x, x_stride, row, num_blocks, out, out_stride, accumulate);
    case 6: return dot_row<Format, 6>(x, x_stride, row, num_blocks, out, out_stride, accumulate);
    case 7: return dot_row<Format, 7>(x, x_stride, row, num_blocks, out, out_stride, accumulate);
    default: return dot_row<Format, 8>(x, x_stride, row, num_blocks, out, out_stride, accumulate);
  }
}

// out[t * out_stride + n] for weight rows n in [row_begin, row_end), on the calling thread.
template <class Format>
void matmul_rows(const float* x, int64_t x_stride, const uint8_t* weight, float* out, int64_t out_stride,
                 int64_t num_tokens, int64_t in_features, int64_t row_begin, int64_t row_end) {
  const int64_t num_blocks = in_features / Format::kWeights;
  const int64_t row_bytes = num_blocks * Format::kBytes;
  // A tile of 8 tokens reads 8 rows of x for every weight row of a chunk; where those rows are
  // long (the down projection's 1536 features: 48 KB of float32, more than Zen 3's 32 KB L1),
  // they came from L2 again for each weight row, and 1536 -> 576 at 64 tokens ran 0.65-0.83x the
  // weights a second of 576 -> 960 or 3072. So the features are walked in segments of at most
  // kSegmentWeights (24 KB of x a tile), each row's sum carried from one to the next in its
  // output: 1536 -> 576 took 0.71x the time at 64 tokens, 0.88x at 8 (Zen 3, one thread,
  // alternated in one process; a segment's sum is added to the row's so far, so the additions
  // round in another order). Not at 4 tokens or fewer, whose rows of x fit (a single stream's
  // sums stay one chain), nor for rows of at most kSegmentWeights (576 -> 960 and 3072 split in
  // 8- or 16-block segments took 1.04-1.23x the time: each segment ends in a horizontal sum).
  // AVX2 only: the AVX-512 path keeps a row's sums in the same order whatever its batch, and was
  // not measured so.
#ifdef PAGEDRS_QUANT_AVX2
  const int64_t segment =
      num_tokens > 4 ? std::max<int64_t>(1, kSegmentWeights / Format::kWeights) : num_blocks;
#else
  const int64_t segment = num_blocks;
#endif
  for (int64_t chunk = row_begin; chunk < row_end; chunk += kRowChunk) {
    const int64_t chunk_end = std::min(row_end, chunk + kRowChunk);
    for (int64_t t0 = 0; t0 < num_tokens; t0 += kTokenTile) {
      const int tile = static_cast<int>(std::min<int64_t>(kTokenTile, num_tokens - t0));
      for (int64_t b0 = 0; b0 < num_blocks; b0 += segment) {
        const int64_t blocks = std::min(segment, num_blocks - b0);
        for (int64_t n = chunk; n < chunk_end; ++n) {
          if (t0 == 0 && b0 == 0) prefetch_ahead(weight + n * row_bytes, row_bytes, weight + row_end * row_bytes);
          dot_row_tokens<Format>(tile, x + t0 * x_stride + b0 * Format::kWeights, x_stride,
                                 weight + n * row_bytes + b0 * Format::kBytes, blocks, out + t0 * out_stride + n,
                                 out_stride, b0 > 0);
        }
      }
    }
  }
}

#ifdef PAGEDRS_QUANT_AVX2
// ---------------------------------------------------------------------------------------------
// Scales-first rows (AVX2 builds; type ids with kScalesFirst, cpu_kernels.h): a Q8_0, Q4_0 or
// Q4_1 row's bytes permuted once at load so that its fp16 scales sit together at its start:
//   [num_blocks fp16 d][num_blocks fp16 m (Q4_1 only)][num_blocks x kQuantBytes quants]
// the quants of each block as GGUF stores them. The same bytes a row, so a tensor keeps its
// shape and size, and a range of rows is still those rows (row-parallel shards, lookups).
// Why: a single token's exact dot product is bound by its instructions on AVX2 (Zen 3: ~2.5
// vector instructions a cycle over the FMA, conversion and shuffle pipes), and a GGUF block's
// scales cost 4-5 of a Q4_1 block's ~22 (converting one fp16 pair, then broadcasting each from a
// register, which Zen 3 issues once a cycle). Together at a row's start, 8 blocks' scales convert
// in one instruction into a float buffer, and each block broadcasts its own from memory (a load,
// no vector pipe). The values are the same floats, so the weights multiplied are the same.
template <class Format>
constexpr bool kHasMinimum = std::is_same_v<Format, Q4_1>;
template <class Format>
constexpr int kQuantBytes = Format::kBytes - (kHasMinimum<Format> ? 4 : 2);  // after d (and m)
template <class Format>
constexpr bool kScalesFirstFormat = std::is_same_v<Format, Q8_0> || std::is_same_v<Format, Q4_0> || kHasMinimum<Format>;

// Where block b's fields are in a scales-first row of num_blocks blocks.
template <class Format>
inline const uint8_t* sf_scale(const uint8_t* row, int64_t b) { return row + 2 * b; }
template <class Format>
inline const uint8_t* sf_minimum(const uint8_t* row, int64_t num_blocks, int64_t b) {
  return row + 2 * num_blocks + 2 * b;
}
template <class Format>
inline const uint8_t* sf_quants(const uint8_t* row, int64_t num_blocks, int64_t b) {
  return row + (kHasMinimum<Format> ? 4 : 2) * num_blocks + kQuantBytes<Format> * b;
}

// A GGUF row (num_blocks blocks) into its scales-first order (to), and back (scales_first_to_row).
template <class Format>
void row_to_scales_first(const uint8_t* row, int64_t num_blocks, uint8_t* to) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* block = row + b * Format::kBytes;
    std::memcpy(to + 2 * b, block, 2);
    if constexpr (kHasMinimum<Format>) std::memcpy(to + 2 * num_blocks + 2 * b, block + 2, 2);
    std::memcpy(const_cast<uint8_t*>(sf_quants<Format>(to, num_blocks, b)), block + Format::kBytes - kQuantBytes<Format>,
                kQuantBytes<Format>);
  }
}
template <class Format>
void scales_first_to_row(const uint8_t* from, int64_t num_blocks, uint8_t* row) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    uint8_t* block = row + b * Format::kBytes;
    std::memcpy(block, sf_scale<Format>(from, b), 2);
    if constexpr (kHasMinimum<Format>) std::memcpy(block + 2, sf_minimum<Format>(from, num_blocks, b), 2);
    std::memcpy(block + Format::kBytes - kQuantBytes<Format>, sf_quants<Format>(from, num_blocks, b), kQuantBytes<Format>);
  }
}

// Blocks a walk converts the scales of at a time (a row longer is walked in pieces, each
// piece's sum added to the row's so far), and the float scales of one row's piece.
constexpr int64_t kScalePiece = 64;
struct PieceScales {
  alignas(32) float d[kScalePiece];
  alignas(32) float m[kScalePiece];
};

// The scales of blocks [b0, b0 + blocks) of a scales-first row as floats, 8 a conversion. The
// last conversion may read up to 14 bytes past the piece's halves: still the row's (the
// minimums or quants follow them), and the lanes it fills are never read.
template <class Format>
inline void convert_scales(const uint8_t* row, int64_t num_blocks, int64_t b0, int64_t blocks, PieceScales& s) {
  for (int64_t j = 0; j < blocks; j += 8) {
    _mm256_store_ps(s.d + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sf_scale<Format>(row, b0 + j)))));
    if constexpr (kHasMinimum<Format>) {
      _mm256_store_ps(s.m + j, _mm256_cvtph_ps(_mm_loadu_si128(
                                   reinterpret_cast<const __m128i*>(sf_minimum<Format>(row, num_blocks, b0 + j)))));
    }
  }
}

// A block's 32 weights in four 8-lane registers from its quants and float scale (and minimum),
// each the float Format::dequant_avx2 makes of it.
template <class Format>
inline void dequant_scaled(const uint8_t* quants, __m256 d, __m256 m, __m256 (&w)[4]) {
  if constexpr (std::is_same_v<Format, Q8_0>) {
    (void)m;
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(quants + 8 * i));
      w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
  } else {
    // Weights 0..7 and 8..15 (the low nibbles of bytes 0..15) and 16..23, 24..31 (their high
    // ones): bytes 0..7 and 8..15 zero-extended to int32 lanes straight from memory (each a load
    // and one shuffle; unpack_nibbles_avx2's broadcast and two in-lane shuffles took longer here).
    const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(quants)));
    const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(quants + 8)));
    const __m256i mask = _mm256_set1_epi32(0x0F);
    const __m256i q[4] = {_mm256_and_si256(first, mask), _mm256_and_si256(second, mask), _mm256_srli_epi32(first, 4),
                          _mm256_srli_epi32(second, 4)};
    for (int i = 0; i < 4; ++i) {
      if constexpr (kHasMinimum<Format>) {
        w[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q[i]), m);  // one rounding, as Q4_1::dequant_avx2
      } else {
        w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[i], _mm256_set1_epi32(8))));
      }
    }
  }
}

inline float sum_lanes(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
}

// dot_row's sums (the same accumulators a token) for kRows scales-first rows at once (kRows 2
// for a single token: its x loaded once for both; 1 otherwise): out[r][t * out_stride] for the
// `blocks` blocks from quants[r] (a piece of row r's quants), whose scales are in scales[r].
template <class Format, int kTokens, int kRows>
inline void dot_rows_sf(const float* __restrict__ x, int64_t x_stride, const uint8_t* const (&quants)[kRows],
                        const PieceScales* scales, int64_t blocks, float* const (&out)[kRows], int64_t out_stride,
                        bool accumulate) {
  // Accumulators as dot_row's, split between the rows where two share a token.
  constexpr int kAcc = kTokens == 1 ? 4 / kRows : kTokens <= 4 ? 2 : 1;
  __m256 acc[kRows][kTokens][kAcc];
  for (int r = 0; r < kRows; ++r)
    for (int t = 0; t < kTokens; ++t)
      for (int a = 0; a < kAcc; ++a) acc[r][t][a] = _mm256_setzero_ps();
  for (int64_t j = 0; j < blocks; ++j) {
    __m256 w[kRows][4];
    for (int r = 0; r < kRows; ++r) {
      const __m256 d = _mm256_broadcast_ss(scales[r].d + j);
      const __m256 m = kHasMinimum<Format> ? _mm256_broadcast_ss(scales[r].m + j) : d;
      dequant_scaled<Format>(quants[r] + j * kQuantBytes<Format>, d, m, w[r]);
    }
    const float* xb = x + j * kBlockSize;
    for (int t = 0; t < kTokens; ++t) {
      for (int i = 0; i < 4; ++i) {
        const __m256 xv = _mm256_loadu_ps(xb + t * x_stride + 8 * i);
        for (int r = 0; r < kRows; ++r) acc[r][t][i % kAcc] = _mm256_fmadd_ps(xv, w[r][i], acc[r][t][i % kAcc]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int t = 0; t < kTokens; ++t) {
      __m256 sum = acc[r][t][0];
      if constexpr (kAcc == 4) {
        sum = _mm256_add_ps(_mm256_add_ps(acc[r][t][0], acc[r][t][1]), _mm256_add_ps(acc[r][t][2], acc[r][t][3]));
      } else if constexpr (kAcc == 2) {
        sum = _mm256_add_ps(acc[r][t][0], acc[r][t][1]);
      }
      float& o = out[r][t * out_stride];
      o = accumulate ? o + sum_lanes(sum) : sum_lanes(sum);
    }
  }
}

// dot_row's sums for one scales-first row: kTokens tokens and the `blocks` blocks from quants
// (a piece of the row's quants), whose scales are in `scales`.
template <class Format, int kTokens>
inline void dot_row_sf(const float* __restrict__ x, int64_t x_stride, const uint8_t* __restrict__ quants,
                       const float* __restrict__ d, const float* __restrict__ m, int64_t blocks,
                       float* __restrict__ out, int64_t out_stride, bool accumulate) {
  constexpr int kAcc = kTokens == 1 ? 4 : kTokens <= 4 ? 2 : 1;
  __m256 acc[kTokens][kAcc];
  for (int t = 0; t < kTokens; ++t)
    for (int a = 0; a < kAcc; ++a) acc[t][a] = _mm256_setzero_ps();
  // Each token's row of x through its own pointer, advanced a block at a time: written as
  // dot_row's `x + b * 32 + t * x_stride`, GCC kept 32 offsets (one per token and register) on
  // the stack, reloaded every block, and 8 tokens ran 1.2x dot_row's time.
  const float* xt[kTokens];
  for (int t = 0; t < kTokens; ++t) xt[t] = x + t * x_stride;
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 w[4];
    const __m256 db = _mm256_broadcast_ss(d + b);
    dequant_scaled<Format>(quants + b * kQuantBytes<Format>, db, kHasMinimum<Format> ? _mm256_broadcast_ss(m + b) : db, w);
    for (int t = 0; t < kTokens; ++t) {
      for (int i = 0; i < 4; ++i) {
        acc[t][i % kAcc] = _mm256_fmadd_ps(_mm256_loadu_ps(xt[t] + 8 * i), w[i], acc[t][i % kAcc]);
      }
      xt[t] += kBlockSize;
    }
  }
  for (int t = 0; t < kTokens; ++t) {
    __m256 sum = acc[t][0];
    if constexpr (kAcc == 4) {
      sum = _mm256_add_ps(_mm256_add_ps(acc[t][0], acc[t][1]), _mm256_add_ps(acc[t][2], acc[t][3]));
    } else if constexpr (kAcc == 2) {
      sum = _mm256_add_ps(acc[t][0], acc[t][1]);
    }
    out[t * out_stride] = accumulate ? out[t * out_stride] + sum_lanes(sum) : sum_lanes(sum);
  }
}

template <class Format>
inline void dot_row_sf_tokens(int num_tokens, const float* x, int64_t x_stride, const uint8_t* quants,
                              const PieceScales& scales, int64_t blocks, float* out, int64_t out_stride, bool accumulate) {
  static_assert(kTokenTile == 8);
  const auto run = [&](auto tokens) {
    dot_row_sf<Format, decltype(tokens)::value>(x, x_stride, quants, scales.d, scales.m, blocks, out, out_stride,
                                                accumulate);
  };
  switch (num_tokens) {
    case 1: return run(std::integral_constant<int, 1>{});
    case 2: return run(std::integral_constant<int, 2>{});
    case 3: return run(std::integral_constant<int, 3>{});
    case 4: return run(std::integral_constant<int, 4>{});
    case 5: return run(std::integral_constant<int, 5>{});
    case 6: return run(std::integral_constant<int, 6>{});
    case 7: return run(std::integral_constant<int, 7>{});
    default: return run(std::integral_constant<int, 8>{});
  }
}

// matmul_rows over scales-first rows: the same walk (chunks of rows, tiles of tokens, segments
// of features), each row's piece of scales converted before its blocks, at most kScalePiece
// blocks at a time; a single token takes its rows two at a time (dot_rows_sf).
template <class Format>
void matmul_rows_sf(const float* x, int64_t x_stride, const uint8_t* weight, float* out, int64_t out_stride,
                    int64_t num_tokens, int64_t in_features, int64_t row_begin, int64_t row_end) {
  const int64_t num_blocks = in_features / Format::kWeights;
  const int64_t row_bytes = num_blocks * Format::kBytes;
  const uint8_t* weight_end = weight + row_end * row_bytes;
  static_assert(kSegmentWeights / kBlockSize % 8 == 0 && kSegmentWeights / kBlockSize <= kScalePiece);
  const int64_t segment = num_tokens > 4 ? kSegmentWeights / kBlockSize : kScalePiece;
  PieceScales scales[2];
  if (num_tokens == 1) {
    int64_t n = row_begin;
    for (; n + 1 < row_end; n += 2) {
      const uint8_t* const rows[2] = {weight + n * row_bytes, weight + (n + 1) * row_bytes};
      prefetch_ahead(rows[0], 2 * row_bytes, weight_end);
      float* const outs[2] = {out + n, out + n + 1};
      for (int64_t b0 = 0; b0 < num_blocks; b0 += segment) {
        const int64_t blocks = std::min(segment, num_blocks - b0);
        convert_scales<Format>(rows[0], num_blocks, b0, blocks, scales[0]);
        convert_scales<Format>(rows[1], num_blocks, b0, blocks, scales[1]);
        const uint8_t* const quants[2] = {sf_quants<Format>(rows[0], num_blocks, b0),
                                          sf_quants<Format>(rows[1], num_blocks, b0)};
        dot_rows_sf<Format, 1, 2>(x + b0 * Format::kWeights, x_stride, quants, scales, blocks, outs, out_stride, b0 > 0);
      }
    }
    row_begin = n;  // an odd last row: below
  }
  for (int64_t chunk = row_begin; chunk < row_end; chunk += kRowChunk) {
    const int64_t chunk_end = std::min(row_end, chunk + kRowChunk);
    for (int64_t t0 = 0; t0 < num_tokens; t0 += kTokenTile) {
      const int tile = static_cast<int>(std::min<int64_t>(kTokenTile, num_tokens - t0));
      for (int64_t b0 = 0; b0 < num_blocks; b0 += segment) {
        const int64_t blocks = std::min(segment, num_blocks - b0);
        for (int64_t n = chunk; n < chunk_end; ++n) {
          const uint8_t* row = weight + n * row_bytes;
          if (t0 == 0 && b0 == 0) prefetch_ahead(row, row_bytes, weight_end);
          convert_scales<Format>(row, num_blocks, b0, blocks, scales[0]);
          dot_row_sf_tokens<Format>(tile, x + t0 * x_stride + b0 * Format::kWeights, x_stride,
                                    sf_quants<Format>(row, num_blocks, b0), scales[0], blocks,
                                    out + t0 * out_stride + n, out_stride, b0 > 0);
        }
      }
    }
  }
}
#endif  // PAGEDRS_QUANT_AVX2

// ---------------------------------------------------------------------------------------------
// int8 activations (opt-in; quant_matmul.cpp's header comment has the scheme). The quantized
// rows are shared by every instruction set; x86's kernels are in quant_matmul.cpp, the NEON ones
// below (here, so that the harness runs them under qemu).

// x quantized per token and 32 features: q = round(x / d), d = max|x| / 127; d * sum(q) (what
// Q4_1's minimum multiplies) and -zero * sum(q) (where a VNNI block sum starts: see VnniPanel).
struct Int8Rows {
  int64_t num_blocks = 0;      // per token
  std::vector<int8_t> q;       // [num_tokens, num_blocks * 32]
  std::vector<float> d;        // [num_tokens, num_blocks]
  std::vector<float> sum;      // [num_tokens, num_blocks]
  std::vector<int32_t> start;  // [num_tokens, num_blocks]
};

#ifdef PAGEDRS_QUANT_NEON
// Four lanes of int32 sums of byte products: sdot (ARMv8.2's dot product, 4 products a lane)
// where the target has it, else widening multiplies and pairwise adds (the same exact sums,
// lanes holding other products).
inline int32x4_t dot_bytes_neon(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, a, b);
#else
  return vpadalq_s16(vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b))), vmull_high_s8(a, b));
#endif
}

// Tokens [t_begin, t_end) of x into `rows` (sized by the caller), rounded to nearest, ties to
// even, as the x86 path rounds; weight_zero: see Int8Rows::start (0 here: sdot takes signed
// weights as they are).
inline void quantize_rows(const float* x, int64_t in_features, int64_t t_begin, int64_t t_end, int32_t weight_zero,
                          Int8Rows& rows) {
  for (int64_t t = t_begin; t < t_end; ++t) {
    for (int64_t b = 0; b < rows.num_blocks; ++b) {
      const float* xb = x + t * in_features + b * kBlockSize;
      float32x4_t v[8];
      float32x4_t amax = vdupq_n_f32(0.f);
      for (int i = 0; i < 8; ++i) {
        v[i] = vld1q_f32(xb + 4 * i);
        amax = vmaxq_f32(amax, vabsq_f32(v[i]));
      }
      const float d = vmaxvq_f32(amax) / 127.f;
      const float inverse = d != 0.f ? 1.f / d : 0.f;
      int16x8_t q16[4];
      for (int i = 0; i < 4; ++i) {
        q16[i] = vcombine_s16(vqmovn_s32(vcvtnq_s32_f32(vmulq_n_f32(v[2 * i], inverse))),
                              vqmovn_s32(vcvtnq_s32_f32(vmulq_n_f32(v[2 * i + 1], inverse))));
      }
      const int8x16_t lo = vcombine_s8(vqmovn_s16(q16[0]), vqmovn_s16(q16[1]));
      const int8x16_t hi = vcombine_s8(vqmovn_s16(q16[2]), vqmovn_s16(q16[3]));
      int8_t* q = rows.q.data() + (t * rows.num_blocks + b) * kBlockSize;
      vst1q_s8(q, lo);
      vst1q_s8(q + 16, hi);
      const int32_t total = vaddlvq_s8(lo) + vaddlvq_s8(hi);  // |total| <= 32 * 127
      rows.d[t * rows.num_blocks + b] = d;
      rows.sum[t * rows.num_blocks + b] = d * static_cast<float>(total);
      rows.start[t * rows.num_blocks + b] = -weight_zero * total;
    }
  }
}

// The 32 weights of a block as signed bytes in order (Q4_1's unsigned nibbles too: 0..15 fit;
// the caller adds its minimum).
template <class Format>
inline void block_bytes_neon(const uint8_t* block, int8x16_t& lo, int8x16_t& hi) {
  if constexpr (std::is_same_v<Format, Q8_0>) {
    lo = vld1q_s8(reinterpret_cast<const int8_t*>(block + 2));
    hi = vld1q_s8(reinterpret_cast<const int8_t*>(block + 18));
  } else if constexpr (std::is_same_v<Format, Q4_0>) {
    nibble_bytes_neon(block + 2, 8, lo, hi);
  } else {
    nibble_bytes_neon(block + 4, 0, lo, hi);
  }
}

// out[t * out_stride] for kTokens quantized tokens (from token t0 of `rows`) and one weight row:
// each block's integer dot product, scaled by dw * dx; Q4_1's minimum adds m * dx * sum(q).
template <class Format, int kTokens>
inline void dot_row_int8(const Int8Rows& rows, int64_t t0, const uint8_t* __restrict__ row, float* __restrict__ out,
                         int64_t out_stride) {
  static_assert(std::is_same_v<Format, Q8_0> || std::is_same_v<Format, Q4_0> || std::is_same_v<Format, Q4_1>);
  const int64_t num_blocks = rows.num_blocks;
  float32x4_t acc[kTokens];
  float minimums[kTokens] = {};
  for (int t = 0; t < kTokens; ++t) acc[t] = vdupq_n_f32(0.f);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* block = row + b * Format::kBytes;
    int8x16_t w_lo, w_hi;
    block_bytes_neon<Format>(block, w_lo, w_hi);
    const float dw = fp16_to_float(block);
    const float minimum = std::is_same_v<Format, Q4_1> ? fp16_to_float(block + 2) : 0.f;
    for (int t = 0; t < kTokens; ++t) {
      const int64_t at = (t0 + t) * num_blocks + b;
      const int8_t* q = rows.q.data() + at * kBlockSize;
      const int32x4_t dot = dot_bytes_neon(dot_bytes_neon(vdupq_n_s32(0), w_lo, vld1q_s8(q)), w_hi, vld1q_s8(q + 16));
      acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(dot), dw * rows.d[at]);
      if constexpr (std::is_same_v<Format, Q4_1>) minimums[t] += minimum * rows.sum[at];
    }
  }
  for (int t = 0; t < kTokens; ++t) out[t * out_stride] = vaddvq_f32(acc[t]) + minimums[t];
}
#endif

}  // namespace
