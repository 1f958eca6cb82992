// The entry points of the cpu/ kernels: what torch_bindings.cpp registers (torch.ops.pagedrs_cpu.*
// and torch.classes.pagedrs_cpu.DecoderStack), what one source calls in another (the fused
// decoder stack runs the attention and the packed matmul without going back through the
// dispatcher), and the vectorizable exp they share. Each is defined, and its layouts documented,
// in the file named beside it; every op checks its tensors' dtype, device, contiguity and shapes
// before it reads them.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace pagedrs_cpu {

// ---------------------------------------------------------------------------------------------
// An fp8 (e4m3) KV cache (--kv-cache-dtype fp8): scale 1.0, as vLLM's without calibrated scales.
// Rows are clamped to the largest finite e4m3 value and rounded by c10's conversion (torch's
// own, so the decoder stack and Python's write_kv store the same bytes; NaN stays NaN); they are
// read back by kv_rows.h.

constexpr float kFp8Max = 448.f;

inline c10::Float8_e4m3fn to_fp8(float x) { return c10::Float8_e4m3fn(std::clamp(x, -kFp8Max, kFp8Max)); }

// The dtypes a KV cache may have (the attention kernel and the decoder stack read them all as
// float32).
inline bool is_kv_cache_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat8_e4m3fn;
}

// ---------------------------------------------------------------------------------------------
// Registered ops (schemas in torch_bindings.cpp)

// paged_attention.cpp: query rows [num_rows, num_heads, head_size] against their paged context
// (caches [num_blocks, block_size, num_kv_heads, head_size]) into out (written); the step's keys
// and values must already be in the caches.
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                     const at::Tensor& context_lens, double scale, int64_t sliding_window, double softcap,
                     const std::optional<at::Tensor>& sinks);

// paged_attention.cpp: one paged_attention call split for a caller's own parallel region. Made
// before the region (checking what paged_attention checks; it fails loudly there); then each
// thread of the region calls attend_share, which takes work items from `next` (shared by the
// threads, starting at 0) until none are left, and never throws. The tensors must outlive it.
class PagedAttentionPlan {
 public:
  PagedAttentionPlan(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                     const at::Tensor& context_lens, double scale, int64_t sliding_window, double softcap,
                     const std::optional<at::Tensor>& sinks);
  void attend_share(std::atomic<int64_t>& next) const;
  int64_t num_items() const;

 private:
  struct State;
  std::shared_ptr<const State> state_;
};

// paged_attention.cpp: a float32 copy of an fp8 (e4m3) tensor, any shape (a prefill chunk's
// gathered cache blocks).
at::Tensor fp8_as_float(const at::Tensor& x);

// sampling.cpp: the sampled tokens' logprobs and ranks and each row's top logprobs (all four
// outputs written) of logits [num_rows, vocab_size].
void logprob_stats(const at::Tensor& logits, const at::Tensor& token_ids, int64_t num_top, at::Tensor& logprobs,
                   at::Tensor& ranks, at::Tensor& top_ids, at::Tensor& top_logprobs);

// sampling.cpp: token_ids [num_rows] (written): one draw per row under temperature, min-p and
// top-p, from the caller's uniforms [num_rows, num_uniforms].
void sample_from_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& min_p,
                      const at::Tensor& top_p, const at::Tensor& uniforms, at::Tensor& token_ids);

// sampling.cpp: token_ids [num_rows] (written): each row's first index of its largest logit (of
// its first NaN, if any), as torch.argmax.
void argmax_rows(const at::Tensor& logits, at::Tensor& token_ids);

// sampling.cpp: -inf into logits (written) of the tokens each masked row's grammar bitmask
// [num_masked, num_words] forbids.
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& bitmask);

// quant_matmul.cpp: x [num_tokens, in_features] @ dequant(weight)^T, weight packed uint8
// [out_features, row_bytes] of ggml_type; returns [num_tokens, out_features] in x's dtype.
at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& weight, int64_t ggml_type, int64_t in_features);

// quant_matmul.cpp: float32 [num_tokens, in_features], the dequantized rows token_ids [num_tokens]
// of a packed uint8 table [num_rows, row_bytes] of ggml_type.
at::Tensor embedding_rows(const at::Tensor& weight, const at::Tensor& token_ids, int64_t ggml_type,
                          int64_t in_features);

// quant_matmul.cpp: a Q8_0, Q4_0 or Q4_1 weight [out_features, row_bytes] rearranged into the
// stored int8 panels (the same shape), for type ids with kInt8Panels; out_features a multiple of
// int8_panel_rows(), the rows of a panel: 16 with AVX-512 VNNI, 8 with AVX-VNNI or AVX2, 0 (none)
// elsewhere (NEON, scalar builds).
at::Tensor pack_int8_panels(const at::Tensor& weight, int64_t ggml_type, int64_t in_features);
int64_t int8_panel_rows();
// quant_matmul.cpp: how far ahead (bytes) a walk over stored int8 panels asks for the weights
// (0: it leaves them to the hardware's prefetchers; chosen for this machine's CPU at load), or
// -1 where the build has no stored panels.
int64_t int8_panel_prefetch_bytes();
// quant_matmul.cpp: a Q8_0, Q4_0 or Q4_1 weight [out_features, row_bytes] with each row's bytes
// in the scales-first order (the same shape), for type ids with kScalesFirst, where
// scales_first_rows() (AVX2 builds without AVX-512: the exact kernel reads them faster there).
at::Tensor pack_scales_first(const at::Tensor& weight, int64_t ggml_type, int64_t in_features);
bool scales_first_rows();

// moe.cpp: x [num_tokens, hidden_size] through each token's top-k experts (topk_ids, topk_weights
// [num_tokens, top_k]), experts' gate_up [E, 2 * I, ...] and down [E, H, ...] float32 or packed
// of their ggml type; returns [num_tokens, hidden_size] float32.
at::Tensor fused_experts(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                         const at::Tensor& gate_up, int64_t gate_up_type, const at::Tensor& down, int64_t down_type,
                         int64_t intermediate_size, int64_t activation, const std::optional<at::Tensor>& gate_up_bias,
                         const std::optional<at::Tensor>& down_bias, double alpha, double limit);

// decoder_stack.cpp: a dense model's decoder layers run in one call per step (weights
// and per-step tensors: the header comment of decoder_stack.cpp). Registered as
// torch.classes.pagedrs_cpu.DecoderStack, made by make_decoder_stack.
class DecoderStack : public torch::CustomClassHolder {
 public:
  // Appends a layer: its norms (each optional: before attention, on attention's output, before
  // the MLP, on the MLP's output), q/k norms (both or neither), each linear's weight, ggml type
  // (0: dense float32) and bias; then its MLP activation (0 silu, 1 gelu tanh, 2 gelu), residual
  // multiplier, attention scale, window (0: none) and softcap (0: none), and which of forward's
  // rotary pairs and attention views (slot mapping, block tables, chunk blocks and masks) it reads,
  // and its attention sinks (float32 [num_heads], gpt-oss), if any.
  virtual void add_layer(std::optional<at::Tensor> input_norm, std::optional<at::Tensor> attn_out_norm,
                         std::optional<at::Tensor> pre_mlp_norm, std::optional<at::Tensor> mlp_out_norm,
                         std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm, at::Tensor qkv,
                         int64_t qkv_type, std::optional<at::Tensor> qkv_bias, at::Tensor o, int64_t o_type,
                         std::optional<at::Tensor> o_bias, std::optional<at::Tensor> gate_up, int64_t gate_up_type,
                         std::optional<at::Tensor> gate_up_bias, std::optional<at::Tensor> down, int64_t down_type,
                         std::optional<at::Tensor> down_bias, int64_t activation, double residual_multiplier,
                         double scale, int64_t sliding_window, double softcap, int64_t rope,
                         int64_t view, std::optional<at::Tensor> sinks) = 0;

  // Makes the last added layer's MLP (added without gate_up and down) a mixture of experts: the
  // router [E, H] float32 and its optional bias [E], top_k, whether the top-k weights are
  // renormalized or are the softmax of the top-k logits (gpt-oss), the experts' gate_up
  // [E, 2 * I_e, ...] and down [E, H, ...], their types and optional biases, the activation's
  // alpha and limit (gpt-oss's clamped SwiGLU: the layer's activation 3; moe.cpp), and an optional
  // shared expert (its gate_up and down linears and the [1, H] or [H] float32 gate of its sigmoid);
  // expert_tokens, int64 [E], counts the (token, slot) pairs routed to each expert (written).
  virtual void set_experts(at::Tensor router, std::optional<at::Tensor> router_bias, int64_t top_k,
                           bool renormalize, bool softmax_after_topk, at::Tensor gate_up, int64_t gate_up_type,
                           at::Tensor down, int64_t down_type, std::optional<at::Tensor> gate_up_bias,
                           std::optional<at::Tensor> down_bias, double alpha, double limit,
                           std::optional<at::Tensor> shared_gate_up, int64_t shared_gate_up_type,
                           std::optional<at::Tensor> shared_down, int64_t shared_down_type,
                           std::optional<at::Tensor> shared_gate, at::Tensor expert_tokens) = 0;

  virtual int64_t num_layers() const = 0;

  // The model's final norm's weight [H] float32 (the layers' eps), for forward's final_rows.
  virtual void set_final_norm(at::Tensor weight) = 0;
  // The language-model head: float32 [vocab, hidden_size] (ggml_type 0) or its packed blocks
  // (ggml_type, with the kernel's flags), for forward's logits.
  virtual void set_head(at::Tensor weight, int64_t ggml_type) = 0;
  // The token embedding table: float32 [vocab, hidden_size] (ggml_type 0) or its packed rows
  // (ggml_type, with kInt8Panels where they are stored as panels), for forward's token ids.
  virtual void set_embedding(at::Tensor weight, int64_t ggml_type) = 0;

  // Whether steps of a few rows run every layer in one parallel region (the default; see
  // decoder_stack.cpp's SharedTeam) or each part in its own (tests and benchmarks compare them).
  virtual void set_one_region(bool enabled) = 0;
  // How many steps ran in one parallel region so far.
  virtual int64_t one_region_steps() const = 0;

  // Runs every layer over the step's rows; hidden [num_tokens, hidden_size] (written) ends as
  // the last layer's output, or hidden is the step's token ids (int64 [num_tokens]) and their
  // rows of the embedding table (set_embedding) are the layers' input. Returns the final norm
  // of the final_rows rows (int64 [R]) as float32 [R, hidden_size], or with `logits` their
  // head's logits (set_head), float32 [R, vocab].
  // cos and sin: each rotary embedding's [num_tokens, rotary_dim] rows, or with rope_rows (int64
  // [num_tokens]) tables [P, rotary_dim] of which token t rotates by row rope_rows[t] (its position).
  virtual at::Tensor forward(at::Tensor hidden, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                             std::vector<at::Tensor> key_caches, std::vector<at::Tensor> value_caches,
                             std::vector<at::Tensor> slot_mappings, std::optional<at::Tensor> kernel_rows,
                             std::vector<at::Tensor> block_tables, std::optional<at::Tensor> cu_seqlens_q,
                             std::optional<at::Tensor> context_lens, std::vector<int64_t> chunk_bounds,
                             std::vector<at::Tensor> chunk_blocks, c10::List<std::optional<at::Tensor>> chunk_masks,
                             at::Tensor final_rows, std::optional<at::Tensor> rope_rows, bool logits) const = 0;

  // LoRA (pagedrs/lora/slots.py's layout): the adapter slots of layer `layer`'s linear `linear`
  // (0 qkv, 1 o, 2 gate_up, 3 down): a float32 [slots, slices, rank, in_features] and, per output
  // slice, b[j] float32 [slots, rank, out_j] (B transposed). Held by reference: slots are filled in place.
  virtual void set_lora(int64_t layer, int64_t linear, at::Tensor a, std::vector<at::Tensor> b) = 0;

  // Each row's LoRA slot for the forward passes that follow (int64 [num_tokens], -1: none), or
  // none (no row has an adapter).
  virtual void set_lora_rows(std::optional<at::Tensor> row_slots) = 0;
};

// decoder_stack.cpp: an empty stack for a model of these sizes (fails loudly on sizes it cannot run).
c10::intrusive_ptr<DecoderStack> make_decoder_stack(int64_t hidden_size, int64_t num_heads, int64_t num_kv_heads,
                                                    int64_t head_size, int64_t intermediate_size, double eps);

// ---------------------------------------------------------------------------------------------
// Shared between sources

// A kernel type id is a ggml type, or a ggml type ORed with this flag: its activations are
// quantized to int8 per 32 features before the matmul (quant_matmul.cpp's "int8 activations";
// Q8_0, Q4_0 and Q4_1 with AVX2; other types and machines run the exact path).
constexpr int64_t kInt8Activations = 1 << 8;
// ORed with kInt8Activations: the weight's bytes are in quant_matmul.cpp's stored int8 panels
// (pack_int8_panels), which only the int8 path of an x86 build reads.
constexpr int64_t kInt8Panels = 1 << 9;
// Exact activations only: each row's bytes are in quant_matmul.cpp's scales-first order
// (pack_scales_first, quant_blocks.h), which only an AVX2 build reads.
constexpr int64_t kScalesFirst = 1 << 10;
constexpr int64_t kKernelFlags = kInt8Activations | kInt8Panels | kScalesFirst;  // a type id less these is the ggml type

// quant_matmul.cpp: out [num_tokens, out_features] = x [num_tokens, in_features] @
// dequant(weight)^T, all float32 and contiguous, weight packed in a GGUF block format
// (ggml_type may carry kInt8Activations).
void quant_matmul_f32(const float* x, const uint8_t* weight, float* out, int64_t num_tokens, int64_t in_features,
                      int64_t out_features, int64_t ggml_type);

// quant_matmul.cpp: the share `part` of `parts` of quant_matmul_f32 (the same values), on the
// calling thread alone, for a caller that splits a matmul between the threads of its own
// parallel region (decoder_stack.cpp's one-region decode); returns the output columns
// [begin, end) it wrote. Each part quantizes x for itself (int8 activations). Nothing is
// checked: it may not throw inside a parallel region, so the caller asks quant_matmul_splits
// first.
std::pair<int64_t, int64_t> quant_matmul_part_f32(const float* x, const uint8_t* weight, float* out,
                                                  int64_t num_tokens, int64_t in_features, int64_t out_features,
                                                  int64_t ggml_type, int part, int parts);
// quant_matmul.cpp: whether quant_matmul_part_f32 takes this matmul (a packed type it runs
// without torch's ops: not a float32 weight, not a step of kGemmTokens tokens or more).
bool quant_matmul_splits(int64_t num_tokens, int64_t out_features, int64_t ggml_type);

// quant_matmul.cpp: out[t * out_stride + n] = x[t * x_stride + :] . dequant(weight row n) for
// weight rows n in [row_begin, row_end), on the calling thread (callers split the work).
void quant_matmul_rows_f32(const float* x, int64_t x_stride, const uint8_t* weight, float* out, int64_t out_stride,
                           int64_t num_tokens, int64_t in_features, int64_t row_begin, int64_t row_end,
                           int64_t ggml_type);

// moe.cpp: one layer's experts: weights (moe.cpp's header comment), optional biases, activation.
struct ExpertWeights {
  at::Tensor gate_up;
  int64_t gate_up_type;
  at::Tensor down;
  int64_t down_type;
  std::optional<at::Tensor> gate_up_bias;  // float32 [E, 2 * I]
  std::optional<at::Tensor> down_bias;     // float32 [E, H]
  int64_t activation;
  float alpha;  // kSwigluOai's
  float limit;
};

// moe.cpp: checks one layer's experts against the hidden size; fails loudly.
void check_moe_experts(const ExpertWeights& experts, int64_t hidden_size);

// moe.cpp: out [num_tokens, H] (written) = x through each token's top_k experts, tensors checked
// by the caller (check_moe_experts; ids within [0, E)).
void fused_experts_f32(const at::Tensor& x, const int64_t* topk_ids, const float* topk_weights, int64_t top_k,
                       const ExpertWeights& experts, at::Tensor& out);

// quant_matmul.cpp: the instruction sets of the int8-activation path this build runs:
// "avx512-vnni", "avx-vnni", "avx2" (maddubs), or "none" (every type id runs the exact path).
std::string int8_activation_path();

// quant_matmul.cpp: bytes and weights of one stored block of a supported ggml type (32
// weights, 256 for the k-quants; kKernelFlags ignored); both fail loudly on any other type.
int64_t quant_block_bytes(int64_t ggml_type);
int64_t quant_block_weights(int64_t ggml_type);

// exp(x) for x <= 0 (a score minus its row's maximum) in a form the compiler vectorizes,
// unlike std::exp: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes' polynomial (about
// 1 ulp), 2^n by the exponent bits. Below -87 (2^n would be subnormal) it returns ~1e-38,
// which weighs nothing against the row's maximum key, whose term is 1.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * __builtin_bit_cast(float, (static_cast<int>(n) + 127) << 23);
}

// The MLP activations the kernels apply to a gate and an up row (decoder_stack.cpp, moe.cpp).
// kSwigluOai: gpt-oss's clamped SwiGLU, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
// g = min(gate, limit).
enum Activation : int64_t { kSilu = 0, kGeluTanh = 1, kGelu = 2, kSwigluOai = 3 };

// silu(gate) * up, with silu(g) = g / (1 + exp(-g)) written for an exp of non-positive
// arguments (it vectorizes; std::exp does not).
inline void silu_mul(const float* __restrict__ gate, const float* __restrict__ up, int64_t n, float* __restrict__ out) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float g = gate[j];
    const float e = exp_nonpositive(-std::abs(g));  // exp(-|g|)
    const float sigmoid = g >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
    out[j] = g * sigmoid * up[j];
  }
}

// gelu(gate) * up: torch's tanh approximation (Gemma's gelu_pytorch_tanh), or the exact erf form.
inline void gelu_mul(const float* __restrict__ gate, const float* __restrict__ up, int64_t n, bool tanh_form,
                     float* __restrict__ out) {
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f, kInvSqrt2 = 0.7071067811865476f;
  for (int64_t j = 0; j < n; ++j) {
    const float g = gate[j];
    const float cdf = tanh_form ? 0.5f * (1.f + std::tanh(kBeta * (g + kKappa * g * g * g)))
                                : 0.5f * (1.f + std::erf(g * kInvSqrt2));
    out[j] = g * cdf * up[j];
  }
}

// gpt-oss's clamped SwiGLU (kSwigluOai) of a gate and an up row.
inline void swiglu_oai(const float* __restrict__ gate, const float* __restrict__ up, int64_t n, float alpha,
                       float limit, float* __restrict__ out) {
  for (int64_t j = 0; j < n; ++j) {
    const float g = std::min(gate[j], limit);
    const float u = std::clamp(up[j], -limit, limit);
    out[j] = (u + 1.f) * (g / (1.f + std::exp(-alpha * g)));
  }
}

// out = act(gate) * up over n elements, act an Activation (alpha and limit: kSwigluOai's).
inline void activate_mul(int64_t activation, const float* gate, const float* up, int64_t n, float* out,
                         float alpha = 0.f, float limit = 0.f) {
  if (activation == kSilu) {
    silu_mul(gate, up, n, out);
  } else if (activation == kSwigluOai) {
    swiglu_oai(gate, up, n, alpha, limit, out);
  } else {
    gelu_mul(gate, up, n, activation == kGeluTanh, out);
  }
}

}  // namespace pagedrs_cpu
