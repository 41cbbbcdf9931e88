// CPU tree rows of one Mamba2 layer inside a serving engine: the tree conv and the tree scan of
// a group of equally shaped token trees, read straight from the engine's token-major activations
// and state caches, nothing written to the caches (what the commit replays is returned as
// copies), and the two commits that then write the accepted paths' states into the caches.
//
// References (same math, eager PyTorch, the oracles of tests/test_cpu_ops.py):
// stree/kernels/tree_conv.py (_tree_conv_ref), stree/kernels/tree_scan.py (_tree_scan_ref) and
// stree/kernels/replay.py (conv_replay, ssm_replay).
// fp32 only: the Python side (stree/kernels/cpu_ops.py) takes the eager path for anything else.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

namespace {

constexpr int kLanes = 8;  // partial sums for the dot products, so the compiler vectorizes them

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "stree cpu ops: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat, "stree cpu ops: ", name, " must be float32");
}

void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous(),
              "stree cpu ops: ", name, " must be a contiguous int64 CPU tensor");
}

void check_rows(const at::Tensor& t, const char* name) {  // (tokens, ...) with dense rows
  check_f32(t, name);
  int64_t inner = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    TORCH_CHECK(t.stride(d) == inner, "stree cpu ops: ", name, " needs dense rows");
    inner *= t.size(d);
  }
}

void check_range(const at::Tensor& t, int64_t low, int64_t high, const char* name) {  // low <= t < high
  const int64_t* v = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i)
    TORCH_CHECK(v[i] >= low && v[i] < high, "stree cpu ops: ", name, " out of range");
}

inline float softplus(float v) { return v > 20.f ? v : std::log1p(std::exp(v)); }

}  // namespace

// x (tokens, c) pre-conv inputs; conv_state (slots, c, L) any strides; slots, col0 (b,): each
// tree's slot and first committed column; index (b, n): each node's token row; window (n, w), or
// (b, n, w) for trees of different shapes: node i's taps as indices into cat(committed window
// (w - 1 columns), the tree's inputs), oldest first; weight (c, w); bias (c,) or empty. Writes
// act(conv) into out's rows index; returns the nodes' inputs (b, n, c) and the committed windows
// (b, w - 1, c).
std::vector<at::Tensor> tree_conv_rows(const at::Tensor& x, const at::Tensor& conv_state,
                                       const at::Tensor& slots, const at::Tensor& col0,
                                       const at::Tensor& index, const at::Tensor& window,
                                       const at::Tensor& weight, const at::Tensor& bias, bool silu,
                                       at::Tensor out) {
  check_rows(x, "x");
  check_rows(out, "out");
  check_f32(conv_state, "conv_state");
  check_f32(weight, "weight");
  for (auto* t : {&slots, &col0, &index, &window}) check_index(*t, "an index table");
  const int64_t c = x.size(1), b = index.size(0), n = index.size(1), w = weight.size(1);
  TORCH_CHECK(weight.size(0) == c && conv_state.size(1) == c && out.size(1) == c,
              "stree cpu ops: tree_conv_rows channel counts differ");
  const bool per_tree = window.dim() == 3;  // each tree its own taps (stree's batches of trees)
  TORCH_CHECK(per_tree ? window.size(0) == b && window.size(1) == n && window.size(2) == w
                       : window.dim() == 2 && window.size(0) == n && window.size(1) == w,
              "stree cpu ops: window must be (n, w) or (b, n, w)");
  TORCH_CHECK(slots.numel() == b && col0.numel() == b, "stree cpu ops: slots and col0 must be (b,)");
  TORCH_CHECK(w >= 1 && conv_state.size(2) >= w - 1, "stree cpu ops: the conv state is narrower than the window");
  check_range(slots, 0, conv_state.size(0), "a conv slot");
  check_range(col0, 0, conv_state.size(2) - (w - 1) + 1, "a window column");
  check_range(index, 0, std::min(x.size(0), out.size(0)), "a token row");
  check_range(window, 0, w - 1 + n, "a conv tap");
  const bool has_bias = bias.numel() > 0;
  if (has_bias) check_f32(bias, "bias");
  at::Tensor wt = weight.t().contiguous();  // (w, c): each tap's weights contiguous
  at::Tensor bias_c = has_bias ? bias.contiguous() : bias;
  at::Tensor xbc = at::empty({b, n, c}, x.options());
  at::Tensor win = at::empty({b, w - 1, c}, x.options());
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  const int64_t* col_p = col0.data_ptr<int64_t>();
  const int64_t* idx_p = index.data_ptr<int64_t>();
  const int64_t* tap_p = window.data_ptr<int64_t>();
  const float* x_p = x.data_ptr<float>();
  const float* cs_p = conv_state.data_ptr<float>();
  const float* wt_p = wt.data_ptr<float>();
  const float* bias_p = has_bias ? bias_c.data_ptr<float>() : nullptr;
  float* out_p = out.data_ptr<float>();
  float* xbc_p = xbc.data_ptr<float>();
  float* win_p = win.data_ptr<float>();
  const int64_t sx = x.stride(0), so = out.stride(0);
  const int64_t ss = conv_state.stride(0), sc = conv_state.stride(1), sl = conv_state.stride(2);
  for (int64_t r = 0; r < b; ++r) {
    float* wr = win_p + r * (w - 1) * c;
    const float* base = cs_p + slot_p[r] * ss + col_p[r] * sl;
    for (int64_t j = 0; j < w - 1; ++j)
      for (int64_t k = 0; k < c; ++k) wr[j * c + k] = base[k * sc + j * sl];
    for (int64_t i = 0; i < n; ++i) {
      const float* src = x_p + idx_p[r * n + i] * sx;
      std::copy(src, src + c, xbc_p + (r * n + i) * c);
    }
  }
  // threads only where a share is worth waking them for (a lone 17-node tree is not)
  at::parallel_for(0, b * n, std::max<int64_t>(1, 65536 / c), [&](int64_t begin, int64_t end) {
    std::vector<const float*> taps(w);
    for (int64_t bi = begin; bi < end; ++bi) {
      const int64_t r = bi / n, i = bi % n;
      for (int64_t k = 0; k < w; ++k) {
        const int64_t t = tap_p[((per_tree ? r * n : 0) + i) * w + k];
        taps[k] = t < w - 1 ? win_p + (r * (w - 1) + t) * c : xbc_p + (r * n + t - (w - 1)) * c;
      }
      float* __restrict dst = out_p + idx_p[bi] * so;
      for (int64_t k = 0; k < c; ++k) dst[k] = has_bias ? bias_p[k] : 0.f;
      for (int64_t t = 0; t < w; ++t) {
        const float* __restrict src = taps[t];
        const float* __restrict wk = wt_p + t * c;
        for (int64_t k = 0; k < c; ++k) dst[k] += src[k] * wk[k];
      }
      if (silu)
        for (int64_t k = 0; k < c; ++k) dst[k] = dst[k] / (1.f + std::exp(-dst[k]));
    }
  });
  return {xbc, win};
}

// x (tokens, h, p); dt (tokens, h) before bias and softplus; B, C (tokens, g, s); ssm_state
// (slots, h, p, s) any strides; start (b,): each tree's state slot; index (b, n); parents (n,)
// with parents[i] < i and -1 at the root; A, D, dt_bias (h,). Writes y = C.h + D x into out's
// rows index (tokens, h, p); returns the start states (b, h, p, s), the nodes' x (b, n, h, p),
// processed dt (b, n, h) and B (b, n, g, s).
std::vector<at::Tensor> tree_scan_rows(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& B,
                                       const at::Tensor& C, const at::Tensor& ssm_state,
                                       const at::Tensor& start, const at::Tensor& index,
                                       const at::Tensor& parents, const at::Tensor& A,
                                       const at::Tensor& D, const at::Tensor& dt_bias, at::Tensor out) {
  for (const at::Tensor* t : {&x, &dt, &B, &C, static_cast<const at::Tensor*>(&out)})
    check_rows(*t, "x, dt, B, C and out");
  check_f32(ssm_state, "ssm_state");
  for (auto* t : {&start, &index, &parents}) check_index(*t, "an index table");
  const int64_t h = x.size(1), p = x.size(2), g = B.size(1), s = B.size(2);
  const int64_t b = index.size(0), n = index.size(1);
  TORCH_CHECK(h % g == 0 && ssm_state.size(1) == h && ssm_state.size(2) == p && ssm_state.size(3) == s,
              "stree cpu ops: tree_scan_rows shapes differ");
  TORCH_CHECK(parents.numel() == n && start.numel() == b, "stree cpu ops: parents (n,), start (b,)");
  TORCH_CHECK(dt.size(1) == h && C.size(1) == g && C.size(2) == s && out.size(1) == h && out.size(2) == p,
              "stree cpu ops: tree_scan_rows shapes differ");
  check_range(start, 0, ssm_state.size(0), "a state slot");
  const int64_t tokens = std::min({x.size(0), dt.size(0), B.size(0), C.size(0), out.size(0)});
  check_range(index, 0, tokens, "a token row");
  at::Tensor a_c = A.to(at::kFloat).contiguous(), d_c = D.to(at::kFloat).contiguous();
  at::Tensor bias_c = dt_bias.to(at::kFloat).contiguous();
  at::Tensor h0 = at::empty({b, h, p, s}, x.options());
  at::Tensor xs = at::empty({b, n, h, p}, x.options());
  at::Tensor dts = at::empty({b, n, h}, x.options());
  at::Tensor bs = at::empty({b, n, g, s}, x.options());
  const int64_t* start_p = start.data_ptr<int64_t>();
  const int64_t* idx_p = index.data_ptr<int64_t>();
  const int64_t* par_p = parents.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(par_p[i] < i && (par_p[i] >= 0 || i == 0), "stree cpu ops: parents not topological");
  const float *x_p = x.data_ptr<float>(), *dt_p = dt.data_ptr<float>(), *b_p = B.data_ptr<float>();
  const float *c_p = C.data_ptr<float>(), *st_p = ssm_state.data_ptr<float>();
  const float *a_p = a_c.data_ptr<float>(), *d_p = d_c.data_ptr<float>(), *bias_p = bias_c.data_ptr<float>();
  float *out_p = out.data_ptr<float>(), *h0_p = h0.data_ptr<float>(), *xs_p = xs.data_ptr<float>();
  float *dts_p = dts.data_ptr<float>(), *bs_p = bs.data_ptr<float>();
  const int64_t sx = x.stride(0), sdt = dt.stride(0), sb = B.stride(0), sc = C.stride(0), so = out.stride(0);
  const int64_t s0 = ssm_state.stride(0), s1 = ssm_state.stride(1), s2 = ssm_state.stride(2),
                s3 = ssm_state.stride(3);
  for (int64_t r = 0; r < b; ++r)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = idx_p[r * n + i];
      std::copy(x_p + t * sx, x_p + t * sx + h * p, xs_p + (r * n + i) * h * p);
      std::copy(b_p + t * sb, b_p + t * sb + g * s, bs_p + (r * n + i) * g * s);
      for (int64_t k = 0; k < h; ++k) dts_p[(r * n + i) * h + k] = softplus(dt_p[t * sdt + k] + bias_p[k]);
    }
  const int64_t heads_per_group = h / g;
  at::parallel_for(0, b * h, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> states(new float[n * p * s]);  // every node's state, not zero-filled
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t r = bh / h, k = bh % h, grp = k / heads_per_group;
      float* h0_r = h0_p + (r * h + k) * p * s;
      const float* src = st_p + start_p[r] * s0 + k * s1;
      for (int64_t pi = 0; pi < p; ++pi)
        for (int64_t si = 0; si < s; ++si) h0_r[pi * s + si] = src[pi * s2 + si * s3];
      for (int64_t i = 0; i < n; ++i) {
        const int64_t node = r * n + i, t = idx_p[node];
        const float dt_v = dts_p[node * h + k], decay = std::exp(dt_v * a_p[k]);
        const float* __restrict parent = par_p[i] < 0 ? h0_r : states.get() + par_p[i] * p * s;
        float* __restrict state = states.get() + i * p * s;
        const float* __restrict bv = bs_p + node * g * s + grp * s;
        const float* __restrict cv = c_p + t * sc + grp * s;
        const float* xv = xs_p + node * h * p + k * p;
        float* yv = out_p + t * so + k * p;
        for (int64_t pi = 0; pi < p; ++pi) {
          const float coef = dt_v * xv[pi];
          const float* __restrict hp = parent + pi * s;
          float* __restrict hs = state + pi * s;
          float acc[kLanes] = {0.f};
          int64_t si = 0;
          for (; si + kLanes <= s; si += kLanes)
            for (int l = 0; l < kLanes; ++l) {
              const float v = decay * hp[si + l] + coef * bv[si + l];
              hs[si + l] = v;
              acc[l] += v * cv[si + l];
            }
          float y = 0.f;
          for (; si < s; ++si) {
            const float v = decay * hp[si] + coef * bv[si];
            hs[si] = v;
            y += v * cv[si];
          }
          for (int l = 0; l < kLanes; ++l) y += acc[l];
          yv[pi] = y + d_p[k] * xv[pi];
        }
      }
    }
  });
  return {h0, xs, dts, bs};
}

// The commit of tree_conv_rows: each tree's new window, the last w - 1 of [its committed window
// win (b, w - 1, c), xbc (b, n, c) along path (b, k) (node indices, root first, -1 padded)], is
// written to conv_state[slots[r], :, cols[r] : cols[r] + w - 1] (conv_state (slots, c, L)).
// Reference: stree/kernels/replay.py (conv_replay).
void tree_conv_commit(at::Tensor conv_state, const at::Tensor& slots, const at::Tensor& cols,
                      const at::Tensor& win, const at::Tensor& xbc, const at::Tensor& path) {
  check_f32(conv_state, "conv_state");
  for (const at::Tensor* t : {&win, &xbc}) {
    check_f32(*t, "win and xbc");
    TORCH_CHECK(t->is_contiguous(), "stree cpu ops: win and xbc must be contiguous");
  }
  for (auto* t : {&slots, &cols, &path}) check_index(*t, "an index table");
  const int64_t b = win.size(0), w1 = win.size(1), c = win.size(2), n = xbc.size(1), k = path.size(1);
  TORCH_CHECK(conv_state.size(1) == c && xbc.size(2) == c && path.size(0) == b && slots.numel() == b
                  && cols.numel() == b, "stree cpu ops: tree_conv_commit shapes differ");
  check_range(slots, 0, conv_state.size(0), "a conv slot");
  const int64_t *slot_p = slots.data_ptr<int64_t>(), *col_p = cols.data_ptr<int64_t>();
  const int64_t* path_p = path.data_ptr<int64_t>();
  const float *win_p = win.data_ptr<float>(), *xbc_p = xbc.data_ptr<float>();
  float* cs_p = conv_state.data_ptr<float>();
  const int64_t ss = conv_state.stride(0), sc = conv_state.stride(1), sl = conv_state.stride(2);
  for (int64_t r = 0; r < b; ++r) {
    int64_t len = 0;
    while (len < k && path_p[r * k + len] >= 0) ++len;
    TORCH_CHECK(col_p[r] >= 0 && col_p[r] + w1 <= conv_state.size(2), "stree cpu ops: window past the conv state");
    float* dst = cs_p + slot_p[r] * ss + col_p[r] * sl;
    for (int64_t j = 0; j < w1; ++j) {
      const int64_t q = len + j;  // position in [window columns, path nodes]
      const float* src;
      if (q < w1) {
        src = win_p + (r * w1 + q) * c;
      } else {
        const int64_t node = path_p[r * k + q - w1];
        TORCH_CHECK(node >= 0 && node < n, "stree cpu ops: path node out of range");
        src = xbc_p + (r * n + node) * c;
      }
      for (int64_t ch = 0; ch < c; ++ch) dst[ch * sc + j * sl] = src[ch];
    }
  }
}

// The commit of tree_scan_rows: each tree's state advanced from h0 (b, h, p, s) along path (b, k)
// with the nodes' x (b, n, h, p), processed dt (b, n, h) and B (b, n, g, s), written to
// ssm_state[slots[r]] (ssm_state (slots, h, p, s)). Reference: stree/kernels/replay.py (ssm_replay).
void tree_scan_commit(at::Tensor ssm_state, const at::Tensor& slots, const at::Tensor& h0,
                      const at::Tensor& xs, const at::Tensor& dts, const at::Tensor& A, const at::Tensor& bs,
                      const at::Tensor& path) {
  check_f32(ssm_state, "ssm_state");
  for (const at::Tensor* t : {&h0, &xs, &dts, &bs}) {
    check_f32(*t, "h0, x, dt and B");
    TORCH_CHECK(t->is_contiguous(), "stree cpu ops: h0, x, dt and B must be contiguous");
  }
  for (auto* t : {&slots, &path}) check_index(*t, "an index table");
  const int64_t b = h0.size(0), h = h0.size(1), p = h0.size(2), s = h0.size(3);
  const int64_t n = xs.size(1), g = bs.size(2), k = path.size(1);
  TORCH_CHECK(ssm_state.size(1) == h && ssm_state.size(2) == p && ssm_state.size(3) == s && h % g == 0
                  && path.size(0) == b && slots.numel() == b, "stree cpu ops: tree_scan_commit shapes differ");
  const int64_t* path_p = path.data_ptr<int64_t>();
  for (int64_t i = 0; i < b * k; ++i)
    TORCH_CHECK(path_p[i] < n, "stree cpu ops: path node out of range");
  check_range(slots, 0, ssm_state.size(0), "a state slot");
  at::Tensor a_c = A.to(at::kFloat).contiguous();
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  const float *h0_p = h0.data_ptr<float>(), *xs_p = xs.data_ptr<float>(), *dts_p = dts.data_ptr<float>();
  const float *bs_p = bs.data_ptr<float>(), *a_p = a_c.data_ptr<float>();
  float* st_p = ssm_state.data_ptr<float>();
  const int64_t s0 = ssm_state.stride(0), s1 = ssm_state.stride(1), s2 = ssm_state.stride(2),
                s3 = ssm_state.stride(3);
  const int64_t heads_per_group = h / g;
  at::parallel_for(0, b * h, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> state(new float[p * s]);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t r = bh / h, k_h = bh % h, grp = k_h / heads_per_group;
      float* __restrict cur = state.get();
      std::copy(h0_p + bh * p * s, h0_p + (bh + 1) * p * s, cur);
      for (int64_t j = 0; j < k && path_p[r * k + j] >= 0; ++j) {
        const int64_t node = r * n + path_p[r * k + j];
        const float dt_v = dts_p[node * h + k_h], decay = std::exp(dt_v * a_p[k_h]);
        const float* __restrict bv = bs_p + (node * g + grp) * s;
        const float* xv = xs_p + (node * h + k_h) * p;
        for (int64_t pi = 0; pi < p; ++pi) {
          const float coef = dt_v * xv[pi];
          for (int64_t si = 0; si < s; ++si) cur[pi * s + si] = decay * cur[pi * s + si] + coef * bv[si];
        }
      }
      float* dst = st_p + slot_p[r] * s0 + k_h * s1;
      for (int64_t pi = 0; pi < p; ++pi)
        for (int64_t si = 0; si < s; ++si) dst[pi * s2 + si * s3] = cur[pi * s + si];
    }
  });
}

// csrc/tree_attention.cpp
void tree_attention_rows(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                         int64_t k_ts, int64_t k_es, int64_t v_ts, int64_t v_es, const at::Tensor& block_table,
                         const at::Tensor& seq_lens, const at::Tensor& index, const at::Tensor& mask, double scale,
                         at::Tensor out);
// csrc/tree_delta.cpp
std::vector<at::Tensor> tree_delta_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& g, const at::Tensor& beta, const at::Tensor& mask,
                                        const at::Tensor& s0);
// csrc/replay.cpp
void conv_replay_rows(at::Tensor conv_state, const at::Tensor& xbc, const at::Tensor& path);
void ssm_replay_rows(at::Tensor ssm_state, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                     const at::Tensor& B, const at::Tensor& path);
void delta_replay_rows(at::Tensor state, const at::Tensor& k, const at::Tensor& u, const at::Tensor& G,
                       const at::Tensor& path);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tree_conv_commit", &tree_conv_commit, "commit of tree_conv_rows along the accepted paths (CPU, fp32)");
  m.def("tree_scan_commit", &tree_scan_commit, "commit of tree_scan_rows along the accepted paths (CPU, fp32)");
  m.def("tree_conv_rows", &tree_conv_rows, "tree conv of a group of equally shaped trees (CPU, fp32)");
  m.def("tree_scan_rows", &tree_scan_rows, "tree scan of a group of equally shaped trees (CPU, fp32)");
  m.def("tree_attention_rows", &tree_attention_rows,
        "attention rows of a group of equally shaped trees over a paged KV cache (CPU, fp32)");
  m.def("tree_delta_rows", &tree_delta_rows, "the gated delta rule over a packed token tree (CPU, fp32)");
  m.def("conv_replay_rows", &conv_replay_rows, "conv windows advanced along the accepted paths, in place (CPU, fp32)");
  m.def("ssm_replay_rows", &ssm_replay_rows, "Mamba2 states advanced along the accepted paths, in place (CPU, fp32)");
  m.def("delta_replay_rows", &delta_replay_rows,
        "gated delta rule states advanced along the accepted paths, in place (CPU, fp32)");
}
