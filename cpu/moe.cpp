// A mixture-of-experts MLP on the CPU: each token's top-k experts (chosen by the router, in
// Python or in decoder_stack.cpp) run over the tokens routed to them, and each token's output is
// the weighted sum of its experts' outputs. Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE layers run
// on it (python/pagedrs/layers/moe.py).
//
// A step's (token, slot) pairs are grouped by expert with one counting sort; every expert that
// has tokens runs its gate/up matmul, the activation and its down matmul once over all of them,
// and experts without tokens are never read: a single-stream decode of Qwen3-30B-A3B reads 8 of
// 128 experts per layer, which is what makes a mixture cheap to decode. The matmuls are the
// packed GGUF kernel of quant_matmul.cpp (llama.cpp stores experts as 3-D ffn_*_exps tensors, one
// packed [rows, row_bytes] matrix per expert) or torch's for float32 experts. Results equal a
// per-expert loop of "dequantize, then float matmul" (HF's eager MoE) up to the order of float
// additions; tests/kernels/test_moe.py holds the two side by side. Registered as
// torch.ops.pagedrs_cpu.fused_experts by torch_bindings.cpp.
//
// Dimensions:
//   num_tokens          T, rows of the step
//   top_k               K, experts per token
//   num_experts         E
//   hidden_size         H
//   intermediate_size   I, one expert's width (this rank's share of it under tensor parallelism)
//
// Layouts (contiguous, CPU):
//   x                   [T, H] float32
//   topk_ids            [T, K] int64, each in [0, E)
//   topk_weights        [T, K] float32, each slot's weight in the sum
//   gate_up             [E, 2 * I, H] float32 (gate rows, then up rows), or packed uint8
//                       [E, 2 * I, H / block_weights * block_bytes] of a quant_matmul.cpp type
//   down                [E, H, I] float32, or packed uint8 [E, H, I / block_weights * block_bytes]
//   gate_up_bias        optional float32 [E, 2 * I], down_bias optional float32 [E, H] (gpt-oss)
//   out                 [T, H] float32: sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]),
//                       added in slot order k = 0, 1, ... (deterministic whatever the threads)
//
// Work split: the packed path runs each matmul as one at::parallel_for over tasks (expert, range
// of kTaskRows weight rows), so a decode's few experts spread over every core and a batch's many
// experts share them evenly; the float path runs torch's matmul per active expert (each itself
// parallel).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "cpu_kernels.h"

namespace {

constexpr int64_t kF32 = 0;        // ggml's type id of float32: dense experts
constexpr int64_t kTaskRows = 64;  // weight rows of one thread task of the packed matmuls

// Rows [offsets[e], offsets[e + 1]) of a grouped buffer belong to expert e.
struct Groups {
  std::vector<int64_t> offsets;  // [E + 1]
  std::vector<int64_t> slot_of;  // grouped row -> t * K + k
};

Groups group_by_expert(const int64_t* topk_ids, int64_t num_slots, int64_t num_experts) {
  Groups groups{std::vector<int64_t>(num_experts + 1, 0), std::vector<int64_t>(num_slots)};
  for (int64_t s = 0; s < num_slots; ++s) ++groups.offsets[topk_ids[s] + 1];
  for (int64_t e = 0; e < num_experts; ++e) groups.offsets[e + 1] += groups.offsets[e];
  std::vector<int64_t> next(groups.offsets.begin(), groups.offsets.end() - 1);
  for (int64_t s = 0; s < num_slots; ++s) groups.slot_of[next[topk_ids[s]]++] = s;
  return groups;
}

// out rows of each active expert = its rows of x (grouped) @ W_e^T, W_e [out_features, in_features]
// the expert's matrix of `weight` ([E, out_features, ...]).
void grouped_matmul(const Groups& groups, const at::Tensor& x, const at::Tensor& weight, int64_t ggml_type,
                    int64_t in_features, int64_t out_features, at::Tensor& out) {
  const int64_t num_experts = static_cast<int64_t>(groups.offsets.size()) - 1;
  if (ggml_type == kF32) {
    for (int64_t e = 0; e < num_experts; ++e) {
      const int64_t begin = groups.offsets[e], end = groups.offsets[e + 1];
      if (begin == end) continue;
      at::Tensor rows = out.slice(0, begin, end);
      at::mm_out(rows, x.slice(0, begin, end), weight[e].t());
    }
    return;
  }
  struct Task {
    int64_t expert, row_begin, row_end;
  };
  std::vector<Task> tasks;
  for (int64_t e = 0; e < num_experts; ++e) {
    if (groups.offsets[e] == groups.offsets[e + 1]) continue;
    for (int64_t row = 0; row < out_features; row += kTaskRows) {
      tasks.push_back(Task{e, row, std::min(out_features, row + kTaskRows)});
    }
  }
  const int64_t expert_bytes = weight.size(1) * weight.size(2);
  const float* x_rows = x.data_ptr<float>();
  const uint8_t* weights = weight.data_ptr<uint8_t>();
  float* out_rows = out.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[i];
      const int64_t first = groups.offsets[task.expert];
      pagedrs_cpu::quant_matmul_rows_f32(x_rows + first * in_features, in_features,
                                         weights + task.expert * expert_bytes, out_rows + first * out_features,
                                         out_features, groups.offsets[task.expert + 1] - first, in_features,
                                         task.row_begin, task.row_end, ggml_type);
    }
  });
}

// rows of each expert (grouped) += its bias row, where the experts have biases (gpt-oss).
void add_expert_bias(const Groups& groups, const std::optional<at::Tensor>& bias, at::Tensor& rows) {
  if (!bias) return;
  const int64_t width = rows.size(1), num_experts = static_cast<int64_t>(groups.offsets.size()) - 1;
  const float* biases = bias->data_ptr<float>();
  float* data = rows.data_ptr<float>();
  at::parallel_for(0, num_experts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const float* b = biases + e * width;
      for (int64_t row = groups.offsets[e]; row < groups.offsets[e + 1]; ++row) {
        float* r = data + row * width;
#pragma omp simd
        for (int64_t j = 0; j < width; ++j) r[j] += b[j];
      }
    }
  });
}

void check_experts(const at::Tensor& weight, int64_t ggml_type, int64_t num_experts, int64_t out_features,
                   int64_t in_features, const char* name) {
  TORCH_CHECK(weight.device().is_cpu() && weight.is_contiguous() && weight.dim() == 3, "pagedrs_cpu: ", name,
              " must be a contiguous 3-D CPU tensor");
  int64_t row_width = in_features;
  if (ggml_type == kF32) {
    TORCH_CHECK(weight.scalar_type() == at::kFloat, "pagedrs_cpu: ", name, " (type F32) must be float32");
  } else {
    const int64_t block_weights = pagedrs_cpu::quant_block_weights(ggml_type);
    TORCH_CHECK(weight.scalar_type() == at::kByte, "pagedrs_cpu: ", name, " (packed) must be uint8");
    TORCH_CHECK(in_features % block_weights == 0, "pagedrs_cpu: ", name, "'s ", in_features,
                " input features are not whole blocks of ", block_weights);
    row_width = in_features / block_weights * pagedrs_cpu::quant_block_bytes(ggml_type);
  }
  TORCH_CHECK(weight.size(0) == num_experts && weight.size(1) == out_features && weight.size(2) == row_width,
              "pagedrs_cpu: ", name, " must be [", num_experts, ", ", out_features, ", ", row_width, "] for ggml type ",
              ggml_type, ", got ", weight.sizes());
}

}  // namespace

namespace pagedrs_cpu {

void check_moe_experts(const ExpertWeights& experts, int64_t hidden_size) {
  const int64_t activation = experts.activation;
  TORCH_CHECK(activation == kSilu || activation == kGeluTanh || activation == kGelu || activation == kSwigluOai,
              "pagedrs_cpu: activation must be 0 (silu), 1 (gelu tanh), 2 (gelu) or 3 (gpt-oss swiglu), got ",
              activation);
  const at::Tensor& gate_up = experts.gate_up;
  TORCH_CHECK(gate_up.dim() == 3 && gate_up.size(0) > 0 && gate_up.size(1) > 0 && gate_up.size(1) % 2 == 0 &&
                  hidden_size > 0,
              "pagedrs_cpu: experts need positive sizes and gate_up [E, 2 * I, ...]");
  const int64_t num_experts = gate_up.size(0), intermediate_size = gate_up.size(1) / 2;
  check_experts(gate_up, experts.gate_up_type, num_experts, 2 * intermediate_size, hidden_size, "gate_up");
  check_experts(experts.down, experts.down_type, num_experts, hidden_size, intermediate_size, "down");
  const std::pair<const std::optional<at::Tensor>*, int64_t> biases[] = {{&experts.gate_up_bias, 2 * intermediate_size},
                                                                          {&experts.down_bias, hidden_size}};
  for (const auto& [bias, width] : biases) {
    TORCH_CHECK(!bias->has_value() || ((*bias)->device().is_cpu() && (*bias)->scalar_type() == at::kFloat &&
                                       (*bias)->is_contiguous() && (*bias)->dim() == 2 &&
                                       (*bias)->size(0) == num_experts && (*bias)->size(1) == width),
                "pagedrs_cpu: an experts' bias must be contiguous float32 [", num_experts, ", ", width, "]");
  }
}

void fused_experts_f32(const at::Tensor& x, const int64_t* topk_ids, const float* topk_weights, int64_t top_k,
                       const ExpertWeights& experts, at::Tensor& out) {
  const at::Tensor &gate_up = experts.gate_up, &down = experts.down;
  const int64_t num_tokens = x.size(0), hidden_size = x.size(1), num_slots = num_tokens * top_k;
  const int64_t num_experts = gate_up.size(0), intermediate_size = gate_up.size(1) / 2;
  if (num_tokens == 0) return;
  const Groups groups = group_by_expert(topk_ids, num_slots, num_experts);
  // Each slot's row of x, grouped by expert.
  const auto options = x.options();
  at::Tensor grouped = at::empty({num_slots, hidden_size}, options);
  const float* x_rows = x.data_ptr<float>();
  float* grouped_rows = grouped.data_ptr<float>();
  at::parallel_for(0, num_slots, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* source = x_rows + groups.slot_of[row] / top_k * hidden_size;
      std::copy(source, source + hidden_size, grouped_rows + row * hidden_size);
    }
  });
  at::Tensor gate_up_out = at::empty({num_slots, 2 * intermediate_size}, options);
  grouped_matmul(groups, grouped, gate_up, experts.gate_up_type, hidden_size, 2 * intermediate_size, gate_up_out);
  add_expert_bias(groups, experts.gate_up_bias, gate_up_out);
  at::Tensor activated = at::empty({num_slots, intermediate_size}, options);
  const float* gate_up_rows = gate_up_out.data_ptr<float>();
  float* activated_rows = activated.data_ptr<float>();
  at::parallel_for(0, num_slots, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* gate = gate_up_rows + row * 2 * intermediate_size;
      activate_mul(experts.activation, gate, gate + intermediate_size, intermediate_size,
                   activated_rows + row * intermediate_size, experts.alpha, experts.limit);
    }
  });
  // Each slot's expert output, reused for the grouped input (same shape, no longer needed).
  grouped_matmul(groups, activated, down, experts.down_type, intermediate_size, hidden_size, grouped);
  add_expert_bias(groups, experts.down_bias, grouped);
  std::vector<int64_t> row_of(num_slots);
  for (int64_t row = 0; row < num_slots; ++row) row_of[groups.slot_of[row]] = row;
  float* out_rows = out.data_ptr<float>();
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* target = out_rows + t * hidden_size;
      std::fill(target, target + hidden_size, 0.f);
      for (int64_t k = 0; k < top_k; ++k) {
        const float weight = topk_weights[t * top_k + k];
        const float* source = grouped_rows + row_of[t * top_k + k] * hidden_size;
#pragma omp simd
        for (int64_t j = 0; j < hidden_size; ++j) target[j] += weight * source[j];
      }
    }
  });
}

// The registered op (see the header for layouts): checks every tensor, then fused_experts_f32.
at::Tensor fused_experts(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                         const at::Tensor& gate_up, int64_t gate_up_type, const at::Tensor& down, int64_t down_type,
                         int64_t intermediate_size, int64_t activation, const std::optional<at::Tensor>& gate_up_bias,
                         const std::optional<at::Tensor>& down_bias, double alpha, double limit) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2,
              "pagedrs_cpu: x must be contiguous float32 [num_tokens, hidden_size]");
  const int64_t num_tokens = x.size(0), hidden_size = x.size(1);
  const ExpertWeights experts{gate_up,      gate_up_type, down, down_type, gate_up_bias, down_bias, activation,
                              static_cast<float>(alpha), static_cast<float>(limit)};
  check_moe_experts(experts, hidden_size);
  TORCH_CHECK(gate_up.size(1) == 2 * intermediate_size, "pagedrs_cpu: gate_up must have 2 * ", intermediate_size,
              " rows per expert, got ", gate_up.size(1));
  TORCH_CHECK(topk_ids.device().is_cpu() && topk_ids.scalar_type() == at::kLong && topk_ids.is_contiguous() &&
                  topk_ids.dim() == 2 && topk_ids.size(0) == num_tokens && topk_ids.size(1) > 0,
              "pagedrs_cpu: topk_ids must be contiguous int64 [", num_tokens, ", top_k]");
  const int64_t top_k = topk_ids.size(1), num_experts = gate_up.size(0);
  TORCH_CHECK(topk_weights.device().is_cpu() && topk_weights.scalar_type() == at::kFloat &&
                  topk_weights.is_contiguous() && topk_weights.sizes() == topk_ids.sizes(),
              "pagedrs_cpu: topk_weights must be contiguous float32 [", num_tokens, ", ", top_k, "]");
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  for (int64_t s = 0; s < num_tokens * top_k; ++s) {
    TORCH_CHECK(ids[s] >= 0 && ids[s] < num_experts, "pagedrs_cpu: expert id ", ids[s], " is outside [0, ",
                num_experts, ")");
  }
  at::Tensor out = at::empty({num_tokens, hidden_size}, x.options());
  fused_experts_f32(x, ids, topk_weights.data_ptr<float>(), top_k, experts, out);
  return out;
}

}  // namespace pagedrs_cpu
