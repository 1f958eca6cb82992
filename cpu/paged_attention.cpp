// PagedAttention on the CPU: query rows against their sequences' paged key/value context,
// read in place through the block tables (no gather copy), for decodes (one row per sequence)
// and prefill chunks over a cached prefix (several rows per sequence, causal) in one call,
// with grouped-query attention and an optional sliding window. Built and loaded by
// python/pagedrs/kernels/cpu.py; registered as torch.ops.pagedrs_cpu.paged_attention by
// torch_bindings.cpp.
//
// Dimensions:
//   num_seqs        sequences of the step
//   num_rows        query rows of the step (a decode has one, a prefill chunk several)
//   num_heads       query heads; num_kv_heads divides it, group = num_heads / num_kv_heads
//   num_kv_heads    key/value heads
//   head_size       elements of one head (any size: the inner loops run over it)
//   block_size      token slots of one cache block (any size)
//
// Layouts:
//   query, out      [num_rows, num_heads, head_size]; heads contiguous, any row stride
//   key/value cache [num_blocks, block_size, num_kv_heads, head_size], contiguous; the
//                   query's dtype, or bfloat16 / float16 / float8_e4m3fn under float32
//                   queries (a 16-bit or fp8 cache of a float32 model: each row is converted
//                   to float32 as it is read)
//   block_tables    [num_seqs, max_blocks_per_seq] int32
//   cu_seqlens_q    [num_seqs + 1] int32: rows of sequence s are cu_seqlens_q[s] .. [s + 1]
//   context_lens    [num_seqs] int32: tokens sequence s attends to, its new rows included
//
// Rows of a sequence are the last tokens of its context: row i of a sequence with q rows and
// context c is at position p = c - q + i and sees the keys at positions [0, p], or with
// sliding_window > 0 only those > p - sliding_window (Mistral's rule). With sinks (gpt-oss),
// head h's softmax has one more logit, sinks[h], whose probability goes to no value.
//
// Work split: one item is (a tile of up to kRowTile consecutive rows of one sequence, one KV
// head); a decode is a tile of one row. The item computes all group * rows query vectors
// together, so each key and value row is loaded from the cache once per item, and walks the
// context kKeyTile keys at a time with an online softmax in float32 (scores of the tile, then
// rescale the running sums to the new maximum, then add probabilities times values). Threads
// (torch's pool, at::parallel_for) take items from a shared counter, so ragged lengths in a
// mixed batch still spread over every core.
//
// Long contexts split: an item whose keys run past kSplitKeys is cut at the multiples of
// kSplitKeys (absolute key positions) into parts, each an item of its own that leaves its
// unnormalized sums, maximum and sum of exponentials per vector in the plan's partials; the
// part that finishes last merges them in part order and writes the output. Where the parts
// fall depends on the positions alone, not on the batch, the row tile or the thread count, so a
// row gets the same bits alone or among others (as without a split: a part's tiles start at
// the part's first key, the multiples of kKeyTile an unsplit walk from key 0 reaches too, and a
// row that sees one part only merges to exactly that part's values). A single decode's few
// items (one a KV head) no longer leave cores idle: with 3 KV heads on 2 threads every layer
// waited for one thread's second item.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu_kernels.h"
#include "kv_rows.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

using pagedrs_cpu::exp_nonpositive;

constexpr int kRowTile = 8;   // prefill rows that share one pass over their context
constexpr int kKeyTile = 64;  // keys scored before the softmax is brought up to date
// An item's keys past this are split in parts (above). On a 2-core Zen 4 VM, single-stream int8
// decode steps alternated one by one with and without: 512 keys x1.04-1.055 at contexts of
// 768-1535, nothing below; 256 keys the same there and x1.02-1.03 at 256-767, but a batch of
// 16 at ~1000 keys x0.96 (each part's start costs) where 512 gave x1.01.
constexpr int kSplitKeys = 8 * kKeyTile;

// One work item: rows [first_row, first_row + num_rows) of sequence seq, KV head kv_head.
struct WorkItem {
  int seq;
  int first_row;
  int num_rows;
  int kv_head;
  int key_begin;  // the keys this item walks: [key_begin, key_end) (each row sees its own of them)
  int key_end;
  int split = -1;  // for a part of a split item: its Split's index, and its part in it
  int part = 0;
};

// The parts of one split item: part p's partial starts at float first + p * vectors *
// (head_size + 2) of the plan's buffer (vectors: the item's rows times the query heads of a KV
// head, attend_item's num_vectors).
struct Split {
  int64_t first;
  int num_parts;
};

template <typename T>
inline void load_row(const T* __restrict__ src, float* __restrict__ dst, int n, float factor) {
#pragma omp simd
  for (int d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]) * factor;
}

// A float16 or fp8 cache's row, converted in vector registers (kv_rows.h: c10's conversions
// do not vectorize).
inline void load_row(const c10::Half* __restrict__ src, float* __restrict__ dst, int n, float factor) {
  pagedrs_cpu::fp16_row_to_float(reinterpret_cast<const uint16_t*>(src), dst, n, factor);
}

inline void load_row(const c10::Float8_e4m3fn* __restrict__ src, float* __restrict__ dst, int n, float factor) {
  pagedrs_cpu::fp8_e4m3_row_to_float(reinterpret_cast<const uint8_t*>(src), dst, n, factor);
}

// Lanes of the partial sums of a dot product: one AVX-512 register, two AVX2 or four NEON ones.
constexpr int kLanes = 16;

#ifdef __AVX2__
// out[k] = key k's four lanes b_k summed as (l0 + l2) + (l1 + l3), the four keys side by side.
inline void store_sums(__m128 b0, __m128 b1, __m128 b2, __m128 b3, float* out) {
  const __m128 s01 = _mm_add_ps(_mm_unpacklo_ps(b0, b1), _mm_unpackhi_ps(b0, b1));
  const __m128 s23 = _mm_add_ps(_mm_unpacklo_ps(b2, b3), _mm_unpackhi_ps(b2, b3));
  _mm_storeu_ps(out, _mm_add_ps(_mm_movelh_ps(s01, s23), _mm_movehl_ps(s23, s01)));
}
#endif

// out[j] = q . keys[j] for four keys at once: q is read once, and each key's partial sums stay
// in kLanes lanes until one pairwise reduction at the end (an `omp simd reduction` would sum
// the lanes one by one). A head size of whole registers keeps the lanes in registers: GCC kept
// the arrays' version on the stack between the loop and the reduction, and that version took
// 3-10% longer per decode attention call (Zen 5, contexts of 300-1500, both builds). The same
// sums in the same order either way: the same bits.
inline void dot4(const float* __restrict__ q, const float* const* keys, int n, float* out) {
#ifdef __AVX512F__
  if (n % kLanes == 0) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int d = 0; d < n; d += kLanes) {
      const __m512 x = _mm512_loadu_ps(q + d);
      s0 = _mm512_fmadd_ps(x, _mm512_loadu_ps(keys[0] + d), s0);
      s1 = _mm512_fmadd_ps(x, _mm512_loadu_ps(keys[1] + d), s1);
      s2 = _mm512_fmadd_ps(x, _mm512_loadu_ps(keys[2] + d), s2);
      s3 = _mm512_fmadd_ps(x, _mm512_loadu_ps(keys[3] + d), s3);
    }
    const auto halves = [](__m512 s) {  // lanes j + (j + 8), then j + (j + 4)
      const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(s),
                                     _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
      return _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    };
    store_sums(halves(s0), halves(s1), halves(s2), halves(s3), out);
    return;
  }
#elif defined(__AVX2__)
  if (n % kLanes == 0) {  // the same, each key's 16 lanes in two registers (lanes 0-7, 8-15)
    __m256 s[4][2];
    for (auto& key : s) key[0] = key[1] = _mm256_setzero_ps();
    for (int d = 0; d < n; d += kLanes) {
      const __m256 x0 = _mm256_loadu_ps(q + d), x1 = _mm256_loadu_ps(q + d + kLanes / 2);
      for (int k = 0; k < 4; ++k) {
        s[k][0] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(keys[k] + d), s[k][0]);
        s[k][1] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(keys[k] + d + kLanes / 2), s[k][1]);
      }
    }
    const auto halves = [](const __m256* key) {
      const __m256 a = _mm256_add_ps(key[0], key[1]);
      return _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    };
    store_sums(halves(s[0]), halves(s[1]), halves(s[2]), halves(s[3]), out);
    return;
  }
#endif
  const float* __restrict__ k0 = keys[0];
  const float* __restrict__ k1 = keys[1];
  const float* __restrict__ k2 = keys[2];
  const float* __restrict__ k3 = keys[3];
  float s0[kLanes] = {}, s1[kLanes] = {}, s2[kLanes] = {}, s3[kLanes] = {};
  int d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      s0[j] += q[d + j] * k0[d + j];
      s1[j] += q[d + j] * k1[d + j];
      s2[j] += q[d + j] * k2[d + j];
      s3[j] += q[d + j] * k3[d + j];
    }
  }
  for (int j = 0; d < n; ++d, ++j) {  // a head size that is not a multiple of kLanes
    s0[j] += q[d] * k0[d];
    s1[j] += q[d] * k1[d];
    s2[j] += q[d] * k2[d];
    s3[j] += q[d] * k3[d];
  }
  // Transposing reduction: halve the lanes and interleave the keys, until lane j of one
  // register holds key j's sum (adds of whole registers only).
#ifdef __AVX2__
  // The same adds in the same order, in registers: GCC leaves the arrays' version below as
  // scalar loads and adds through the stack (about half of a one-token decode's attention).
  const auto halves = [](const float* s) {  // lanes j + (j + 8), then j + (j + 4): 4 lanes
    const __m256 a = _mm256_add_ps(_mm256_loadu_ps(s), _mm256_loadu_ps(s + kLanes / 2));
    return _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  };
  store_sums(halves(s0), halves(s1), halves(s2), halves(s3), out);
#else
  float h01[kLanes], h23[kLanes];
  for (int j = 0; j < kLanes / 2; ++j) {
    h01[j] = s0[j] + s0[j + kLanes / 2];
    h01[j + kLanes / 2] = s1[j] + s1[j + kLanes / 2];
    h23[j] = s2[j] + s2[j + kLanes / 2];
    h23[j + kLanes / 2] = s3[j] + s3[j + kLanes / 2];
  }
  float q4[kLanes];  // [key 0: 4 lanes | key 1 | key 2 | key 3]
  for (int j = 0; j < kLanes / 4; ++j) {
    q4[j] = h01[j] + h01[j + kLanes / 4];
    q4[j + kLanes / 4] = h01[j + kLanes / 2] + h01[j + 3 * kLanes / 4];
    q4[j + kLanes / 2] = h23[j] + h23[j + kLanes / 4];
    q4[j + 3 * kLanes / 4] = h23[j + kLanes / 2] + h23[j + 3 * kLanes / 4];
  }
  for (int k = 0; k < 4; ++k) {
    const float* lanes = q4 + k * (kLanes / 4);
    out[k] = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
  }
#endif
}

// The sum and the maximum of x[0..n), kLanes at a time (vectorized; an `omp simd
// reduction` leaves GCC's loop scalar here).
inline float sum_of(const float* __restrict__ x, int n) {
  float lanes[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] += x[i + j];
  for (int j = 0; i < n; ++i, ++j) lanes[j] += x[i];
  float sum = 0.f;
  for (int j = 0; j < kLanes; ++j) sum += lanes[j];
  return sum;
}

inline float max_of(const float* __restrict__ x, int n) {
  float lanes[kLanes];
  std::fill(lanes, lanes + kLanes, -std::numeric_limits<float>::infinity());
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] = std::max(lanes[j], x[i + j]);
  for (int j = 0; i < n; ++i, ++j) lanes[j] = std::max(lanes[j], x[i]);
  return *std::max_element(lanes, lanes + kLanes);
}

inline float dot(const float* __restrict__ a, const float* __restrict__ b, int n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int d = 0; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// acc += sum_j p[j] * values[j] over eight value rows: acc is loaded and stored once.
inline void axpy8(const float* p, const float* const* values, float* __restrict__ acc, int n) {
  const float* __restrict__ v0 = values[0];
  const float* __restrict__ v1 = values[1];
  const float* __restrict__ v2 = values[2];
  const float* __restrict__ v3 = values[3];
  const float* __restrict__ v4 = values[4];
  const float* __restrict__ v5 = values[5];
  const float* __restrict__ v6 = values[6];
  const float* __restrict__ v7 = values[7];
  const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3], p4 = p[4], p5 = p[5], p6 = p[6], p7 = p[7];
#pragma omp simd
  for (int d = 0; d < n; ++d)
    acc[d] += (p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d]) + (p4 * v4[d] + p5 * v5[d] + p6 * v6[d] + p7 * v7[d]);
}

inline void axpy(float p, const float* __restrict__ value, float* __restrict__ acc, int n) {
#pragma omp simd
  for (int d = 0; d < n; ++d) acc[d] += p * value[d];
}

struct Args {
  const void* query;
  void* out;
  const void* key_cache;
  const void* value_cache;
  const int* block_tables;
  const int* cu_seqlens_q;
  const int* context_lens;
  int64_t query_row_stride;  // elements between consecutive query rows
  int64_t out_row_stride;
  int num_heads;
  int num_kv_heads;
  int head_size;
  int block_size;
  int max_blocks_per_seq;
  int sliding_window;
  float scale;
  float softcap;  // > 0: scores become softcap * tanh(score / softcap) (Gemma 2)
  const float* sinks;  // [num_heads] or null: a logit per head that joins every row's softmax
                       // with no value (gpt-oss's attention sinks)
  // Split items (see the top): each part's partial (its vectors' head_size sums, then their
  // maxima, then their sums of exponentials; where: Split), and each split's count of finished
  // parts (from 0).
  const Split* splits = nullptr;
  float* partials = nullptr;
  std::atomic<int>* parts_done = nullptr;
};

// Per-thread scratch, kept by each of torch's threads across calls and grown to a call's sizes
// (a decode layer's attention is a few microseconds: allocating and zeroing ~40 KB per thread
// per call was a measurable part of it). Every entry is written before it is read. A "vector"
// is one (query row, query head) of an item.
struct Scratch {
  std::vector<float> queries;      // [vectors, head_size], pre-scaled
  std::vector<float> acc;          // [vectors, head_size]: unnormalized output
  std::vector<float> scores;       // [vectors, kKeyTile]: scores, then probabilities
  std::vector<float> max_score;    // [vectors]
  std::vector<float> sum_exp;      // [vectors]
  std::vector<int> visible_begin;  // [vectors]: first key of the tile the vector sees
  std::vector<int> visible_end;    // [vectors]: one past its last
  std::vector<float> key_tile;     // [kKeyTile, head_size]: a half-precision tile as float32
  std::vector<float> value_tile;   // [kKeyTile, head_size]

  void reserve(int num_vectors, int head_size) {
    const auto grow = [](auto& v, size_t n) {
      if (v.size() < n) v.resize(n);
    };
    const size_t vectors = static_cast<size_t>(num_vectors), row = static_cast<size_t>(head_size);
    grow(queries, vectors * row);
    grow(acc, vectors * row);
    grow(scores, vectors * kKeyTile);
    grow(max_score, vectors);
    grow(sum_exp, vectors);
    grow(visible_begin, vectors);
    grow(visible_end, vectors);
    grow(key_tile, kKeyTile * row);
    grow(value_tile, kKeyTile * row);
  }
};

// NOTE: a tile's rows lie in blocks scattered over the cache, which the hardware prefetcher
// cannot foresee; asking for the next tile's rows while this one is computed keeps many loads
// in flight. Into L2 (locality 2), not L1: a tile's keys and values outgrow L1, and the
// measured decode step was a third faster than with L1 prefetches.
template <typename T>
inline void prefetch_row(const T* row, int n) {
  const char* bytes = reinterpret_cast<const char*>(row);
  const int64_t num_bytes = static_cast<int64_t>(n) * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0; b < num_bytes; b += 64) __builtin_prefetch(bytes + b, 0, 2);
}

// A key or value row as float32: the cache's own row when it already is, else converted into buf.
template <typename T>
inline const float* as_float(const T* row, float* buf, int n) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    load_row(row, buf, n, 1.f);
    return buf;
  }
}

// A part of a split item (see the top): leaves its vectors' sums, maxima and sums of
// exponentials in its partial; the part that finishes last merges every part's, in part order,
// into `scratch` and returns true (the caller writes the output from there), the others false.
// A part a vector sees none of left a maximum of -inf and zero sums: it adds exactly nothing.
inline bool merge_parts(const Args& args, const WorkItem& item, int num_vectors, Scratch& scratch) {
  const Split& split = args.splits[item.split];
  const int64_t head_size = args.head_size;
  const auto partial = [&](int part) { return args.partials + split.first + part * num_vectors * (head_size + 2); };
  float* mine = partial(item.part);
  std::copy(scratch.acc.begin(), scratch.acc.begin() + num_vectors * head_size, mine);
  std::copy(scratch.max_score.begin(), scratch.max_score.begin() + num_vectors, mine + num_vectors * head_size);
  std::copy(scratch.sum_exp.begin(), scratch.sum_exp.begin() + num_vectors, mine + num_vectors * (head_size + 1));
  // acq_rel: the last part sees every other part's partial.
  if (args.parts_done[item.split].fetch_add(1, std::memory_order_acq_rel) != split.num_parts - 1) return false;
  for (int v = 0; v < num_vectors; ++v) {
    float max_score = -std::numeric_limits<float>::infinity();
    for (int part = 0; part < split.num_parts; ++part) {
      max_score = std::max(max_score, partial(part)[num_vectors * head_size + v]);
    }
    float* acc = scratch.acc.data() + v * head_size;
    std::fill(acc, acc + head_size, 0.f);
    float sum_exp = 0.f;
    for (int part = 0; part < split.num_parts; ++part) {
      const float* from = partial(part);
      const float scale = std::exp(from[num_vectors * head_size + v] - max_score);  // 0 for a part it did not see
      sum_exp += from[num_vectors * (head_size + 1) + v] * scale;
      const float* part_acc = from + v * head_size;
#pragma omp simd
      for (int64_t d = 0; d < head_size; ++d) acc[d] += part_acc[d] * scale;
    }
    scratch.max_score[v] = max_score;
    scratch.sum_exp[v] = sum_exp;
  }
  return true;
}

// T: the query's and the output's dtype; C: the caches' (the query's, or a 16-bit or fp8 cache
// under float32 queries).
template <typename T, typename C>
void attend_item(const Args& args, const WorkItem& item, Scratch& scratch) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int group = args.num_heads / args.num_kv_heads;
  const int head_size = args.head_size;
  const int num_vectors = item.num_rows * group;  // vector v: row v / group, head v % group
  const int query_len = args.cu_seqlens_q[item.seq + 1] - args.cu_seqlens_q[item.seq];
  const int context = args.context_lens[item.seq];
  const int* block_table = args.block_tables + static_cast<int64_t>(item.seq) * args.max_blocks_per_seq;
  // Position of the item's first row; its row r is at first_pos + r.
  const int first_pos = context - query_len + (item.first_row - args.cu_seqlens_q[item.seq]);
  const int window = args.sliding_window;
  const int keys_begin = item.key_begin, keys_end = item.key_end;  // (work_items: the rows' keys, or a part's)

  const T* query = static_cast<const T*>(args.query);
  for (int v = 0; v < num_vectors; ++v) {
    const int row = item.first_row + v / group, head = item.kv_head * group + v % group;
    load_row(query + row * args.query_row_stride + static_cast<int64_t>(head) * head_size,
             scratch.queries.data() + static_cast<int64_t>(v) * head_size, head_size, args.scale);
  }
  std::fill(scratch.acc.begin(), scratch.acc.begin() + static_cast<int64_t>(num_vectors) * head_size, 0.f);
  std::fill(scratch.max_score.begin(), scratch.max_score.begin() + num_vectors, kNegInf);
  std::fill(scratch.sum_exp.begin(), scratch.sum_exp.begin() + num_vectors, 0.f);

  const C* key_cache = static_cast<const C*>(args.key_cache);
  const C* value_cache = static_cast<const C*>(args.value_cache);
  const int64_t token_stride = static_cast<int64_t>(args.num_kv_heads) * head_size;
  const int64_t head_offset = static_cast<int64_t>(item.kv_head) * head_size;
  const float* key_rows[kKeyTile];
  const float* value_rows[kKeyTile];
  int64_t offsets[2][kKeyTile];  // cache offsets of this tile's rows and of the next tile's

  // Cache offsets of the rows of keys [tile_begin, tile_begin + kKeyTile), walking the block
  // table (no division per key); each row is prefetched as it is found.
  auto locate_tile = [&](int tile_begin, int64_t* tile_offsets) {
    const int tile_len = std::min(kKeyTile, keys_end - tile_begin);
    int block = tile_begin / args.block_size, in_block = tile_begin % args.block_size;
    int64_t block_start = static_cast<int64_t>(block_table[block]) * args.block_size;
    for (int t = 0; t < tile_len; ++t) {
      if (in_block == args.block_size) {
        in_block = 0;
        block_start = static_cast<int64_t>(block_table[++block]) * args.block_size;
      }
      const int64_t offset = (block_start + in_block++) * token_stride + head_offset;
      prefetch_row(key_cache + offset, head_size);
      prefetch_row(value_cache + offset, head_size);
      tile_offsets[t] = offset;
    }
  };

  locate_tile(keys_begin, offsets[0]);
  for (int tile_begin = keys_begin, tile = 0; tile_begin < keys_end; tile_begin += kKeyTile, tile ^= 1) {
    const int tile_len = std::min(kKeyTile, keys_end - tile_begin);
    // The next tile's rows start arriving while this one is computed.
    if (tile_begin + kKeyTile < keys_end) locate_tile(tile_begin + kKeyTile, offsets[tile ^ 1]);
    for (int t = 0; t < tile_len; ++t) {
      const int64_t offset = offsets[tile][t];
      key_rows[t] = as_float(key_cache + offset, scratch.key_tile.data() + t * head_size, head_size);
      value_rows[t] = as_float(value_cache + offset, scratch.value_tile.data() + t * head_size, head_size);
    }
    // (1) Scores. A row sees one contiguous run of the tile's keys; the rest score -inf.
    for (int v = 0; v < num_vectors; ++v) {
      const int row_pos = first_pos + v / group;
      const int begin = std::clamp((window > 0 ? row_pos - window + 1 : 0) - tile_begin, 0, tile_len);
      const int end = std::max(begin, std::min(tile_len, row_pos + 1 - tile_begin));
      scratch.visible_begin[v] = begin;
      scratch.visible_end[v] = end;
      float* row_scores = scratch.scores.data() + v * kKeyTile;
      const float* q = scratch.queries.data() + static_cast<int64_t>(v) * head_size;
      std::fill(row_scores, row_scores + begin, kNegInf);
      int t = begin;
      for (; t + 4 <= end; t += 4) dot4(q, key_rows + t, head_size, row_scores + t);
      for (; t < end; ++t) row_scores[t] = dot(q, key_rows[t], head_size);
      if (args.softcap > 0.f) {
        const float cap = args.softcap, inverse = 1.f / args.softcap;
        for (t = begin; t < end; ++t) row_scores[t] = cap * std::tanh(row_scores[t] * inverse);
      }
      std::fill(row_scores + end, row_scores + tile_len, kNegInf);
    }
    // (2) Online softmax: bring each vector's running maximum, sum and output up to date.
    for (int v = 0; v < num_vectors; ++v) {
      const int begin = scratch.visible_begin[v], end = scratch.visible_end[v];
      if (begin == end) continue;  // nothing visible in this tile
      float* row_scores = scratch.scores.data() + v * kKeyTile;
      const float new_max = std::max(scratch.max_score[v], max_of(row_scores + begin, end - begin));
      const float rescale = std::exp(scratch.max_score[v] - new_max);  // 0 on the first visible tile
      if (rescale != 1.f) {
        float* acc = scratch.acc.data() + static_cast<int64_t>(v) * head_size;
#pragma omp simd
        for (int d = 0; d < head_size; ++d) acc[d] *= rescale;
      }
#pragma omp simd
      for (int t = begin; t < end; ++t) row_scores[t] = exp_nonpositive(row_scores[t] - new_max);
      const float tile_sum = sum_of(row_scores + begin, end - begin);
      scratch.sum_exp[v] = scratch.sum_exp[v] * rescale + tile_sum;
      scratch.max_score[v] = new_max;
    }
    // (3) Probabilities times values.
    for (int v = 0; v < num_vectors; ++v) {
      const int begin = scratch.visible_begin[v], end = scratch.visible_end[v];
      const float* p = scratch.scores.data() + v * kKeyTile;
      float* acc = scratch.acc.data() + static_cast<int64_t>(v) * head_size;
      int t = begin;
      for (; t + 8 <= end; t += 8) axpy8(p + t, value_rows + t, acc, head_size);
      for (; t < end; ++t) axpy(p[t], value_rows[t], acc, head_size);
    }
  }

  if (item.split >= 0 && !merge_parts(args, item, num_vectors, scratch)) return;  // other parts to come
  T* out = static_cast<T*>(args.out);
  for (int v = 0; v < num_vectors; ++v) {
    const int row = item.first_row + v / group, head = item.kv_head * group + v % group;
    const float* acc = scratch.acc.data() + static_cast<int64_t>(v) * head_size;
    // Every row sees at least its own key, so the sum is positive. A sink adds its term to
    // the denominator only (exp(sink - max) overflows to inf, rightly giving 0, for a sink far
    // above every score).
    const float sink = args.sinks != nullptr ? std::exp(args.sinks[head] - scratch.max_score[v]) : 0.f;
    const float inv_sum = 1.f / (scratch.sum_exp[v] + sink);
    T* dst = out + row * args.out_row_stride + static_cast<int64_t>(head) * head_size;
#pragma omp simd
    for (int d = 0; d < head_size; ++d) dst[d] = static_cast<T>(acc[d] * inv_sum);
  }
}

// The items of a call: a tile of rows of one sequence and one KV head each, its keys those of
// its rows, cut in parts at the multiples of kSplitKeys when they run past one (splits: one
// entry a split item; partial_floats: what their parts' partials take).
std::vector<WorkItem> work_items(const Args& args, int num_seqs, std::vector<Split>& splits,
                                 int64_t& partial_floats) {
  std::vector<WorkItem> items;
  partial_floats = 0;
  const int group = args.num_heads / args.num_kv_heads;
  for (int seq = 0; seq < num_seqs; ++seq) {
    const int seq_begin = args.cu_seqlens_q[seq], seq_end = args.cu_seqlens_q[seq + 1];
    for (int row = seq_begin; row < seq_end; row += kRowTile) {
      const int rows = std::min(kRowTile, seq_end - row);
      const int first_pos = args.context_lens[seq] - (seq_end - seq_begin) + (row - seq_begin);
      const int keys_begin = args.sliding_window > 0 ? std::max(0, first_pos - args.sliding_window + 1) : 0;
      const int keys_end = first_pos + rows;  // one past the last row's position
      const int first_part = keys_begin / kSplitKeys, num_parts = (keys_end - 1) / kSplitKeys - first_part + 1;
      for (int kv_head = 0; kv_head < args.num_kv_heads; ++kv_head) {
        if (num_parts == 1) {
          items.push_back({seq, row, rows, kv_head, keys_begin, keys_end});
          continue;
        }
        const int split = static_cast<int>(splits.size());
        splits.push_back({partial_floats, num_parts});
        partial_floats += int64_t{num_parts} * rows * group * (args.head_size + 2);
        for (int part = 0; part < num_parts; ++part) {
          const int begin = std::max(keys_begin, (first_part + part) * kSplitKeys);
          const int end = std::min(keys_end, (first_part + part + 1) * kSplitKeys);
          items.push_back({seq, row, rows, kv_head, begin, end, split, part});
        }
      }
    }
  }
  return items;
}

using AttendItem = void (*)(const Args&, const WorkItem&, Scratch&);

// Items taken from `next` until none are left, on the calling thread, with its own scratch.
void attend_items(const Args& args, const std::vector<WorkItem>& items, AttendItem attend,
                  std::atomic<int64_t>& next) {
  thread_local Scratch scratch;
  scratch.reserve(kRowTile * (args.num_heads / args.num_kv_heads), args.head_size);
  const int64_t num_items = static_cast<int64_t>(items.size());
  for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) attend(args, items[i], scratch);
}

void check_cache(const at::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.device().is_cpu(), "pagedrs_cpu: ", name, " must be a CPU tensor, got one on ", cache.device());
  TORCH_CHECK(cache.dim() == 4, "pagedrs_cpu: ", name, " must be [num_blocks, block_size, num_kv_heads, head_size], got ",
              cache.sizes());
  TORCH_CHECK(cache.is_contiguous(), "pagedrs_cpu: ", name, " must be contiguous");
}

void check_rows(const at::Tensor& t, const char* name, const at::Tensor& key_cache) {
  TORCH_CHECK(t.device().is_cpu(), "pagedrs_cpu: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 3 && t.size(2) == key_cache.size(3), "pagedrs_cpu: ", name,
              " must be [num_rows, num_heads, ", key_cache.size(3), "], got ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), "pagedrs_cpu: ", name,
              "'s heads must be contiguous within a row (a row stride is fine)");
  // The cache's dtype, or float32 rows over a 16-bit or fp8 cache (--kv-cache-dtype).
  TORCH_CHECK(t.scalar_type() == key_cache.scalar_type() || t.scalar_type() == at::kFloat, "pagedrs_cpu: ", name,
              " dtype ", t.scalar_type(), " differs from the cache's ", key_cache.scalar_type(),
              " (only float32 rows may read a cache of another dtype)");
}

void check_index(const at::Tensor& t, int64_t dims, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "pagedrs_cpu: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kInt, "pagedrs_cpu: ", name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dims, "pagedrs_cpu: ", name, " must have ", dims, " dimensions, got ", t.dim());
  TORCH_CHECK(t.is_contiguous(), "pagedrs_cpu: ", name, " must be contiguous");
}

}  // namespace

namespace pagedrs_cpu {

struct PagedAttentionPlan::State {
  Args args;
  std::vector<WorkItem> items;
  AttendItem attend;  // attend_item of the query's and the caches' dtypes
  std::vector<Split> splits;                         // split items (Args::splits)
  std::unique_ptr<float[]> partials;                 // their parts' partials (Args::partials)
  std::unique_ptr<std::atomic<int>[]> parts_done;    // each split's finished parts, from 0
};

PagedAttentionPlan::PagedAttentionPlan(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                       const at::Tensor& value_cache, const at::Tensor& block_tables,
                                       const at::Tensor& cu_seqlens_q, const at::Tensor& context_lens, double scale,
                                       int64_t sliding_window, double softcap,
                                       const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(softcap >= 0, "pagedrs_cpu: softcap must be >= 0 (0: none), got ", softcap);
  check_cache(key_cache, "key_cache");
  check_cache(value_cache, "value_cache");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.scalar_type() == value_cache.scalar_type(),
              "pagedrs_cpu: key_cache and value_cache differ in shape or dtype");
  const auto dtype = key_cache.scalar_type();
  TORCH_CHECK(pagedrs_cpu::is_kv_cache_dtype(dtype),
              "pagedrs_cpu: paged_attention supports float32, bfloat16, float16 and float8_e4m3fn caches, got ",
              dtype);
  check_rows(query, "query", key_cache);
  check_rows(out, "out", key_cache);
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "pagedrs_cpu: out and query differ in dtype");
  TORCH_CHECK(out.sizes() == query.sizes(), "pagedrs_cpu: out ", out.sizes(), " must match query ", query.sizes());
  const int64_t num_kv_heads = key_cache.size(2), num_heads = query.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "pagedrs_cpu: ", num_heads, " query heads do not group over ",
              num_kv_heads, " KV heads");
  check_index(block_tables, 2, "block_tables");
  check_index(cu_seqlens_q, 1, "cu_seqlens_q");
  check_index(context_lens, 1, "context_lens");
  const int64_t num_seqs = context_lens.size(0);
  TORCH_CHECK(cu_seqlens_q.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs,
              "pagedrs_cpu: cu_seqlens_q needs num_seqs + 1 entries and block_tables num_seqs rows");
  const int64_t block_size = key_cache.size(1), num_blocks = key_cache.size(0);
  const int* cu = cu_seqlens_q.data_ptr<int>();
  const int* contexts = context_lens.data_ptr<int>();
  const int* tables = block_tables.data_ptr<int>();
  TORCH_CHECK(cu[0] == 0 && cu[num_seqs] == query.size(0), "pagedrs_cpu: cu_seqlens_q must run from 0 to the ",
              query.size(0), " query rows");
  // The kernel reads the cache at these addresses unchecked: no sequence may reach past its
  // block table or the cache.
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int rows = cu[s + 1] - cu[s];
    TORCH_CHECK(rows >= 0 && contexts[s] >= rows, "pagedrs_cpu: sequence ", s, " has ", rows,
                " query rows but a context of ", contexts[s]);
    const int64_t used_blocks = (contexts[s] + block_size - 1) / block_size;
    TORCH_CHECK(used_blocks <= block_tables.size(1), "pagedrs_cpu: the context of sequence ", s, " (", contexts[s],
                " tokens) is longer than its block table's ", block_tables.size(1) * block_size, " slots");
    for (int64_t b = 0; b < used_blocks; ++b) {
      const int block = tables[s * block_tables.size(1) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "pagedrs_cpu: block ", block, " of sequence ", s,
                  " is outside the cache's ", num_blocks, " blocks");
    }
  }
  if (sinks) {
    TORCH_CHECK(sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                    sinks->dim() == 1 && sinks->size(0) == num_heads,
                "pagedrs_cpu: sinks must be contiguous float32 [", num_heads, "]");
  }
  auto state = std::make_shared<State>();
  Args& args = state->args;
  args.query = query.data_ptr();
  args.out = out.data_ptr();
  args.key_cache = key_cache.data_ptr();
  args.value_cache = value_cache.data_ptr();
  args.block_tables = block_tables.data_ptr<int>();
  args.cu_seqlens_q = cu_seqlens_q.data_ptr<int>();
  args.context_lens = context_lens.data_ptr<int>();
  args.query_row_stride = query.stride(0);
  args.out_row_stride = out.stride(0);
  args.num_heads = static_cast<int>(num_heads);
  args.num_kv_heads = static_cast<int>(num_kv_heads);
  args.head_size = static_cast<int>(key_cache.size(3));
  args.block_size = static_cast<int>(block_size);
  args.max_blocks_per_seq = static_cast<int>(block_tables.size(1));
  args.sliding_window = static_cast<int>(sliding_window);
  args.scale = static_cast<float>(scale);
  args.softcap = static_cast<float>(softcap);
  args.sinks = sinks ? sinks->data_ptr<float>() : nullptr;
  if (query.size(0) > 0) {
    int64_t partial_floats = 0;
    state->items = work_items(args, static_cast<int>(num_seqs), state->splits, partial_floats);
    if (!state->splits.empty()) {  // (most steps split nothing: no allocation for them)
      state->partials.reset(new float[partial_floats]);  // written before read, so not zeroed
      state->parts_done.reset(new std::atomic<int>[state->splits.size()]());
      args.splits = state->splits.data();
      args.partials = state->partials.get();
      args.parts_done = state->parts_done.get();
    }
  }
  const bool float_rows = query.scalar_type() == at::kFloat;
  switch (dtype) {
    case at::kFloat: state->attend = attend_item<float, float>; break;
    case at::kBFloat16:
      state->attend = float_rows ? attend_item<float, c10::BFloat16> : attend_item<c10::BFloat16, c10::BFloat16>;
      break;
    case at::kHalf: state->attend = float_rows ? attend_item<float, c10::Half> : attend_item<c10::Half, c10::Half>; break;
    default:  // float8_e4m3fn (the rest are refused above)
      TORCH_CHECK(float_rows, "pagedrs_cpu: an fp8 cache is read by float32 queries only, got ", query.scalar_type());
      state->attend = attend_item<float, c10::Float8_e4m3fn>;
      break;
  }
  state_ = std::move(state);
}

void PagedAttentionPlan::attend_share(std::atomic<int64_t>& next) const {
  attend_items(state_->args, state_->items, state_->attend, next);
}

int64_t PagedAttentionPlan::num_items() const { return static_cast<int64_t>(state_->items.size()); }

// Reads the cache only: the step's new keys and values must already be written (the
// runner's contract, rust/src/batch.rs).
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                     const at::Tensor& context_lens, double scale, int64_t sliding_window, double softcap,
                     const std::optional<at::Tensor>& sinks) {
  const PagedAttentionPlan plan(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens, scale,
                                sliding_window, softcap, sinks);
  // One task per thread, each pulling items until none are left (dynamic scheduling over
  // torch's own pool: a long prefill tile does not hold up a thread's share of decodes).
  std::atomic<int64_t> next{0};
  const int64_t num_tasks = std::min<int64_t>(at::get_num_threads(), plan.num_items());
  at::parallel_for(0, num_tasks, 1, [&](int64_t, int64_t) { plan.attend_share(next); });
}

// torch's own fp8 -> float32 copy converts one element at a time (about 2 ns each here, 30
// times bfloat16's): the gathered blocks of a prefill chunk go through this instead.
at::Tensor fp8_as_float(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat8_e4m3fn,
              "pagedrs_cpu: fp8_as_float takes a CPU float8_e4m3fn tensor, got ", x.scalar_type(), " on ", x.device());
  const at::Tensor source = x.contiguous();
  at::Tensor out = at::empty(source.sizes(), source.options().dtype(at::kFloat));
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(source.data_ptr());
  float* values = out.data_ptr<float>();
  at::parallel_for(0, source.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    fp8_e4m3_row_to_float(bytes + begin, values + begin, end - begin, 1.f);
  });
  return out;
}

}  // namespace pagedrs_cpu
