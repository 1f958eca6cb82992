// Weight-only quantized matmul on the CPU: y = x @ dequant(W)^T with W kept in a GGUF block
// format: Q8_0, Q4_0, Q4_1 (blocks of 32 weights along the input features, each with an fp16
// scale, and for Q4_1 an fp16 minimum), and the k-quants Q4_K and Q6_K (superblocks of 256
// weights: an fp16 scale (and Q4_K an fp16 minimum) refined by 6- or 8-bit scales of each
// 32 (Q4_K) or 16 (Q6_K) weights; llama.cpp's Q4_K_M files mix the two). A decode step of a small model is bound by reading its
// weights; reading the 4/8-bit blocks instead of a float32 copy reads 4-7x fewer bytes.
// Built and loaded by python/pagedrs/kernels/cpu.py with the other cpu/ kernels; registered as
// torch.ops.pagedrs_cpu.quant_matmul by torch_bindings.cpp; layers in python/pagedrs/quant/.
//
// Dimensions:
//   num_tokens      rows of activations (1 for a single-stream decode)
//   in_features     K, a multiple of the format's block (32 weights; 256 for the k-quants)
//   out_features    N, rows of the weight (as GGUF stores them: one row per output feature)
//   num_blocks      in_features / Format::kWeights, stored blocks of one weight row
//
// Layouts (all contiguous, on the CPU):
//   x               [num_tokens, in_features] float32, bfloat16 or float16 (the two 16-bit
//                   dtypes are converted to float32 once, before the matmul)
//   weight          [out_features, num_blocks * block_bytes] uint8; block_bytes: Q8_0 34
//                   (fp16 d, int8 q[32]), Q4_0 18 (fp16 d, 16 bytes of nibbles), Q4_1 20 (fp16
//                   d, fp16 m, 16 bytes of nibbles); byte j of the nibbles holds weight j in its
//                   low half and weight j + 16 in its high half (ggml-common.h's layout);
//                   Q4_K 144 (fp16 d, fp16 dmin, 12 bytes of 6-bit scales and minimums, 128
//                   bytes of nibbles), Q6_K 210 (128 bytes of low nibbles, 64 of high 2-bit
//                   pairs, 16 int8 scales, fp16 d); see Q4_K and Q6_K below
//   returns         [num_tokens, out_features], x's dtype
//
// Values: Q8_0 w = d * q; Q4_0 w = d * (q - 8); Q4_1 w = d * q + m; Q4_K w = (d * sc) * q -
// dmin * m; Q6_K w = (d * sc) * (q - 32); exactly as gguf's dequantize computes them in float32.
// By default activations are never quantized: each block is dequantized in registers and
// multiplied in float32, so the result equals "dequantize, then float matmul" up to the order of
// the additions.
//
// int8 activations (opt-in: a type id ORed with kInt8Activations, cpu_kernels.h): each token's
// row of x is quantized per 32 features to int8 once per matmul (dx = max|x| / 127, llama.cpp's
// Q8_0 / Q8_1 activations), and each block's dot product is an integer one (32 int8 x int8
// products summed exactly in int32), scaled by dw * dx in float; Q4_1's minimum adds
// m * dx * sum(qx). It changes results (the activations' rounding, about 0.4% of a block's largest
// value); Q8_0, Q4_0 and Q4_1 with AVX2 or NEON take it, anything else runs the exact path. With
// VNNI (vpdpbusd) the weights are regrouped in panels of 16 (AVX-512 VNNI) or 8 (AVX-VNNI) rows,
// one row per int32 lane, so one instruction advances every row of the panel and each block's sum
// is scaled once for all of them (VnniPanel); without, AVX2's maddubs + madd take one row at a
// time, and so does NEON's sdot (ARMv8.2 dot product; widening multiplies without it, in
// quant_blocks.h).
//
// Instruction sets: with AVX-512 each 32 weights dequantize into two 16-lane registers; with
// AVX2 + FMA (no AVX-512) into four 8-lane ones; on aarch64 (NEON) into eight 4-lane ones;
// elsewhere into a buffer (scalar code). The build targets the machine (-march=native, on aarch64
// -mcpu=native), so only one of them is compiled, and one int8 path: AVX-512 VNNI (with
// AVX-512 BW), else AVX-VNNI, else AVX2 on x86; NEON with or without the dot product on
// aarch64 (int8_activation_path() names it). The formats and the
// per-row kernel are in quant_blocks.h, which needs no torch: make neon-check runs them for
// aarch64 under qemu-user.
//
// Work split: threads (torch's pool, at::parallel_for) take ranges of output features, so a
// single-token decode is spread over every core and streams each weight byte once. Inside a
// range, kRowChunk weight rows (a few KB of packed blocks, they stay in L2) meet the tokens
// kTokenTile at a time: each weight block is dequantized once per tile of tokens, whose
// rows of x stay in L1/L2.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu_kernels.h"
#include "quant_blocks.h"

#include <algorithm>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>


namespace {

// ggml's type ids (gguf.constants.GGMLQuantizationType).
constexpr int64_t kQ4_0 = 2;
constexpr int64_t kQ4_1 = 3;
constexpr int64_t kQ8_0 = 8;
constexpr int64_t kQ4_K = 12;
constexpr int64_t kQ6_K = 14;

// run(Format{}) for one of ggml's legacy 32-weight formats (Q8_0, Q4_0, Q4_1), those int8
// activations, stored panels and scales-first rows take: the caller has checked that ggml_type is
// one of them.
template <class Run>
void with_legacy_format(int64_t ggml_type, Run&& run) {
  switch (ggml_type) {
    case kQ8_0: run(Q8_0{}); break;
    case kQ4_0: run(Q4_0{}); break;
    default: run(Q4_1{}); break;
  }
}


// Steps of many tokens (a prompt's prefill, an embedding batch) are compute-bound, and there the
// per-row kernel (quant_blocks.h), which dequantizes each block once per tile of 8 tokens, loses to torch's
// sgemm on float weights (0.64x on a 2048-token step of the default model, Zen 3 AVX2). From
// kGemmTokens tokens on, panels of weight rows (kPanelBytes of them) are dequantized to float32 (exactly
// the values the per-row kernel multiplies by) and multiplied with at::mm, so the dequantization
// is done once per step, not once per 8 tokens, and the scratch stays a few MB whatever the
// model. Sums are then taken in sgemm's order: results equal the per-row kernel's to float32
// rounding, not bit for bit.
constexpr int64_t kGemmTokens = 128;
constexpr int64_t kPanelBytes = 8 << 20;  // float32 weights dequantized at a time (at least 256 rows)

template <class Format>
void dequant_rows(const uint8_t* weight, int64_t in_features, int64_t row_begin, int64_t row_end, float* out) {
  const int64_t num_blocks = in_features / Format::kWeights;
  const int64_t row_bytes = num_blocks * Format::kBytes;
  for (int64_t n = row_begin; n < row_end; ++n) {
    const uint8_t* row = weight + n * row_bytes;
    float* w = out + (n - row_begin) * in_features;
    for (int64_t b = 0; b < num_blocks; ++b) {
      for (int sub = 0; sub < Format::kWeights / kBlockSize; ++sub) {
        Format::dequant(row + b * Format::kBytes, sub, w + b * Format::kWeights + sub * kBlockSize);
      }
    }
  }
}

// dequant_rows of rows in GGUF's order, or in the scales-first one (put back in GGUF's first).
template <class Format>
void dequant_rows_of(const uint8_t* weight, bool scales_first, int64_t in_features, int64_t row_begin,
                     int64_t row_end, float* out) {
#ifdef PAGEDRS_QUANT_AVX2
  if constexpr (kScalesFirstFormat<Format>) {
    if (scales_first) {
      const int64_t num_blocks = in_features / Format::kWeights, row_bytes = num_blocks * Format::kBytes;
      std::vector<uint8_t> row(row_bytes);
      for (int64_t n = row_begin; n < row_end; ++n) {
        scales_first_to_row<Format>(weight + n * row_bytes, num_blocks, row.data());
        dequant_rows<Format>(row.data(), in_features, 0, 1, out + (n - row_begin) * in_features);
      }
      return;
    }
  }
#endif
  (void)scales_first;  // checked by the caller: only the formats and builds above have it
  dequant_rows<Format>(weight, in_features, row_begin, row_end, out);
}

template <class Format>
void matmul_dequant_gemm(const float* x, const uint8_t* weight, bool scales_first, float* out, int64_t num_tokens,
                         int64_t in_features, int64_t out_features) {
  const auto options = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor xs = at::from_blob(const_cast<float*>(x), {num_tokens, in_features}, options);
  at::Tensor outs = at::from_blob(out, {num_tokens, out_features}, options);
  const int64_t panel_rows = std::min(out_features, std::max<int64_t>(256, kPanelBytes / (4 * in_features)));
  at::Tensor panel = at::empty({panel_rows, in_features}, options);
  for (int64_t n0 = 0; n0 < out_features; n0 += panel_rows) {
    const int64_t rows = std::min(panel_rows, out_features - n0);
    float* panel_data = panel.data_ptr<float>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      dequant_rows_of<Format>(weight, scales_first, in_features, n0 + begin, n0 + end, panel_data + begin * in_features);
    });
    if (rows == out_features) {
      at::mm_out(outs, xs, panel.t());  // one panel: straight into out
    } else {
      outs.narrow(1, n0, rows).copy_(at::mm(xs, panel.narrow(0, 0, rows).t()));
    }
  }
}

#ifdef __AVX2__
#define PAGEDRS_INT8_ACTIVATIONS 1

// Which integer dot product the int8 path runs: vpdpbusd (4 byte products summed into each
// int32 lane) over 16-lane registers with AVX-512 VNNI, over 8-lane ones with AVX-VNNI (Alder
// Lake and later without AVX-512), else AVX2's maddubs + madd.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGEDRS_INT8_VNNI 1
constexpr const char* kInt8Path = "avx512-vnni";
#elif defined(__AVXVNNI__)
#define PAGEDRS_INT8_VNNI 1
constexpr const char* kInt8Path = "avx-vnni";
#else
constexpr const char* kInt8Path = "avx2";
#endif

inline float hsum_avx2(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
}

// Tokens [t_begin, t_end) of x into `rows` (sized by the caller); weight_zero: see Int8Rows::start.
void quantize_rows(const float* x, int64_t in_features, int64_t t_begin, int64_t t_end, int32_t weight_zero,
                   Int8Rows& rows) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t t = t_begin; t < t_end; ++t) {
    for (int64_t b = 0; b < rows.num_blocks; ++b) {
      const float* xb = x + t * in_features + b * kBlockSize;
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
      }
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
      const float d = _mm_cvtss_f32(m) / 127.f;
      const __m256 inverse = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) {
        const __m256 scaled = _mm256_round_ps(_mm256_mul_ps(v[i], inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q[i] = _mm256_cvtps_epi32(scaled);
      }
      // int32 -> int16 -> int8; packs interleave 128-bit lanes, the permute puts them back in order.
      const __m256i q16_lo = _mm256_packs_epi32(q[0], q[1]), q16_hi = _mm256_packs_epi32(q[2], q[3]);
      const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16_lo, q16_hi),
                                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows.q.data() + (t * rows.num_blocks + b) * kBlockSize), q8);
      const __m256i sum32 = _mm256_madd_epi16(_mm256_add_epi16(q16_lo, q16_hi), _mm256_set1_epi16(1));
      const float total = hsum_avx2(_mm256_cvtepi32_ps(sum32));  // |sum| <= 32 * 127: exact
      rows.d[t * rows.num_blocks + b] = d;
      rows.sum[t * rows.num_blocks + b] = d * total;
      rows.start[t * rows.num_blocks + b] = -weight_zero * static_cast<int32_t>(total);
    }
  }
}

#ifdef PAGEDRS_INT8_VNNI
// vpdpbusd multiplies unsigned bytes by signed ones. The weights go in unsigned, offset by their
// format's zero (Q8_0: q + 128, Q4_0: the stored nibble, q + 8; Q4_1: the nibble itself), and
// the activations signed, so each int32 lane sums sum(w * q) + zero * sum(q): starting the lane at
// -zero * sum(q) (Int8Rows::start) leaves the exact integer dot product of the block.
template <class Format>
constexpr int32_t kWeightZero = std::is_same_v<Format, Q8_0> ? 128 : std::is_same_v<Format, Q4_0> ? 8 : 0;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// A panel of 16 weight rows, one per 32-bit lane of a 512-bit register.
struct VnniLanes {
  static constexpr int kRows = 16;
  static constexpr int kTokens = 8;  // tokens one pass over a panel serves (registers: 3 per token)
  static constexpr int kRegisters = 32;
  using Int = __m512i;
  using Float = __m512;
  static Int load(const int32_t* p) { return _mm512_load_si512(p); }
  static Int loadu(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static void store(int32_t* p, Int v) { _mm512_store_si512(p, v); }
  static Int set1(int32_t v) { return _mm512_set1_epi32(v); }
  static Int dpbusd(Int sum, Int unsigned_bytes, Int signed_bytes) {
    return _mm512_dpbusd_epi32(sum, unsigned_bytes, signed_bytes);
  }
  // Bytes [offset, offset + 16) of rows i, i + 4, i + 8 and i + 12 as the four 128-bit lanes.
  static Int load_quarters(const uint8_t* const* rows, int i, int64_t offset) {
    const auto piece = [&](int r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + offset)); };
    Int v = _mm512_castsi128_si512(piece(i));
    v = _mm512_inserti32x4(v, piece(i + 4), 1);
    v = _mm512_inserti32x4(v, piece(i + 8), 2);
    return _mm512_inserti32x4(v, piece(i + 12), 3);
  }
  static Int unpacklo32(Int a, Int b) { return _mm512_unpacklo_epi32(a, b); }
  static Int unpackhi32(Int a, Int b) { return _mm512_unpackhi_epi32(a, b); }
  static Int unpacklo64(Int a, Int b) { return _mm512_unpacklo_epi64(a, b); }
  static Int unpackhi64(Int a, Int b) { return _mm512_unpackhi_epi64(a, b); }
  static Int low_nibbles(Int v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
  static Int high_nibbles(Int v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
  static Int flip_sign_bits(Int v) { return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80))); }
  static Float halves(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(p))); }
  static Float halvesu(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static Float fzero() { return _mm512_setzero_ps(); }
  static Float fset1(float v) { return _mm512_set1_ps(v); }
  static Float to_float(Int v) { return _mm512_cvtepi32_ps(v); }
  static Float add(Float a, Float b) { return _mm512_add_ps(a, b); }
  static Float mul(Float a, Float b) { return _mm512_mul_ps(a, b); }
  static Float fmadd(Float a, Float b, Float c) { return _mm512_fmadd_ps(a, b, c); }
  static void store_rows(float* out, Float v, int num_rows) {
    _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << num_rows) - 1), v);
  }
};
#else
// A panel of 8 weight rows, one per 32-bit lane of a 256-bit register (AVX-VNNI).
struct VnniLanes {
  static constexpr int kRows = 8;
  static constexpr int kTokens = 4;  // 16 registers: 3 per token, the weights, their scales
  static constexpr int kRegisters = 16;
  using Int = __m256i;
  using Float = __m256;
  static Int load(const int32_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
  static Int loadu(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store(int32_t* p, Int v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); }
  static Int set1(int32_t v) { return _mm256_set1_epi32(v); }
  static Int dpbusd(Int sum, Int unsigned_bytes, Int signed_bytes) {
    return _mm256_dpbusd_avx_epi32(sum, unsigned_bytes, signed_bytes);
  }
  // Bytes [offset, offset + 16) of rows i and i + 4 as the two 128-bit lanes.
  static Int load_quarters(const uint8_t* const* rows, int i, int64_t offset) {
    const auto piece = [&](int r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r] + offset)); };
    return _mm256_inserti128_si256(_mm256_castsi128_si256(piece(i)), piece(i + 4), 1);
  }
  static Int unpacklo32(Int a, Int b) { return _mm256_unpacklo_epi32(a, b); }
  static Int unpackhi32(Int a, Int b) { return _mm256_unpackhi_epi32(a, b); }
  static Int unpacklo64(Int a, Int b) { return _mm256_unpacklo_epi64(a, b); }
  static Int unpackhi64(Int a, Int b) { return _mm256_unpackhi_epi64(a, b); }
  static Int low_nibbles(Int v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
  static Int high_nibbles(Int v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
  static Int flip_sign_bits(Int v) { return _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))); }
  static Float halves(const uint16_t* p) { return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(p))); }
  static Float halvesu(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static Float fzero() { return _mm256_setzero_ps(); }
  static Float fset1(float v) { return _mm256_set1_ps(v); }
  static Float to_float(Int v) { return _mm256_cvtepi32_ps(v); }
  static Float add(Float a, Float b) { return _mm256_add_ps(a, b); }
  static Float mul(Float a, Float b) { return _mm256_mul_ps(a, b); }
  static Float fmadd(Float a, Float b, Float c) { return _mm256_fmadd_ps(a, b, c); }
  static void store_rows(float* out, Float v, int num_rows) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(out, _mm256_cmpgt_epi32(_mm256_set1_epi32(num_rows), lanes), v);
  }
};
#endif

constexpr int kPanelRows = VnniLanes::kRows;
constexpr int64_t kPanelsAhead = 2;  // how far ahead a single tile's walk prefetches (panel_dot)

// kPanelRows weight rows regrouped so that one vpdpbusd serves them all: for each block, 8
// registers whose lane r holds weights 4k .. 4k + 3 (register k) of row r as unsigned bytes
// (kWeightZero), and the rows' fp16 scales (and Q4_1's minimums) side by side. Built once per
// panel and read once per tile of tokens, so a block is unpacked once however many tokens:
//
//   row r, block b:  [w0 w1 w2 w3 | w4 .. w7 | ... | w28 .. w31]      (32 bytes, 8 dwords)
//   panel, block b:  register k = [row 0 dword k, row 1 dword k, ..., row kPanelRows-1 dword k]
//   token t, block b: sum = start + sum over k of vpdpbusd(register k, broadcast(x dword k)),
//                     then acc += float(sum) * (dw * dx), one lane per row
struct VnniPanel {
  struct alignas(4 * kPanelRows) Words {
    int32_t lane[kPanelRows];
  };
  struct alignas(2 * kPanelRows) Halves {
    uint16_t lane[kPanelRows];
  };
  std::vector<Words> quants;     // [num_blocks * 8]
  std::vector<Halves> scales;    // [num_blocks] fp16 d
  std::vector<Halves> minimums;  // [num_blocks] fp16 m (Q4_1)
};

// The four registers a[i] (lane L: 16 bytes of row i + 4L) transposed by 32-bit words: a[k] lane
// L then holds word k of rows 4L .. 4L + 3, so a[k]'s 32-bit lane r is word k of row r.
inline void transpose_words(VnniLanes::Int (&a)[4]) {
  using V = VnniLanes;
  const V::Int t0 = V::unpacklo32(a[0], a[1]), t1 = V::unpackhi32(a[0], a[1]);
  const V::Int t2 = V::unpacklo32(a[2], a[3]), t3 = V::unpackhi32(a[2], a[3]);
  a[0] = V::unpacklo64(t0, t2);
  a[1] = V::unpackhi64(t0, t2);
  a[2] = V::unpacklo64(t1, t3);
  a[3] = V::unpackhi64(t1, t3);
}

inline uint16_t load_half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return bits;
}

// Block b of rows[0 .. kPanelRows) regrouped (see VnniPanel): its 8 weight registers, and its
// rows' fp16 scales (and Q4_1's minimums) into `scales` (`minimums`).
template <class Format>
inline void unpack_block(const uint8_t* const (&rows)[kPanelRows], int64_t b, VnniLanes::Int (&w)[8],
                         VnniPanel::Halves& scales, VnniPanel::Halves& minimums) {
  using V = VnniLanes;
  const int64_t at = b * Format::kBytes;
  for (int r = 0; r < kPanelRows; ++r) {
    scales.lane[r] = load_half(rows[r] + at);
    if constexpr (std::is_same_v<Format, Q4_1>) minimums.lane[r] = load_half(rows[r] + at + 2);
  }
  V::Int a[4];
  if constexpr (std::is_same_v<Format, Q8_0>) {
    for (int half = 0; half < 2; ++half) {  // weights 0..15, then 16..31
      for (int i = 0; i < 4; ++i) a[i] = V::load_quarters(rows, i, at + 2 + 16 * half);
      transpose_words(a);
      for (int k = 0; k < 4; ++k) w[4 * half + k] = V::flip_sign_bits(a[k]);
    }
  } else {
    // Byte j of the nibbles holds weight j (low half) and j + 16 (high half).
    constexpr int kNibbles = std::is_same_v<Format, Q4_1> ? 4 : 2;
    for (int i = 0; i < 4; ++i) a[i] = V::load_quarters(rows, i, at + kNibbles);
    transpose_words(a);
    for (int k = 0; k < 4; ++k) {
      w[k] = V::low_nibbles(a[k]);
      w[4 + k] = V::high_nibbles(a[k]);
    }
  }
}

// The panel of rows[0 .. kPanelRows) (num_blocks blocks each).
template <class Format>
void pack_panel(const uint8_t* const (&rows)[kPanelRows], int64_t num_blocks, VnniPanel& panel) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    VnniLanes::Int w[8];
    unpack_block<Format>(rows, b, w, panel.scales[b], panel.minimums[b]);
    for (int k = 0; k < 8; ++k) VnniLanes::store(panel.quants[8 * b + k].lane, w[k]);
  }
}

// out[t * out_stride + r] for the panel's rows r < num_rows and kTokens quantized tokens (from
// token t0 of `x`), reading each block from `panel` or, kFromRows (a single tile of tokens),
// unpacking it from `rows` on the way. Each token's sums run in block order whatever the tile
// or panel: a row's result does not depend on the batch it is in.
template <class Format, int kTokens, bool kFromRows>
void panel_dot(const Int8Rows& x, int64_t t0, const uint8_t* const (&rows)[kPanelRows], const VnniPanel& panel,
               float* __restrict__ out, int64_t out_stride, int num_rows) {
  using V = VnniLanes;
  constexpr bool kMinimum = std::is_same_v<Format, Q4_1>;
  const int64_t num_blocks = x.num_blocks;
  const int64_t panels_ahead_bytes = kPanelsAhead * kPanelRows * num_blocks * Format::kBytes;
  V::Float acc[kTokens], minimums[kTokens];
  for (int t = 0; t < kTokens; ++t) acc[t] = minimums[t] = V::fzero();
  for (int64_t b = 0; b < num_blocks; ++b) {
    V::Int w[8];
    VnniPanel::Halves unpacked_scales, unpacked_minimums;
    if constexpr (kFromRows) {
      // The panel two ahead, a line at a time as this one's blocks reach a new line (see
      // kPrefetchAhead; a prefetch past the weight's end never faults).
      if (const int64_t at = b * Format::kBytes; b == 0 || at / 64 != (at - Format::kBytes) / 64) {
        for (int r = 0; r < kPanelRows; ++r) __builtin_prefetch(rows[r] + panels_ahead_bytes + at, 0, 3);
      }
      unpack_block<Format>(rows, b, w, unpacked_scales, unpacked_minimums);
    }
    V::Int sums[kTokens];
    for (int t = 0; t < kTokens; ++t) sums[t] = V::set1(x.start[(t0 + t) * num_blocks + b]);
    for (int k = 0; k < 8; ++k) {
      if constexpr (!kFromRows) w[k] = V::load(panel.quants[8 * b + k].lane);
      for (int t = 0; t < kTokens; ++t) {
        int32_t word;  // activations 4k .. 4k + 3 of the token's block, one per byte
        std::memcpy(&word, x.q.data() + ((t0 + t) * num_blocks + b) * kBlockSize + 4 * k, sizeof(word));
        sums[t] = V::dpbusd(sums[t], w[k], V::set1(word));
      }
    }
    const V::Float dw = V::halves(kFromRows ? unpacked_scales.lane : panel.scales[b].lane);
    for (int t = 0; t < kTokens; ++t) {
      const int64_t at = (t0 + t) * num_blocks + b;
      acc[t] = V::fmadd(V::to_float(sums[t]), V::mul(dw, V::fset1(x.d[at])), acc[t]);
      if constexpr (kMinimum) {
        const V::Float dm = V::halves(kFromRows ? unpacked_minimums.lane : panel.minimums[b].lane);
        minimums[t] = V::fmadd(dm, V::fset1(x.sum[at]), minimums[t]);
      }
    }
  }
  for (int t = 0; t < kTokens; ++t) {
    V::store_rows(out + t * out_stride, kMinimum ? V::add(acc[t], minimums[t]) : acc[t], num_rows);
  }
}

// panel_dot with the tile's token count as a compile-time constant, so the accumulators live in
// registers.
template <class Format, bool kFromRows, int... kTiles>
void panel_dot_tile(int tile, const Int8Rows& x, int64_t t0, const uint8_t* const (&rows)[kPanelRows],
                    const VnniPanel& panel, float* out, int64_t out_stride, int num_rows,
                    std::integer_sequence<int, kTiles...>) {
  ((tile == kTiles + 1 ? panel_dot<Format, kTiles + 1, kFromRows>(x, t0, rows, panel, out, out_stride, num_rows)
                       : void()),
   ...);
}

template <class Format>
void matmul_rows_int8(const Int8Rows& x, const uint8_t* weight, float* out, int64_t out_stride, int64_t num_tokens,
                      int64_t row_begin, int64_t row_end) {
  constexpr auto kTiles = std::make_integer_sequence<int, VnniLanes::kTokens>();
  const int64_t num_blocks = x.num_blocks;
  const int64_t row_bytes = num_blocks * Format::kBytes;
  // One tile of tokens unpacks each block as it goes; more store the panel once and read it per tile.
  const bool one_tile = num_tokens <= VnniLanes::kTokens;
  thread_local VnniPanel panel;
  if (!one_tile && panel.scales.size() < static_cast<size_t>(num_blocks)) {
    panel.quants.resize(8 * num_blocks), panel.scales.resize(num_blocks), panel.minimums.resize(num_blocks);
  }
  for (int64_t n0 = row_begin; n0 < row_end; n0 += kPanelRows) {
    const int num_rows = static_cast<int>(std::min<int64_t>(kPanelRows, row_end - n0));
    const uint8_t* rows[kPanelRows];  // a short panel repeats its last row
    for (int r = 0; r < kPanelRows; ++r) rows[r] = weight + (n0 + std::min(r, num_rows - 1)) * row_bytes;
    if (one_tile) {
      panel_dot_tile<Format, true>(static_cast<int>(num_tokens), x, 0, rows, panel, out + n0, out_stride, num_rows,
                                   kTiles);
      continue;
    }
    pack_panel<Format>(rows, num_blocks, panel);
    for (int64_t t0 = 0; t0 < num_tokens; t0 += VnniLanes::kTokens) {
      const int tile = static_cast<int>(std::min<int64_t>(VnniLanes::kTokens, num_tokens - t0));
      panel_dot_tile<Format, false>(tile, x, t0, rows, panel, out + t0 * out_stride + n0, out_stride, num_rows,
                                    kTiles);
    }
  }
}

#else
// The 32 weights of a block as bytes in order: signed for Q8_0 and Q4_0, unsigned nibbles for
// Q4_1 (whose minimum the caller adds).
template <class Format>
inline __m256i block_bytes(const uint8_t* block);
template <>
inline __m256i block_bytes<Q8_0>(const uint8_t* block) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
}
inline __m256i nibble_bytes(const uint8_t* qs) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_insertf128_si256(_mm256_castsi128_si256(packed), _mm_srli_epi16(packed, 4), 1);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));  // weights 0..15 low halves, 16..31 high
}
template <>
inline __m256i block_bytes<Q4_0>(const uint8_t* block) {
  return _mm256_sub_epi8(nibble_bytes(block + 2), _mm256_set1_epi8(8));
}
template <>
inline __m256i block_bytes<Q4_1>(const uint8_t* block) {
  return nibble_bytes(block + 4);
}

// out[t * out_stride] for kTokens quantized tokens (from token t0 of `rows`) and one weight row.
template <class Format, int kTokens>
inline void dot_row_int8(const Int8Rows& rows, int64_t t0, const uint8_t* __restrict__ row, float* __restrict__ out,
                         int64_t out_stride) {
  constexpr bool kUnsigned = std::is_same_v<Format, Q4_1>;
  const int64_t num_blocks = rows.num_blocks;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[kTokens];
  float minimums[kTokens] = {};
  for (int t = 0; t < kTokens; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* block = row + b * Format::kBytes;
    const __m256i w = block_bytes<Format>(block);
    const __m256 dw = _mm256_set1_ps(fp16_to_float(block));
    const float minimum = kUnsigned ? fp16_to_float(block + 2) : 0.f;
    // maddubs multiplies unsigned by signed bytes: signed weights go in as |w|, their signs
    // moved onto the activations.
    const __m256i w_unsigned = kUnsigned ? w : _mm256_sign_epi8(w, w);
    for (int t = 0; t < kTokens; ++t) {
      const int64_t at = (t0 + t) * num_blocks + b;
      __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows.q.data() + at * kBlockSize));
      if (!kUnsigned) q = _mm256_sign_epi8(q, w);
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w_unsigned, q), ones);
      const __m256 scale = _mm256_mul_ps(dw, _mm256_broadcast_ss(rows.d.data() + at));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[t]);
      if constexpr (kUnsigned) minimums[t] += minimum * rows.sum[at];
    }
  }
  for (int t = 0; t < kTokens; ++t) out[t * out_stride] = hsum_avx2(acc[t]) + minimums[t];
}

#endif  // PAGEDRS_INT8_VNNI

#define PAGEDRS_INT8_PANELS 1
// The registers of the stored panels' kernel (stored_panel_dot): VNNI's, or AVX2's 8 rows of
// 32-bit lanes with vpdpbusd's sums made of maddubs and madd.
#ifdef PAGEDRS_INT8_VNNI
struct PanelLanes : VnniLanes {
  // One token's integer sums of a block, one int32 lane per row: from Int8Rows::start, each
  // register's 4 byte products added by vpdpbusd.
  template <class Format>
  struct Sums {
    struct Weights {  // one register of a block's weights, as vpdpbusd takes them
      Int bytes;
      explicit Weights(Int stored) : bytes(stored) {}
    };
    Int lanes;
    void begin(int32_t start) { lanes = set1(start); }
    void add(const Weights& weights, Int signed_activations) {
      lanes = dpbusd(lanes, weights.bytes, signed_activations);
    }
    Int total() const { return lanes; }
  };
};
// The weights' zero in the stored panels (Int8Rows::start): vpdpbusd's unsigned weights.
template <class Format>
constexpr int32_t kPanelWeightZero = kWeightZero<Format>;
#else
struct PanelLanes {
  static constexpr int kRows = 8;
  static constexpr int kTokens = 4;  // 16 registers: 3 per token, the weights, their scales
  static constexpr int kRegisters = 16;
  using Int = __m256i;
  using Float = __m256;
  static Int loadu(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static Int set1(int32_t v) { return _mm256_set1_epi32(v); }
  static Int low_nibbles(Int v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
  static Int high_nibbles(Int v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
  // One token's integer sums of a block, one int32 lane per row (the products of each lane's 4
  // weight bytes and 4 activation bytes, from Int8Rows::start). Nibbles (unsigned, at most 15)
  // add maddubs' int16 pairs as they come, at most 8 x 2 x 15 x 127 = 30480 in a lane, and
  // widen once per block; Q8_0's signed weights go in as |w| with their signs on the
  // activations, each pair near int16's limit, so each register widens at once.
  // Each token's sum built in the order written: without this barrier GCC reassociates the
  // tile's integer adds into one tree, every product live at once, and spills most of them.
  static void keep_order(Int& v) { asm("" : "+x"(v)); }
  template <class Format>
  struct Sums {
    static constexpr bool kSigned = std::is_same_v<Format, Q8_0>;
    struct Weights {  // one register of a block's weights: |w| (nibbles as they are), and w for its signs
      Int magnitude, signs;
      explicit Weights(Int stored) : magnitude(kSigned ? _mm256_abs_epi8(stored) : stored), signs(stored) {}
    };
    Int lanes;  // int32 (Q8_0) or int16 pairs
    int32_t start;
    void begin(int32_t block_start) {
      start = block_start;
      lanes = kSigned ? set1(start) : _mm256_setzero_si256();
    }
    void add(const Weights& weights, Int activations) {
      if constexpr (kSigned) {
        const Int pairs = _mm256_maddubs_epi16(weights.magnitude, _mm256_sign_epi8(activations, weights.signs));
        lanes = _mm256_add_epi32(lanes, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
        keep_order(lanes);
      } else {
        lanes = _mm256_add_epi16(lanes, _mm256_maddubs_epi16(weights.magnitude, activations));
        keep_order(lanes);
      }
    }
    Int total() const {
      if constexpr (kSigned) return lanes;
      return _mm256_add_epi32(set1(start), _mm256_madd_epi16(lanes, _mm256_set1_epi16(1)));
    }
  };
  static Float halvesu(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static Float fzero() { return _mm256_setzero_ps(); }
  static Float fset1(float v) { return _mm256_set1_ps(v); }
  static Float to_float(Int v) { return _mm256_cvtepi32_ps(v); }
  static Float add(Float a, Float b) { return _mm256_add_ps(a, b); }
  static Float mul(Float a, Float b) { return _mm256_mul_ps(a, b); }
  static Float fmadd(Float a, Float b, Float c) { return _mm256_fmadd_ps(a, b, c); }
  static void store_rows(float* out, Float v, int) { _mm256_storeu_ps(out, v); }  // always whole panels
};
constexpr int kPanelRows = PanelLanes::kRows;
// Q4_0's nibbles are q + 8 (maddubs takes them unsigned); Q8_0 and Q4_1 as stored.
template <class Format>
constexpr int32_t kPanelWeightZero = std::is_same_v<Format, Q4_0> ? 8 : 0;
#endif

// The stored panel layout (pack_int8_panels, type ids with kInt8Panels): the weight's bytes
// permuted once at load so that the int8 kernel reads one stream, in the order it multiplies,
// with no regrouping per call. Panel p (rows p * kPanelRows ..) keeps the bytes of its rows, as
// kPanelBlockBytes for each block b in turn:
//   kQuantWords registers of kPanelRows int32 lanes: register k, lane r = bytes 4k .. 4k + 3 of
//     row r's stored quants in block b (Q8_0: its int8 weights, with VNNI each + 128 as
//     vpdpbusd's unsigned operand; Q4_0 and Q4_1: its packed nibbles, split in registers)
//   kPanelRows fp16 d (lane r: row r's), then for Q4_1 kPanelRows fp16 m
// A panel of Q4_1 blocks is 16 x 20 = 320 bytes a block, as many as the rows it replaces: the
// tensor keeps its shape and size. Needs out_features a multiple of kPanelRows (16 with AVX-512
// VNNI, 8 with AVX-VNNI or AVX2). Each register's products are summed into its int32 lanes by
// PanelLanes::dot: vpdpbusd with VNNI; AVX2's maddubs (unsigned by signed bytes, pairs summed
// in int16) then madd, the sums exact either way (a pair of products is at most 2 x 15 x 127
// for nibbles; Q8_0's signed weights go in as |w|, their signs moved onto the activations).
template <class Format>
constexpr int kQuantWords = std::is_same_v<Format, Q8_0> ? 8 : 4;
template <class Format>
constexpr int64_t kPanelBlockBytes = kPanelRows * Format::kBytes;
template <class Format>
constexpr int64_t kPanelScalesAt = 4 * kQuantWords<Format> * kPanelRows;  // bytes into a panel's block

template <class Format>
void pack_panels(const uint8_t* weight, uint8_t* packed, int64_t out_features, int64_t num_blocks) {
  constexpr int64_t kQuantsAt = Format::kBytes - 4 * kQuantWords<Format>;  // after d (and Q4_1's m)
  const int64_t row_bytes = num_blocks * Format::kBytes;
  at::parallel_for(0, out_features / kPanelRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t b = 0; b < num_blocks; ++b) {
        uint8_t* to = packed + (p * num_blocks + b) * kPanelBlockBytes<Format>;
        for (int r = 0; r < kPanelRows; ++r) {
          const uint8_t* block = weight + (p * kPanelRows + r) * row_bytes + b * Format::kBytes;
          for (int k = 0; k < kQuantWords<Format>; ++k) {
            for (int j = 0; j < 4; ++j) {
              const uint8_t byte = block[kQuantsAt + 4 * k + j];
              to[(k * kPanelRows + r) * 4 + j] = kPanelWeightZero<Format> == 128 ? byte ^ 0x80 : byte;
            }
          }
          std::memcpy(to + kPanelScalesAt<Format> + 2 * r, block, 2);
          if constexpr (std::is_same_v<Format, Q4_1>) {
            std::memcpy(to + kPanelScalesAt<Format> + 2 * kPanelRows + 2 * r, block + 2, 2);
          }
        }
      }
    }
  });
}

// Row n of stored panels back as GGUF stores it (row_bytes), pack_panels undone for one row.
template <class Format>
void unpack_panel_row(const uint8_t* panels, int64_t n, int64_t num_blocks, uint8_t* row) {
  constexpr int64_t kQuantsAt = Format::kBytes - 4 * kQuantWords<Format>;
  const int64_t r = n % kPanelRows;
  const uint8_t* panel = panels + (n / kPanelRows) * num_blocks * kPanelBlockBytes<Format>;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* from = panel + b * kPanelBlockBytes<Format>;
    uint8_t* block = row + b * Format::kBytes;
    for (int k = 0; k < kQuantWords<Format>; ++k) {
      for (int j = 0; j < 4; ++j) {
        const uint8_t byte = from[(k * kPanelRows + r) * 4 + j];
        block[kQuantsAt + 4 * k + j] = kPanelWeightZero<Format> == 128 ? byte ^ 0x80 : byte;
      }
    }
    std::memcpy(block, from + kPanelScalesAt<Format> + 2 * r, 2);
    if constexpr (std::is_same_v<Format, Q4_1>) {
      std::memcpy(block + 2, from + kPanelScalesAt<Format> + 2 * kPanelRows + 2 * r, 2);
    }
  }
}

// Stored panels are one sequential stream, but the hardware prefetchers do not keep a core's
// reads ahead of it on every CPU (see kPrefetchAhead): there the first tile's walk asks for the
// bytes this far ahead as it reaches each block (0: it asks for nothing). Each choice below was
// measured on the default model's single-stream int8 decode, the variants alternated in one
// process:
// - Sapphire Rapids VM, whose L3 holds the default model: a step took 4.19 ms without, 3.60 with
//   2 KB, 3.26-3.30 with 6-16 KB (medians of 20 rounds): 8 KB;
// - AMD EPYC Zen 4 VM, whose weights come from memory: slower at every distance, 4.21 ms without
//   against 4.44 with 8 KB (x1.056; steps alternated one by one, 1,260 each), 2 to 32 KB all
//   slower, and prefetching the block being read (1 byte ahead: the same instructions, nothing
//   fetched early) as fast as none: its prefetchers keep up with the stream, software
//   prefetches only compete with them. None there, nor on other AMD CPUs not measured (Zen 5
//   and Zen 2 and older);
// - AMD EPYC Zen 3 VM: requests of 128 tokens 1.09-1.11x as fast with 1-4 KB as without (1.07-
//   1.12x with 8 KB, 1.03x with 16): 2 KB.
// The exact kernel, bound by its instructions, gained nothing from a longer distance than its
// 1 KB on any of them.
int64_t stored_prefetch_distance() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) && ebx == 0x68747541 /* "Auth" of AuthenticAMD */) {
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 0;
    const unsigned family = ((eax >> 8) & 0x0F) + ((eax >> 20) & 0xFF);
    const unsigned model = ((eax >> 4) & 0x0F) | ((eax >> 12) & 0xF0);
    // Zen 3: family 0x19, models 0x00-0x0F (EPYC Milan), 0x20-0x2F and 0x40-0x5F (Ryzen);
    // Zen 4 is the same family's 0x10-0x1F, 0x60-0x7F and 0xA0-0xAF
    const bool zen3 =
        family == 0x19 && (model < 0x10 || (model >= 0x20 && model < 0x30) || (model >= 0x40 && model < 0x60));
    return zen3 ? int64_t{2} << 10 : 0;
  }
#endif
  return int64_t{8} << 10;
}
const int64_t kStoredPrefetchAhead = stored_prefetch_distance();

// out[t * out_stride + r] for the kPanelRows rows of one stored panel and kTokens quantized
// tokens from t0: panel_dot's sums (the same integers, scaled and added in the same order, so
// the same floats), read from the stored layout.
template <class Format, int kTokens>
void stored_panel_dot(const Int8Rows& x, int64_t t0, const uint8_t* __restrict__ panel, float* __restrict__ out,
                      int64_t out_stride) {
  using V = PanelLanes;
  constexpr bool kMinimum = std::is_same_v<Format, Q4_1>;
  // Registers a tile's loop holds: an accumulator, a sum and a minimum a token, the weights'
  // two nibble registers, the mask, the scales and two temporaries.
  constexpr bool kMinimumsApart = kMinimum && 3 * kTokens + 6 > V::kRegisters;
  const int64_t num_blocks = x.num_blocks;
  V::Float acc[kTokens], minimums[kTokens];
  for (int t = 0; t < kTokens; ++t) acc[t] = minimums[t] = V::fzero();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* block = panel + b * kPanelBlockBytes<Format>;
    if (t0 == 0 && kStoredPrefetchAhead > 0) {  // the first tile's walk asks for the stream ahead
      for (int64_t line = 0; line < kPanelBlockBytes<Format>; line += 64) {
        __builtin_prefetch(block + kStoredPrefetchAhead + line, 0, 3);
      }
    }
    const int8_t* activations = x.q.data() + (t0 * num_blocks + b) * kBlockSize;  // token t0's block b
    const auto word = [&](int t, int k) {  // activations 4k .. 4k + 3 of token t0 + t, one per byte
      int32_t bits;
      std::memcpy(&bits, activations + t * num_blocks * kBlockSize + 4 * k, sizeof(bits));
      return V::set1(bits);
    };
    using Sums = typename V::template Sums<Format>;
    using Weights = typename Sums::Weights;  // prepared once for every token of the tile
    Sums sums[kTokens];
    for (int t = 0; t < kTokens; ++t) {  // a zero of 0 starts every sum at 0, known at compile time
      sums[t].begin(kPanelWeightZero<Format> != 0 ? x.start[(t0 + t) * num_blocks + b] : 0);
    }
    // The register words' loops below, unrolled where AVX2 runs Q8_0 and Q4_1: there GCC kept
    // them rolled, each token's sums on the stack from one turn to the next (a store and a load
    // on every sum's chain), and the unrolled loops took 0.67-0.78x the time from 4 tokens on,
    // 0.86-0.92x at 3 (Zen 3, one thread, the same outputs). Q4_0 unrolled took 1.05-1.09x its
    // rolled time, and stays rolled. VNNI builds, not measured so, are left to GCC.
    if constexpr (std::is_same_v<Format, Q8_0>) {
      const auto multiply = [&](int k) {
        const Weights w(V::loadu(block + 4 * k * kPanelRows));
        for (int t = 0; t < kTokens; ++t) sums[t].add(w, word(t, k));
      };
#ifndef PAGEDRS_INT8_VNNI
#pragma GCC unroll 8
#endif
      for (int k = 0; k < 8; ++k) multiply(k);
    } else {
      const auto multiply = [&](int k) {  // byte j of the nibbles: weight j (low), j + 16 (high)
        const V::Int nibbles = V::loadu(block + 4 * k * kPanelRows);
        const Weights low(V::low_nibbles(nibbles)), high(V::high_nibbles(nibbles));
        for (int t = 0; t < kTokens; ++t) {
          sums[t].add(low, word(t, k));
          sums[t].add(high, word(t, 4 + k));
        }
      };
      if constexpr (std::is_same_v<Format, Q4_1>) {
#ifndef PAGEDRS_INT8_VNNI
#pragma GCC unroll 4
#endif
        for (int k = 0; k < 4; ++k) multiply(k);
      } else {
        for (int k = 0; k < 4; ++k) multiply(k);
      }
    }
    const V::Float dw = V::halvesu(block + kPanelScalesAt<Format>);
    for (int t = 0; t < kTokens; ++t) {
      const int64_t at = (t0 + t) * num_blocks + b;
      acc[t] = V::fmadd(V::to_float(sums[t].total()), V::mul(dw, V::fset1(x.d[at])), acc[t]);
      if constexpr (kMinimum && !kMinimumsApart) {
        const V::Float dm = V::halvesu(block + kPanelScalesAt<Format> + 2 * kPanelRows);
        minimums[t] = V::fmadd(dm, V::fset1(x.sum[at]), minimums[t]);
      }
    }
  }
  // Where a tile's registers would not hold them too, Q4_1's minimums take a pass of their own
  // over the panel's (cached) scales, in the same block order: the same floats. (Apart at one
  // token, their chain of dependent fmadds would cost more than the spills it saves.)
  if constexpr (kMinimumsApart) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const V::Float dm = V::halvesu(panel + b * kPanelBlockBytes<Format> + kPanelScalesAt<Format> + 2 * kPanelRows);
      for (int t = 0; t < kTokens; ++t) minimums[t] = V::fmadd(dm, V::fset1(x.sum[(t0 + t) * num_blocks + b]), minimums[t]);
    }
  }
  for (int t = 0; t < kTokens; ++t) {
    V::store_rows(out + t * out_stride, kMinimum ? V::add(acc[t], minimums[t]) : acc[t], kPanelRows);
  }
}

template <class Format, int... kTiles>
void stored_panel_dot_tile(int tile, const Int8Rows& x, int64_t t0, const uint8_t* panel, float* out,
                           int64_t out_stride, std::integer_sequence<int, kTiles...>) {
  ((tile == kTiles + 1 ? stored_panel_dot<Format, kTiles + 1>(x, t0, panel, out, out_stride) : void()), ...);
}

// Stored panels [panel_begin, panel_end) times every token.
template <class Format>
void matmul_stored_panels(const Int8Rows& x, const uint8_t* weight, float* out, int64_t out_stride,
                          int64_t num_tokens, int64_t panel_begin, int64_t panel_end) {
  constexpr auto kTiles = std::make_integer_sequence<int, PanelLanes::kTokens>();
  for (int64_t p = panel_begin; p < panel_end; ++p) {
    const uint8_t* panel = weight + p * x.num_blocks * kPanelBlockBytes<Format>;
    for (int64_t t0 = 0; t0 < num_tokens; t0 += PanelLanes::kTokens) {
      const int tile = static_cast<int>(std::min<int64_t>(PanelLanes::kTokens, num_tokens - t0));
      stored_panel_dot_tile<Format>(tile, x, t0, panel, out + t0 * out_stride + p * kPanelRows, out_stride, kTiles);
    }
  }
}
#elif defined(PAGEDRS_QUANT_NEON)
// quantize_rows and dot_row_int8 are NEON's (quant_blocks.h): sdot with ARMv8.2's dot product,
// smull + sadalp without it.
#define PAGEDRS_INT8_ACTIVATIONS 1
#if defined(__ARM_FEATURE_DOTPROD)
constexpr const char* kInt8Path = "neon-dotprod";
#else
constexpr const char* kInt8Path = "neon";
#endif
#endif

#if defined(PAGEDRS_INT8_ACTIVATIONS) && !defined(PAGEDRS_INT8_VNNI)
template <class Format>
void matmul_rows_int8(const Int8Rows& rows, const uint8_t* weight, float* out, int64_t out_stride, int64_t num_tokens,
                      int64_t row_begin, int64_t row_end) {
  const int64_t row_bytes = rows.num_blocks * Format::kBytes;
  for (int64_t chunk = row_begin; chunk < row_end; chunk += kRowChunk) {
    const int64_t chunk_end = std::min(row_end, chunk + kRowChunk);
    for (int64_t t0 = 0; t0 < num_tokens; t0 += kTokenTile) {
      const int64_t tile = std::min<int64_t>(kTokenTile, num_tokens - t0);
      for (int64_t n = chunk; n < chunk_end; ++n) {
        const uint8_t* w = weight + n * row_bytes;
        if (t0 == 0) prefetch_ahead(w, row_bytes, weight + row_end * row_bytes);
        float* o = out + t0 * out_stride + n;
        switch (tile) {
          case 1: dot_row_int8<Format, 1>(rows, t0, w, o, out_stride); break;
          case 2: dot_row_int8<Format, 2>(rows, t0, w, o, out_stride); break;
          case 3: dot_row_int8<Format, 3>(rows, t0, w, o, out_stride); break;
          case 4: dot_row_int8<Format, 4>(rows, t0, w, o, out_stride); break;
          case 5: dot_row_int8<Format, 5>(rows, t0, w, o, out_stride); break;
          case 6: dot_row_int8<Format, 6>(rows, t0, w, o, out_stride); break;
          case 7: dot_row_int8<Format, 7>(rows, t0, w, o, out_stride); break;
          default: dot_row_int8<Format, 8>(rows, t0, w, o, out_stride); break;
        }
      }
    }
  }
}
#endif

#ifdef PAGEDRS_INT8_ACTIVATIONS
// Whether the int8 path takes this ggml type (the rest run the exact path).
bool int8_takes(int64_t ggml_type) { return ggml_type == kQ8_0 || ggml_type == kQ4_0 || ggml_type == kQ4_1; }

// The calling thread's buffers for num_tokens rows of in_features activations, reused across
// calls (no allocation per matmul once grown).
Int8Rows& int8_buffers(int64_t num_tokens, int64_t in_features) {
  thread_local Int8Rows buffers;
  buffers.num_blocks = in_features / kBlockSize;
  const size_t blocks = static_cast<size_t>(num_tokens * buffers.num_blocks);
  if (buffers.q.size() < blocks * kBlockSize) buffers.q.resize(blocks * kBlockSize);
  if (buffers.d.size() < blocks) buffers.d.resize(blocks), buffers.sum.resize(blocks), buffers.start.resize(blocks);
  return buffers;
}

// The weights' zero the quantized activations start their sums from (Int8Rows::start).
int32_t int8_weight_zero(int64_t ggml_type, bool stored_panels) {
#ifdef PAGEDRS_INT8_VNNI
  (void)stored_panels;
  return ggml_type == kQ8_0 ? kWeightZero<Q8_0> : ggml_type == kQ4_0 ? kWeightZero<Q4_0> : 0;
#elif defined(PAGEDRS_INT8_PANELS)
  return !stored_panels ? 0 : ggml_type == kQ4_0 ? kPanelWeightZero<Q4_0> : 0;
#else
  (void)ggml_type, (void)stored_panels;
  return 0;  // maddubs and sdot take the weights as they are
#endif
}

// How the int8 path splits a matmul's outputs between threads: in units of this many rows
// (whole panels where the weights are in panels), and at least `grain` units per thread.
struct Int8Units {
  int64_t rows;
  int64_t count;
  int64_t grain;
};

Int8Units int8_units(int64_t out_features, bool stored_panels) {
#ifdef PAGEDRS_INT8_PANELS
  if (stored_panels) return {kPanelRows, out_features / kPanelRows, 1};
#else
  (void)stored_panels;
#endif
#ifdef PAGEDRS_INT8_VNNI
  constexpr int64_t kRowsPerUnit = kPanelRows;  // threads take whole panels
#else
  constexpr int64_t kRowsPerUnit = 1;
#endif
  return {kRowsPerUnit, (out_features + kRowsPerUnit - 1) / kRowsPerUnit, std::max<int64_t>(1, 16 / kRowsPerUnit)};
}

// Units [begin, end) of the int8 matmul of rows (quantized) with weight; returns the output
// rows they cover.
std::pair<int64_t, int64_t> matmul_int8_units(const Int8Rows& rows, const uint8_t* weight, float* out,
                                              int64_t num_tokens, int64_t out_features, int64_t ggml_type,
                                              bool stored_panels, int64_t begin, int64_t end) {
#ifdef PAGEDRS_INT8_PANELS
  if (stored_panels) {
    with_legacy_format(ggml_type, [&](auto format) {
      matmul_stored_panels<decltype(format)>(rows, weight, out, out_features, num_tokens, begin, end);
    });
    return {begin * kPanelRows, end * kPanelRows};
  }
#else
  (void)stored_panels;
#endif
  const int64_t unit_rows = int8_units(out_features, false).rows;
  const int64_t row_begin = begin * unit_rows, row_end = std::min(out_features, end * unit_rows);
  with_legacy_format(ggml_type, [&](auto format) {
    matmul_rows_int8<decltype(format)>(rows, weight, out, out_features, num_tokens, row_begin, row_end);
  });
  return {row_begin, row_end};
}

// The int8-activation matmul, or false where this type has none (the caller runs the exact one).
// stored_panels: the weight is in the stored panel layout (pack_int8_panels).
bool matmul_int8(const float* x, const uint8_t* weight, float* out, int64_t num_tokens, int64_t in_features,
                 int64_t out_features, int64_t ggml_type, bool stored_panels) {
  if (!int8_takes(ggml_type)) return false;
#ifndef PAGEDRS_INT8_PANELS
  TORCH_CHECK(!stored_panels, "pagedrs_cpu: this build has no stored int8 panels");
#endif
  // The workers below read the calling thread's buffers through this reference.
  Int8Rows& rows = int8_buffers(num_tokens, in_features);
  const int32_t weight_zero = int8_weight_zero(ggml_type, stored_panels);
  at::parallel_for(0, num_tokens, 8, [&](int64_t begin, int64_t end) {
    quantize_rows(x, in_features, begin, end, weight_zero, rows);
  });
  const Int8Units units = int8_units(out_features, stored_panels);
  at::parallel_for(0, units.count, units.grain, [&](int64_t begin, int64_t end) {
    matmul_int8_units(rows, weight, out, num_tokens, out_features, ggml_type, stored_panels, begin, end);
  });
  return true;
}
#endif

}  // namespace

namespace pagedrs_cpu {

// Whether a type id's format has scales-first rows (quant_blocks.h), its flags aside.
static bool scales_first_takes(int64_t ggml_type) {
  const int64_t format = ggml_type & ~kKernelFlags;
  return format == kQ8_0 || format == kQ4_0 || format == kQ4_1;
}

// Fails for a type id with kScalesFirst this build does not read: not an AVX2 build, another
// format, or with int8 activations (whose own layout is the stored panels).
static void check_scales_first(int64_t ggml_type) {
  if (!(ggml_type & kScalesFirst)) return;
  TORCH_CHECK(scales_first_rows(), "pagedrs_cpu: this build has no scales-first rows (type ", ggml_type,
              ")");
  TORCH_CHECK(scales_first_takes(ggml_type) && !(ggml_type & (kInt8Activations | kInt8Panels)),
              "pagedrs_cpu: scales-first rows hold Q8_0, Q4_0 or Q4_1 blocks for exact activations, got type ",
              ggml_type);
}

std::string int8_activation_path() {
#ifdef PAGEDRS_INT8_ACTIVATIONS
  return kInt8Path;
#else
  return "none";
#endif
}

int64_t int8_panel_prefetch_bytes() {
#ifdef PAGEDRS_INT8_PANELS
  return kStoredPrefetchAhead;
#else
  return -1;
#endif
}

int64_t int8_panel_rows() {
#ifdef PAGEDRS_INT8_PANELS
  return kPanelRows;
#else
  return 0;
#endif
}

// The weight's bytes in the stored int8 panel layout (see pack_panels), a new tensor of the same
// shape, for type ids with kInt8Panels.
//   weight: uint8 [out_features, in_features / 32 * block_bytes] of ggml_type (Q8_0, Q4_0, Q4_1),
//           out_features a multiple of int8_panel_rows()
at::Tensor pack_int8_panels(const at::Tensor& weight, int64_t ggml_type, int64_t in_features) {
  const int64_t format = ggml_type & ~kKernelFlags;
  TORCH_CHECK(int8_panel_rows() > 0, "pagedrs_cpu: this build (int8 path ", int8_activation_path(),
              ") has no stored int8 panels");
  TORCH_CHECK(format == kQ8_0 || format == kQ4_0 || format == kQ4_1,
              "pagedrs_cpu: stored int8 panels hold Q8_0 (8), Q4_0 (2) or Q4_1 (3) blocks, got type ", ggml_type);
  const int64_t bytes = quant_block_bytes(format);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.dim() == 2 && in_features > 0 && in_features % kBlockSize == 0 &&
                  weight.size(1) == in_features / kBlockSize * bytes,
              "pagedrs_cpu: weight must be contiguous uint8 [out_features, ", in_features / kBlockSize * bytes,
              "] for type ", ggml_type, " and ", in_features, " input features, got ", weight.sizes());
  TORCH_CHECK(weight.size(0) % int8_panel_rows() == 0, "pagedrs_cpu: stored int8 panels take whole panels of ",
              int8_panel_rows(), " rows, got ", weight.size(0));
  at::Tensor packed = at::empty_like(weight);
#ifdef PAGEDRS_INT8_PANELS
  with_legacy_format(format, [&](auto block) {
    pack_panels<decltype(block)>(weight.data_ptr<uint8_t>(), packed.data_ptr<uint8_t>(), weight.size(0),
                                 in_features / kBlockSize);
  });
#endif
  return packed;
}

bool scales_first_rows() {
#ifdef PAGEDRS_QUANT_AVX2
  return true;
#else
  return false;
#endif
}

// The weight's rows in the scales-first order (quant_blocks.h), a new tensor of the same shape,
// for type ids with kScalesFirst.
//   weight: uint8 [out_features, in_features / 32 * block_bytes] of ggml_type (Q8_0, Q4_0, Q4_1)
at::Tensor pack_scales_first(const at::Tensor& weight, int64_t ggml_type, int64_t in_features) {
  TORCH_CHECK(scales_first_rows(), "pagedrs_cpu: this build has no scales-first rows (AVX2 builds only)");
  TORCH_CHECK(scales_first_takes(ggml_type) && !(ggml_type & kKernelFlags),
              "pagedrs_cpu: scales-first rows hold Q8_0 (8), Q4_0 (2) or Q4_1 (3) blocks, got type ", ggml_type);
  const int64_t bytes = quant_block_bytes(ggml_type);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.dim() == 2 && in_features > 0 && in_features % kBlockSize == 0 &&
                  weight.size(1) == in_features / kBlockSize * bytes,
              "pagedrs_cpu: weight must be contiguous uint8 [out_features, ", in_features / kBlockSize * bytes,
              "] for type ", ggml_type, " and ", in_features, " input features, got ", weight.sizes());
  at::Tensor packed = at::empty_like(weight);
#ifdef PAGEDRS_QUANT_AVX2
  const int64_t num_blocks = in_features / kBlockSize, row_bytes = weight.size(1);
  const uint8_t* from = weight.data_ptr<uint8_t>();
  uint8_t* to = packed.data_ptr<uint8_t>();
  with_legacy_format(ggml_type, [&](auto format) {
    at::parallel_for(0, weight.size(0), 256, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        row_to_scales_first<decltype(format)>(from + n * row_bytes, num_blocks, to + n * row_bytes);
      }
    });
  });
#endif
  return packed;
}

// A block's bytes of a packed type the kernel takes (its flags aside), else 0.
static int64_t packed_block_bytes(int64_t ggml_type) {
  switch (ggml_type & ~kKernelFlags) {
    case kQ8_0: return Q8_0::kBytes;
    case kQ4_0: return Q4_0::kBytes;
    case kQ4_1: return Q4_1::kBytes;
    case kQ4_K: return Q4_K::kBytes;
    case kQ6_K: return Q6_K::kBytes;
    default: return 0;
  }
}

int64_t quant_block_bytes(int64_t ggml_type) {
  const int64_t bytes = packed_block_bytes(ggml_type);
  TORCH_CHECK(bytes > 0,
              "pagedrs_cpu: quant_matmul supports ggml types Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_K (12) and Q6_K (14), got ",
              ggml_type);
  return bytes;
}

int64_t quant_block_weights(int64_t ggml_type) {
  quant_block_bytes(ggml_type);  // fails on an unsupported type
  const int64_t format = ggml_type & ~kKernelFlags;
  return format == kQ4_K || format == kQ6_K ? 256 : kBlockSize;
}

void quant_matmul_rows_f32(const float* x, int64_t x_stride, const uint8_t* weight, float* out, int64_t out_stride,
                           int64_t num_tokens, int64_t in_features, int64_t row_begin, int64_t row_end,
                           int64_t ggml_type) {
  TORCH_CHECK(!(ggml_type & kInt8Panels), "pagedrs_cpu: stored int8 panels are read by quant_matmul only");
  if (num_tokens == 0 || row_begin >= row_end) return;
  const auto args = [&](auto run) { run(x, x_stride, weight, out, out_stride, num_tokens, in_features, row_begin, row_end); };
  if (ggml_type & kScalesFirst) {
#ifdef PAGEDRS_QUANT_AVX2
    with_legacy_format(ggml_type & ~kKernelFlags, [&](auto format) { args(matmul_rows_sf<decltype(format)>); });
    return;
#else
    TORCH_CHECK(false, "pagedrs_cpu: this build has no scales-first rows");
#endif
  }
  switch (ggml_type & ~kKernelFlags) {  // always exact (the experts' kernel calls it)
    case kQ8_0: args(matmul_rows<Q8_0>); break;
    case kQ4_0: args(matmul_rows<Q4_0>); break;
    case kQ4_1: args(matmul_rows<Q4_1>); break;
    case kQ4_K: args(matmul_rows<Q4_K>); break;
    case kQ6_K: args(matmul_rows<Q6_K>); break;
    default: quant_block_bytes(ggml_type);  // fails with the list of supported types
  }
}

void quant_matmul_f32(const float* x, const uint8_t* weight, float* out, int64_t num_tokens, int64_t in_features,
                      int64_t out_features, int64_t ggml_type) {
  quant_block_bytes(ggml_type);  // fails on an unsupported type, before any thread starts
  const bool stored_panels = ggml_type & kInt8Panels;
  TORCH_CHECK(!stored_panels || ((ggml_type & kInt8Activations) && int8_panel_rows() > 0 &&
                                 out_features % int8_panel_rows() == 0),
              "pagedrs_cpu: stored int8 panels (type ", ggml_type, ") need int8 activations, a VNNI build and ",
              "whole panels of ", int8_panel_rows(), " rows; got ", out_features, " rows");
  const bool scales_first = ggml_type & kScalesFirst;
  check_scales_first(ggml_type);
#ifdef PAGEDRS_INT8_ACTIVATIONS
  if ((ggml_type & kInt8Activations) &&
      matmul_int8(x, weight, out, num_tokens, in_features, out_features, ggml_type & ~kKernelFlags, stored_panels)) {
    return;
  }
#endif
  TORCH_CHECK(!stored_panels, "pagedrs_cpu: stored int8 panels hold Q8_0, Q4_0 or Q4_1 blocks only");
  if (num_tokens >= kGemmTokens) {
    switch (ggml_type & ~kKernelFlags) {
      case kQ8_0: return matmul_dequant_gemm<Q8_0>(x, weight, scales_first, out, num_tokens, in_features, out_features);
      case kQ4_0: return matmul_dequant_gemm<Q4_0>(x, weight, scales_first, out, num_tokens, in_features, out_features);
      case kQ4_1: return matmul_dequant_gemm<Q4_1>(x, weight, scales_first, out, num_tokens, in_features, out_features);
      case kQ4_K: return matmul_dequant_gemm<Q4_K>(x, weight, scales_first, out, num_tokens, in_features, out_features);
      default: return matmul_dequant_gemm<Q6_K>(x, weight, scales_first, out, num_tokens, in_features, out_features);
    }
  }
  // A range of at least 16 rows per thread: smaller ones cost more in scheduling than they save.
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
    quant_matmul_rows_f32(x, in_features, weight, out, out_features, num_tokens, in_features, begin, end, ggml_type);
  });
}

std::pair<int64_t, int64_t> quant_matmul_part_f32(const float* x, const uint8_t* weight, float* out,
                                                  int64_t num_tokens, int64_t in_features, int64_t out_features,
                                                  int64_t ggml_type, int part, int parts) {
  const auto share = [&](int64_t count) {
    return std::pair<int64_t, int64_t>{count * part / parts, count * (part + 1) / parts};
  };
#ifdef PAGEDRS_INT8_ACTIVATIONS
  const int64_t format = ggml_type & ~kKernelFlags;
  if ((ggml_type & kInt8Activations) && int8_takes(format)) {
    const bool stored_panels = ggml_type & kInt8Panels;
    Int8Rows& rows = int8_buffers(num_tokens, in_features);  // each thread quantizes x for itself
    quantize_rows(x, in_features, 0, num_tokens, int8_weight_zero(format, stored_panels), rows);
    const auto [begin, end] = share(int8_units(out_features, stored_panels).count);
    return matmul_int8_units(rows, weight, out, num_tokens, out_features, format, stored_panels, begin, end);
  }
#endif
  const auto [begin, end] = share(out_features);
  quant_matmul_rows_f32(x, in_features, weight, out, out_features, num_tokens, in_features, begin, end, ggml_type);
  return {begin, end};
}

bool quant_matmul_splits(int64_t num_tokens, int64_t out_features, int64_t ggml_type) {
  if (ggml_type == 0 || num_tokens >= kGemmTokens || packed_block_bytes(ggml_type) == 0) return false;
  if (ggml_type & kScalesFirst) return scales_first_rows() && scales_first_takes(ggml_type);
  if (!(ggml_type & kInt8Panels)) return true;
#ifdef PAGEDRS_INT8_ACTIVATIONS
  return (ggml_type & kInt8Activations) && int8_takes(ggml_type & ~kKernelFlags) &&
         out_features % int8_panel_rows() == 0;
#else
  (void)out_features;
  return false;
#endif
}

// y = x @ dequant(weight)^T (see the header for layouts).
//   x:      float32, bfloat16 or float16 [num_tokens, in_features]
//   weight: uint8 [out_features, in_features / block_weights * block_bytes] (of ggml_type)
//   in_features is given, not inferred, so a weight of the wrong type or width fails loudly.
at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& weight, int64_t ggml_type, int64_t in_features) {
  const int64_t bytes = pagedrs_cpu::quant_block_bytes(ggml_type);
  const int64_t block_weights = pagedrs_cpu::quant_block_weights(ggml_type);
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "pagedrs_cpu: quant_matmul needs CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "pagedrs_cpu: x must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(weight.scalar_type() == at::kByte, "pagedrs_cpu: weight must be uint8 (packed blocks), got ",
              weight.scalar_type());
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "pagedrs_cpu: x and weight must be contiguous");
  TORCH_CHECK(in_features > 0 && in_features % block_weights == 0, "pagedrs_cpu: in_features (", in_features,
              ") must be a positive multiple of ", block_weights, " for ggml type ", ggml_type);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features, "pagedrs_cpu: x must be [num_tokens, ", in_features,
              "], got ", x.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == in_features / block_weights * bytes,
              "pagedrs_cpu: weight must be [out_features, ", in_features / block_weights * bytes, "] for type ",
              ggml_type, " and ", in_features, " input features, got ", weight.sizes());
  const int64_t num_tokens = x.size(0), out_features = weight.size(0);
  const at::Tensor x_float = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  at::Tensor out = at::empty({num_tokens, out_features}, x.options().dtype(at::kFloat));
  if (num_tokens == 0 || out_features == 0) return out.to(x.scalar_type());
  pagedrs_cpu::quant_matmul_f32(x_float.data_ptr<float>(), weight.data_ptr<uint8_t>(), out.data_ptr<float>(),
                                num_tokens, in_features, out_features, ggml_type);
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// out[i] = the float32 weights of packed row token_ids[i] (an embedding lookup), the values the
// matmul multiplies by. In Python the same takes ~10 small ops a step.
//   weight:    uint8 [num_rows, in_features / block_weights * block_bytes] (of ggml_type)
//   token_ids: int64 [num_tokens], each in [0, num_rows)
//   returns    float32 [num_tokens, in_features]
at::Tensor embedding_rows(const at::Tensor& weight, const at::Tensor& token_ids, int64_t ggml_type,
                          int64_t in_features) {
  const int64_t bytes = pagedrs_cpu::quant_block_bytes(ggml_type);
  const int64_t block_weights = pagedrs_cpu::quant_block_weights(ggml_type);
  const int64_t format = ggml_type & ~kKernelFlags;
  const bool stored_panels = ggml_type & kInt8Panels;
  const bool scales_first = ggml_type & kScalesFirst;
  check_scales_first(ggml_type);
  TORCH_CHECK(!stored_panels || (int8_panel_rows() > 0 && (format == kQ8_0 || format == kQ4_0 || format == kQ4_1) &&
                                 weight.size(0) % int8_panel_rows() == 0),
              "pagedrs_cpu: stored int8 panels (type ", ggml_type, ") hold whole panels of ", int8_panel_rows(),
              " rows of Q8_0, Q4_0 or Q4_1 blocks");
  TORCH_CHECK(weight.device().is_cpu() && token_ids.device().is_cpu(), "pagedrs_cpu: embedding_rows needs CPU tensors");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.is_contiguous() && weight.dim() == 2,
              "pagedrs_cpu: weight must be contiguous uint8 [num_rows, row_bytes] (packed blocks)");
  TORCH_CHECK(in_features > 0 && in_features % block_weights == 0 &&
                  weight.size(1) == in_features / block_weights * bytes,
              "pagedrs_cpu: weight must be [num_rows, ", in_features / block_weights * bytes, "] for type ", ggml_type,
              " and ", in_features, " features, got ", weight.sizes());
  TORCH_CHECK(token_ids.scalar_type() == at::kLong && token_ids.is_contiguous() && token_ids.dim() == 1,
              "pagedrs_cpu: token_ids must be contiguous int64 [num_tokens]");
  const int64_t num_tokens = token_ids.size(0), num_rows = weight.size(0);
  const int64_t* ids = token_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_tokens; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < num_rows, "pagedrs_cpu: token id ", ids[i], " is not a row of the ", num_rows,
                "-row table");
  }
  at::Tensor out = at::empty({num_tokens, in_features}, weight.options().dtype(at::kFloat));
  const uint8_t* table = weight.data_ptr<uint8_t>();
  float* rows = out.data_ptr<float>();
  const int64_t row_bytes = weight.size(1);
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> unpacked(stored_panels || scales_first ? row_bytes : 0);  // a row, as GGUF's
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* row = table + ids[i] * row_bytes;
      float* dst = rows + i * in_features;
#ifdef PAGEDRS_INT8_PANELS
      if (stored_panels) {
        with_legacy_format(format, [&](auto block) {
          unpack_panel_row<decltype(block)>(table, ids[i], in_features / kBlockSize, unpacked.data());
        });
        row = unpacked.data();
      }
#endif
#ifdef PAGEDRS_QUANT_AVX2
      if (scales_first) {
        with_legacy_format(format, [&](auto block) {
          scales_first_to_row<decltype(block)>(row, in_features / kBlockSize, unpacked.data());
        });
        row = unpacked.data();
      }
#endif
      switch (format) {  // the weights' values, whatever the activations
        case kQ8_0: dequant_rows<Q8_0>(row, in_features, 0, 1, dst); break;
        case kQ4_0: dequant_rows<Q4_0>(row, in_features, 0, 1, dst); break;
        case kQ4_1: dequant_rows<Q4_1>(row, in_features, 0, 1, dst); break;
        case kQ4_K: dequant_rows<Q4_K>(row, in_features, 0, 1, dst); break;
        default: dequant_rows<Q6_K>(row, in_features, 0, 1, dst); break;
      }
    }
  });
  return out;
}

}  // namespace pagedrs_cpu
