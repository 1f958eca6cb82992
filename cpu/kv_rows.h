// The rows of a float16 or fp8 KV cache (--kv-cache-dtype) as float32, for paged_attention.cpp:
// through the hardware's fp16 conversion, 16 values an instruction with AVX-512, 8 with F16C or
// NEON (c10's scalar conversions do not vectorize: a float16 cache read 2.2x slower than a
// float32 one). Free of torch, so that cpu/tests/quant_blocks_check.cpp checks every value on
// each instruction set (aarch64 under qemu-user: make neon-check).
//
// fp8 is e4m3: exponent 4 bits with bias 7, mantissa 3, no infinities, NaN 0x7F/0xFF. A byte's
// low 7 bits shifted left by 7 are an fp16 whose value is the e4m3 one times 2^-8, subnormals
// included (both exponent fields are 0 there), so the same conversion serves; a NaN byte (a NaN
// row value: clamping to ±448 keeps NaN) gets fp16's NaN exponent and reads back as NaN, as a
// float32 or 16-bit cache would give it.
#pragma once

#include <cstdint>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace pagedrs_cpu {

// fp16 bits as a float, exactly, in integer operations (the reference for the conversions
// below, and what runs where neither F16C nor __fp16 converts): a NaN keeps its payload and comes
// back quiet, as vcvtph2ps and fcvt return it.
inline float fp16_bits_to_float(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1Fu, mantissa = half & 0x3FFu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, a normal float (exact)
    return __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, static_cast<float>(mantissa) * 0x1p-24f) | sign);
  }
  if (exponent == 0x1F) {  // infinity or NaN (quieted)
    return __builtin_bit_cast(float, sign | 0x7F800000u | (mantissa << 13) | (mantissa ? 0x00400000u : 0));
  }
  return __builtin_bit_cast(float, sign | ((exponent + 112) << 23) | (mantissa << 13));
}

// One fp16 value by its bits: F16C or aarch64's __fp16 where there is one, else the bits.
inline float fp16_value(uint16_t half) {
#if defined(__F16C__)
  return _cvtsh_ss(half);
#elif defined(__aarch64__)
  return __builtin_bit_cast(__fp16, half);
#else
  return fp16_bits_to_float(half);
#endif
}

// dst[i] = float32 of the fp16 src[i], times factor, for i < n.
inline void fp16_row_to_float(const uint16_t* __restrict__ src, float* __restrict__ dst, int64_t n, float factor) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 scale16 = _mm512_set1_ps(factor);
  for (; i + 16 <= n; i += 16) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtph_ps(half), scale16));
  }
#endif
#if defined(__F16C__)
  const __m256 scale8 = _mm256_set1_ps(factor);
  for (; i + 8 <= n; i += 8) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(half), scale8));
  }
#elif defined(__aarch64__) && defined(__ARM_NEON)
  const float32x4_t scale4 = vdupq_n_f32(factor);
  for (; i + 8 <= n; i += 8) {
    const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(src + i));
    vst1q_f32(dst + i, vmulq_f32(vcvt_f32_f16(vget_low_f16(h)), scale4));
    vst1q_f32(dst + i + 4, vmulq_f32(vcvt_high_f32_f16(h), scale4));
  }
#endif
  for (; i < n; ++i) dst[i] = fp16_value(src[i]) * factor;
}

// The fp16 bits of an e4m3 byte, times 2^-8: sign, then the 7 bits below it shifted by 7; a NaN
// (all 7 set) with fp16's NaN exponent ORed in.
inline uint16_t fp8_e4m3_half(uint8_t byte) {
  const uint16_t magnitude = static_cast<uint16_t>((byte & 0x7Fu) << 7);
  return static_cast<uint16_t>(((byte & 0x80u) << 8) | magnitude | (magnitude == 0x3F80u ? 0x7C00u : 0));
}

// dst[i] = float32 of the e4m3 src[i], times factor, for i < n.
inline void fp8_e4m3_row_to_float(const uint8_t* __restrict__ src, float* __restrict__ dst, int64_t n, float factor) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 scale16 = _mm512_set1_ps(256.f * factor);
  for (; i + 16 <= n; i += 16) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    const __m256i magnitude = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(0x3F80));
    const __m256i nan = _mm256_and_si256(_mm256_cmpeq_epi16(magnitude, _mm256_set1_epi16(0x3F80)),
                                         _mm256_set1_epi16(0x7C00));
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi16(w, 8), _mm256_set1_epi16(-0x8000));
    const __m256i half = _mm256_or_si256(_mm256_or_si256(sign, magnitude), nan);
    _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtph_ps(half), scale16));
  }
#endif
#if defined(__F16C__)
  const __m256 scale8 = _mm256_set1_ps(256.f * factor);
  for (; i + 8 <= n; i += 8) {
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
    const __m128i magnitude = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(0x3F80));
    const __m128i nan = _mm_and_si128(_mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x3F80)), _mm_set1_epi16(0x7C00));
    const __m128i sign = _mm_and_si128(_mm_slli_epi16(w, 8), _mm_set1_epi16(-0x8000));
    const __m128i half = _mm_or_si128(_mm_or_si128(sign, magnitude), nan);
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(half), scale8));
  }
#elif defined(__aarch64__) && defined(__ARM_NEON)
  const float32x4_t scale4 = vdupq_n_f32(256.f * factor);
  for (; i + 8 <= n; i += 8) {
    const uint16x8_t w = vmovl_u8(vld1_u8(src + i));
    const uint16x8_t magnitude = vandq_u16(vshlq_n_u16(w, 7), vdupq_n_u16(0x3F80));
    const uint16x8_t nan = vandq_u16(vceqq_u16(magnitude, vdupq_n_u16(0x3F80)), vdupq_n_u16(0x7C00));
    const uint16x8_t sign = vandq_u16(vshlq_n_u16(w, 8), vdupq_n_u16(0x8000));
    const float16x8_t h = vreinterpretq_f16_u16(vorrq_u16(vorrq_u16(sign, magnitude), nan));
    vst1q_f32(dst + i, vmulq_f32(vcvt_f32_f16(vget_low_f16(h)), scale4));
    vst1q_f32(dst + i + 4, vmulq_f32(vcvt_high_f32_f16(h), scale4));
  }
#endif
  for (; i < n; ++i) dst[i] = fp16_value(fp8_e4m3_half(src[i])) * (256.f * factor);
}

}  // namespace pagedrs_cpu
