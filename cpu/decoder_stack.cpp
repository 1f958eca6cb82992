// The decoder stack of every registered family (Llama, Mistral, Qwen2/3, Phi-3, Gemma 1/2/3, Granite,
// OLMo 2, and the mixtures of experts: Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss) run on the CPU in one
// call per step. The Python layers (python/pagedrs/models/decoder.py)
// issue ~140 small aten ops per layer (norms, rotary, splits, views, the KV write, residual adds);
// at one token per step each costs more to dispatch than to compute, and in a single-stream
// decode of a small model they took as long as the matmuls. Here each layer is a few loops over
// float32 rows around the same matmuls (the packed GGUF kernel of quant_matmul.cpp, or torch's
// for dense weights) and the same paged attention (paged_attention.cpp, torch's SDPA for long
// prefill chunks, as python/pagedrs/attention/cpu_backend.py splits them). Results equal the
// Python layers' up to the order of float additions (and fused multiply-adds);
// tests/models/test_decoder_stack.py holds the two side by side. Built with the other cpu/
// kernels by python/pagedrs/kernels/cpu.py; its interface (cpu_kernels.h) registered as
// torch.classes.pagedrs_cpu.DecoderStack by torch_bindings.cpp, driven by
// python/pagedrs/models/cpu_stack.py.
//
// Dimensions:
//   num_tokens          rows of the step (decodes and prefill chunks, flattened)
//   hidden_size         H, the residual stream's width
//   num_heads           query heads; num_kv_heads divides it
//   num_kv_heads        key/value heads
//   head_size           D, elements of one head
//   intermediate_size   I, the MLP's width
//   q_size, kv_size     num_heads * D, num_kv_heads * D; qkv_size = q_size + 2 * kv_size
//
// Weights (per layer, held by reference from the model's parameters, never copied):
//   norms                [H] float32 each, every one optional: before attention, on attention's
//                        output, before the MLP, on the MLP's output (Llama has the first and the
//                        third; Gemma 2/3 all four; OLMo 2 the second and the fourth). Each
//                        multiplies by its weight as given (Gemma's 1 + w is passed as such).
//   q_norm, k_norm       per head [D] (Qwen3, Gemma 3) or over all heads [q_size] / [kv_size]
//                        (OLMo 2), or absent
//   qkv                  [qkv_size, H]: q rows, then k rows, then v rows
//   o                    [H, q_size]
//   gate_up              [2 * I, H]: gate rows, then up rows
//   down                 [H, I]
//   each linear is float32 (ggml type 0, `F32`) or packed blocks of a type quant_matmul.cpp
//   multiplies (uint8 [out, in / block_weights * block_bytes]); each bias, if any, is [out] float32.
//   or, in place of gate_up and down, a mixture of experts (set_experts): the router [E, H] (and
//   gpt-oss's bias [E]), the experts as moe.cpp takes them (stacked, float32 or packed, optional
//   biases), and Qwen2-MoE's shared expert (two linears and the [H] gate of its sigmoid)
//   sinks                [num_heads] float32, gpt-oss's attention sinks, or absent
// and how it computes: the MLP's activation (SiLU, GELU-tanh, GELU; gpt-oss's clamped SwiGLU for
// experts), the residual multiplier (Granite), the attention scale, window and softcap, which
// rotary factors and which attention view it reads.
//
// Per step (see DecoderStack::forward):
//   hidden              [num_tokens, H] float32: the embeddings in, the last layer's output
//                       out (written in place)
//   cos, sin            one [num_tokens, rotary_dim] float32 pair per rotary embedding: the
//                       factors of each row's position; the first rotary_dim of each head rotate
//   key/value caches    one pair per layer, [num_blocks, block_size, num_kv_heads, D] float32,
//                       bfloat16, float16 or float8_e4m3fn (--kv-cache-dtype: rows rounded as
//                       they are stored, read back as float32)
//   attention views     one per (KV layer group, window) the layers use, each the layout of a
//                       CpuAttentionMetadata: the cache slot of each row's key and value
//                       ([num_tokens] int64), the block tables of the rows the kernel attends
//                       (all of them, or the listed ones: those rows are the same in every
//                       view), and the blocks and masks of the long prefill chunks SDPA attends.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_kernels.h"

namespace {

constexpr int64_t kF32 = 0;            // ggml's type id of float32: a dense weight (cpu_stack.py's F32)
constexpr int64_t kGrain = 16;          // rows per thread task in the row-wise loops
constexpr int64_t kMaxHeadSize = 512;   // the rotary step's scratch (cpu_stack.py's MAX_HEAD_DIM)
constexpr int64_t kOneRegionTokens = 8;  // steps of up to this many rows run in one parallel region (SharedTeam)

// One linear: y = x W^T + b.
struct Linear {
  at::Tensor weight;               // float32 [out_features, in_features], or the packed blocks
  int64_t ggml_type;               // kF32, or the packed blocks' ggml type
  std::optional<at::Tensor> bias;  // float32 [out_features]
  int64_t in_features;
  int64_t out_features;

  // out [num_tokens, out_features] = x [num_tokens, in_features] W^T (+ b), the same ops as the
  // Python layers: addmm / mm for dense weights, the packed kernel then a bias add.
  void apply(const at::Tensor& x, at::Tensor& out) const {
    if (ggml_type == kF32) {
      if (bias) {
        at::addmm_out(out, *bias, x, weight.t());
      } else {
        at::mm_out(out, x, weight.t());
      }
      return;
    }
    pagedrs_cpu::quant_matmul_f32(x.data_ptr<float>(), weight.data_ptr<uint8_t>(), out.data_ptr<float>(), x.size(0),
                                  in_features, out_features, ggml_type);
    if (bias) out.add_(*bias);
  }
};

// One row of n float32 values into a cache (float32, bfloat16, float16 or float8_e4m3fn,
// checked by the caller) at element offset `at`.
void store_row(const float* row, const at::Tensor& cache, int64_t at, int64_t n) {
  switch (cache.scalar_type()) {
    case at::kFloat: std::copy(row, row + n, cache.data_ptr<float>() + at); break;
    case at::kBFloat16: {
      c10::BFloat16* dst = cache.data_ptr<c10::BFloat16>() + at;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<c10::BFloat16>(row[i]);
      break;
    }
    case at::kFloat8_e4m3fn: {
      c10::Float8_e4m3fn* dst = cache.data_ptr<c10::Float8_e4m3fn>() + at;
      for (int64_t i = 0; i < n; ++i) dst[i] = pagedrs_cpu::to_fp8(row[i]);
      break;
    }
    default: {
      c10::Half* dst = cache.data_ptr<c10::Half>() + at;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<c10::Half>(row[i]);
      break;
    }
  }
}

void check_float_vector(const at::Tensor& t, int64_t size, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), "pagedrs_cpu: ", name,
              " must be a contiguous float32 CPU tensor");
  TORCH_CHECK(t.dim() == 1 && t.size(0) == size, "pagedrs_cpu: ", name, " must be [", size, "], got ", t.sizes());
}

Linear make_linear(const char* name, const at::Tensor& weight, int64_t ggml_type, const std::optional<at::Tensor>& bias,
                   int64_t in_features, int64_t out_features) {
  TORCH_CHECK(weight.device().is_cpu() && weight.is_contiguous(), "pagedrs_cpu: ", name,
              " must be a contiguous CPU tensor");
  if (ggml_type == kF32) {
    TORCH_CHECK(weight.scalar_type() == at::kFloat, "pagedrs_cpu: ", name, " (type F32) must be float32, got ",
                weight.scalar_type());
    TORCH_CHECK(weight.dim() == 2 && weight.size(0) == out_features && weight.size(1) == in_features, "pagedrs_cpu: ",
                name, " must be [", out_features, ", ", in_features, "], got ", weight.sizes());
  } else {
    const int64_t bytes = pagedrs_cpu::quant_block_bytes(ggml_type);
    const int64_t block_weights = pagedrs_cpu::quant_block_weights(ggml_type);
    TORCH_CHECK(weight.scalar_type() == at::kByte, "pagedrs_cpu: ", name, " (packed) must be uint8, got ",
                weight.scalar_type());
    TORCH_CHECK(in_features % block_weights == 0 && weight.dim() == 2 && weight.size(0) == out_features &&
                    weight.size(1) == in_features / block_weights * bytes,
                "pagedrs_cpu: ", name, " must be [", out_features, ", ", in_features / block_weights * bytes,
                "] for ggml type ", ggml_type, ", got ", weight.sizes());
  }
  if (bias) check_float_vector(*bias, out_features, name);
  return Linear{weight, ggml_type, bias, in_features, out_features};
}

using pagedrs_cpu::kGelu;
using pagedrs_cpu::kGeluTanh;
using pagedrs_cpu::kSilu;

// A mixture-of-experts MLP (moe.cpp): the router, each token's top-k experts, and an optional
// shared expert scaled by a sigmoid gate (Qwen2-MoE).
struct Experts {
  at::Tensor router;                     // float32 [E, H]
  std::optional<at::Tensor> router_bias; // float32 [E] (gpt-oss)
  int64_t top_k;
  bool renormalize;         // the top-k probabilities divided by their sum
  bool softmax_after_topk;  // the softmax over the top-k logits only (gpt-oss)
  pagedrs_cpu::ExpertWeights weights;    // moe.cpp's layouts
  std::optional<Linear> shared_gate_up;  // [2 * I_s, H], the shared expert's
  std::optional<Linear> shared_down;     // [H, I_s]
  std::optional<at::Tensor> shared_gate; // float32 [H]: the shared expert's output times sigmoid(x . gate)
  at::Tensor expert_tokens;              // int64 [E] (written): (token, slot) pairs routed to each expert
};

// Each row's top_k experts by router probability (softmax of its logits [num_tokens, E], in
// float32) into ids and weights [num_tokens, top_k], highest first (the first index on ties,
// as torch.topk on these values), divided by their sum when renormalize; with
// softmax_after_topk (gpt-oss), the top_k logits are chosen first and their softmax is the weights.
void route(const at::Tensor& logits, int64_t top_k, bool renormalize, bool softmax_after_topk, int64_t* ids,
           float* weights) {
  const int64_t num_experts = logits.size(1);
  const float* rows = logits.data_ptr<float>();
  at::parallel_for(0, logits.size(0), kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(num_experts);
    for (int64_t t = begin; t < end; ++t) {
      const float* row = rows + t * num_experts;
      const float top = *std::max_element(row, row + num_experts);
      if (softmax_after_topk) {
        std::copy(row, row + num_experts, probs.begin());
      } else {
        float sum = 0.f;
        for (int64_t e = 0; e < num_experts; ++e) sum += probs[e] = std::exp(row[e] - top);
        for (int64_t e = 0; e < num_experts; ++e) probs[e] /= sum;
      }
      float chosen = 0.f;
      for (int64_t k = 0; k < top_k; ++k) {
        const int64_t best = std::max_element(probs.begin(), probs.end()) - probs.begin();
        ids[t * top_k + k] = best;
        weights[t * top_k + k] = softmax_after_topk ? std::exp(probs[best] - top) : probs[best];
        chosen += weights[t * top_k + k];
        probs[best] = -std::numeric_limits<float>::infinity();  // never chosen again
      }
      if (renormalize || softmax_after_topk) {
        for (int64_t k = 0; k < top_k; ++k) weights[t * top_k + k] /= chosen;
      }
    }
  });
}

// One decoder layer's weights (shapes in the header) and how it computes.
struct Layer {
  std::optional<at::Tensor> input_norm;     // RMSNorm before attention
  std::optional<at::Tensor> attn_out_norm;  // on attention's output, before the residual add
  std::optional<at::Tensor> pre_mlp_norm;   // RMSNorm before the MLP
  std::optional<at::Tensor> mlp_out_norm;   // on the MLP's output, before the residual add
  std::optional<at::Tensor> q_norm;         // norms of q and k before rotary, per head or whole
  std::optional<at::Tensor> k_norm;
  bool whole_qk_norms;  // q_norm and k_norm span all heads at once (OLMo 2), not one head
  Linear qkv;      // fused q, k, v projections
  Linear o;        // attention output projection
  std::optional<Linear> gate_up;  // fused gate and up projections (absent: a mixture, `experts`)
  std::optional<Linear> down;     // MLP output projection
  std::optional<Experts> experts; // the mixture of experts in place of the MLP
  int64_t activation;         // an Activation
  float residual_multiplier;  // each branch's output times it joins the residual stream
  double scale;               // of the attention scores
  int64_t sliding_window;     // keys a row sees, its own included; 0: all
  double softcap;             // scores become softcap * tanh(score / softcap); 0: none
  int64_t rope;               // which of forward's cos/sin pairs rotates q and k
  int64_t view;               // which of forward's attention views it reads
  std::optional<at::Tensor> sinks;  // [num_heads] float32: gpt-oss's attention sinks, or absent
};

// out = weight * (x * rsqrt(mean(x^2) + eps)) over n elements, as Hugging Face's RMSNorm in
// float32 (the sum of squares in 16 lanes, so it vectorizes). out may be x.
inline void rms_norm(const float* x, const float* __restrict__ weight, float eps, int64_t n, float* out) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += x[i + j] * x[i + j];
  for (int j = 0; i < n; ++i, ++j) lanes[j] += x[i] * x[i];
  float sum = 0.f;
  for (float lane : lanes) sum += lane;
  const float scale = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t k = 0; k < n; ++k) out[k] = weight[k] * (x[k] * scale);
}

// The "rotate half" rotary embedding of one head, in place: x * cos + rotate_half(x) * sin.
inline void rotate(float* __restrict__ x, const float* __restrict__ cos, const float* __restrict__ sin, int64_t size) {
  const int64_t half = size / 2;
  float rotated[kMaxHeadSize];
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) {
    rotated[j] = x[j] * cos[j] - x[j + half] * sin[j];
    rotated[j + half] = x[j + half] * cos[j + half] + x[j] * sin[j + half];
  }
  std::copy(rotated, rotated + size, x);
}

// x += multiplier * y (the residual add; Granite scales the branch).
inline void add_rows(float* __restrict__ x, const float* __restrict__ y, float multiplier, int64_t n) {
  if (multiplier == 1.f) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) x[j] += y[j];
    return;
  }
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) x[j] += y[j] * multiplier;
}

// One patched linear's LoRA slots (see the header): y[t] += B_s (A_s x[t]) for a row t in slot s.
struct LoRALinear {
  at::Tensor a;               // float32 [slots, slices, rank, in_features]
  std::vector<at::Tensor> b;  // per output slice, float32 [slots, rank, out_j] (B transposed)
};

constexpr int64_t kMaxLoRAWidth = 3 * 512;  // slices x rank of one linear
constexpr int64_t kLoRAGemmRows = 32;       // an adapter with this many rows in a step multiplies with ATen
constexpr int64_t kLoRAColumns = 128;       // outputs of one expand task

// The rows of one step that use one LoRA slot.
struct LoRAGroup {
  int64_t slot;
  std::vector<int64_t> rows;
  at::Tensor index;  // the rows, int64
};

inline float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Runs f(row) for rows [0, num_rows) over torch's threads (one thread for a decode's few rows).
template <class F>
void for_rows(int64_t num_rows, const F& f) {
  at::parallel_for(0, num_rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) f(row);
  });
}

// A step's tensors: forward's arguments and the layers' scratch rows.
struct Step {
  at::Tensor& hidden;  // [num_tokens, H]: the residual stream, in place
  const std::vector<at::Tensor>& cos;
  const std::vector<at::Tensor>& sin;
  const int64_t* rope_rows;  // row of cos and sin that token t rotates by (null: row t)
  const std::vector<at::Tensor>& key_caches;
  const std::vector<at::Tensor>& value_caches;
  const std::vector<at::Tensor>& slot_mappings;
  const std::optional<at::Tensor>& kernel_rows;
  const std::vector<at::Tensor>& block_tables;
  const std::optional<at::Tensor>& cu_seqlens_q;
  const std::optional<at::Tensor>& context_lens;
  const std::vector<int64_t>& chunk_bounds;
  const std::vector<at::Tensor>& chunk_blocks;
  const c10::List<std::optional<at::Tensor>>& chunk_masks;
  at::Tensor normed;         // [num_tokens, H]: a norm's output, a linear's input
  at::Tensor qkv;            // [num_tokens, qkv_size]
  at::Tensor query;          // [num_tokens, num_heads, D]: the q heads, in place in qkv's rows
  at::Tensor attended;       // [num_tokens, num_heads, D]
  at::Tensor attended_rows;  // the same as [num_tokens, q_size]
  at::Tensor projected;      // [num_tokens, H]: o's and down's outputs
  at::Tensor gate_up;        // [num_tokens, 2 * I]
  at::Tensor activated;      // [num_tokens, I]
};

// The layers of a step split between threads part by part as each part comes: every linear, the
// attention, the row-wise loops over torch's pool (at::parallel_for), each call a parallel region
// of its own. Steps of many rows take it (and every step SharedTeam does not take).
struct PooledTeam {
  static constexpr bool kPooled = true;
  template <class F>
  void rows(int64_t num_rows, const F& f) {
    for_rows(num_rows, f);
  }
  // f(row, first head, end head) for each row's heads.
  template <class F>
  void heads(int64_t num_rows, int64_t num_heads, const F& f) {
    for_rows(num_rows, [&](int64_t t) { f(t, 0, num_heads); });
  }
  void linear(const Linear& linear, const at::Tensor& x, at::Tensor& out) { linear.apply(x, out); }
  template <class F>
  void attention(int64_t, const F& attend) {
    attend();
  }
};

// Keeps a waiting thread on its core: the others arrive within microseconds.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Threads of one parallel region wait here until all `parts` have arrived. A round trip of a
// cache line between cores (a fraction of a microsecond), where ending an OpenMP region and
// starting the next cost ~1.5 us (docs/cpu.md). It spins, then yields (an oversubscribed
// machine: a descheduled thread gets the core back).
class SpinBarrier {
 public:
  void wait(int parts) {
    const int phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == parts - 1) {
      arrived_.store(0, std::memory_order_relaxed);  // before the release: no thread arrives early
      phase_.store(phase + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; phase_.load(std::memory_order_acquire) == phase; ++spins) {
      if (spins < kSpins) {
        cpu_relax();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  static constexpr int kSpins = 1 << 14;
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<int> phase_{0};
};

// The layers of a small step (a decode) on every thread of one parallel region: thread `part`
// of `parts` takes its share of each part (rows, heads, the output columns of a linear,
// attention's items) and waits at the barrier for the others before the next part reads it.
// A single-stream decode has ~150 small parts per step (4 linears and the attention per layer);
// as regions of their own each paid a fork and a join. The values are the pooled path's, bit
// for bit: every output element is computed by the same code, only by another thread.
// Nothing here may throw (an exception cannot leave a parallel region): one_region and the
// attention plans check everything before the region starts.
struct SharedTeam {
  static constexpr bool kPooled = false;
  int part;
  int parts;
  SpinBarrier& barrier;
  const std::vector<pagedrs_cpu::PagedAttentionPlan>& attention_plans;  // one per layer
  std::atomic<int64_t>* next_items;                                      // one per layer, from 0

  template <class F>
  void rows(int64_t num_rows, const F& f) {
    for (int64_t t = num_rows * part / parts; t < num_rows * (part + 1) / parts; ++t) f(t);
    barrier.wait(parts);
  }
  template <class F>
  void heads(int64_t num_rows, int64_t num_heads, const F& f) {
    const int64_t begin = num_rows * num_heads * part / parts, end = num_rows * num_heads * (part + 1) / parts;
    for (int64_t unit = begin; unit < end;) {  // unit: row * num_heads + head
      const int64_t t = unit / num_heads, row_end = std::min(end, (t + 1) * num_heads);
      f(t, unit - t * num_heads, row_end - t * num_heads);
      unit = row_end;
    }
    barrier.wait(parts);
  }
  void linear(const Linear& linear, const at::Tensor& x, at::Tensor& out) {
    const int64_t num_rows = x.size(0), width = linear.out_features;
    const auto [begin, end] = pagedrs_cpu::quant_matmul_part_f32(
        x.data_ptr<float>(), linear.weight.data_ptr<uint8_t>(), out.data_ptr<float>(), num_rows,
        linear.in_features, width, linear.ggml_type, part, parts);
    if (linear.bias) {  // as the pooled path's out.add_(bias), on this part's columns
      const float* bias = linear.bias->data_ptr<float>();
      float* rows = out.data_ptr<float>();
      for (int64_t t = 0; t < num_rows; ++t) {
#pragma omp simd
        for (int64_t j = begin; j < end; ++j) rows[t * width + j] += bias[j];
      }
    }
    barrier.wait(parts);
  }
  template <class F>
  void attention(int64_t layer, const F&) {
    attention_plans[layer].attend_share(next_items[layer]);
    barrier.wait(parts);
  }
};

class DecoderStackImpl final : public pagedrs_cpu::DecoderStack {
 public:
  DecoderStackImpl(int64_t hidden_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                   int64_t intermediate_size, double eps)
      : hidden_size_(hidden_size),
        num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_size_(head_size),
        intermediate_size_(intermediate_size),
        eps_(static_cast<float>(eps)) {
    TORCH_CHECK(hidden_size > 0 && num_heads > 0 && num_kv_heads > 0 && intermediate_size > 0,
                "pagedrs_cpu: DecoderStack needs positive sizes");
    TORCH_CHECK(num_heads % num_kv_heads == 0, "pagedrs_cpu: ", num_heads, " query heads do not group over ",
                num_kv_heads, " KV heads");
    TORCH_CHECK(head_size > 0 && head_size % 2 == 0 && head_size <= kMaxHeadSize,
                "pagedrs_cpu: DecoderStack takes an even head size up to ", kMaxHeadSize, ", got ", head_size);
  }

  // Appends a layer (see the header for the weights' shapes and settings).
  void add_layer(std::optional<at::Tensor> input_norm, std::optional<at::Tensor> attn_out_norm,
                 std::optional<at::Tensor> pre_mlp_norm, std::optional<at::Tensor> mlp_out_norm,
                 std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm, at::Tensor qkv, int64_t qkv_type,
                 std::optional<at::Tensor> qkv_bias, at::Tensor o, int64_t o_type, std::optional<at::Tensor> o_bias,
                 std::optional<at::Tensor> gate_up, int64_t gate_up_type, std::optional<at::Tensor> gate_up_bias,
                 std::optional<at::Tensor> down,
                 int64_t down_type, std::optional<at::Tensor> down_bias, int64_t activation,
                 double residual_multiplier, double scale, int64_t sliding_window, double softcap, int64_t rope,
                 int64_t view, std::optional<at::Tensor> sinks) override {
    const int64_t q_size = num_heads_ * head_size_, kv_size = num_kv_heads_ * head_size_;
    const int64_t qkv_size = q_size + 2 * kv_size;
    if (input_norm) check_float_vector(*input_norm, hidden_size_, "input_norm");
    if (attn_out_norm) check_float_vector(*attn_out_norm, hidden_size_, "attn_out_norm");
    if (pre_mlp_norm) check_float_vector(*pre_mlp_norm, hidden_size_, "pre_mlp_norm");
    if (mlp_out_norm) check_float_vector(*mlp_out_norm, hidden_size_, "mlp_out_norm");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "pagedrs_cpu: q_norm and k_norm come together");
    const bool whole = q_norm && q_norm->numel() == q_size && q_size != head_size_;
    if (q_norm) {
      check_float_vector(*q_norm, whole ? q_size : head_size_, "q_norm");
      check_float_vector(*k_norm, whole ? kv_size : head_size_, "k_norm");
    }
    TORCH_CHECK(activation == kSilu || activation == kGeluTanh || activation == kGelu ||
                    (activation == pagedrs_cpu::kSwigluOai && !gate_up),
                "pagedrs_cpu: activation must be 0 (silu), 1 (gelu tanh), 2 (gelu), or 3 (gpt-oss's swiglu, experts "
                "only), got ", activation);
    TORCH_CHECK(sliding_window >= 0 && softcap >= 0 && rope >= 0 && view >= 0,
                "pagedrs_cpu: sliding_window, softcap, rope and view must be >= 0");
    if (sinks) check_float_vector(*sinks, num_heads_, "sinks");
    layers_.push_back(Layer{
        input_norm,
        attn_out_norm,
        pre_mlp_norm,
        mlp_out_norm,
        q_norm,
        k_norm,
        whole,
        make_linear("qkv", qkv, qkv_type, qkv_bias, hidden_size_, qkv_size),
        make_linear("o", o, o_type, o_bias, q_size, hidden_size_),
        gate_up ? std::optional<Linear>(make_linear("gate_up", *gate_up, gate_up_type, gate_up_bias, hidden_size_,
                                                    2 * intermediate_size_))
                : std::nullopt,
        down ? std::optional<Linear>(make_linear("down", *down, down_type, down_bias, intermediate_size_, hidden_size_))
             : std::nullopt,
        std::nullopt,
        activation,
        static_cast<float>(residual_multiplier),
        scale,
        sliding_window,
        softcap,
        rope,
        view,
        sinks,
    });
  }

  // Makes the last layer's MLP a mixture of experts (see Experts; shapes in moe.cpp's header).
  void set_experts(at::Tensor router, std::optional<at::Tensor> router_bias, int64_t top_k, bool renormalize,
                   bool softmax_after_topk, at::Tensor gate_up, int64_t gate_up_type, at::Tensor down,
                   int64_t down_type, std::optional<at::Tensor> gate_up_bias, std::optional<at::Tensor> down_bias,
                   double alpha, double limit, std::optional<at::Tensor> shared_gate_up, int64_t shared_gate_up_type,
                   std::optional<at::Tensor> shared_down, int64_t shared_down_type,
                   std::optional<at::Tensor> shared_gate, at::Tensor expert_tokens) override {
    TORCH_CHECK(!layers_.empty(), "pagedrs_cpu: set_experts follows the add_layer of its layer");
    Layer& layer = layers_.back();
    TORCH_CHECK(!layer.gate_up && !layer.down, "pagedrs_cpu: a layer with experts has no dense gate_up and down");
    TORCH_CHECK(router.device().is_cpu() && router.scalar_type() == at::kFloat && router.is_contiguous() &&
                    router.dim() == 2 && router.size(1) == hidden_size_ && router.size(0) > 0,
                "pagedrs_cpu: router must be contiguous float32 [num_experts, ", hidden_size_, "]");
    const int64_t num_experts = router.size(0);
    TORCH_CHECK(0 < top_k && top_k <= num_experts, "pagedrs_cpu: top_k must be in 1..", num_experts, ", got ", top_k);
    if (router_bias) check_float_vector(*router_bias, num_experts, "router_bias");
    TORCH_CHECK(gate_up.dim() == 3 && gate_up.size(0) == num_experts,
                "pagedrs_cpu: gate_up must be [", num_experts, ", 2 * intermediate_size, ...]");
    const pagedrs_cpu::ExpertWeights weights{gate_up,   gate_up_type,     down,
                                             down_type, gate_up_bias,     down_bias,
                                             layer.activation, static_cast<float>(alpha), static_cast<float>(limit)};
    pagedrs_cpu::check_moe_experts(weights, hidden_size_);
    TORCH_CHECK(shared_gate_up.has_value() == shared_down.has_value() &&
                    shared_gate_up.has_value() == shared_gate.has_value(),
                "pagedrs_cpu: a shared expert needs gate_up, down and its gate");
    TORCH_CHECK(expert_tokens.device().is_cpu() && expert_tokens.scalar_type() == at::kLong &&
                    expert_tokens.is_contiguous() && expert_tokens.dim() == 1 && expert_tokens.size(0) == num_experts,
                "pagedrs_cpu: expert_tokens must be contiguous int64 [", num_experts, "]");
    Experts experts{router, router_bias,  top_k,        renormalize,  softmax_after_topk,
                    weights, std::nullopt, std::nullopt, std::nullopt, expert_tokens};
    if (shared_gate_up) {
      const int64_t shared = shared_gate_up->size(0) / 2;
      experts.shared_gate_up = make_linear("shared_gate_up", *shared_gate_up, shared_gate_up_type, std::nullopt,
                                           hidden_size_, 2 * shared);
      experts.shared_down = make_linear("shared_down", *shared_down, shared_down_type, std::nullopt, shared,
                                        hidden_size_);
      const at::Tensor gate = shared_gate->reshape({-1});
      check_float_vector(gate, hidden_size_, "shared_gate");
      experts.shared_gate = gate;
    }
    layer.experts = std::move(experts);
  }

  int64_t num_layers() const override { return static_cast<int64_t>(layers_.size()); }

  void set_final_norm(at::Tensor weight) override {
    check_float_vector(weight, hidden_size_, "final_norm");
    final_norm_ = std::move(weight);
  }

  void set_head(at::Tensor weight, int64_t ggml_type) override {
    TORCH_CHECK(weight.dim() == 2, "pagedrs_cpu: the head must be [vocab, ...], got ", weight.sizes());
    head_ = make_linear("head", weight, ggml_type, std::nullopt, hidden_size_, weight.size(0));
  }

  void set_embedding(at::Tensor weight, int64_t ggml_type) override {
    TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
                    weight.scalar_type() == (ggml_type == kF32 ? at::kFloat : at::kByte) &&
                    (ggml_type != kF32 || weight.size(1) == hidden_size_),
                "pagedrs_cpu: the embedding table must be contiguous float32 [vocab, ", hidden_size_,
                "] (type 0) or its packed uint8 rows, got ", weight.scalar_type(), " ", weight.sizes());
    embedding_ = std::move(weight);
    embedding_type_ = ggml_type;
  }

  void set_one_region(bool enabled) override { one_region_ = enabled; }
  int64_t one_region_steps() const override { return one_region_steps_; }

  // Runs every layer over the step's rows; `hidden` ends as the last layer's output.
  //   cos, sin: one pair per rotary embedding (a layer reads the pair its `rope` names): each
  //     token's rows [num_tokens, rotary_dim], or, with rope_rows, tables [P, rotary_dim] (the
  //     same P for every pair) of which token t takes row rope_rows[t] (int64 [num_tokens]).
  //   slot_mappings: for each attention view (a layer's `view`), the cache slot of each row
  //     (int64 [num_tokens]).
  //   kernel_rows, block_tables, cu_seqlens_q, context_lens: the rows the paged attention kernel
  //     attends (kernel_rows: int64 [R] of the step's rows, absent for all of them) with, for
  //     each view, their sequences' int32 block tables [S, W], and their rows [S + 1] and
  //     contexts [S]; no block tables when no row goes to the kernel.
  //   chunk_bounds: (first row, end row, context length) of each long prefill chunk SDPA
  //     attends; chunk_blocks and chunk_masks: for each view, each chunk's blocks (int64 [W])
  //     and bool [L, C] mask of the keys each row sees (absent for a whole prompt without a
  //     window: plain causal).
  //   final_rows: int64 [R] rows of the step: returned, float32 [R, H], through the final
  //     norm (set_final_norm), computed while `hidden` is still in cache (as a torch op after
  //     the call, it found its code and data evicted by the weights the layers streamed: ~80 us
  //     of a ~3 ms single-stream decode step, against ~1 here).
  void set_lora(int64_t layer, int64_t linear, at::Tensor a, std::vector<at::Tensor> b) override {
    TORCH_CHECK(layer >= 0 && layer < num_layers() && linear >= 0 && linear < 4,
                "pagedrs_cpu: set_lora takes a layer in [0, ", num_layers(), ") and a linear in [0, 4)");
    const Layer& target = layers_[layer];
    const Linear* base = linear == 0 ? &target.qkv
                         : linear == 1 ? &target.o
                         : linear == 2 ? (target.gate_up ? &*target.gate_up : nullptr)
                                       : (target.down ? &*target.down : nullptr);
    TORCH_CHECK(base != nullptr, "pagedrs_cpu: layer ", layer, " has no dense MLP for LoRA to patch");
    TORCH_CHECK(a.scalar_type() == at::kFloat && a.is_contiguous() && a.dim() == 4 &&
                    a.size(3) == base->in_features && a.size(1) == static_cast<int64_t>(b.size()),
                "pagedrs_cpu: LoRA a must be contiguous float32 [slots, ", b.size(), ", rank, ", base->in_features,
                "], got ", a.sizes());
    TORCH_CHECK(a.size(1) * a.size(2) <= kMaxLoRAWidth, "pagedrs_cpu: LoRA slices x rank above ", kMaxLoRAWidth);
    int64_t outputs = 0;
    for (const at::Tensor& slice : b) {
      TORCH_CHECK(slice.scalar_type() == at::kFloat && slice.is_contiguous() && slice.dim() == 3 &&
                      slice.size(0) == a.size(0) && slice.size(1) == a.size(2),
                  "pagedrs_cpu: LoRA b slices must be contiguous float32 [", a.size(0), ", ", a.size(2),
                  ", out], got ", slice.sizes());
      outputs += slice.size(2);
    }
    TORCH_CHECK(outputs == base->out_features, "pagedrs_cpu: LoRA b slices give ", outputs, " outputs, the linear ",
                base->out_features);
    if (lora_.size() < layers_.size()) lora_.resize(layers_.size());
    lora_[layer][linear] = LoRALinear{a, b};
    lora_slots_ = a.size(0);
  }

  void set_lora_rows(std::optional<at::Tensor> row_slots) override {
    if (row_slots) {
      TORCH_CHECK(row_slots->scalar_type() == at::kLong && row_slots->dim() == 1 && row_slots->is_contiguous(),
                  "pagedrs_cpu: LoRA row slots must be contiguous int64 [num_tokens]");
      const int64_t* slots = row_slots->data_ptr<int64_t>();
      for (int64_t t = 0; t < row_slots->size(0); ++t) {
        TORCH_CHECK(slots[t] >= -1 && slots[t] < lora_slots_, "pagedrs_cpu: LoRA slot ", slots[t], " of row ", t,
                    " is not -1 or one of the ", lora_slots_, " slots");
      }
    }
    lora_groups_.clear();
    lora_rows_ = 0;
    if (!row_slots) return;
    const int64_t* slots = row_slots->data_ptr<int64_t>();
    std::vector<std::vector<int64_t>> rows(lora_slots_);
    for (int64_t t = 0; t < row_slots->size(0); ++t) {
      if (slots[t] >= 0) rows[slots[t]].push_back(t);
    }
    lora_rows_ = row_slots->size(0);
    for (int64_t slot = 0; slot < lora_slots_; ++slot) {
      if (rows[slot].empty()) continue;
      at::Tensor index = at::tensor(rows[slot], at::kLong);
      lora_groups_.push_back(LoRAGroup{slot, std::move(rows[slot]), std::move(index)});
    }
  }

  at::Tensor forward(at::Tensor hidden, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                     std::vector<at::Tensor> key_caches, std::vector<at::Tensor> value_caches,
                     std::vector<at::Tensor> slot_mappings, std::optional<at::Tensor> kernel_rows,
                     std::vector<at::Tensor> block_tables, std::optional<at::Tensor> cu_seqlens_q,
                     std::optional<at::Tensor> context_lens, std::vector<int64_t> chunk_bounds,
                     std::vector<at::Tensor> chunk_blocks, c10::List<std::optional<at::Tensor>> chunk_masks,
                     at::Tensor final_rows, std::optional<at::Tensor> rope_rows, bool logits) const override {
    // NOTE: token ids looked up here, not by the model's embedding module (an op and a module
    // call, run cold after the previous step's weights streamed through the caches): a
    // single-stream decode step 17 us shorter (x1.005-1.007, Zen 5 VM).
    if (hidden.scalar_type() == at::kLong) hidden = embed(hidden);  // before anything is written
    TORCH_CHECK(final_norm_, "pagedrs_cpu: the stack has no final norm (set_final_norm)");
    TORCH_CHECK(!logits || head_, "pagedrs_cpu: the stack has no head (set_head)");
    TORCH_CHECK(final_rows.device().is_cpu() && final_rows.scalar_type() == at::kLong && final_rows.dim() == 1 &&
                    final_rows.is_contiguous(),
                "pagedrs_cpu: final_rows must be a contiguous CPU int64 [R]");
    const int64_t num_tokens = hidden.size(0), num_rows = final_rows.size(0), H = hidden_size_;
    const int64_t* rows = final_rows.data_ptr<int64_t>();
    for (int64_t r = 0; r < num_rows; ++r) {  // before the layers run: a bad row leaves the caches untouched
      TORCH_CHECK(rows[r] >= 0 && rows[r] < num_tokens, "pagedrs_cpu: final row ", rows[r], " is outside the step's ",
                  num_tokens, " rows");
    }
    run_layers(hidden, cos, sin, rope_rows, key_caches, value_caches, slot_mappings, kernel_rows, block_tables,
               cu_seqlens_q, context_lens, chunk_bounds, chunk_blocks, chunk_masks);
    at::Tensor out = at::empty({num_rows, H}, hidden.options());
    const float* hidden_rows = hidden.data_ptr<float>();
    const float* weight = final_norm_->data_ptr<float>();
    float* out_rows = out.data_ptr<float>();
    for_rows(num_rows, [&](int64_t r) { rms_norm(hidden_rows + rows[r] * H, weight, eps_, H, out_rows + r * H); });
    if (!logits) return out;
    // NOTE: the head in the same call: through Python it ran ~80 us above its matmul's time in a
    // single-stream decode step, its code and data evicted by the layers' weights.
    at::Tensor head_logits = at::empty({num_rows, head_->out_features}, hidden.options());
    if (num_rows > 0) head_->apply(out, head_logits);
    return head_logits;
  }

 private:
  // The embedding table's rows of token_ids (int64 [num_tokens]), float32 [num_tokens, H]; an id
  // outside the table fails.
  at::Tensor embed(const at::Tensor& token_ids) const {
    TORCH_CHECK(embedding_, "pagedrs_cpu: the stack has no embedding table (set_embedding) for token ids");
    if (embedding_type_ != kF32) {
      return pagedrs_cpu::embedding_rows(*embedding_, token_ids, embedding_type_, hidden_size_);
    }
    TORCH_CHECK(token_ids.dim() == 1, "pagedrs_cpu: token ids must be int64 [num_tokens]");
    return at::embedding(*embedding_, token_ids);
  }

  void run_layers(at::Tensor& hidden, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                  const std::optional<at::Tensor>& rope_rows, const std::vector<at::Tensor>& key_caches,
                  const std::vector<at::Tensor>& value_caches, const std::vector<at::Tensor>& slot_mappings,
                  const std::optional<at::Tensor>& kernel_rows,
                  const std::vector<at::Tensor>& block_tables, const std::optional<at::Tensor>& cu_seqlens_q,
                  const std::optional<at::Tensor>& context_lens, const std::vector<int64_t>& chunk_bounds,
                  const std::vector<at::Tensor>& chunk_blocks,
                  const c10::List<std::optional<at::Tensor>>& chunk_masks) const {
    const int64_t num_tokens = hidden.size(0), num_layers = this->num_layers();
    const size_t num_views = slot_mappings.size();
    TORCH_CHECK(num_views > 0, "pagedrs_cpu: a step needs at least one attention view");
    for (const at::Tensor& slot_mapping : slot_mappings) {
      check_step(hidden, cos, sin, rope_rows, key_caches, value_caches, slot_mapping);
    }
    const size_t num_chunks = chunk_bounds.size() / 3;
    TORCH_CHECK(chunk_bounds.size() == 3 * num_chunks && chunk_blocks.size() == num_views * num_chunks &&
                    chunk_masks.size() == num_views * num_chunks,
                "pagedrs_cpu: each long chunk needs its (start, end, context length), and its blocks and mask "
                "in each of the ", num_views, " views");
    TORCH_CHECK(block_tables.empty() || block_tables.size() == num_views,
                "pagedrs_cpu: the kernel's rows need block tables in each of the ", num_views, " views");
    for (const Layer& layer : layers_) {
      TORCH_CHECK(static_cast<size_t>(layer.view) < num_views, "pagedrs_cpu: a layer reads attention view ",
                  layer.view, ", but only ", num_views, " came");
      TORCH_CHECK((layer.gate_up && layer.down) || layer.experts,
                  "pagedrs_cpu: a layer without gate_up and down needs its experts (set_experts)");
    }
    check_chunks(num_tokens, key_caches.empty() ? 0 : key_caches[0].size(1), chunk_bounds, chunk_blocks, chunk_masks);
    TORCH_CHECK(lora_groups_.empty() || lora_rows_ == num_tokens, "pagedrs_cpu: LoRA row slots for ", lora_rows_,
                " rows, the step has ", num_tokens);
    if (num_tokens == 0) return;
    const int64_t H = hidden_size_, D = head_size_, q_size = num_heads_ * D;
    const int64_t qkv_size = q_size + 2 * num_kv_heads_ * D, I = intermediate_size_;  // H, D, I: the header's names
    const auto options = hidden.options();
    at::Tensor qkv = at::empty({num_tokens, qkv_size}, options);
    at::Tensor attended = at::empty({num_tokens, num_heads_, D}, options);
    Step step{hidden,
              cos,
              sin,
              rope_rows ? rope_rows->data_ptr<int64_t>() : nullptr,
              key_caches,
              value_caches,
              slot_mappings,
              kernel_rows,
              block_tables,
              cu_seqlens_q,
              context_lens,
              chunk_bounds,
              chunk_blocks,
              chunk_masks,
              at::empty({num_tokens, H}, options),
              qkv,
              // The query heads of each row, in place in the qkv rows (paged attention takes a row stride).
              qkv.narrow(1, 0, q_size).view({num_tokens, num_heads_, D}),
              attended,
              attended.view({num_tokens, q_size}),
              at::empty({num_tokens, H}, options),
              at::empty({num_tokens, 2 * I}, options),
              at::empty({num_tokens, I}, options)};
#ifdef _OPENMP
    if (one_region(step)) {
      // One parallel region for every layer (see SharedTeam): each layer's attention is
      // checked and its work listed before it starts, as nothing inside may throw.
      std::vector<pagedrs_cpu::PagedAttentionPlan> plans;
      plans.reserve(num_layers);
      for (const Layer& layer : layers_) {
        const int64_t l = static_cast<int64_t>(plans.size());
        plans.emplace_back(step.attended, step.query, key_caches[l], value_caches[l], block_tables[layer.view],
                           *cu_seqlens_q, *context_lens, layer.scale, layer.sliding_window, layer.softcap,
                           layer.sinks);
      }
      std::unique_ptr<std::atomic<int64_t>[]> next_items(new std::atomic<int64_t>[num_layers]());
      SpinBarrier barrier;
#pragma omp parallel num_threads(at::get_num_threads())
      {
        SharedTeam team{omp_get_thread_num(), omp_get_num_threads(), barrier, plans, next_items.get()};
        layer_loop(team, step);
      }
      ++one_region_steps_;
      return;
    }
#endif
    PooledTeam team;
    layer_loop(team, step);
  }

  // Whether a step runs every layer in one parallel region (SharedTeam): a few rows (a decode),
  // all of them to the paged attention kernel, every linear one quant_matmul_part_f32 takes,
  // no experts, no LoRA, and no norm over all of q's heads at once (OLMo 2).
  bool one_region(const Step& step) const {
    const int64_t num_tokens = step.hidden.size(0);
    if (!one_region_ || at::get_num_threads() < 2 || at::in_parallel_region() || num_tokens > kOneRegionTokens) {
      return false;
    }
    if (!step.chunk_bounds.empty() || step.kernel_rows || step.block_tables.empty() || !step.cu_seqlens_q ||
        !step.context_lens || !lora_groups_.empty()) {  // (the pooled path refuses a table without its rows)
      return false;
    }
    for (const Layer& layer : layers_) {
      if (layer.experts || layer.whole_qk_norms) return false;
      for (const Linear* linear : {&layer.qkv, &layer.o, &*layer.gate_up, &*layer.down}) {
        if (!pagedrs_cpu::quant_matmul_splits(num_tokens, linear->out_features, linear->ggml_type)) return false;
      }
    }
    return true;
  }

  // Every layer over the step, the team splitting each part between its threads (PooledTeam,
  // SharedTeam).
  template <class Team>
  void layer_loop(Team& team, Step& step) const {
    const int64_t num_tokens = step.hidden.size(0), num_layers = this->num_layers();
    const int64_t H = hidden_size_, D = head_size_, q_size = num_heads_ * D, kv_size = num_kv_heads_ * D;
    const int64_t qkv_size = q_size + 2 * kv_size, I = intermediate_size_;
    const at::Tensor& hidden = step.hidden;
    float* hidden_rows = hidden.data_ptr<float>();
    float* normed_rows = step.normed.data_ptr<float>();
    float* projected_rows = step.projected.data_ptr<float>();
    const float* gate_up_rows = step.gate_up.data_ptr<float>();
    float* activated_rows = step.activated.data_ptr<float>();
    float* qkv_rows = step.qkv.data_ptr<float>();
    auto data = [](const std::optional<at::Tensor>& t) { return t ? t->data_ptr<float>() : nullptr; };
    for (int64_t layer_index = 0; layer_index < num_layers; ++layer_index) {
      const Layer& layer = layers_[layer_index];
      const float* input_norm = data(layer.input_norm);
      if (input_norm != nullptr) {
        team.rows(num_tokens, [&](int64_t t) { rms_norm(hidden_rows + t * H, input_norm, eps_, H, normed_rows + t * H); });
      }
      const at::Tensor& qkv_input = input_norm != nullptr ? step.normed : hidden;
      team.linear(layer.qkv, qkv_input, step.qkv);
      if constexpr (Team::kPooled) add_lora(layer_index, 0, qkv_input, step.qkv);
      // Per row: q/k norms, rotary on q and k, then k and v into their cache slot.
      const at::Tensor& key_cache = step.key_caches[layer_index];
      const at::Tensor& value_cache = step.value_caches[layer_index];
      const float* q_norm = data(layer.q_norm);
      const float* k_norm = data(layer.k_norm);
      const bool whole_norms = layer.whole_qk_norms;
      const int64_t rotary_dim = step.cos[layer.rope].size(1);
      const float* cos_rows = step.cos[layer.rope].data_ptr<float>();
      const float* sin_rows = step.sin[layer.rope].data_ptr<float>();
      const int64_t* slots = step.slot_mappings[layer.view].data_ptr<int64_t>();
      // Heads [begin, end) of row t (q heads, then k heads); a k head stores its key and value.
      team.heads(num_tokens, num_heads_ + num_kv_heads_, [&](int64_t t, int64_t begin, int64_t end) {
        float* row = qkv_rows + t * qkv_size;
        if (whole_norms) {  // OLMo 2: q over all its heads at once, k likewise (never SharedTeam's)
          rms_norm(row, q_norm, eps_, q_size, row);
          rms_norm(row + q_size, k_norm, eps_, kv_size, row + q_size);
        }
        for (int64_t head = begin; head < end; ++head) {
          float* x = row + head * D;
          const float* norm = head < num_heads_ ? q_norm : k_norm;
          if (norm != nullptr && !whole_norms) rms_norm(x, norm, eps_, D, x);
          const int64_t rope_row = step.rope_rows != nullptr ? step.rope_rows[t] : t;
          rotate(x, cos_rows + rope_row * rotary_dim, sin_rows + rope_row * rotary_dim, rotary_dim);
          if (head < num_heads_) continue;
          const int64_t at = slots[t] * kv_size + (head - num_heads_) * D;
          store_row(x, key_cache, at, D);
          store_row(x + kv_size, value_cache, at, D);
        }
      });
      team.attention(layer_index, [&] {
        const std::optional<at::Tensor> view_tables =
            step.block_tables.empty() ? std::nullopt : std::optional<at::Tensor>(step.block_tables[layer.view]);
        attend(layer, step.query, key_cache, value_cache, step.kernel_rows, view_tables, step.cu_seqlens_q,
               step.context_lens, step.chunk_bounds, step.chunk_blocks, step.chunk_masks, step.attended);
      });
      team.linear(layer.o, step.attended_rows, step.projected);
      if constexpr (Team::kPooled) add_lora(layer_index, 1, step.attended_rows, step.projected);
      const float* attn_out_norm = data(layer.attn_out_norm);
      const float* pre_mlp_norm = data(layer.pre_mlp_norm);
      const float multiplier = layer.residual_multiplier;
      team.rows(num_tokens, [&](int64_t t) {
        float* out = projected_rows + t * H;
        if (attn_out_norm != nullptr) rms_norm(out, attn_out_norm, eps_, H, out);
        add_rows(hidden_rows + t * H, out, multiplier, H);
        if (pre_mlp_norm != nullptr) rms_norm(hidden_rows + t * H, pre_mlp_norm, eps_, H, normed_rows + t * H);
      });
      const at::Tensor& mlp_input = pre_mlp_norm != nullptr ? step.normed : hidden;
      if (layer.experts) {  // never SharedTeam's
        if constexpr (Team::kPooled) mixture(*layer.experts, mlp_input, step.projected);
      } else {
        team.linear(*layer.gate_up, mlp_input, step.gate_up);
        if constexpr (Team::kPooled) add_lora(layer_index, 2, mlp_input, step.gate_up);
        team.rows(num_tokens, [&](int64_t t) {
          const float* gate = gate_up_rows + t * 2 * I;
          pagedrs_cpu::activate_mul(layer.activation, gate, gate + I, I, activated_rows + t * I);
        });
        team.linear(*layer.down, step.activated, step.projected);
        if constexpr (Team::kPooled) add_lora(layer_index, 3, step.activated, step.projected);
      }
      const float* mlp_out_norm = data(layer.mlp_out_norm);
      team.rows(num_tokens, [&](int64_t t) {
        float* out = projected_rows + t * H;
        if (mlp_out_norm != nullptr) rms_norm(out, mlp_out_norm, eps_, H, out);
        add_rows(hidden_rows + t * H, out, multiplier, H);
      });
    }
  }

  // out[t] += B_s (A_s x[t]) for the rows t with a LoRA slot s (lora_groups_: each slot's rows),
  // when the layer's linear has LoRA slots. The rows of one adapter go together, so each row of
  // its A and B is read once per step, not once per row: threads split A's rows (the shrink),
  // then the outputs (the expand). An adapter with many rows (a prefill) multiplies with ATen.
  void add_lora(int64_t layer, int linear, const at::Tensor& x, at::Tensor& out) const {
    if (lora_groups_.empty() || static_cast<size_t>(layer) >= lora_.size() || !lora_[layer][linear]) return;
    const LoRALinear& lora = *lora_[layer][linear];
    const int64_t slices = lora.a.size(1), rank = lora.a.size(2), in = lora.a.size(3), width = out.size(1);
    const int64_t shrink_width = slices * rank;
    TORCH_CHECK(x.is_contiguous() && x.size(1) == in && out.is_contiguous(), "pagedrs_cpu: LoRA rows mismatch");
    std::vector<const LoRAGroup*> small;
    for (const LoRAGroup& group : lora_groups_) {
      if (static_cast<int64_t>(group.rows.size()) < kLoRAGemmRows) {
        small.push_back(&group);
        continue;
      }
      const at::Tensor shrunk = at::mm(x.index_select(0, group.index), lora.a[group.slot].view({shrink_width, in}).t());
      for (int64_t j = 0, start = 0; j < slices; start += lora.b[j].size(2), ++j) {
        const at::Tensor update = at::mm(shrunk.narrow(1, j * rank, rank), lora.b[j][group.slot]);
        out.narrow(1, start, lora.b[j].size(2)).index_add_(0, group.index, update);
      }
    }
    if (small.empty()) return;
    const float* a = lora.a.data_ptr<float>();
    const float* xs = x.data_ptr<float>();
    float* ys = out.data_ptr<float>();
    const int64_t num_small = static_cast<int64_t>(small.size());
    std::vector<float> shrunk(x.size(0) * shrink_width);
    at::parallel_for(0, num_small * shrink_width, 16, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) {
        const LoRAGroup& group = *small[k / shrink_width];
        const int64_t i = k % shrink_width;
        const float* row = a + (group.slot * shrink_width + i) * in;
        for (const int64_t t : group.rows) shrunk[t * shrink_width + i] = dot(row, xs + t * in, in);
      }
    });
    // The expand in chunks of kLoRAColumns outputs of one slice: y[t, chunk] += s[t, r] B^T[r, chunk]
    // over the ranks r, the chunk of B^T staying in cache over the group's rows.
    struct Chunk {
      const LoRAGroup* group;
      int64_t slice, begin, end;  // the chunk's outputs within the slice
    };
    std::vector<Chunk> chunks;
    for (const LoRAGroup* group : small) {
      for (int64_t j = 0; j < slices; ++j) {
        for (int64_t c = 0; c < lora.b[j].size(2); c += kLoRAColumns) {
          chunks.push_back(Chunk{group, j, c, std::min(c + kLoRAColumns, lora.b[j].size(2))});
        }
      }
    }
    std::vector<int64_t> starts(slices);
    for (int64_t j = 1; j < slices; ++j) starts[j] = starts[j - 1] + lora.b[j - 1].size(2);
    at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) {
        const Chunk& chunk = chunks[k];
        const int64_t size = lora.b[chunk.slice].size(2), n = chunk.end - chunk.begin;
        const float* bt = lora.b[chunk.slice].data_ptr<float>() + chunk.group->slot * rank * size + chunk.begin;
        for (const int64_t t : chunk.group->rows) {
          float* __restrict__ y = ys + t * width + starts[chunk.slice] + chunk.begin;
          const float* s = &shrunk[t * shrink_width + chunk.slice * rank];
          for (int64_t r = 0; r < rank; ++r) {
            const float* __restrict__ row = bt + r * size;
            const float scale = s[r];
#pragma omp simd
            for (int64_t o = 0; o < n; ++o) y[o] += scale * row[o];
          }
        }
      }
    });
  }

  // out [num_tokens, H] = the mixture's output for x [num_tokens, H]: the router, the routed
  // experts (moe.cpp), plus the gated shared expert.
  void mixture(const Experts& experts, const at::Tensor& x, at::Tensor& out) const {
    const int64_t activation = experts.weights.activation;
    const int64_t num_tokens = x.size(0), H = hidden_size_, K = experts.top_k;
    const at::Tensor logits =
        experts.router_bias ? at::addmm(*experts.router_bias, x, experts.router.t()) : at::mm(x, experts.router.t());
    std::vector<int64_t> ids(num_tokens * K);
    std::vector<float> weights(num_tokens * K);
    route(logits, K, experts.renormalize, experts.softmax_after_topk, ids.data(), weights.data());
    int64_t* counts = experts.expert_tokens.data_ptr<int64_t>();
    for (const int64_t id : ids) ++counts[id];
    pagedrs_cpu::fused_experts_f32(x, ids.data(), weights.data(), K, experts.weights, out);
    if (!experts.shared_gate_up) return;
    const int64_t S = experts.shared_down->in_features;
    at::Tensor gate_up = at::empty({num_tokens, 2 * S}, x.options());
    at::Tensor activated = at::empty({num_tokens, S}, x.options());
    at::Tensor shared = at::empty({num_tokens, H}, x.options());
    experts.shared_gate_up->apply(x, gate_up);
    const float* gate_up_rows = gate_up.data_ptr<float>();
    float* activated_rows = activated.data_ptr<float>();
    for_rows(num_tokens, [&](int64_t t) {
      const float* gate = gate_up_rows + t * 2 * S;
      pagedrs_cpu::activate_mul(activation, gate, gate + S, S, activated_rows + t * S);
    });
    experts.shared_down->apply(activated, shared);
    const float* x_rows = x.data_ptr<float>();
    const float* gate_weight = experts.shared_gate->data_ptr<float>();
    const float* shared_rows = shared.data_ptr<float>();
    float* out_rows = out.data_ptr<float>();
    for_rows(num_tokens, [&](int64_t t) {
      float dot = 0.f;
      for (int64_t j = 0; j < H; ++j) dot += x_rows[t * H + j] * gate_weight[j];
      const float scale = 1.f / (1.f + std::exp(-dot));
#pragma omp simd
      for (int64_t j = 0; j < H; ++j) out_rows[t * H + j] += scale * shared_rows[t * H + j];
    });
  }

  // SDPA reads a chunk's rows and keys through slices, which would clamp bounds silently. A
  // chunk's keys run from its first gathered block to the end of its context: all of them
  // without a mask, else as many as its mask has columns.
  static void check_chunks(int64_t num_tokens, int64_t block_size, const std::vector<int64_t>& chunk_bounds,
                           const std::vector<at::Tensor>& chunk_blocks,
                           const c10::List<std::optional<at::Tensor>>& chunk_masks) {
    const size_t num_chunks = chunk_bounds.size() / 3;
    for (size_t i = 0; i < chunk_blocks.size(); ++i) {
      const size_t c = i % num_chunks;
      const int64_t start = chunk_bounds[3 * c], end = chunk_bounds[3 * c + 1], context_len = chunk_bounds[3 * c + 2];
      TORCH_CHECK(0 <= start && start < end && end <= num_tokens, "pagedrs_cpu: long chunk ", c, " has rows ", start,
                  "..", end, " of a step of ", num_tokens);
      const std::optional<at::Tensor> mask = chunk_masks.get(i);
      const int64_t num_keys = mask.has_value() ? mask->size(1) : context_len;
      TORCH_CHECK(!mask.has_value() || (mask->scalar_type() == at::kBool && mask->dim() == 2 &&
                                        mask->size(0) == end - start),
                  "pagedrs_cpu: long chunk ", c, "'s mask must be bool [", end - start, ", keys]");
      TORCH_CHECK(chunk_blocks[i].scalar_type() == at::kLong && chunk_blocks[i].dim() == 1 &&
                      end - start <= context_len && num_keys <= context_len &&
                      num_keys <= chunk_blocks[i].size(0) * block_size,
                  "pagedrs_cpu: long chunk ", c, " needs int64 blocks covering its ", num_keys,
                  " keys and at most as many rows as its context of ", context_len, " tokens");
    }
  }

  void check_step(const at::Tensor& hidden, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                  const std::optional<at::Tensor>& rope_rows, const std::vector<at::Tensor>& key_caches,
                  const std::vector<at::Tensor>& value_caches, const at::Tensor& slot_mapping) const {
    TORCH_CHECK(hidden.device().is_cpu() && hidden.scalar_type() == at::kFloat && hidden.is_contiguous() &&
                    hidden.dim() == 2 && hidden.size(1) == hidden_size_,
                "pagedrs_cpu: hidden must be contiguous float32 [num_tokens, ", hidden_size_, "], got ",
                hidden.scalar_type(), " ", hidden.sizes());
    const int64_t num_tokens = hidden.size(0);
    TORCH_CHECK(cos.size() == sin.size(), "pagedrs_cpu: cos and sin come in pairs");
    for (const Layer& layer : layers_) {
      TORCH_CHECK(static_cast<size_t>(layer.rope) < cos.size(), "pagedrs_cpu: a layer reads rotary ", layer.rope,
                  " of ", cos.size());
    }
    // Rows of cos and sin: one a token, or a table's rows that rope_rows picks from.
    int64_t rows = num_tokens;
    if (rope_rows) {
      TORCH_CHECK(rope_rows->device().is_cpu() && rope_rows->scalar_type() == at::kLong &&
                      rope_rows->is_contiguous() && rope_rows->dim() == 1 && rope_rows->size(0) == num_tokens,
                  "pagedrs_cpu: rope_rows must be contiguous int64 [", num_tokens, "]");
      rows = cos.empty() || cos[0].dim() != 2 ? 0 : cos[0].size(0);
      const int64_t* picked = rope_rows->data_ptr<int64_t>();
      for (int64_t t = 0; t < num_tokens; ++t) {
        TORCH_CHECK(picked[t] >= 0 && picked[t] < rows, "pagedrs_cpu: rope row ", picked[t], " of token ", t,
                    " is outside the rotary tables' ", rows, " rows");
      }
    }
    for (size_t r = 0; r < cos.size(); ++r) {
      const int64_t rotary_dim = cos[r].dim() == 2 ? cos[r].size(1) : -1;
      for (const at::Tensor* t : {&cos[r], &sin[r]}) {
        TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                        t->size(0) == rows && t->size(1) == rotary_dim && rotary_dim > 0 &&
                        rotary_dim % 2 == 0 && rotary_dim <= head_size_,
                    "pagedrs_cpu: cos and sin must be contiguous float32 [", rows,
                    ", an even rotary size up to ", head_size_, "], got ", t->sizes());
      }
    }
    TORCH_CHECK(key_caches.size() == layers_.size() && value_caches.size() == layers_.size(), "pagedrs_cpu: ",
                layers_.size(), " layers need as many key and value caches, got ", key_caches.size(), " and ",
                value_caches.size());
    for (size_t l = 0; l < layers_.size(); ++l) {
      for (const at::Tensor* cache : {&key_caches[l], &value_caches[l]}) {
        const auto dtype = cache->scalar_type();
        TORCH_CHECK(cache->device().is_cpu() && pagedrs_cpu::is_kv_cache_dtype(dtype) &&
                        dtype == key_caches[0].scalar_type() && cache->is_contiguous() && cache->dim() == 4 &&
                        cache->size(2) == num_kv_heads_ && cache->size(3) == head_size_ &&
                        cache->sizes() == key_caches[0].sizes(),
                    "pagedrs_cpu: every cache must be contiguous float32, bfloat16, float16 or float8_e4m3fn "
                    "(all one dtype) [num_blocks, block_size, ", num_kv_heads_, ", ", head_size_, "], got ",
                    cache->sizes(), " ", dtype);
      }
    }
    TORCH_CHECK(slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == at::kLong &&
                    slot_mapping.is_contiguous() && slot_mapping.dim() == 1 &&
                    slot_mapping.size(0) == num_tokens,
                "pagedrs_cpu: slot_mapping must be contiguous int64 [", num_tokens, "]");
    // The rows are written at these slots unchecked: none may fall outside the cache.
    const int64_t num_slots = key_caches.empty() ? 0 : key_caches[0].size(0) * key_caches[0].size(1);
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t t = 0; t < num_tokens; ++t) {
      TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "pagedrs_cpu: slot ", slots[t], " of row ", t,
                  " is outside the cache's ", num_slots, " slots");
    }
  }

  // attended [num_tokens, num_heads, D] = every query row over its sequence's paged context
  // under the layer's scale, window and softcap, split between the kernel and SDPA as
  // CpuAttentionMetadata.attend splits it.
  void attend(const Layer& layer, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
              const std::optional<at::Tensor>& kernel_rows, const std::optional<at::Tensor>& block_tables,
              const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& context_lens,
              const std::vector<int64_t>& chunk_bounds, const std::vector<at::Tensor>& chunk_blocks,
              const c10::List<std::optional<at::Tensor>>& chunk_masks, at::Tensor& attended) const {
    if (block_tables) {
      TORCH_CHECK(cu_seqlens_q && context_lens, "pagedrs_cpu: the kernel's rows need cu_seqlens_q and context_lens");
      if (kernel_rows) {
        at::Tensor rows_query = query.index_select(0, *kernel_rows);
        at::Tensor rows_out = at::empty_like(rows_query);
        pagedrs_cpu::paged_attention(rows_out, rows_query, key_cache, value_cache, *block_tables, *cu_seqlens_q,
                                     *context_lens, layer.scale, layer.sliding_window, layer.softcap, layer.sinks);
        attended.index_copy_(0, *kernel_rows, rows_out);
      } else {
        pagedrs_cpu::paged_attention(attended, query, key_cache, value_cache, *block_tables, *cu_seqlens_q,
                                     *context_lens, layer.scale, layer.sliding_window, layer.softcap, layer.sinks);
      }
    }
    const int64_t group = num_heads_ / num_kv_heads_;
    const size_t num_chunks = chunk_bounds.size() / 3;
    const size_t first = static_cast<size_t>(layer.view) * num_chunks;
    for (size_t c = 0; c < num_chunks; ++c) {
      const int64_t start = chunk_bounds[3 * c], end = chunk_bounds[3 * c + 1], context_len = chunk_bounds[3 * c + 2];
      const std::optional<at::Tensor> mask = chunk_masks.get(first + c);
      const at::Tensor& blocks = chunk_blocks[first + c];
      // Keys from the first gathered block on: a window's chunk starts at its first row's window.
      const int64_t num_keys = mask.has_value() ? mask->size(1) : context_len;
      // [L, H, D] -> [KVH, group, L, D]; keys and values [C, KVH, D] -> [KVH, 1, C, D].
      const at::Tensor q = query.slice(0, start, end).transpose(0, 1).unflatten(0, {num_kv_heads_, group});
      // A 16-bit or fp8 cache's rows as float32, as the query (the gather copies them anyway).
      const auto gather = [&](const at::Tensor& cache) {
        const at::Tensor rows = cache.index_select(0, blocks);
        const at::Tensor as_float =
            rows.scalar_type() == at::kFloat8_e4m3fn ? pagedrs_cpu::fp8_as_float(rows) : rows.to(at::kFloat);
        return as_float.flatten(0, 1).slice(0, 0, num_keys).transpose(0, 1).unsqueeze(1);
      };
      const at::Tensor keys = gather(key_cache);
      const at::Tensor values = gather(value_cache);
      at::Tensor out;
      if (layer.softcap > 0 || layer.sinks) {  // SDPA has neither: scores capped, masked, softmaxed
        at::Tensor visible = mask.has_value() ? *mask
                                              : at::ones({end - start, num_keys}, query.options().dtype(at::kBool))
                                                    .tril(context_len - (end - start));
        at::Tensor scores = at::matmul(q, keys.transpose(-1, -2)) * layer.scale;  // [KVH, group, L, C]
        if (layer.softcap > 0) scores = at::tanh(scores / layer.softcap) * layer.softcap;
        scores.masked_fill_(visible.logical_not(), -std::numeric_limits<float>::infinity());
        if (layer.sinks) {  // one more logit per head, whose probability goes to no value
          const at::Tensor sink = layer.sinks->view({num_kv_heads_, group, 1, 1}).expand({-1, -1, end - start, 1});
          out = at::matmul(at::softmax(at::cat({scores, sink}, -1), -1).narrow(-1, 0, num_keys), values);
        } else {
          out = at::matmul(at::softmax(scores, -1), values);
        }
      } else {
        out = at::scaled_dot_product_attention(q, keys, values, mask, 0.0, !mask.has_value(), layer.scale);
      }
      attended.slice(0, start, end).copy_(out.flatten(0, 1).transpose(0, 1).reshape({end - start, num_heads_, head_size_}));
    }
  }

  int64_t hidden_size_;
  int64_t num_heads_;
  int64_t num_kv_heads_;
  int64_t head_size_;
  int64_t intermediate_size_;
  float eps_;
  std::vector<Layer> layers_;
  std::vector<std::array<std::optional<LoRALinear>, 4>> lora_;  // per layer: qkv, o, gate_up, down
  int64_t lora_slots_ = 0;
  std::optional<at::Tensor> final_norm_;  // [H] float32 (set_final_norm), for forward's final_rows
  std::optional<Linear> head_;            // the language-model head (set_head), for forward's logits
  std::optional<at::Tensor> embedding_;   // the token embedding table (set_embedding), for token ids
  int64_t embedding_type_ = 0;            // its kF32 or packed type (set_embedding)
  bool one_region_ = true;                // set_one_region
  mutable int64_t one_region_steps_ = 0;  // steps run in one region (forward is const; never concurrent)
  std::vector<LoRAGroup> lora_groups_;  // this step's rows of each slot in use (set_lora_rows)
  int64_t lora_rows_ = 0;               // rows of the step set_lora_rows was given
};

}  // namespace

c10::intrusive_ptr<pagedrs_cpu::DecoderStack> pagedrs_cpu::make_decoder_stack(int64_t hidden_size, int64_t num_heads,
                                                                              int64_t num_kv_heads, int64_t head_size,
                                                                              int64_t intermediate_size, double eps) {
  return c10::make_intrusive<DecoderStackImpl>(hidden_size, num_heads, num_kv_heads, head_size, intermediate_size, eps);
}
