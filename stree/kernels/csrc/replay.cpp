// CPU activation replay: the commit of stree's own decoding loop, one call per layer and state
// where the eager reference is a dozen small batched ops (gathers, exps, a product, copies), each
// paying the interpreter and dispatcher. Every op writes the state in place along the accepted
// path (node indices, root first, -1 padded at the end; a row of -1 keeps its state).
//
// Reference (same math, same arguments, eager PyTorch, the oracle of tests/test_cpu_ops.py):
// stree/kernels/replay.py (conv_replay, ssm_replay, delta_replay), whose docstring has the rules.
// fp32 only: the Python side takes the reference for anything else.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

void check_f32(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && (t.dim() == 0 || t.stride(-1) == 1),
              "stree cpu ops: ", op, ": ", name, " must be a float32 CPU tensor, last axis dense");
}

// each row's accepted length; path (b, k) contiguous int64, every node below n
std::vector<int64_t> path_lengths(const at::Tensor& path, int64_t b, int64_t n, const char* op) {
  TORCH_CHECK(path.device().is_cpu() && path.scalar_type() == at::kLong && path.is_contiguous()
                  && path.dim() == 2 && path.size(0) == b,
              "stree cpu ops: ", op, ": path must be a contiguous (batch, steps) int64 CPU tensor");
  const int64_t k = path.size(1), *p = path.data_ptr<int64_t>();
  std::vector<int64_t> len(b, 0);
  for (int64_t r = 0; r < b; ++r) {
    while (len[r] < k && p[r * k + len[r]] >= 0) ++len[r];
    for (int64_t j = 0; j < len[r]; ++j)
      TORCH_CHECK(p[r * k + j] < n, "stree cpu ops: ", op, ": path node out of range");
  }
  return len;
}

// rows (of b * heads) per thread: a commit of a short path over a few heads is microseconds of
// work, less than waking a second thread costs
int64_t grain(int64_t work_per_row) {
  return std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, work_per_row));
}

}  // namespace

// conv_state (b, c, w), any strides; xbc (b, n, c), last axis dense. The new window of row r is
// the last w columns of [its window, xbc[path nodes]], written in place: column j reads column
// len + j >= j of the old window, never one already written.
void conv_replay_rows(at::Tensor conv_state, const at::Tensor& xbc, const at::Tensor& path) {
  const char* op = "conv_replay_rows";
  TORCH_CHECK(conv_state.device().is_cpu() && conv_state.scalar_type() == at::kFloat && conv_state.dim() == 3,
              "stree cpu ops: ", op, ": conv_state must be a (batch, channels, width) float32 CPU tensor");
  check_f32(xbc, op, "xbc");
  const int64_t b = conv_state.size(0), c = conv_state.size(1), w = conv_state.size(2), n = xbc.size(1);
  TORCH_CHECK(xbc.dim() == 3 && xbc.size(0) == b && xbc.size(2) == c,
              "stree cpu ops: ", op, " shapes differ");
  const std::vector<int64_t> len = path_lengths(path, b, n, op);
  const int64_t k = path.size(1), *p = path.data_ptr<int64_t>();
  float* cs = conv_state.data_ptr<float>();
  const float* x = xbc.data_ptr<float>();
  const int64_t s0 = conv_state.stride(0), s1 = conv_state.stride(1), s2 = conv_state.stride(2);
  const int64_t x0 = xbc.stride(0), x1 = xbc.stride(1);
  for (int64_t r = 0; r < b; ++r) {
    if (len[r] == 0) continue;
    float* row = cs + r * s0;
    for (int64_t j = 0; j < w; ++j) {
      const int64_t q = len[r] + j;  // position in [window columns, path nodes]
      if (q < w) {
        for (int64_t ch = 0; ch < c; ++ch) row[ch * s1 + j * s2] = row[ch * s1 + q * s2];
      } else {
        const float* src = x + r * x0 + p[r * k + q - w] * x1;
        for (int64_t ch = 0; ch < c; ++ch) row[ch * s1 + j * s2] = src[ch];
      }
    }
  }
}

// ssm_state (b, h, p, s); x (b, n, h, p); dt (b, n, h) processed; A (h,); B (b, n, g, s); last axes
// dense. Per path node j: S <- exp(dt_j A) S + dt_j x_j B_j^T.
void ssm_replay_rows(at::Tensor ssm_state, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                     const at::Tensor& B, const at::Tensor& path) {
  const char* op = "ssm_replay_rows";
  check_f32(ssm_state, op, "ssm_state");
  check_f32(x, op, "x");
  check_f32(B, op, "B");
  TORCH_CHECK(dt.device().is_cpu() && dt.scalar_type() == at::kFloat && A.device().is_cpu()
                  && A.scalar_type() == at::kFloat,
              "stree cpu ops: ", op, ": dt and A must be float32 CPU tensors");
  const int64_t b = ssm_state.size(0), h = ssm_state.size(1), hp = ssm_state.size(2), s = ssm_state.size(3);
  const int64_t n = x.size(1), g = B.size(2);
  TORCH_CHECK(x.dim() == 4 && x.size(0) == b && x.size(2) == h && x.size(3) == hp && dt.dim() == 3
                  && dt.size(0) == b && dt.size(1) == n && dt.size(2) == h && A.numel() == h && B.dim() == 4
                  && B.size(0) == b && B.size(1) == n && B.size(3) == s && g > 0 && h % g == 0,
              "stree cpu ops: ", op, " shapes differ");
  const std::vector<int64_t> len = path_lengths(path, b, n, op);
  const at::Tensor a_c = A.contiguous();
  const int64_t k = path.size(1), *pp = path.data_ptr<int64_t>();
  const float *x_p = x.data_ptr<float>(), *dt_p = dt.data_ptr<float>(), *a_p = a_c.data_ptr<float>();
  const float* b_p = B.data_ptr<float>();
  float* st = ssm_state.data_ptr<float>();
  const int64_t t0 = ssm_state.stride(0), t1 = ssm_state.stride(1), t2 = ssm_state.stride(2);
  const int64_t heads_per_group = h / g;
  at::parallel_for(0, b * h, grain(k * hp * s), [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t r = bh / h, hh = bh % h, grp = hh / heads_per_group;
      float* S = st + r * t0 + hh * t1;
      for (int64_t j = 0; j < len[r]; ++j) {
        const int64_t node = pp[r * k + j];
        const float d = dt_p[r * dt.stride(0) + node * dt.stride(1) + hh * dt.stride(2)];
        const float decay = std::exp(d * a_p[hh]);
        const float* xv = x_p + r * x.stride(0) + node * x.stride(1) + hh * x.stride(2);
        const float* __restrict bv = b_p + r * B.stride(0) + node * B.stride(1) + grp * B.stride(2);
        for (int64_t pi = 0; pi < hp; ++pi) {
          float* __restrict row = S + pi * t2;
          const float coef = d * xv[pi];
          for (int64_t si = 0; si < s; ++si) row[si] = decay * row[si] + coef * bv[si];
        }
      }
    }
  });
}

// state (b, h, dk, dv); k (b, n, h, dk); u (b, n, h, dv); G (b, n, h) per head or (b, n, h, dk) per key
// channel; last axes dense. With a the path's last node:
// S <- e^{G_a} S + sum_{j on the path} e^{G_a - G_j} k_j u_j^T (per key channel for a per-channel G).
void delta_replay_rows(at::Tensor state, const at::Tensor& k, const at::Tensor& u, const at::Tensor& G,
                       const at::Tensor& path) {
  const char* op = "delta_replay_rows";
  check_f32(state, op, "state");
  check_f32(k, op, "k");
  check_f32(u, op, "u");
  check_f32(G, op, "G");
  const int64_t b = state.size(0), h = state.size(1), dk = state.size(2), dv = state.size(3), n = k.size(1);
  const bool per_channel = G.dim() == 4;
  TORCH_CHECK(k.dim() == 4 && k.size(0) == b && k.size(2) == h && k.size(3) == dk && u.dim() == 4
                  && u.size(0) == b && u.size(1) == n && u.size(2) == h && u.size(3) == dv && G.size(0) == b
                  && G.size(1) == n && G.size(2) == h && (G.dim() == 3 || (per_channel && G.size(3) == dk)),
              "stree cpu ops: ", op, " shapes differ");
  const std::vector<int64_t> len = path_lengths(path, b, n, op);
  const int64_t kk = path.size(1), *pp = path.data_ptr<int64_t>();
  const float *k_p = k.data_ptr<float>(), *u_p = u.data_ptr<float>(), *g_p = G.data_ptr<float>();
  float* st = state.data_ptr<float>();
  const int64_t t0 = state.stride(0), t1 = state.stride(1), t2 = state.stride(2);
  const int64_t g0 = G.stride(0), g1 = G.stride(1), g2 = G.stride(2);
  at::parallel_for(0, b * h, grain(kk * dk * dv), [&](int64_t begin, int64_t end) {
    std::vector<float> wk(dk);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t r = bh / h, hh = bh % h;
      if (len[r] == 0) continue;
      float* S = st + r * t0 + hh * t1;
      auto Gat = [&](int64_t node) { return g_p + r * g0 + node * g1 + hh * g2; };
      const float* Ga = Gat(pp[r * kk + len[r] - 1]);
      for (int64_t c = 0; c < dk; ++c) {  // S <- e^{G_a} S
        const float decay = std::exp(Ga[per_channel ? c : 0]);
        float* __restrict row = S + c * t2;
        for (int64_t e = 0; e < dv; ++e) row[e] *= decay;
      }
      for (int64_t j = 0; j < len[r]; ++j) {  // S += (e^{G_a - G_j} k_j) u_j^T
        const int64_t node = pp[r * kk + j];
        const float *kj = k_p + r * k.stride(0) + node * k.stride(1) + hh * k.stride(2), *Gj = Gat(node);
        const float* __restrict uj = u_p + r * u.stride(0) + node * u.stride(1) + hh * u.stride(2);
        for (int64_t c = 0; c < dk; ++c) {
          const int64_t gc = per_channel ? c : 0;
          wk[c] = kj[c] * std::exp(Ga[gc] - Gj[gc]);
        }
        for (int64_t c = 0; c < dk; ++c) {
          float* __restrict row = S + c * t2;
          const float a = wk[c];
          for (int64_t e = 0; e < dv; ++e) row[e] += a * uj[e];
        }
      }
    }
  });
}
