// quant_blocks.h without torch, on whichever vector path the compiler targets (NEON, AVX2,
// AVX-512 or none): for each format, matmul_rows on random blocks against a double-precision sum
// over the scalar dequant (within 1e-5 of sum |x * w|: float32 sums in another order; on AVX2
// also matmul_rows_sf on the same rows in the scales-first order), the vector
// dequant against the scalar one bit for bit, fp16_to_float against the bit-level conversion
// for all 65536 halves, kv_rows.h's row conversions (a float16 or fp8 KV cache's) against e4m3's
// definition for every byte, and on aarch64 the int8-activation kernels (quantization and
// integer dot products, with sdot or without) against scalar references. make neon-check runs it
// for aarch64 under qemu-user and natively.
// Exits 1 at the first mismatch.
// HasAvx2Dequant takes the address of a function of __m256 values: GCC (with AVX2) warns that
// their alignment attribute is dropped there, which is harmless.
#pragma GCC diagnostic ignored "-Wignored-attributes"
#include "../kv_rows.h"
#include "../quant_blocks.h"

#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <random>
#include <vector>

namespace {

#if defined(PAGEDRS_QUANT_AVX512)
constexpr const char* kPath = "avx512";
#elif defined(PAGEDRS_QUANT_AVX2)
constexpr const char* kPath = "avx2";
#elif defined(PAGEDRS_QUANT_NEON)
constexpr const char* kPath = "neon";
#else
constexpr const char* kPath = "scalar";
#endif

[[noreturn]] void fail(const char* format, ...) {
  std::fprintf(stderr, "quant_blocks_check (%s): FAILED: ", kPath);
  va_list args;
  va_start(args, format);
  std::vfprintf(stderr, format, args);
  va_end(args);
  std::fputc('\n', stderr);
  std::exit(1);
}

uint32_t bits_of(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// A finite normal half with its exponent field in [min_exponent, max_exponent] (1..30: all of them).
uint16_t random_half(std::mt19937& rng, int min_exponent, int max_exponent) {
  const uint32_t exponent = std::uniform_int_distribution<uint32_t>(min_exponent, max_exponent)(rng);
  return static_cast<uint16_t>(((rng() & 1) << 15) | (exponent << 10) | (rng() & 0x3FF));
}

// Random bytes, but finite normal halves where the format keeps its fp16 fields (any other bytes
// make a valid block, the k-quants' packed scales included).
template <class Format>
std::vector<uint8_t> random_blocks(std::mt19937& rng, int64_t num_blocks, std::initializer_list<int> halves,
                                   int min_exponent, int max_exponent) {
  std::vector<uint8_t> bytes(num_blocks * Format::kBytes);
  for (uint8_t& byte : bytes) byte = static_cast<uint8_t>(rng());
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int at : halves) {
      const uint16_t half = random_half(rng, min_exponent, max_exponent);
      std::memcpy(bytes.data() + b * Format::kBytes + at, &half, sizeof(half));
    }
  }
  return bytes;
}

// Weights sub * 32 .. sub * 32 + 31 of a block by the compiled vector path; false where there is none.
template <class Format>
bool vector_dequant(const uint8_t* block, int sub, float* w) {
#if defined(PAGEDRS_QUANT_AVX512)
  __m512 lo, hi;
  Format::dequant(block, sub, lo, hi);
  _mm512_storeu_ps(w, lo);
  _mm512_storeu_ps(w + 16, hi);
  return true;
#elif defined(PAGEDRS_QUANT_AVX2)
  __m256 v[4];
  Format::dequant_avx2(block, sub, v);
  for (int i = 0; i < 4; ++i) _mm256_storeu_ps(w + 8 * i, v[i]);
  return true;
#elif defined(PAGEDRS_QUANT_NEON)
  float32x4_t v[8];
  Format::dequant_neon(block, sub, v);
  for (int i = 0; i < 8; ++i) vst1q_f32(w + 4 * i, v[i]);
  return true;
#else
  (void)block, (void)sub, (void)w;
  return false;
#endif
}

struct Counts {
  int matmuls = 0;
  int64_t outputs = 0;
  int64_t dequants = 0;
};

template <class Format>
void check_dequant(const char* name, std::initializer_list<int> halves, std::mt19937& rng, Counts& counts) {
  constexpr int kBlocks = 2000;
  const std::vector<uint8_t> blocks = random_blocks<Format>(rng, kBlocks, halves, 1, 30);
  for (int b = 0; b < kBlocks; ++b) {
    for (int sub = 0; sub < Format::kWeights / kBlockSize; ++sub) {
      const uint8_t* block = blocks.data() + b * Format::kBytes;
      float scalar[kBlockSize], vector[kBlockSize];
      Format::dequant(block, sub, scalar);
      if (!vector_dequant<Format>(block, sub, vector)) return;
      for (int j = 0; j < kBlockSize; ++j) {
        if (bits_of(scalar[j]) != bits_of(vector[j])) {
          fail("%s block %d sub-block %d weight %d: vector dequant %.9g (0x%08x), scalar %.9g (0x%08x)", name, b, sub,
               j, vector[j], bits_of(vector[j]), scalar[j], bits_of(scalar[j]));
        }
      }
      ++counts.dequants;
    }
  }
}

template <class Format>
void check_matmul(const char* name, std::initializer_list<int> halves, std::mt19937& rng, Counts& counts) {
  // Scales within a factor of 2^6 of each other: no block's sum is lost in another's rounding,
  // so a wrong weight or activation anywhere shows.
  constexpr int kMinExponent = 12, kMaxExponent = 18;
  const int64_t widths[] = {1, 7};  // blocks per row (Q4_K/Q6_K: superblocks of 256)
  const int64_t row_counts[] = {1, 7, 70};  // 70: two chunks of kRowChunk rows
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  for (int64_t width : widths) {
    const int64_t num_blocks = Format::kWeights == kBlockSize ? width : std::min<int64_t>(width, 2);
    const int64_t in_features = num_blocks * Format::kWeights;
    const int64_t x_stride = in_features + 4;  // padded rows: the kernel must honour the stride
    for (int64_t num_rows : row_counts) {
      const std::vector<uint8_t> weight =
          random_blocks<Format>(rng, num_rows * num_blocks, halves, kMinExponent, kMaxExponent);
      std::vector<float> w(num_rows * in_features);
      for (int64_t i = 0; i < num_rows * num_blocks; ++i) {
        for (int sub = 0; sub < Format::kWeights / kBlockSize; ++sub) {
          Format::dequant(weight.data() + i * Format::kBytes, sub, w.data() + i * Format::kWeights + sub * kBlockSize);
        }
      }
      for (int num_tokens = 1; num_tokens <= 9; ++num_tokens) {
        std::vector<float> x(num_tokens * x_stride);
        for (float& value : x) value = uniform(rng);
        const int64_t out_stride = num_rows + 3;
        const int64_t split = num_rows / 3;  // two ranges of rows, as two threads would take them
        const auto verify = [&](const std::vector<float>& out, const char* layout) {
          ++counts.matmuls;
          for (int t = 0; t < num_tokens; ++t) {
            for (int64_t n = 0; n < out_stride; ++n) {
              const float got = out[t * out_stride + n];
              if (n >= num_rows) {
                if (!std::isnan(got)) fail("%s%s wrote past its rows: token %d, column %lld", name, layout, t, (long long)n);
                continue;
              }
              double sum = 0, magnitude = 0;
              for (int64_t k = 0; k < in_features; ++k) {
                const double product = static_cast<double>(x[t * x_stride + k]) * w[n * in_features + k];
                sum += product;
                magnitude += std::fabs(product);
              }
              if (!(std::fabs(got - sum) <= 1e-5 * magnitude)) {
                fail("%s%s, %lld input features, %lld rows, %d tokens: out[%d, %lld] = %.9g, reference %.9g (sum "
                     "|x*w| %.6g)",
                     name, layout, (long long)in_features, (long long)num_rows, num_tokens, t, (long long)n, got, sum,
                     magnitude);
              }
              ++counts.outputs;
            }
          }
        };
        std::vector<float> out(num_tokens * out_stride, std::numeric_limits<float>::quiet_NaN());
        matmul_rows<Format>(x.data(), x_stride, weight.data(), out.data(), out_stride, num_tokens, in_features, 0,
                            split);
        matmul_rows<Format>(x.data(), x_stride, weight.data(), out.data(), out_stride, num_tokens, in_features, split,
                            num_rows);
        verify(out, "");
#ifdef PAGEDRS_QUANT_AVX2
        if constexpr (kScalesFirstFormat<Format>) {  // the same rows in the scales-first order
          const int64_t row_bytes = num_blocks * Format::kBytes;
          std::vector<uint8_t> stored(weight.size());
          for (int64_t n = 0; n < num_rows; ++n) {
            row_to_scales_first<Format>(weight.data() + n * row_bytes, num_blocks, stored.data() + n * row_bytes);
          }
          std::vector<float> sf_out(num_tokens * out_stride, std::numeric_limits<float>::quiet_NaN());
          matmul_rows_sf<Format>(x.data(), x_stride, stored.data(), sf_out.data(), out_stride, num_tokens, in_features,
                                 0, split);
          matmul_rows_sf<Format>(x.data(), x_stride, stored.data(), sf_out.data(), out_stride, num_tokens, in_features,
                                 split, num_rows);
          verify(sf_out, " (scales-first rows)");
        }
#endif
      }
    }
  }
}

void check_fp16() {
  // The bit-level conversion at known points, then the compiled fp16_to_float (F16C, __fp16 or
  // the bit-level one itself) against it for every half.
  const struct {
    uint16_t half;
    float value;
  } known[] = {{0x0000, 0.f},       {0x8000, -0.f},       {0x3C00, 1.f},         {0xC000, -2.f},
               {0x7BFF, 65504.f},   {0x0400, 0x1p-14f},   {0x0001, 0x1p-24f},    {0x83FF, -0x3FFp-24f},
               {0x3555, 0x1.554p-2f}, {0x7C00, INFINITY}, {0xFC00, -INFINITY}};
  for (const auto& [half, value] : known) {
    if (bits_of(fp16_bits_to_float(half)) != bits_of(value)) {
      fail("fp16_bits_to_float(0x%04x) = %.9g, expected %.9g", half, fp16_bits_to_float(half), value);
    }
  }
  if (bits_of(fp16_bits_to_float(0x7C01)) != 0x7FC02000u || bits_of(fp16_bits_to_float(0xFE00)) != 0xFFC00000u) {
    fail("fp16_bits_to_float: NaNs 0x7c01, 0xfe00 -> 0x%08x, 0x%08x, expected 0x7fc02000, 0xffc00000",
         bits_of(fp16_bits_to_float(0x7C01)), bits_of(fp16_bits_to_float(0xFE00)));
  }
  for (uint32_t half = 0; half < 0x10000; ++half) {
    const uint16_t bits = static_cast<uint16_t>(half);
    uint8_t bytes[2];
    std::memcpy(bytes, &bits, sizeof(bits));
    const float converted = fp16_to_float(bytes), expected = fp16_bits_to_float(bits);
    if (bits_of(converted) != bits_of(expected)) {
      fail("fp16_to_float(0x%04x) = 0x%08x, bit-level conversion 0x%08x", half, bits_of(converted), bits_of(expected));
    }
  }
}

#ifdef PAGEDRS_QUANT_NEON
// The NEON int8-activation path (quant_blocks.h): quantize_rows against a scalar quantization
// (round to nearest even of x / d, d = max|x| / 127; bytes, scales and sums equal), then
// dot_row_int8 at 1-9 tokens against a float64 sum over the scalar dequant of the weights times
// the quantized activations (within 1e-5 of the sum of magnitudes). Returns the outputs checked.
template <class Format>
int64_t check_int8(const char* name, std::initializer_list<int> halves, std::mt19937& rng) {
  int64_t checked = 0;
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  for (int64_t num_blocks : {1, 7}) {
    const int64_t in_features = num_blocks * kBlockSize, num_rows = 5;
    const std::vector<uint8_t> weight = random_blocks<Format>(rng, num_rows * num_blocks, halves, 12, 18);
    std::vector<float> w(num_rows * in_features);
    for (int64_t i = 0; i < num_rows * num_blocks; ++i) {
      Format::dequant(weight.data() + i * Format::kBytes, 0, w.data() + i * kBlockSize);
    }
    for (int num_tokens = 1; num_tokens <= 9; ++num_tokens) {
      std::vector<float> x(num_tokens * in_features);
      for (float& value : x) value = uniform(rng) * (rng() % 4 == 0 ? 100.f : 1.f);
      std::fill(x.begin(), x.begin() + kBlockSize, 0.f);  // an all-zero block: d = 0
      Int8Rows rows;
      rows.num_blocks = num_blocks;
      rows.q.resize(num_tokens * in_features);
      rows.d.resize(num_tokens * num_blocks), rows.sum.resize(num_tokens * num_blocks);
      rows.start.resize(num_tokens * num_blocks);
      quantize_rows(x.data(), in_features, 0, num_tokens, 0, rows);
      for (int64_t block = 0; block < num_tokens * num_blocks; ++block) {
        const float* xb = x.data() + block * kBlockSize;
        float amax = 0.f;
        for (int j = 0; j < kBlockSize; ++j) amax = std::max(amax, std::fabs(xb[j]));
        const float d = amax / 127.f, inverse = d != 0.f ? 1.f / d : 0.f;
        int total = 0;
        for (int j = 0; j < kBlockSize; ++j) {
          const int q = static_cast<int>(std::nearbyint(xb[j] * inverse));
          total += q;
          if (rows.q[block * kBlockSize + j] != q) {
            fail("%s int8: block %lld feature %d quantized to %d, scalar %d", name, (long long)block, j,
                 rows.q[block * kBlockSize + j], q);
          }
        }
        const float sum = d * static_cast<float>(total);
        if (bits_of(rows.d[block]) != bits_of(d) || bits_of(rows.sum[block]) != bits_of(sum)) {
          fail("%s int8: block %lld scale %g / sum %g, scalar %g / %g", name, (long long)block, rows.d[block],
               rows.sum[block], d, sum);
        }
      }
      const int64_t out_stride = num_tokens;
      std::vector<float> out(num_rows * out_stride);
      for (int64_t n = 0; n < num_rows; ++n) {
        const uint8_t* row = weight.data() + n * num_blocks * Format::kBytes;
        for (int t0 = 0; t0 < num_tokens; t0 += 8) {
          float* o = out.data() + n * out_stride + t0;
          switch (std::min(8, num_tokens - t0)) {
            case 1: dot_row_int8<Format, 1>(rows, t0, row, o, 1); break;
            case 2: dot_row_int8<Format, 2>(rows, t0, row, o, 1); break;
            case 3: dot_row_int8<Format, 3>(rows, t0, row, o, 1); break;
            case 4: dot_row_int8<Format, 4>(rows, t0, row, o, 1); break;
            case 5: dot_row_int8<Format, 5>(rows, t0, row, o, 1); break;
            case 6: dot_row_int8<Format, 6>(rows, t0, row, o, 1); break;
            case 7: dot_row_int8<Format, 7>(rows, t0, row, o, 1); break;
            default: dot_row_int8<Format, 8>(rows, t0, row, o, 1); break;
          }
        }
        for (int t = 0; t < num_tokens; ++t) {
          double sum = 0, magnitude = 0;
          for (int64_t k = 0; k < in_features; ++k) {
            const int64_t block = t * num_blocks + k / kBlockSize;
            const double product = static_cast<double>(w[n * in_features + k]) * rows.d[block] *
                                   rows.q[t * in_features + k];
            sum += product;
            magnitude += std::fabs(product);
          }
          const float got = out[n * out_stride + t];
          if (!(std::fabs(got - sum) <= 1e-5 * magnitude + 1e-30)) {
            fail("%s int8, %lld features, %d tokens: out[%d, %lld] = %.9g, reference %.9g (sum |terms| %.6g)", name,
                 (long long)in_features, num_tokens, t, (long long)n, got, sum, magnitude);
          }
          ++checked;
        }
      }
    }
  }
  return checked;
}
#endif

// kv_rows.h's float16 rows: every half, in rows of several lengths at each offset (each vector
// loop and its tail), times a factor, against the bit-level conversion (NaNs quieted alike).
void check_fp16_rows() {
  std::vector<uint16_t> halves(0x10000 + 70);
  for (size_t i = 0; i < halves.size(); ++i) halves[i] = static_cast<uint16_t>(i * 40503u);  // odd: all of them
  std::vector<float> out(70);
  for (int n : {1, 7, 8, 9, 15, 16, 17, 33, 70}) {  // each vector loop, and their tails
    for (int start = 0; start < 0x10000; start += n) {
      const float factor = n % 2 ? 1.f : 0.75f;
      pagedrs_cpu::fp16_row_to_float(halves.data() + start, out.data(), n, factor);
      for (int i = 0; i < n; ++i) {
        const float expected = fp16_bits_to_float(halves[start + i]) * factor;
        if (bits_of(out[i]) != bits_of(expected)) {
          fail("fp16_row_to_float: half 0x%04x (row of %d) = 0x%08x, bit-level 0x%08x", halves[start + i], n,
               bits_of(out[i]), bits_of(expected));
        }
      }
    }
  }
}

// Every e4m3 byte by its definition (sign, 4 exponent bits with bias 7, 3 mantissa bits;
// exponent 0: subnormal), through rows of 1-70 bytes at each offset (the vector loops and
// their scalar tails), times a factor; NaN bytes (0x7F, 0xFF) read as NaN.
void check_fp8() {
  std::vector<uint8_t> bytes(256 + 70);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 37 + 11);
  std::vector<float> out(70);
  for (int n = 1; n <= 70; ++n) {
    for (int start = 0; start < 256; start += n) {
      const float factor = n % 2 ? 1.f : 0.75f;
      pagedrs_cpu::fp8_e4m3_row_to_float(bytes.data() + start, out.data(), n, factor);
      for (int i = 0; i < n; ++i) {
        const uint8_t byte = bytes[start + i];
        const int exponent = (byte >> 3) & 0xF, mantissa = byte & 0x7;
        if ((byte & 0x7F) == 0x7F) {
          if (!std::isnan(out[i])) fail("fp8_e4m3_row_to_float: NaN byte 0x%02x read as %g", byte, out[i]);
          continue;
        }
        const double magnitude = exponent == 0 ? std::ldexp(mantissa, -9) : std::ldexp(8 + mantissa, exponent - 10);
        const float expected = static_cast<float>((byte & 0x80 ? -magnitude : magnitude) * factor);
        if (bits_of(out[i]) != bits_of(expected)) {
          fail("fp8_e4m3_row_to_float: byte 0x%02x (row of %d) = %g, e4m3 says %g", byte, n, out[i], expected);
        }
      }
    }
  }
}

template <class Format>
void check(const char* name, std::initializer_list<int> halves, std::mt19937& rng, Counts& counts) {
  check_dequant<Format>(name, halves, rng, counts);
  check_matmul<Format>(name, halves, rng, counts);
}

}  // namespace

int main() {
  std::mt19937 rng(20251203);
  Counts counts;
  check_fp16();
  check_fp16_rows();
  check_fp8();
  check<Q8_0>("Q8_0", {0}, rng, counts);
  check<Q4_0>("Q4_0", {0}, rng, counts);
  check<Q4_1>("Q4_1", {0, 2}, rng, counts);
  check<Q4_K>("Q4_K", {0, 2}, rng, counts);
  check<Q6_K>("Q6_K", {208}, rng, counts);
  int64_t int8_outputs = 0;
#ifdef PAGEDRS_QUANT_NEON
  int8_outputs += check_int8<Q8_0>("Q8_0", {0}, rng);
  int8_outputs += check_int8<Q4_0>("Q4_0", {0}, rng);
  int8_outputs += check_int8<Q4_1>("Q4_1", {0, 2}, rng);
#endif
  std::printf(
      "quant_blocks_check (%s): ok: Q8_0 Q4_0 Q4_1 Q4_K Q6_K, %d matmuls (1-9 tokens, 1/7/70 rows, %lld outputs) "
      "within 1e-5 of sum |x*w|, %lld vector dequants bit-exact%s, fp16 conversion of all 65536 halves, "
      "float16 rows of all 65536 halves, fp8 (e4m3) rows of all 256 bytes, %lld int8-activation outputs (%s)\n",
      kPath, counts.matmuls, (long long)counts.outputs, (long long)counts.dequants,
      counts.dequants ? "" : " (no vector path compiled)", (long long)int8_outputs,
#if defined(PAGEDRS_QUANT_NEON) && defined(__ARM_FEATURE_DOTPROD)
      "sdot"
#elif defined(PAGEDRS_QUANT_NEON)
      "smull + sadalp"
#else
      "x86's are in quant_matmul.cpp"
#endif
  );
  return 0;
}
