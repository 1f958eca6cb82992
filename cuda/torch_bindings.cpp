// The one registration file: torch.ops.pagedrs.* schemas (written tensors marked `(a!)`) and
// their CUDA implementations, which check every tensor before launching.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <initializer_list>

#include "ops.h"

namespace {

using pagedrs::DType;

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      TORCH_CHECK(false, "pagedrs kernels support float32, float16 and bfloat16, got ", t.scalar_type());
  }
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "pagedrs: ", name, " must be a CUDA tensor, got one on ", t.device());
}

void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), "pagedrs: ", name, " must be contiguous");
}

void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* name) {
  TORCH_CHECK(a.device() == b.device(), "pagedrs: ", name, " is on ", b.device(), ", the cache on ", a.device());
}

void check_index(const at::Tensor& t, at::ScalarType type, int64_t dims, const char* name) {
  TORCH_CHECK(t.scalar_type() == type, "pagedrs: ", name, " must be ", type, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dims, "pagedrs: ", name, " must have ", dims, " dimensions, got ", t.dim());
}

void check_cache(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  check_cuda(key_cache, "key_cache");
  check_contiguous(key_cache, "key_cache");
  check_contiguous(value_cache, "value_cache");
  TORCH_CHECK(key_cache.dim() == 4, "pagedrs: a cache is [num_blocks, block_size, num_kv_heads, head_dim], got ",
              key_cache.sizes());
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "pagedrs: key_cache ", key_cache.sizes(),
              " and value_cache ", value_cache.sizes(), " differ in shape");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "pagedrs: key and value caches differ in dtype");
  check_same_device(key_cache, value_cache, "value_cache");
  dtype_of(key_cache);
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                       const at::Tensor& slot_mapping) {
  check_cache(key_cache, value_cache);
  const int64_t num_kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  for (const auto* t : {&key, &value}) {
    check_same_device(key_cache, *t, t == &key ? "key" : "value");
    TORCH_CHECK(t->dim() == 3 && t->size(1) == num_kv_heads && t->size(2) == head_dim,
                "pagedrs: key and value must be [num_tokens, ", num_kv_heads, ", ", head_dim, "], got ", t->sizes());
    TORCH_CHECK(t->scalar_type() == key_cache.scalar_type(), "pagedrs: key/value dtype ", t->scalar_type(),
                " differs from the cache's ", key_cache.scalar_type());
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == head_dim,
                "pagedrs: each token's key/value row must be contiguous (a token stride is fine)");
  }
  check_index(slot_mapping, at::kLong, 1, "slot_mapping");
  check_same_device(key_cache, slot_mapping, "slot_mapping");
  TORCH_CHECK(slot_mapping.size(0) == key.size(0) && key.size(0) == value.size(0),
              "pagedrs: slot_mapping, key and value must have one entry per token");
  const at::cuda::CUDAGuard guard(key_cache.device());
  pagedrs::reshape_and_cache(dtype_of(key_cache), key.data_ptr(), value.data_ptr(), key_cache.data_ptr(),
                             value_cache.data_ptr(), slot_mapping.contiguous().data_ptr<int64_t>(), key.size(0),
                             static_cast<int>(num_kv_heads), static_cast<int>(head_dim), key.stride(0),
                             value.stride(0), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The pairs run in parallel: no block may be both a source and a destination in one call (the
// scheduler's copy-on-write copies into freshly allocated blocks only).
void copy_blocks(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& block_mapping) {
  check_cache(key_cache, value_cache);
  check_index(block_mapping, at::kLong, 2, "block_mapping");
  check_same_device(key_cache, block_mapping, "block_mapping");
  TORCH_CHECK(block_mapping.size(1) == 2, "pagedrs: block_mapping must be [num_pairs, 2] (src, dst)");
  const at::cuda::CUDAGuard guard(key_cache.device());
  const int64_t elements_per_block = key_cache.numel() / key_cache.size(0);
  pagedrs::copy_blocks(dtype_of(key_cache), key_cache.data_ptr(), value_cache.data_ptr(),
                       block_mapping.contiguous().data_ptr<int64_t>(), block_mapping.size(0), elements_per_block,
                       at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Shared by the decode and prefill entry points: rows of sequence s are
// cu_seqlens_q[s]..cu_seqlens_q[s+1].
void attend(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q, const at::Tensor& context_lens,
            int64_t max_context_len, double scale, int64_t sliding_window) {
  check_cache(key_cache, value_cache);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "pagedrs: paged attention supports head sizes 64 and 128, got ",
              head_dim);
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &query}) {
    check_same_device(key_cache, *t, t == &out ? "out" : "query");
    check_contiguous(*t, t == &out ? "out" : "query");
    TORCH_CHECK(t->dim() == 3 && t->size(2) == head_dim, "pagedrs: query and out must be [num_rows, num_heads, ",
                head_dim, "], got ", t->sizes());
    TORCH_CHECK(t->scalar_type() == key_cache.scalar_type(), "pagedrs: query/out dtype ", t->scalar_type(),
                " differs from the cache's ", key_cache.scalar_type());
  }
  TORCH_CHECK(out.sizes() == query.sizes(), "pagedrs: out ", out.sizes(), " must match query ", query.sizes());
  const int64_t num_rows = query.size(0), num_heads = query.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "pagedrs: ", num_heads, " query heads do not group over ", num_kv_heads,
              " KV heads");
  TORCH_CHECK(num_heads / num_kv_heads <= 16, "pagedrs: at most 16 query heads per KV head, got ",
              num_heads / num_kv_heads);
  check_index(block_tables, at::kInt, 2, "block_tables");
  check_index(cu_seqlens_q, at::kInt, 1, "cu_seqlens_q");
  check_index(context_lens, at::kInt, 1, "context_lens");
  for (const auto* t : {&block_tables, &cu_seqlens_q, &context_lens}) {
    check_same_device(key_cache, *t, "block_tables / cu_seqlens_q / context_lens");
    check_contiguous(*t, "block_tables / cu_seqlens_q / context_lens");
  }
  const int64_t num_seqs = context_lens.size(0);
  TORCH_CHECK(cu_seqlens_q.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs,
              "pagedrs: cu_seqlens_q needs num_seqs + 1 entries and block_tables num_seqs rows");
  TORCH_CHECK(max_context_len >= 1 || num_rows == 0, "pagedrs: max_context_len must be at least 1");
  TORCH_CHECK(max_context_len <= block_tables.size(1) * block_size, "pagedrs: max_context_len ", max_context_len,
              " exceeds the block tables' ", block_tables.size(1) * block_size, " slots");
  if (num_rows == 0) return;
  const at::cuda::CUDAGuard guard(key_cache.device());
  const int num_partitions = pagedrs::num_partitions_for(static_cast<int>(max_context_len));
  const bool split_k =
      pagedrs::use_split_k(static_cast<int>(num_rows), static_cast<int>(num_kv_heads), num_partitions);
  at::Tensor tmp_out, tmp_max, tmp_sum;
  if (split_k) {
    const auto options = query.options().dtype(at::kFloat);
    tmp_out = at::empty({num_rows, num_heads, num_partitions, head_dim}, options);
    tmp_max = at::empty({num_rows, num_heads, num_partitions}, options);
    tmp_sum = at::empty({num_rows, num_heads, num_partitions}, options);
  }
  pagedrs::PagedAttentionArgs args{};
  args.dtype = dtype_of(key_cache);
  args.out = out.data_ptr();
  args.query = query.data_ptr();
  args.key_cache = key_cache.data_ptr();
  args.value_cache = value_cache.data_ptr();
  args.block_tables = block_tables.data_ptr<int>();
  args.cu_seqlens_q = cu_seqlens_q.data_ptr<int>();
  args.context_lens = context_lens.data_ptr<int>();
  args.tmp_out = split_k ? tmp_out.data_ptr<float>() : nullptr;
  args.tmp_max = split_k ? tmp_max.data_ptr<float>() : nullptr;
  args.tmp_sum = split_k ? tmp_sum.data_ptr<float>() : nullptr;
  args.num_seqs = static_cast<int>(num_seqs);
  args.num_rows = static_cast<int>(num_rows);
  args.num_heads = static_cast<int>(num_heads);
  args.num_kv_heads = static_cast<int>(num_kv_heads);
  args.head_dim = static_cast<int>(head_dim);
  args.block_size = static_cast<int>(block_size);
  args.max_blocks_per_seq = static_cast<int>(block_tables.size(1));
  args.num_partitions = num_partitions;
  args.split_k = split_k;
  args.sliding_window = static_cast<int>(sliding_window);
  args.scale = static_cast<float>(scale);
  pagedrs::paged_attention(args, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Decode: one query row per sequence (row s belongs to sequence s).
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& context_lens,
                     int64_t max_context_len, double scale, int64_t sliding_window) {
  TORCH_CHECK(query.dim() == 3 && query.size(0) == context_lens.size(0),
              "pagedrs: paged_attention (decode) takes one query row per sequence");
  const auto cu_seqlens_q = at::arange(context_lens.size(0) + 1, context_lens.options());
  attend(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens, max_context_len, scale,
         sliding_window);
}

// Prefill chunks over a cached prefix: varlen query rows, causal within each chunk.
void paged_prefill_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             const at::Tensor& cu_seqlens_q, const at::Tensor& context_lens, int64_t max_context_len,
                             double scale, int64_t sliding_window) {
  attend(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens, max_context_len, scale,
         sliding_window);
}

}  // namespace

TORCH_LIBRARY(pagedrs, m) {
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
  m.def("copy_blocks(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor block_mapping) -> ()");
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor context_lens, int max_context_len, float scale, int sliding_window) -> ()");
  m.def("paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor cu_seqlens_q, Tensor context_lens, int max_context_len, float scale, "
        "int sliding_window) -> ()");
}

TORCH_LIBRARY_IMPL(pagedrs, CUDA, m) {
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("copy_blocks", &copy_blocks);
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
