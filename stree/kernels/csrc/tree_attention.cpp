// CPU attention rows of a group of equally shaped token trees inside a serving engine, read straight
// from the engine's paged KV cache: each node attends to its request's committed context and to the
// tree nodes on its own root path, one pass over the context's blocks with an online softmax, no
// gathered copy of the context and no mask the size of the context.
//
// Reference (same math, eager PyTorch, the path that runs where this op cannot, and the oracle of
// tests/test_cpu_ops.py beside a per-node softmax): stree/vllm/attention_rows.py (tree_attention, SDPA over
// the gathered context under the tree mask). fp32 only.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

// a finite "minus infinity": -ffast-math assumes no infinities, so masked scores get this instead
constexpr float kMasked = -1e30f;

void check_cache(const at::Tensor& cache, int64_t ts, int64_t es, const char* name) {
  TORCH_CHECK(cache.device().is_cpu() && cache.scalar_type() == at::kFloat, "stree cpu ops: ", name,
              " must be a float32 CPU tensor");
  TORCH_CHECK(cache.dim() == 4 && ts > 0 && es > 0 && cache.stride(0) >= 0 && cache.stride(1) >= 0,
              "stree cpu ops: ", name,
              " must be (blocks, kv_heads, block_size, head_dim) with positive token and channel steps");
  // the last element any block, head, token and channel can reach lies inside the storage
  const int64_t last = (cache.size(0) - 1) * cache.stride(0) + (cache.size(1) - 1) * cache.stride(1) +
                       (cache.size(2) - 1) * ts + (cache.size(3) - 1) * es;
  const int64_t room = static_cast<int64_t>(cache.storage().nbytes() / sizeof(float)) - cache.storage_offset();
  TORCH_CHECK(last < room, "stree cpu ops: ", name, "'s layout reaches past its storage");
}

// sum over i < n of a[i] * b[i * step] (the layouts whose loops cannot run along contiguous memory)
inline float strided_dot(const float* __restrict a, const float* b, int64_t step, int64_t n) {
  float dot = 0.f;
  for (int64_t i = 0; i < n; ++i) dot += a[i] * b[i * step];
  return dot;
}

// Register tiles of the two products that dominate (the rows that share a KV head against one
// block of its context), for the contiguous layouts (vLLM's fp32 CPU cache: K channel-major, V
// token-major): R query rows by C vectors of 16 tokens (scores) or 16 channels (weighted values)
// held in registers across the reduction, so each K or V vector is loaded once for R rows (plain
// loops left the sums in memory: 2.3-3.4x slower a call, bench/cpu_ops.py). The other layouts,
// and the tails, take the strided dot products.
typedef float Vec __attribute__((vector_size(64), aligned(4)));  // 16 lanes, unaligned loads
constexpr int64_t kLanes = 16;

inline Vec load(const float* p) {
  Vec v;
  __builtin_memcpy(&v, p, sizeof(Vec));
  return v;
}

inline void store(float* p, const Vec& v) { __builtin_memcpy(p, &v, sizeof(Vec)); }

// s[row * ss + t] = sum_e q[row * d + e] * kb[e * k_es + t], rows [row0, row0 + R), tokens [t0, t0 + 16 C)
template <int R, int C>
inline void score_tile(const float* q, int64_t row0, int64_t d, const float* kb, int64_t k_es, int64_t t0, float* s,
                       int64_t ss) {
  Vec acc[R][C] = {};
  for (int64_t e = 0; e < d; ++e) {
    Vec k[C];
    for (int c = 0; c < C; ++c) k[c] = load(kb + e * k_es + t0 + c * kLanes);
    for (int i = 0; i < R; ++i) {
      const float qe = q[(row0 + i) * d + e];
      for (int c = 0; c < C; ++c) acc[i][c] += qe * k[c];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) store(s + (row0 + i) * ss + t0 + c * kLanes, acc[i][c]);
}

template <int R>
void score_rows(const float* q, int64_t row0, int64_t d, const float* kb, int64_t k_es, int64_t n, float* s,
                int64_t ss) {
  int64_t t = 0;
  for (; t + 4 * kLanes <= n; t += 4 * kLanes) score_tile<R, 4>(q, row0, d, kb, k_es, t, s, ss);
  for (; t + kLanes <= n; t += kLanes) score_tile<R, 1>(q, row0, d, kb, k_es, t, s, ss);
  for (; t < n; ++t)  // the block's last tokens
    for (int i = 0; i < R; ++i) s[(row0 + i) * ss + t] = strided_dot(q + (row0 + i) * d, kb + t, k_es, d);
}

// tile(rows per tile, first row) over [0, rows): tiles of 4 rows, then the last rows one by one
template <typename Tile>
inline void over_row_tiles(int64_t rows, Tile tile) {
  int64_t row = 0;
  for (; row + 4 <= rows; row += 4) tile(std::integral_constant<int, 4>{}, row);
  for (; row < rows; ++row) tile(std::integral_constant<int, 1>{}, row);
}

// the scores (rows, n) of one block of a channel-major K (each channel's tokens contiguous)
void scores_channel_major(const float* q, int64_t rows, int64_t d, const float* kb, int64_t k_es, int64_t n,
                          float* s, int64_t ss) {
  over_row_tiles(rows, [&](auto r, int64_t row) { score_rows<decltype(r)::value>(q, row, d, kb, k_es, n, s, ss); });
}

// acc[row * d + e] += sum_t s[row * ss + t] * vb[t * v_ts + e], rows [row0, row0 + R), channels [e0, e0 + 16 C)
template <int R, int C>
inline void value_tile(const float* s, int64_t ss, int64_t row0, const float* vb, int64_t v_ts, int64_t n, int64_t d,
                       int64_t e0, float* acc) {
  Vec sum[R][C];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) sum[i][c] = load(acc + (row0 + i) * d + e0 + c * kLanes);
  for (int64_t t = 0; t < n; ++t) {
    Vec v[C];
    for (int c = 0; c < C; ++c) v[c] = load(vb + t * v_ts + e0 + c * kLanes);
    for (int i = 0; i < R; ++i) {
      const float p = s[(row0 + i) * ss + t];
      for (int c = 0; c < C; ++c) sum[i][c] += p * v[c];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) store(acc + (row0 + i) * d + e0 + c * kLanes, sum[i][c]);
}

template <int R>
void value_rows(const float* s, int64_t ss, int64_t row0, const float* vb, int64_t v_ts, int64_t n, int64_t d,
                float* acc) {
  int64_t e = 0;
  for (; e + 4 * kLanes <= d; e += 4 * kLanes) value_tile<R, 4>(s, ss, row0, vb, v_ts, n, d, e, acc);
  for (; e + kLanes <= d; e += kLanes) value_tile<R, 1>(s, ss, row0, vb, v_ts, n, d, e, acc);
  for (; e < d; ++e)  // channels past the last full vector
    for (int i = 0; i < R; ++i) acc[(row0 + i) * d + e] += strided_dot(s + (row0 + i) * ss, vb + e, v_ts, n);
}

// acc (rows, d) += the block's weighted values, V token-major (each token's channels contiguous)
void values_token_major(const float* s, int64_t ss, int64_t rows, const float* vb, int64_t v_ts, int64_t n,
                        int64_t d, float* acc) {
  over_row_tiles(rows, [&](auto r, int64_t row) { value_rows<decltype(r)::value>(s, ss, row, vb, v_ts, n, d, acc); });
}

}  // namespace

// query (tokens, heads, d) with dense rows; key_cache, value_cache (blocks, kv_heads, block_size, d)
// whose head regions hold token t's channel e at t * ts + e * es ((k_ts, k_es), (v_ts, v_es): the
// strides of the caches' last two dimensions are not read, as vLLM's CPU views do not show them);
// block_table (b, nb) and seq_lens (b,) int64: each request's blocks and length, its m tree nodes
// last; index (b, m): the nodes' query rows; mask (m, m) bool: node i sees node j (its ancestors
// and itself). Query head h reads KV head h / (heads / kv_heads). Writes softmax(scale q.k) v of
// each node into out (tokens, heads, d) at its query row.
void tree_attention_rows(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                         int64_t k_ts, int64_t k_es, int64_t v_ts, int64_t v_es, const at::Tensor& block_table,
                         const at::Tensor& seq_lens, const at::Tensor& index, const at::Tensor& mask, double scale,
                         at::Tensor out) {
  for (const at::Tensor* t : {&query, static_cast<const at::Tensor*>(&out)}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 3,
                "stree cpu ops: query and out must be float32 CPU tensors (tokens, heads, head_dim)");
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "stree cpu ops: query and out need dense rows");
  }
  check_cache(key_cache, k_ts, k_es, "key_cache");
  check_cache(value_cache, v_ts, v_es, "value_cache");
  for (const at::Tensor* t : {&block_table, &seq_lens, &index})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous(),
                "stree cpu ops: block_table, seq_lens and index must be contiguous int64 CPU tensors");
  const int64_t heads = query.size(1), d = query.size(2), kv_heads = key_cache.size(1);
  const int64_t bs = key_cache.size(2), blocks = key_cache.size(0);
  const int64_t b = index.size(0), m = index.size(1), nb = block_table.size(1);
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.size(3) == d && out.size(1) == heads &&
                  out.size(2) == d && heads % kv_heads == 0,
              "stree cpu ops: tree_attention_rows head counts or sizes differ");
  TORCH_CHECK(block_table.size(0) == b && seq_lens.numel() == b && mask.dim() == 2 && mask.size(0) == m &&
                  mask.size(1) == m && mask.scalar_type() == at::kBool,
              "stree cpu ops: block_table (b, nb), seq_lens (b,), index (b, m), mask (m, m) bool");
  const at::Tensor mask_c = mask.contiguous();
  const bool* mask_p = mask_c.data_ptr<bool>();
  for (int64_t i = 0; i < m; ++i)  // so that every row's softmax has a term
    TORCH_CHECK(mask_p[i * m + i], "stree cpu ops: the tree mask must let each node see itself");
  const int64_t *table_p = block_table.data_ptr<int64_t>(), *len_p = seq_lens.data_ptr<int64_t>();
  const int64_t* idx_p = index.data_ptr<int64_t>();
  const int64_t tokens = std::min(query.size(0), out.size(0));
  for (int64_t r = 0; r < b; ++r) {
    TORCH_CHECK(len_p[r] >= m && len_p[r] <= nb * bs, "stree cpu ops: a sequence length out of range");
    for (int64_t j = 0; j < (len_p[r] + bs - 1) / bs; ++j)
      TORCH_CHECK(table_p[r * nb + j] >= 0 && table_p[r * nb + j] < blocks, "stree cpu ops: a KV block out of range");
    for (int64_t i = 0; i < m; ++i)
      TORCH_CHECK(idx_p[r * m + i] >= 0 && idx_p[r * m + i] < tokens, "stree cpu ops: a token row out of range");
  }
  const float *q_p = query.data_ptr<float>(), *k_p = key_cache.data_ptr<float>(), *v_p = value_cache.data_ptr<float>();
  float* out_p = out.data_ptr<float>();
  const int64_t sq = query.stride(0), so = out.stride(0);
  const int64_t k0 = key_cache.stride(0), k1 = key_cache.stride(1);
  const int64_t v0 = value_cache.stride(0), v1 = value_cache.stride(1);
  const int64_t group = heads / kv_heads, rows = group * m;  // the query rows that share a KV head
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, b * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(rows * d), acc(rows * d), s(rows * bs), top(rows), total(rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, kh = task % kv_heads, len = len_p[r], context = len - m;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < m; ++i) {
          const float* src = q_p + idx_p[r * m + i] * sq + (kh * group + g) * d;
          for (int64_t e = 0; e < d; ++e) q[(g * m + i) * d + e] = src[e] * sc;
        }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(top.begin(), top.end(), kMasked);
      std::fill(total.begin(), total.end(), 0.f);
      for (int64_t blk = 0; blk * bs < len; ++blk) {
        const int64_t first = blk * bs, n = std::min(bs, len - first);
        const float* kb = k_p + table_p[r * nb + blk] * k0 + kh * k1;
        const float* vb = v_p + table_p[r * nb + blk] * v0 + kh * v1;
        // scores (rows, n) of this block, laid out with row stride bs
        if (k_ts == 1) {  // channel-major K: each channel's n tokens contiguous
          scores_channel_major(q.data(), rows, d, kb, k_es, n, s.data(), bs);
        } else {  // token-major (or any other) K: a dot product per token
          for (int64_t t = 0; t < n; ++t)
            for (int64_t row = 0; row < rows; ++row)
              s[row * bs + t] = strided_dot(&q[row * d], kb + t * k_ts, k_es, d);
        }
        // the tree's tokens: node j is seen by the rows of the nodes it is an ancestor of
        for (int64_t t = std::max<int64_t>(0, context - first); t < n; ++t) {
          const int64_t node = first + t - context;
          for (int64_t row = 0; row < rows; ++row)
            if (!mask_p[(row % m) * m + node]) s[row * bs + t] = kMasked;
        }
        // online softmax: rescale what came before to this block's maximum
        for (int64_t row = 0; row < rows; ++row) {
          float* __restrict sr = &s[row * bs];
          float best = kMasked;
          for (int64_t t = 0; t < n; ++t) best = std::max(best, sr[t]);
          if (best <= kMasked) {  // every token of this block hidden from this row
            std::fill_n(sr, n, 0.f);
            continue;
          }
          const float now = std::max(top[row], best), shrink = std::exp(top[row] - now);
          float sum = 0.f;
          for (int64_t t = 0; t < n; ++t) {
            sr[t] = sr[t] <= kMasked ? 0.f : std::exp(sr[t] - now);
            sum += sr[t];
          }
          total[row] = total[row] * shrink + sum;
          top[row] = now;
          float* __restrict ar = &acc[row * d];
          for (int64_t e = 0; e < d; ++e) ar[e] *= shrink;
        }
        if (v_es == 1) {  // token-major V: each token's channels contiguous
          values_token_major(s.data(), bs, rows, vb, v_ts, n, d, acc.data());
        } else {  // channel-major (or any other) V: a dot product per channel
          for (int64_t row = 0; row < rows; ++row)
            for (int64_t e = 0; e < d; ++e) acc[row * d + e] += strided_dot(&s[row * bs], vb + e * v_es, v_ts, n);
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < m; ++i) {
          const int64_t row = g * m + i;
          float* dst = out_p + idx_p[r * m + i] * so + (kh * group + g) * d;
          const float inv = 1.f / total[row];  // > 0: a node always sees itself
          for (int64_t e = 0; e < d; ++e) dst[e] = acc[row * d + e] * inv;
        }
    }
  });
}
