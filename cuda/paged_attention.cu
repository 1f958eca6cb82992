// PagedAttention: query rows against their sequences' paged key/value context, for decode
// (one row per sequence) and for prefill chunks over a cached prefix (several rows per
// sequence, causal), with grouped-query attention and an optional sliding window.
//
// One thread block computes one (query row, KV head): the `group` query heads that share the
// KV head are done together, so each key and value row is read once per block. The context is
// taken kPartitionSize tokens at a time, in three phases: (1) a warp per key row computes the
// scaled dot products with all the group's queries; (2) softmax numerators over the
// partition, a warp per query head; (3) each thread owns one output dimension (and, for
// 64-wide heads, half the rows) and accumulates numerators times values.
// Two ways over a long context: the block walks its partitions with an online softmax
// (rescaling to the running maximum), or, when there are too few rows to fill the GPU (a
// decode batch), split-K: one block per partition (blockIdx.z) and a second kernel merging
// the partial results, out = sum_p w_p * out_p / sum_p w_p with w_p = sum_p * exp(max_p - max).
#include <cfloat>
#include <cstdint>

#include "dtype.cuh"
#include "ops.h"

namespace pagedrs {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxGroup = 16;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// The sequence whose rows include `row`: the last s with cu_seqlens_q[s] <= row.
__device__ __forceinline__ int sequence_of(const int* __restrict__ cu_seqlens_q, int num_seqs, int row) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (cu_seqlens_q[mid] <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kThreads) paged_attention_kernel(PagedAttentionArgs args) {
  static_assert(HEAD_DIM % 32 == 0 && kThreads % HEAD_DIM == 0, "unsupported head size");
  constexpr int kPerLane = HEAD_DIM / 32;              // key elements per lane in phase 1
  constexpr int kRowsInParallel = kThreads / HEAD_DIM;  // value rows at once in phase 3

  const int row = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int group = args.num_heads / args.num_kv_heads;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int dim = threadIdx.x % HEAD_DIM;
  const int lane_row = threadIdx.x / HEAD_DIM;

  const int seq = sequence_of(args.cu_seqlens_q, args.num_seqs, row);
  const int query_len = args.cu_seqlens_q[seq + 1] - args.cu_seqlens_q[seq];
  // This row is the (context - query_len + i)-th token: it sees positions [0, context).
  const int context = args.context_lens[seq] - query_len + (row - args.cu_seqlens_q[seq]) + 1;
  const int window_start = args.sliding_window > 0 ? max(0, context - args.sliding_window) : 0;
  const int64_t out_head0 = static_cast<int64_t>(row) * args.num_heads + kv_head * group;
  // Split-K: this block does partition blockIdx.z. Otherwise it walks every partition of the
  // row, rescaling as it goes (online softmax).
  const int first = args.split_k ? blockIdx.z : window_start / kPartitionSize;
  const int last = args.split_k ? blockIdx.z : (context - 1) / kPartitionSize;

  if (args.split_k && max(first * kPartitionSize, window_start) >= min((first + 1) * kPartitionSize, context)) {
    // An empty partition (past this row's context, or before its window) weighs nothing in
    // the merge. The whole block leaves together, before any barrier.
    for (int i = threadIdx.x; i < group * HEAD_DIM; i += kThreads) {
      args.tmp_out[((out_head0 + i / HEAD_DIM) * args.num_partitions + first) * HEAD_DIM + i % HEAD_DIM] = 0.f;
    }
    if (threadIdx.x < group) {
      args.tmp_max[(out_head0 + threadIdx.x) * args.num_partitions + first] = -FLT_MAX;
      args.tmp_sum[(out_head0 + threadIdx.x) * args.num_partitions + first] = 0.f;
    }
    return;
  }

  extern __shared__ float shared[];
  float* q_shared = shared;                                // [group][HEAD_DIM]
  float* logits = q_shared + group * HEAD_DIM;             // [group][kPartitionSize]
  float* part_max = logits + group * kPartitionSize;       // [kMaxGroup]
  float* part_sum = part_max + kMaxGroup;                  // [kMaxGroup]
  float* run_max = part_sum + kMaxGroup;                   // [kMaxGroup]
  float* run_sum = run_max + kMaxGroup;                    // [kMaxGroup]
  float* scratch = run_sum + kMaxGroup;                    // [group][HEAD_DIM] when kRowsInParallel > 1

  const T* query = static_cast<const T*>(args.query);
  const T* key_cache = static_cast<const T*>(args.key_cache);
  const T* value_cache = static_cast<const T*>(args.value_cache);
  const int* block_table = args.block_tables + static_cast<int64_t>(seq) * args.max_blocks_per_seq;

  for (int i = threadIdx.x; i < group * HEAD_DIM; i += kThreads) {
    q_shared[i] = to_float(query[out_head0 * HEAD_DIM + i]);
  }
  if (threadIdx.x < kMaxGroup) {
    run_max[threadIdx.x] = -FLT_MAX;
    run_sum[threadIdx.x] = 0.f;
  }
  float acc[kMaxGroup];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) acc[g] = 0.f;
  __syncthreads();

  for (int partition = first; partition <= last; ++partition) {
    const int begin = max(partition * kPartitionSize, window_start);
    const int num_tokens = min((partition + 1) * kPartitionSize, context) - begin;  // >= 1 here

    // Phase 1: scores. A warp per key row; each lane holds kPerLane consecutive elements.
    for (int t = begin + warp; t < begin + num_tokens; t += kWarps) {
      const int64_t block = block_table[t / args.block_size];
      const int64_t slot = block * args.block_size + t % args.block_size;
      const T* key = key_cache + (slot * args.num_kv_heads + kv_head) * HEAD_DIM + lane * kPerLane;
      float k[kPerLane];
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) k[j] = to_float(key[j]);
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g >= group) break;
        const float* q = q_shared + g * HEAD_DIM + lane * kPerLane;
        float dot = 0.f;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) dot += q[j] * k[j];
        dot = warp_sum(dot);
        if (lane == 0) logits[g * kPartitionSize + (t - begin)] = dot * args.scale;
      }
    }
    __syncthreads();

    // Phase 2: softmax numerators over this partition, a warp per query head of the group.
    for (int g = warp; g < group; g += kWarps) {
      float* scores = logits + g * kPartitionSize;
      float m = -FLT_MAX;
      for (int i = lane; i < num_tokens; i += 32) m = fmaxf(m, scores[i]);
      m = warp_max(m);
      float sum = 0.f;
      for (int i = lane; i < num_tokens; i += 32) {
        const float e = expf(scores[i] - m);
        scores[i] = e;
        sum += e;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        part_max[g] = m;
        part_sum[g] = sum;
      }
    }
    __syncthreads();

    // Phase 3: numerators times values. Thread -> (dimension, which of the parallel rows).
    float part[kMaxGroup];
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) part[g] = 0.f;
    for (int t = begin + lane_row; t < begin + num_tokens; t += kRowsInParallel) {
      const int64_t block = block_table[t / args.block_size];
      const int64_t slot = block * args.block_size + t % args.block_size;
      const float v = to_float(value_cache[(slot * args.num_kv_heads + kv_head) * HEAD_DIM + dim]);
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g >= group) break;
        part[g] += logits[g * kPartitionSize + (t - begin)] * v;
      }
    }
    if (kRowsInParallel > 1) {
      // Sum the parallel rows into lane_row 0 (kThreads / HEAD_DIM is 2 here: heads of 64).
      if (lane_row == 1) {
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) { if (g >= group) break; scratch[g * HEAD_DIM + dim] = part[g]; }
      }
      __syncthreads();
      if (lane_row == 0) {
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) { if (g >= group) break; part[g] += scratch[g * HEAD_DIM + dim]; }
      }
    }

    if (args.split_k) {
      if (lane_row == 0) {
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
          if (g >= group) break;
          const int64_t head_part = (out_head0 + g) * args.num_partitions + partition;
          args.tmp_out[head_part * HEAD_DIM + dim] = part[g] / part_sum[g];
          if (dim == 0) {
            args.tmp_max[head_part] = part_max[g];
            args.tmp_sum[head_part] = part_sum[g];
          }
        }
      }
      return;  // one partition per block in split-K
    }

    // Online softmax: rescale what came before and this partition to their common maximum.
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g >= group) break;
      const float m = fmaxf(run_max[g], part_max[g]);
      acc[g] = acc[g] * expf(run_max[g] - m) + part[g] * expf(part_max[g] - m);
    }
    __syncthreads();  // every thread has read run_max; the next partition may overwrite logits
    if (threadIdx.x < group) {
      const int g = threadIdx.x;
      const float m = fmaxf(run_max[g], part_max[g]);
      run_sum[g] = run_sum[g] * expf(run_max[g] - m) + part_sum[g] * expf(part_max[g] - m);
      run_max[g] = m;
    }
    __syncthreads();
  }

  if (lane_row == 0) {
    T* out = static_cast<T*>(args.out);
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g >= group) break;
      out[(out_head0 + g) * HEAD_DIM + dim] = from_float<T>(acc[g] / run_sum[g]);
    }
  }
}

// Merges the partitions of one (row, head): a thread per output dimension.
template <typename T, int HEAD_DIM>
__global__ void merge_partitions_kernel(PagedAttentionArgs args) {
  const int64_t head = static_cast<int64_t>(blockIdx.x) * args.num_heads + blockIdx.y;
  const int dim = threadIdx.x;
  const float* maxes = args.tmp_max + head * args.num_partitions;
  const float* sums = args.tmp_sum + head * args.num_partitions;
  float m = -FLT_MAX;
  for (int p = 0; p < args.num_partitions; ++p) m = fmaxf(m, maxes[p]);
  float weight_sum = 0.f, acc = 0.f;
  for (int p = 0; p < args.num_partitions; ++p) {
    const float w = sums[p] * expf(maxes[p] - m);
    weight_sum += w;
    acc += w * args.tmp_out[(head * args.num_partitions + p) * HEAD_DIM + dim];
  }
  static_cast<T*>(args.out)[head * HEAD_DIM + dim] = from_float<T>(acc / weight_sum);
}

template <typename T, int HEAD_DIM>
void launch(const PagedAttentionArgs& args, cudaStream_t stream) {
  constexpr int kRowsInParallel = kThreads / HEAD_DIM;
  const int group = args.num_heads / args.num_kv_heads;
  const size_t shared_bytes =
      sizeof(float) * (group * (HEAD_DIM + kPartitionSize + (kRowsInParallel > 1 ? HEAD_DIM : 0)) + 4 * kMaxGroup);
  // Rows on x (up to 2^31 - 1 of them), KV heads on y, split-K partitions on z.
  const dim3 grid(args.num_rows, args.num_kv_heads, args.split_k ? args.num_partitions : 1);
  if (shared_bytes > 48 * 1024) {
    const cudaError_t error = cudaFuncSetAttribute(
        paged_attention_kernel<T, HEAD_DIM>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes));
    if (error != cudaSuccess) return;  // skip the launch: the caller's launch check reports the error
  }
  paged_attention_kernel<T, HEAD_DIM><<<grid, kThreads, shared_bytes, stream>>>(args);
  if (args.split_k) {
    merge_partitions_kernel<T, HEAD_DIM><<<dim3(args.num_rows, args.num_heads), HEAD_DIM, 0, stream>>>(args);
  }
}

template <typename T>
void launch_for_head_size(const PagedAttentionArgs& args, cudaStream_t stream) {
  if (args.head_dim == 64) {
    launch<T, 64>(args, stream);
  } else {
    launch<T, 128>(args, stream);
  }
}

}  // namespace

void paged_attention(const PagedAttentionArgs& args, cudaStream_t stream) {
  if (args.num_rows == 0) return;
  PAGEDRS_DISPATCH_DTYPE(args.dtype, launch_for_head_size, args, stream);
}

}  // namespace pagedrs
