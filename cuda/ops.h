// pagedrs CUDA kernels: launchers over raw device pointers, so the kernels compile with nvcc
// alone (no torch headers). torch_bindings.cpp checks tensors and calls these.
//
// Layouts (row-major, contiguous):
//   key/value cache of one layer   [num_blocks, block_size, num_kv_heads, head_dim]
//   new keys/values of a step      [num_tokens, num_kv_heads, head_dim]
//   queries / attention output     [num_rows, num_heads, head_dim]
//   block tables                   [num_seqs, max_blocks_per_seq] int32
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace pagedrs {

// Element types the kernels are instantiated for.
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Writes key[t] and value[t] to slot slot_mapping[t] of the caches (slot = block * block_size
// + offset, so a cache is [slots, num_kv_heads, head_dim]); a negative slot is skipped
// (padding). key_stride / value_stride: elements between consecutive tokens' rows.
void reshape_and_cache(DType dtype, const void* key, const void* value, void* key_cache, void* value_cache,
                       const int64_t* slot_mapping, int64_t num_tokens, int num_kv_heads, int head_dim,
                       int64_t key_stride, int64_t value_stride, cudaStream_t stream);

// For every pair (src, dst) of block_mapping [num_pairs, 2]: copies block src of both caches
// onto block dst (copy-on-write before a forward pass).
void copy_blocks(DType dtype, void* key_cache, void* value_cache, const int64_t* block_mapping, int64_t num_pairs,
                 int64_t elements_per_block, cudaStream_t stream);

// Tokens of context a thread block scores at once (its shared-memory logits).
constexpr int kPartitionSize = 512;

// Paged attention of query rows over their sequences' cached context (the step's own keys
// must already be in the cache). Rows of sequence s are cu_seqlens_q[s] .. cu_seqlens_q[s+1];
// they are the last tokens of its context of context_lens[s] tokens, and each row attends to
// the context up to and including its own position (causal), and, with sliding_window > 0,
// only to the last sliding_window positions. A decode batch is the case of one row per
// sequence. With split_k, contexts longer than kPartitionSize are spread over one block per
// partition and the partial softmax results merged afterwards; tmp_out / tmp_max / tmp_sum
// are the workspace for that ([num_rows, num_heads, num_partitions, head_dim] and
// [num_rows, num_heads, num_partitions] floats; null without split_k).
// The caller guarantees (unchecked on the device): context_lens[s] >= the rows of s,
// cu_seqlens_q[num_seqs] == num_rows, max_context_len >= every context_lens[s], and block
// tables wide enough for their contexts.
struct PagedAttentionArgs {
  DType dtype;
  void* out;
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int* block_tables;
  const int* cu_seqlens_q;
  const int* context_lens;
  float* tmp_out;
  float* tmp_max;
  float* tmp_sum;
  int num_seqs;
  int num_rows;
  int num_heads;
  int num_kv_heads;
  int head_dim;
  int block_size;
  int max_blocks_per_seq;
  int num_partitions;
  bool split_k;
  int sliding_window;
  float scale;
};

inline int num_partitions_for(int max_context_len) {
  return max_context_len <= kPartitionSize ? 1 : (max_context_len + kPartitionSize - 1) / kPartitionSize;
}

// Split-K pays off when one block per (row, KV head) would leave the GPU idle; with more rows
// than this, blocks walk their partitions instead (and need no workspace).
constexpr long kSplitKMaxRowHeads = 2048;

inline bool use_split_k(int num_rows, int num_kv_heads, int num_partitions) {
  return num_partitions > 1 && static_cast<long>(num_rows) * num_kv_heads <= kSplitKMaxRowHeads;
}

void paged_attention(const PagedAttentionArgs& args, cudaStream_t stream);

}  // namespace pagedrs
