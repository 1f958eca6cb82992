// Sampling and logprobs on the CPU: one call per step over all rows, each row read a few
// times in place (no [num_rows, vocab_size] temporary), rows spread over torch's threads.
// Built and loaded by python/pagedrs/kernels/cpu.py with the other cpu/ kernels; registered as
// torch.ops.pagedrs_cpu.* by torch_bindings.cpp; typed wrappers in python/pagedrs/sample/cpu_ops.py.
//
// Dimensions:
//   num_rows        logits rows of the step (one per sampled sequence)
//   vocab_size      logits per row
//   num_uniforms    pre-drawn uniforms per row: one per draw, the first draw included
//   num_top         top logprobs per row (0..kMaxTop)
//
// Layouts (all contiguous, on the CPU):
//   logits          [num_rows, vocab_size] float32
//   token_ids       [num_rows] int64
//   temperature, min_p, top_p   [num_rows] float32
//   uniforms        [num_rows, num_uniforms] float32, each in [0, 1)
//
// Both ops walk a row in the same shape: pass 1 reads it from memory (the only pass that does),
// later passes find it in the core's L2 (a 49K vocabulary's row is 192 KB, and sampling's
// scratch row as much), and the last pass over a row also prefetches the thread's next row, so
// the next pass 1 overlaps this row's arithmetic instead of waiting on memory (a quarter off
// the time at 256 rows of 49K). What remains is arithmetic, mostly one exp per logit,
// vectorized (exp_nonpositive_or_zero): 0.24 ns per logit on one core of a Zen 4, where a max
// pass takes 0.04 and torch's argmax 0.8. argmax_rows (the greedy rows) reads each row once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Lanes of the partial sums and maxima: one AVX-512 register, two AVX2 or four NEON ones.
constexpr int kLanes = 16;
// Tokens per chunk of logprob_stats' chunk maxima (which chunks can hold a top token).
constexpr int kChunk = 64;
// Tokens per block of sample_from_rows' cumulative walk: a draw walks the block sums, then
// one block's weights.
constexpr int kBlock = 256;
// Most top logprobs a row may ask for (OpenAI's limit, as SamplingParams checks).
constexpr int64_t kMaxTop = 20;

// exp(x) for x <= 0, in a form GCC vectorizes (std::exp stays a scalar call without
// -ffast-math): x = n ln2 + r with |r| <= ln2 / 2; exp(r) = 1 + r + r^2 q(r) with q a degree-4
// minimax fit; 2^n by the exponent bits. At most 1.01 ulp from exp (checked on every float in
// [ln(FLT_MIN), 0]), about 20 vector instructions per 16 logits with AVX-512. n is
// rounded by adding 1.5 * 2^23 (whose float ulp is 1), which also leaves n in the low bits of
// the sum: no round or convert instruction, and every step is defined for any input.
// NOTE: unlike paged_attention.cpp's exp_nonpositive, a result below FLT_MIN (x < -87.3) is
// exactly 0, and so is NaN's: a banned token (-inf) must have weight 0, not 1e-38, or a draw
// of u = 0 could land on it.
inline float exp_nonpositive_or_zero(float x) {
  constexpr float kMinArg = -87.33654475f;  // ln(FLT_MIN)
  constexpr float kRoundShift = 12582912.f;  // 1.5 * 2^23
  // Written as x86's maxps computes it (NaN gives kMinArg): one instruction.
  const float clamped = x > kMinArg ? x : kMinArg;
  const float shifted = clamped * 1.44269504088896341f + kRoundShift;
  const float n = shifted - kRoundShift;
  const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;  // ln2 in two parts
  float q = 1.3814578e-3f;
  q = q * r + 8.3687007e-3f;
  q = q * r + 4.1668389e-2f;
  q = q * r + 1.6666521e-1f;
  q = q * r + 4.9999994e-1f;
  const float exp_r = q * (r * r) + r + 1.f;
  // The low 9 bits of `shifted` are n (mod 512): these are the bits of 2^n for n in [-126, 0].
  const float two_to_n = __builtin_bit_cast(float, (__builtin_bit_cast(uint32_t, shifted) + 127u) << 23);
  return x >= kMinArg ? exp_r * two_to_n : 0.f;
}

inline float reduce_max(const float* lanes) {
  float m = lanes[0];
  for (int j = 1; j < kLanes; ++j) m = std::max(m, lanes[j]);
  return m;
}

inline float reduce_sum(const float* lanes) {
  float s = 0.f;
  for (int j = 0; j < kLanes; ++j) s += lanes[j];
  return s;
}

// The maximum of x[0..n) (NaN ignored; -inf when n == 0 or all are NaN).
inline float max_of(const float* __restrict__ x, int64_t n) {
  float lanes[kLanes];
  std::fill(lanes, lanes + kLanes, kNegInf);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) lanes[j] = std::max(lanes[j], x[i + j]);
  for (int j = 0; i < n; ++i, ++j) lanes[j] = std::max(lanes[j], x[i]);
  return reduce_max(lanes);
}

// Writes the maximum of each kChunk tokens of x[0..n) (the last chunk may be shorter; NaN
// ignored) to chunk_max; returns the largest.
inline float chunk_maxima(const float* __restrict__ x, int64_t n, float* __restrict__ chunk_max) {
  static_assert(kChunk % kLanes == 0);
  float row_max = kNegInf;
  int64_t begin = 0, c = 0;
  for (; begin + kChunk <= n; begin += kChunk, ++c) {
    float lanes[kLanes];
    std::fill(lanes, lanes + kLanes, kNegInf);  // not x[begin..]: a NaN there would stick
    for (int k = 0; k < kChunk; k += kLanes) {
#pragma omp simd
      for (int j = 0; j < kLanes; ++j) lanes[j] = std::max(lanes[j], x[begin + k + j]);
    }
    chunk_max[c] = reduce_max(lanes);
    row_max = std::max(row_max, chunk_max[c]);
  }
  if (begin < n) {
    chunk_max[c] = max_of(x + begin, n - begin);
    row_max = std::max(row_max, chunk_max[c]);
  }
  return row_max;
}

// Asks for `row`'s cache lines [begin, end) (in floats) to be brought into L2: spread over a
// later pass's loop, a row's prefetches keep pace with its arithmetic.
inline void prefetch_floats(const float* row, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += 64 / sizeof(float)) __builtin_prefetch(row + i, 0, 2);
}

// ---------------------------------------------------------------------------------------------
// logprob_stats

// A row's num_top largest logits, largest first, ties by lower token id: fed tokens in
// increasing id order, a token goes in only if strictly larger than the last kept one.
struct TopTokens {
  float values[kMaxTop];
  int64_t ids[kMaxTop];
  int count = 0;
  int capacity;

  explicit TopTokens(int num_top) : capacity(num_top) {}

  void offer(float x, int64_t id) {
    if (x != x || (count == capacity && !(x > values[count - 1]))) return;
    int p = count < capacity ? count++ : capacity - 1;
    for (; p > 0 && values[p - 1] < x; --p) {
      values[p] = values[p - 1];
      ids[p] = ids[p - 1];
    }
    values[p] = x;
    ids[p] = id;
  }
};

struct LogprobArgs {
  const float* logits;
  const int64_t* token_ids;
  float* logprobs;
  int64_t* ranks;
  int64_t* top_ids;
  float* top_logprobs;
  int64_t vocab_size;
  int num_top;
};

// One row. Pass 1 (memory): the maximum, and with num_top > 0 each chunk's. Pass 2 (L2): the
// sum of exp(x - max) and the count of logits above the sampled one. Then the top tokens, from
// the few chunks whose maximum reaches the num_top-th largest chunk maximum: num_top distinct
// chunks hold a token at least that large, so no token of a chunk below it is among the top.
void logprob_row(const LogprobArgs& args, int64_t row, const float* next_row, float* chunk_max) {
  const int64_t vocab = args.vocab_size;
  const float* __restrict__ x = args.logits + row * vocab;
  const float sampled = x[args.token_ids[row]];
  const int64_t num_chunks = (vocab + kChunk - 1) / kChunk;

  const float max_logit = args.num_top > 0 ? chunk_maxima(x, vocab, chunk_max) : max_of(x, vocab);

  float normalizer = max_logit;  // logsumexp; +-inf stays as it is, as in torch
  float sum_lanes[kLanes] = {};
  int above_lanes[kLanes] = {};
  const bool finite = std::isfinite(max_logit);
  const float shift = finite ? max_logit : 0.f;  // the sum is not used otherwise
  auto visit = [&](int64_t i, int j) {
    sum_lanes[j] += exp_nonpositive_or_zero(x[i] - shift);
    above_lanes[j] += x[i] > sampled;
  };
  int64_t i = 0;
  for (; i + kLanes <= vocab; i += kLanes) {
    if (next_row != nullptr) prefetch_floats(next_row, i, i + kLanes);
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) visit(i + j, j);
  }
  if (next_row != nullptr) prefetch_floats(next_row, i, vocab);
  for (int j = 0; i < vocab; ++i, ++j) visit(i, j);
  if (finite) normalizer = max_logit + std::log(reduce_sum(sum_lanes));
  int64_t num_above = 0;
  for (int j = 0; j < kLanes; ++j) num_above += above_lanes[j];
  args.logprobs[row] = sampled - normalizer;
  args.ranks[row] = num_above + 1;

  if (args.num_top == 0) return;
  // The num_top-th largest chunk maximum (-inf when there are fewer chunks).
  TopTokens top_chunks(args.num_top);
  for (int64_t c = 0; c < num_chunks; ++c) top_chunks.offer(chunk_max[c], c);
  const float threshold = top_chunks.count == args.num_top ? top_chunks.values[args.num_top - 1] : kNegInf;
  TopTokens top(args.num_top);
  for (int64_t c = 0; c < num_chunks; ++c) {
    if (chunk_max[c] < threshold) continue;
    const int64_t end = std::min(vocab, (c + 1) * kChunk);
    for (int64_t i = c * kChunk; i < end; ++i) top.offer(x[i], i);
  }
  int64_t* top_ids = args.top_ids + row * args.num_top;
  float* top_logprobs = args.top_logprobs + row * args.num_top;
  for (int k = 0; k < top.count; ++k) {
    top_ids[k] = top.ids[k];
    top_logprobs[k] = top.values[k] - normalizer;
  }
  // A row with fewer logits that are not NaN than num_top: its NaN tokens come last, by id.
  for (int64_t i = 0, k = top.count; i < vocab && k < args.num_top; ++i) {
    if (x[i] != x[i]) {
      top_ids[k] = i;
      top_logprobs[k++] = x[i];
    }
  }
}

void check_cpu_contiguous(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), "pagedrs_cpu: ", name, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, "pagedrs_cpu: ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "pagedrs_cpu: ", name, " must be contiguous");
}

void check_shape(const at::Tensor& t, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK(t.sizes() == shape, "pagedrs_cpu: ", name, " must have shape ", shape, ", got ", t.sizes());
}

void check_logits(const at::Tensor& logits) {
  check_cpu_contiguous(logits, "logits", at::kFloat);
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "pagedrs_cpu: logits must be [num_rows, vocab_size] with "
              "vocab_size >= 1, got ", logits.sizes());
}

}  // namespace

namespace pagedrs_cpu {

// logprobs[r] = logits[r, token_ids[r]] - logsumexp(logits[r]); ranks[r] = 1 + the number of
// logits of row r strictly larger than the sampled one; top_ids[r] / top_logprobs[r]: the row's
// num_top largest logits as log-probabilities, largest first, equal logits by lower id (a
// deterministic order, where torch.topk promises none). A NaN logit counts as -inf in the
// normalizer and ranks below all others in the top (torch makes the whole row NaN).
void logprob_stats(const at::Tensor& logits, const at::Tensor& token_ids, int64_t num_top, at::Tensor& logprobs,
                   at::Tensor& ranks, at::Tensor& top_ids, at::Tensor& top_logprobs) {
  check_logits(logits);
  const int64_t num_rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(num_top >= 0 && num_top <= std::min(kMaxTop, vocab), "pagedrs_cpu: num_top must be in [0, ",
              std::min(kMaxTop, vocab), "] (at most ", kMaxTop, " and the vocabulary size), got ", num_top);
  check_cpu_contiguous(token_ids, "token_ids", at::kLong);
  check_shape(token_ids, "token_ids", {num_rows});
  check_cpu_contiguous(logprobs, "logprobs", at::kFloat);
  check_shape(logprobs, "logprobs", {num_rows});
  check_cpu_contiguous(ranks, "ranks", at::kLong);
  check_shape(ranks, "ranks", {num_rows});
  check_cpu_contiguous(top_ids, "top_ids", at::kLong);
  check_shape(top_ids, "top_ids", {num_rows, num_top});
  check_cpu_contiguous(top_logprobs, "top_logprobs", at::kFloat);
  check_shape(top_logprobs, "top_logprobs", {num_rows, num_top});
  const int64_t* ids = token_ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < num_rows; ++r)
    TORCH_CHECK(ids[r] >= 0 && ids[r] < vocab, "pagedrs_cpu: token_ids[", r, "] = ", ids[r],
                " is outside the vocabulary of ", vocab);
  if (num_rows == 0) return;

  const LogprobArgs args{logits.data_ptr<float>(), ids, logprobs.data_ptr<float>(), ranks.data_ptr<int64_t>(),
                         top_ids.data_ptr<int64_t>(), top_logprobs.data_ptr<float>(), vocab,
                         static_cast<int>(num_top)};
  const int64_t num_chunks = (vocab + kChunk - 1) / kChunk;
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> chunk_max(num_chunks);
    for (int64_t row = begin; row < end; ++row) {
      const float* next_row = row + 1 < end ? args.logits + (row + 1) * vocab : nullptr;
      logprob_row(args, row, next_row, chunk_max.data());
    }
  });
}

}  // namespace pagedrs_cpu

namespace {

// ---------------------------------------------------------------------------------------------
// sample_from_rows

struct SampleArgs {
  const float* logits;
  const float* temperature;
  const float* min_p;
  const float* top_p;
  const float* uniforms;
  int64_t* token_ids;
  int64_t vocab_size;
  int64_t num_uniforms;
};

// Pass 2 of a row: weight[i] = exp((x[i] - max_logit) / temperature) (the probability relative
// to the most likely token) into the thread's scratch row; per block, the sum of the candidates
// (weights >= min_p); returns the sum of all weights.
template <bool kUnitTemperature, bool kMinP>
float write_weights(const float* __restrict__ x, int64_t vocab, float max_logit, float temperature, float min_p,
                    const float* next_row, float* __restrict__ weight, float* __restrict__ block_sum) {
  float all_lanes[kLanes] = {};
  for (int64_t begin = 0, b = 0; begin < vocab; begin += kBlock, ++b) {
    const int64_t end = std::min(vocab, begin + kBlock);
    if (next_row != nullptr) prefetch_floats(next_row, begin, end);
    float candidate_lanes[kLanes] = {};
    int64_t i = begin;
    auto weigh = [&](int64_t k, int j) {
      const float shifted = x[k] - max_logit;
      const float w = exp_nonpositive_or_zero(kUnitTemperature ? shifted : shifted / temperature);
      weight[k] = w;
      all_lanes[j] += w;
      candidate_lanes[j] += kMinP ? (w >= min_p ? w : 0.f) : w;
    };
    for (; i + kLanes <= end; i += kLanes)
#pragma omp simd
      for (int j = 0; j < kLanes; ++j) weigh(i + j, j);
    for (int j = 0; i < end; ++i, ++j) weigh(i, j);
    block_sum[b] = reduce_sum(candidate_lanes);
  }
  return reduce_sum(all_lanes);
}

// The sum of the weights strictly larger than `drawn` (the mass of the tokens more likely than
// the drawn one).
inline float mass_above(const float* __restrict__ weight, int64_t vocab, float drawn) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= vocab; i += kLanes)
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) lanes[j] += weight[i + j] > drawn ? weight[i + j] : 0.f;
  for (int j = 0; i < vocab; ++i, ++j) lanes[j] += weight[i] > drawn ? weight[i] : 0.f;
  return reduce_sum(lanes);
}

// The first token whose cumulative candidate weight (weights >= min_p) exceeds target: the
// block sums find its block, then that block's weights the token. A token of zero weight adds
// nothing, so the walk never stops on one.
std::optional<int64_t> first_token_past(float target, const float* weight, const float* block_sum, int64_t vocab,
                                        float min_p) {
  const int64_t num_blocks = (vocab + kBlock - 1) / kBlock;
  float cumulative = 0.f;
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (cumulative + block_sum[b] <= target) {
      cumulative += block_sum[b];
      continue;
    }
    for (int64_t i = b * kBlock, end = std::min(vocab, i + kBlock); i < end; ++i) {
      cumulative += weight[i] >= min_p ? weight[i] : 0.f;
      if (cumulative > target) return i;
    }
    return std::nullopt;  // the block's sequential sum fell short of its vectorized one
  }
  return std::nullopt;  // u * total rounded up to the total
}

// One row: pass 1 (memory) the maximum; pass 2 (L2) the weights and the block sums of the
// candidates; per draw, a walk over the block sums and one block (no pass), and with top-p one
// pass over the weights for the mass above the drawn token.
void sample_row(const SampleArgs& args, int64_t row, const float* next_row, float* weight, float* block_sum) {
  const int64_t vocab = args.vocab_size;
  const float* __restrict__ x = args.logits + row * vocab;
  const float max_logit = max_of(x, vocab);
  TORCH_CHECK(std::isfinite(max_logit), "pagedrs_cpu: sample_from_rows: row ", row,
              " has no finite largest logit (all -inf or NaN, or +inf): there is nothing to sample");
  const float temperature = args.temperature[row], min_p = args.min_p[row], top_p = args.top_p[row];
  const bool unit = temperature == 1.f, filter = min_p > 0.f;
  // [unit temperature][min-p filter]: each variant's inner loop carries only its own work.
  constexpr decltype(&write_weights<true, true>) kWriteWeights[2][2] = {
      {write_weights<false, false>, write_weights<false, true>},
      {write_weights<true, false>, write_weights<true, true>}};
  const float total_weight =
      kWriteWeights[unit][filter](x, vocab, max_logit, temperature, min_p, next_row, weight, block_sum);
  const int64_t num_blocks = (vocab + kBlock - 1) / kBlock;
  // The walk adds the block sums in this same order, so it reaches this total exactly.
  float total_candidates = 0.f;
  for (int64_t b = 0; b < num_blocks; ++b) total_candidates += block_sum[b];

  const float* uniforms = args.uniforms + row * args.num_uniforms;
  for (int64_t draw = 0; draw < args.num_uniforms; ++draw) {
    std::optional<int64_t> token =
        first_token_past(uniforms[draw] * total_candidates, weight, block_sum, vocab, filter ? min_p : 0.f);
    // NOTE: float rounding can run a walk past its end; such a draw takes the most likely token,
    // always a candidate (its weight, 1, is >= min_p).
    if (!token) token = std::find(x, x + vocab, max_logit) - x;
    if (top_p >= 1.f || mass_above(weight, vocab, weight[*token]) < top_p * total_weight) {
      args.token_ids[row] = *token;
      return;
    }
  }
  args.token_ids[row] = -1;  // every draw fell outside the nucleus: the caller decides
}

void check_row_params(const at::Tensor& t, const char* name, int64_t num_rows) {
  check_cpu_contiguous(t, name, at::kFloat);
  check_shape(t, name, {num_rows});
}

}  // namespace

namespace pagedrs_cpu {

// token_ids[r]: a draw from row r's distribution exp((x - max) / temperature), restricted to
// the candidates whose relative probability is >= min_p[r], by inverse CDF with u =
// uniforms[r, 0]: the first token in vocabulary order whose cumulative candidate weight exceeds
// u times the candidates' total. With top_p[r] < 1 the draw is kept iff the tokens strictly
// more likely than it (over all tokens, before min-p) hold less than top_p of the mass, else it
// is drawn again with uniforms[r, 1], ... (rejection sampling: exact). -1 when all
// num_uniforms draws were rejected.
void sample_from_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& min_p,
                      const at::Tensor& top_p, const at::Tensor& uniforms, at::Tensor& token_ids) {
  check_logits(logits);
  const int64_t num_rows = logits.size(0), vocab = logits.size(1);
  check_row_params(temperature, "temperature", num_rows);
  check_row_params(min_p, "min_p", num_rows);
  check_row_params(top_p, "top_p", num_rows);
  check_cpu_contiguous(uniforms, "uniforms", at::kFloat);
  TORCH_CHECK(uniforms.dim() == 2 && uniforms.size(0) == num_rows && uniforms.size(1) >= 1,
              "pagedrs_cpu: uniforms must be [", num_rows, ", num_uniforms] with num_uniforms >= 1, got ",
              uniforms.sizes());
  check_cpu_contiguous(token_ids, "token_ids", at::kLong);
  check_shape(token_ids, "token_ids", {num_rows});
  const float* temperatures = temperature.data_ptr<float>();
  const float* min_ps = min_p.data_ptr<float>();
  const float* top_ps = top_p.data_ptr<float>();
  for (int64_t r = 0; r < num_rows; ++r) {
    TORCH_CHECK(temperatures[r] > 0.f && std::isfinite(temperatures[r]), "pagedrs_cpu: temperature[", r, "] = ",
                temperatures[r], " must be positive and finite (greedy rows take the argmax instead)");
    TORCH_CHECK(min_ps[r] >= 0.f && min_ps[r] <= 1.f, "pagedrs_cpu: min_p[", r, "] = ", min_ps[r],
                " must be in [0, 1]");
    TORCH_CHECK(top_ps[r] > 0.f && top_ps[r] <= 1.f, "pagedrs_cpu: top_p[", r, "] = ", top_ps[r],
                " must be in (0, 1]");
  }
  if (num_rows == 0) return;

  const SampleArgs args{logits.data_ptr<float>(), temperatures, min_ps, top_ps, uniforms.data_ptr<float>(),
                        token_ids.data_ptr<int64_t>(), vocab, uniforms.size(1)};
  const int64_t num_blocks = (vocab + kBlock - 1) / kBlock;
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    // Uninitialized: pass 2 writes every weight before it is read.
    std::unique_ptr<float[]> weight(new float[vocab]);
    std::vector<float> block_sum(num_blocks);
    for (int64_t row = begin; row < end; ++row) {
      const float* next_row = row + 1 < end ? args.logits + (row + 1) * vocab : nullptr;
      sample_row(args, row, next_row, weight.get(), block_sum.data());
    }
  });
}

// token_ids[r] = the first index of row r's largest logit, or of its first NaN where it has one
// (torch.argmax's answer), in one pass: kLanes running maxima with the index where each was first
// seen (a compare and two blends a vector), then the largest of them at the lowest index.
void argmax_rows(const at::Tensor& logits, at::Tensor& token_ids) {
  check_logits(logits);
  check_cpu_contiguous(token_ids, "token_ids", at::kLong);
  const int64_t num_rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(token_ids.dim() == 1 && token_ids.size(0) == num_rows, "pagedrs_cpu: token_ids must be [", num_rows,
              "], got ", token_ids.sizes());
  TORCH_CHECK(vocab < (int64_t{1} << 31), "pagedrs_cpu: argmax_rows takes fewer than 2^31 columns");
  constexpr int kLanes = 16;
  const float* in = logits.data_ptr<float>();
  int64_t* out = token_ids.data_ptr<int64_t>();
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = in + r * vocab;
      float best[kLanes];
      int32_t at[kLanes], nan[kLanes];
      for (int l = 0; l < kLanes; ++l) best[l] = -std::numeric_limits<float>::infinity(), at[l] = l, nan[l] = 0;
      const int64_t whole = vocab / kLanes * kLanes;
      for (int64_t j = 0; j < whole; j += kLanes) {
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) {
          const float value = row[j + l];
          const bool larger = value > best[l];
          best[l] = larger ? value : best[l];
          at[l] = larger ? static_cast<int32_t>(j + l) : at[l];
          nan[l] |= value != value;
        }
      }
      int64_t index = whole < vocab ? whole : at[0];  // start from the tail's first, or lane 0
      float top = whole < vocab ? row[whole] : best[0];
      bool any_nan = whole < vocab && row[whole] != row[whole];
      for (int64_t j = whole + 1; j < vocab; ++j) {
        if (row[j] > top) top = row[j], index = j;
        any_nan |= row[j] != row[j];
      }
      for (int l = 0; l < kLanes && whole > 0; ++l) {
        any_nan |= nan[l] != 0;
        if (best[l] > top || (best[l] == top && at[l] < index)) top = best[l], index = at[l];
      }
      if (any_nan) {  // torch's argmax: the first NaN
        index = 0;
        while (row[index] == row[index]) ++index;
      }
      out[r] = index;
    }
  });
}

// Structured outputs: logits[rows[i], t] = -inf for every token t whose bit is clear in
// bitmask[i] (bit j of word w: token 32 w + j, as the core's GrammarMatchers writes it).
// Words with every bit set (most of them, inside a JSON string) are skipped whole.
//   logits:  float32 [num_rows, vocab_size]   (written)
//   rows:    int64   [num_masked]             rows of logits, each in [0, num_rows)
//   bitmask: int32   [num_masked, num_words]  num_words * 32 >= vocab_size
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& bitmask) {
  check_logits(logits);
  check_cpu_contiguous(rows, "rows", at::kLong);
  check_cpu_contiguous(bitmask, "bitmask", at::kInt);
  const int64_t num_rows = logits.size(0), vocab = logits.size(1), num_masked = rows.size(0);
  TORCH_CHECK(rows.dim() == 1 && bitmask.dim() == 2 && bitmask.size(0) == num_masked &&
                  bitmask.size(1) * 32 >= vocab,
              "pagedrs_cpu: bitmask must be [num_masked, >= vocab_size / 32], got ", bitmask.sizes(), " for ",
              num_masked, " rows of ", vocab, " logits");
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_masked; ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < num_rows, "pagedrs_cpu: rows[", i, "] = ", row_ids[i],
                " is not a row of logits");
  }
  const int64_t num_words = bitmask.size(1);
  const uint32_t* words = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  float* out = logits.data_ptr<float>();
  at::parallel_for(0, num_masked, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = out + row_ids[i] * vocab;
      const uint32_t* row_words = words + i * num_words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        uint32_t blocked = ~row_words[w];
        while (blocked != 0) {
          const int64_t token = w * 32 + __builtin_ctz(blocked);
          if (token >= vocab) break;
          row[token] = -std::numeric_limits<float>::infinity();
          blocked &= blocked - 1;
        }
      }
    }
  });
}

}  // namespace pagedrs_cpu
