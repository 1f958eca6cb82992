// What one cpu/ source calls in another: the entry points the fused decoder stack
// (decoder_stack.cpp) runs without going back through the dispatcher, and the vectorizable
// exp they share. Each is defined (and documented with its layouts) in the file named beside it.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace pagedrs_cpu {

// paged_attention.cpp: query rows against their paged context; the step's keys and values
// must already be in the caches. Registered as torch.ops.pagedrs_cpu.paged_attention.
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                     const at::Tensor& context_lens, double scale, int64_t sliding_window);

// quant_matmul.cpp: out [num_tokens, out_features] = x [num_tokens, in_features] @
// dequant(weight)^T, all float32 and contiguous, weight packed in a GGUF block format.
void quant_matmul_f32(const float* x, const uint8_t* weight, float* out, int64_t num_tokens, int64_t in_features,
                      int64_t out_features, int64_t ggml_type);

// quant_matmul.cpp: bytes and weights of one stored block of a supported ggml type (32
// weights, 256 for the k-quants); both fail loudly on any other type.
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

}  // namespace pagedrs_cpu
