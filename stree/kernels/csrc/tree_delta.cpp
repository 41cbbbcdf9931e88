// CPU gated delta rule (Gated DeltaNet, Kimi Delta Attention) over a packed token tree from a
// committed state, writing no state: stree's own tree verify of a Gated DeltaNet layer in one
// call per layer, where the eager reference is about twenty small batched ops.
//
// Reference (same math, same arguments and returns, eager PyTorch, the oracle of
// tests/test_cpu_ops.py): stree/kernels/tree_delta.py (_tree_delta_ref), whose docstring has the
// rule. Per (row, head), node by node in packed order (ancestors first): the path decay
// G_i = sum_{j anc-or-self of i} g_j, then u_i by forward substitution over i's ancestors, then
// o_i from the committed state and the ancestors' u.
// fp32 only: the Python side (stree/kernels/tree_delta.py) takes the reference for anything else.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.stride(-1) == 1,
              "stree cpu ops: tree_delta_rows: ", name, " must be a float32 CPU tensor, last axis dense");
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  float acc = 0.f;  // -ffast-math: vectorized with partial sums
  for (int64_t c = 0; c < d; ++c) acc += a[c] * b[c];
  return acc;
}

// sum_c a[c] b[c] exp(gi[c] - gj[c]): KDA's decay per key channel between two nodes of one path
inline float decayed_dot(const float* __restrict a, const float* __restrict b, const float* __restrict gi,
                         const float* __restrict gj, int64_t d) {
  float acc = 0.f;
  for (int64_t c = 0; c < d; ++c) acc += a[c] * b[c] * std::exp(gi[c] - gj[c]);
  return acc;
}

}  // namespace

// q, k (b, n, h, dk); v (b, n, h, dv); g (b, n, h) per-head log-decay or (b, n, h, dk) per key
// channel; beta (b, n, h); mask (b, n, n) bool ancestor-or-self, nodes packed topologically;
// s0 (b, h, dk, dv). Any strides with a dense last axis. Returns o, u (b, n, h, dv) and G (g's
// shape), new contiguous tensors.
std::vector<at::Tensor> tree_delta_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& g, const at::Tensor& beta, const at::Tensor& mask,
                                        const at::Tensor& s0) {
  check_f32(q, "q");
  check_f32(k, "k");
  check_f32(v, "v");
  check_f32(s0, "initial_state");
  TORCH_CHECK(g.device().is_cpu() && g.scalar_type() == at::kFloat && beta.device().is_cpu()
                  && beta.scalar_type() == at::kFloat,
              "stree cpu ops: tree_delta_rows: g and beta must be float32 CPU tensors");
  TORCH_CHECK(mask.device().is_cpu() && mask.scalar_type() == at::kBool,
              "stree cpu ops: tree_delta_rows: mask must be a bool CPU tensor");
  const int64_t b = q.size(0), n = q.size(1), h = q.size(2), dk = q.size(3), dv = v.size(3);
  const bool per_channel = g.dim() == 4;
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(0) == b && v.size(1) == n && v.size(2) == h
                  && beta.size(0) == b && beta.size(1) == n && beta.size(2) == h && mask.size(0) == b
                  && mask.size(1) == n && mask.size(2) == n && s0.size(0) == b && s0.size(1) == h
                  && s0.size(2) == dk && s0.size(3) == dv && g.size(0) == b && g.size(1) == n
                  && g.size(2) == h && (!per_channel || g.size(3) == dk),
              "stree cpu ops: tree_delta_rows shapes differ");
  const at::Tensor gc = g.contiguous(), bc = beta.contiguous(), mc = mask.contiguous();
  at::Tensor o = at::empty({b, n, h, dv}, v.options());
  at::Tensor u = at::empty({b, n, h, dv}, v.options());
  at::Tensor G = at::empty(g.sizes(), g.options());
  const int64_t gk = per_channel ? dk : 1;  // decay channels per head
  const float *q_p = q.data_ptr<float>(), *k_p = k.data_ptr<float>(), *v_p = v.data_ptr<float>();
  const float *g_p = gc.data_ptr<float>(), *b_p = bc.data_ptr<float>(), *s_p = s0.data_ptr<float>();
  const bool* m_p = mc.data_ptr<bool>();
  float *o_p = o.data_ptr<float>(), *u_p = u.data_ptr<float>(), *G_p = G.data_ptr<float>();
  const int64_t sq0 = q.stride(0), sq1 = q.stride(1), sq2 = q.stride(2);
  const int64_t sk0 = k.stride(0), sk1 = k.stride(1), sk2 = k.stride(2);
  const int64_t sv0 = v.stride(0), sv1 = v.stride(1), sv2 = v.stride(2);
  const int64_t ss0 = s0.stride(0), ss1 = s0.stride(1), ss2 = s0.stride(2);
  // threads only where a share is worth waking them for: a lone 16-node tree's four heads of 64
  // channels take about 40 us on one core, and waking a second thread for half of them measured
  // slower (docs/performance.md, "Measured and not adopted")
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, n * dk * dv));
  at::parallel_for(0, b * h, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> ks(dv), qs(dv), eG(n * gk), kg(dk), qg(dk);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t r = bh / h, hh = bh % h;
      const bool* anc = m_p + r * n * n;
      auto Q = [&](int64_t i) { return q_p + r * sq0 + i * sq1 + hh * sq2; };
      auto K = [&](int64_t i) { return k_p + r * sk0 + i * sk1 + hh * sk2; };
      auto U = [&](int64_t i) { return u_p + ((r * n + i) * h + hh) * dv; };
      auto Gr = [&](int64_t i) { return G_p + ((r * n + i) * h + hh) * gk; };
      const float* S = s_p + r * ss0 + hh * ss1;  // (dk, dv), rows ss2 apart
      for (int64_t i = 0; i < n; ++i) {  // G_i: the decay along i's path (its ancestors precede it)
        float* Gi = Gr(i);
        for (int64_t c = 0; c < gk; ++c) Gi[c] = 0.f;
        for (int64_t j = 0; j <= i; ++j)
          if (anc[i * n + j]) {
            const float* gj = g_p + ((r * n + j) * h + hh) * gk;
            for (int64_t c = 0; c < gk; ++c) Gi[c] += gj[c];
          }
        for (int64_t c = 0; c < gk; ++c) eG[i * gk + c] = std::exp(Gi[c]);
      }
      for (int64_t i = 0; i < n; ++i) {
        const float *qi = Q(i), *ki = K(i), *Gi = Gr(i), *vi = v_p + r * sv0 + i * sv1 + hh * sv2;
        // (e^{G_i} k_i) . S0 and (e^{G_i} q_i) . S0 in one pass over the state
        const float *kS = ki, *qS = qi;
        if (per_channel) {
          for (int64_t c = 0; c < dk; ++c) kg[c] = ki[c] * eG[i * dk + c], qg[c] = qi[c] * eG[i * dk + c];
          kS = kg.data(), qS = qg.data();
        }
        std::fill(ks.begin(), ks.end(), 0.f);
        std::fill(qs.begin(), qs.end(), 0.f);
        for (int64_t c = 0; c < dk; ++c) {
          const float* __restrict row = S + c * ss2;
          const float kc = kS[c], qc = qS[c];
          for (int64_t e = 0; e < dv; ++e) ks[e] += kc * row[e], qs[e] += qc * row[e];
        }
        const float scale = per_channel ? 1.f : eG[i], bi = b_p[(r * n + i) * h + hh];
        float* __restrict ui = U(i);
        float* __restrict oi = o_p + ((r * n + i) * h + hh) * dv;
        for (int64_t e = 0; e < dv; ++e) ui[e] = bi * (vi[e] - scale * ks[e]), oi[e] = scale * qs[e];
        // (I + beta kk) u = beta (v - ks0): row i reads only its strict ancestors' u
        for (int64_t j = 0; j < i; ++j) {
          if (!anc[i * n + j]) continue;
          const float kk = per_channel ? decayed_dot(ki, K(j), Gi, Gr(j), dk)
                                       : dot(ki, K(j), dk) * std::exp(Gi[0] - Gr(j)[0]);
          const float a = bi * kk;
          const float* __restrict uj = U(j);
          for (int64_t e = 0; e < dv; ++e) ui[e] -= a * uj[e];
        }
        for (int64_t j = 0; j <= i; ++j) {  // o_i += sum over ancestors-or-self of <q_i, k_j> decayed u_j
          if (!anc[i * n + j]) continue;
          const float qk = per_channel ? decayed_dot(qi, K(j), Gi, Gr(j), dk)
                                       : dot(qi, K(j), dk) * std::exp(Gi[0] - Gr(j)[0]);
          const float* __restrict uj = U(j);
          for (int64_t e = 0; e < dv; ++e) oi[e] += qk * uj[e];
        }
      }
    }
  });
  return {o, u, G};
}
