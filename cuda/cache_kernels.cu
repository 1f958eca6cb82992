// Writing a step's keys and values into the paged cache, and copy-on-write block copies.
#include <cstdint>

#include "dtype.cuh"
#include "ops.h"

namespace pagedrs {
namespace {

// One thread block per token; threads stride over its num_kv_heads * head_dim elements.
template <typename T>
__global__ void reshape_and_cache_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                         T* __restrict__ key_cache, T* __restrict__ value_cache,
                                         const int64_t* __restrict__ slot_mapping, int row_elements,
                                         int64_t key_stride, int64_t value_stride) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;
  // [num_blocks, block_size, kv_heads, head_dim] is [slots, row_elements]: slot-major.
  T* key_dst = key_cache + slot * row_elements;
  T* value_dst = value_cache + slot * row_elements;
  const T* key_src = key + token * key_stride;
  const T* value_src = value + token * value_stride;
  for (int i = threadIdx.x; i < row_elements; i += blockDim.x) {
    key_dst[i] = key_src[i];
    value_dst[i] = value_src[i];
  }
}

// One thread block per (pair, cache); threads stride over the block's elements.
template <typename T>
__global__ void copy_blocks_kernel(T* __restrict__ key_cache, T* __restrict__ value_cache,
                                   const int64_t* __restrict__ block_mapping, int64_t elements_per_block) {
  const int64_t pair = blockIdx.x;
  T* cache = blockIdx.y == 0 ? key_cache : value_cache;
  const int64_t src = block_mapping[2 * pair] * elements_per_block;
  const int64_t dst = block_mapping[2 * pair + 1] * elements_per_block;
  for (int64_t i = threadIdx.x; i < elements_per_block; i += blockDim.x) {
    cache[dst + i] = cache[src + i];
  }
}

template <typename T>
void launch_reshape_and_cache(const void* key, const void* value, void* key_cache, void* value_cache,
                              const int64_t* slot_mapping, int64_t num_tokens, int row_elements, int64_t key_stride,
                              int64_t value_stride, cudaStream_t stream) {
  const int threads = row_elements < 512 ? row_elements : 512;
  reshape_and_cache_kernel<T><<<static_cast<unsigned>(num_tokens), threads, 0, stream>>>(
      static_cast<const T*>(key), static_cast<const T*>(value), static_cast<T*>(key_cache),
      static_cast<T*>(value_cache), slot_mapping, row_elements, key_stride, value_stride);
}

template <typename T>
void launch_copy_blocks(void* key_cache, void* value_cache, const int64_t* block_mapping, int64_t num_pairs,
                        int64_t elements_per_block, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(num_pairs), 2);
  copy_blocks_kernel<T><<<grid, 256, 0, stream>>>(static_cast<T*>(key_cache), static_cast<T*>(value_cache),
                                                  block_mapping, elements_per_block);
}

}  // namespace

void reshape_and_cache(DType dtype, const void* key, const void* value, void* key_cache, void* value_cache,
                       const int64_t* slot_mapping, int64_t num_tokens, int num_kv_heads, int head_dim,
                       int64_t key_stride, int64_t value_stride, cudaStream_t stream) {
  if (num_tokens == 0) return;
  PAGEDRS_DISPATCH_DTYPE(dtype, launch_reshape_and_cache, key, value, key_cache, value_cache, slot_mapping,
                         num_tokens, num_kv_heads * head_dim, key_stride, value_stride, stream);
}

void copy_blocks(DType dtype, void* key_cache, void* value_cache, const int64_t* block_mapping, int64_t num_pairs,
                 int64_t elements_per_block, cudaStream_t stream) {
  if (num_pairs == 0) return;
  PAGEDRS_DISPATCH_DTYPE(dtype, launch_copy_blocks, key_cache, value_cache, block_mapping, num_pairs,
                         elements_per_block, stream);
}

}  // namespace pagedrs
