// The per-token work of the multi-stream designs (HC, mHC, GR) for CPU tensors: one pass over
// the tokens per direction.
//
// A token's streams are n rows of D numbers (a few KiB): the PyTorch path makes a pass over
// [tokens, n, D] memory per product and sum and writes every intermediate back, where here a
// token's rows stay in cache while every term of the mix, the update or their gradients is
// formed from them. Sinkhorn-Knopp runs its iterations on one n x n matrix at a time, in
// registers and a small per-thread buffer, where the PyTorch path launches four ops per half
// step over all matrices.
//
// Notation (per token t; streams k, j; d in [0, D)):
//   mix:      y[d] = sum_k w[k] H[k, d]
//   update:   out[j, d] = sum_k A[j, k] H[k, d] + b[j] v[d]     (A given transposed, or the identity)
//   gated:    y[d] = (1/n) sum_k sigmoid(z[k, d]) R[k, d]          (GR's read: elementwise gates)
//   sinkhorn: p = exp(x - max x); then `iterations` times: rows, then columns, scaled to sum 1
//             (each sum clamped below at the smallest normal number, multiplied by its reciprocal)
//
// Layouts: H rows of D contiguous numbers, token stride `ts` and stream stride `ks` (0 for the
// embedding broadcast to every stream); every other array contiguous: w, b [T, n]; A [T, n, n];
// v, y [T, D]; out, dH, and GR's R and z [T, n, D]; logits and p [B, n, n]. Null outputs are not computed.

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

template <typename F>
inline F dot(const F* a, const F* b, int64_t n) {
  F s0 = 0, s1 = 0, s2 = 0, s3 = 0;  // four chains, so that the adds do not wait on each other
  int64_t d = 0;
  for (; d + 4 <= n; d += 4) {
    s0 += a[d] * b[d];
    s1 += a[d + 1] * b[d + 1];
    s2 += a[d + 2] * b[d + 2];
    s3 += a[d + 3] * b[d + 3];
  }
  for (; d < n; ++d) s0 += a[d] * b[d];
  return (s0 + s1) + (s2 + s3);
}

template <typename F>
void mix_forward(int64_t T, int64_t n, int64_t D, const F* H, int64_t ts, int64_t ks, const F* w, F* y,
                 int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const F* h = H + t * ts;
    const F* wt = w + t * n;
    F* out = y + t * D;
    for (int64_t d = 0; d < D; ++d) out[d] = wt[0] * h[d];
    for (int64_t k = 1; k < n; ++k) {
      const F* hk = h + k * ks;
      const F a = wt[k];
      for (int64_t d = 0; d < D; ++d) out[d] += a * hk[d];
    }
  }
}

template <typename F>
void mix_backward(int64_t T, int64_t n, int64_t D, const F* H, int64_t ts, int64_t ks, const F* w, const F* g,
                  F* dH, F* dw, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const F* gt = g + t * D;
    for (int64_t k = 0; k < n; ++k) {
      if (dH) {
        const F a = w[t * n + k];
        F* dh = dH + (t * n + k) * D;
        for (int64_t d = 0; d < D; ++d) dh[d] = a * gt[d];
      }
      if (dw) dw[t * n + k] = dot(gt, H + t * ts + k * ks, D);
    }
  }
}

// A[j, k] of token t: A given as [T, n, n] rows j (trans = 0) or rows k (trans = 1); null: identity
template <typename F>
inline F coef(const F* A, int trans, int64_t n, int64_t t, int64_t j, int64_t k) {
  if (!A) return j == k ? F(1) : F(0);
  return trans ? A[(t * n + k) * n + j] : A[(t * n + j) * n + k];
}

template <typename F>
void update_forward(int64_t T, int64_t n, int64_t D, const F* H, int64_t ts, int64_t ks, const F* A, int trans,
                    const F* b, const F* v, F* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const F* h = H + t * ts;
    const F* vt = v + t * D;
    for (int64_t j = 0; j < n; ++j) {
      F* o = out + (t * n + j) * D;
      const F bj = b[t * n + j];
      for (int64_t d = 0; d < D; ++d) o[d] = bj * vt[d];
      for (int64_t k = 0; k < n; ++k) {
        const F a = coef(A, trans, n, t, j, k);
        if (!A && j != k) continue;
        const F* hk = h + k * ks;
        for (int64_t d = 0; d < D; ++d) o[d] += a * hk[d];
      }
    }
  }
}

template <typename F>
void update_backward(int64_t T, int64_t n, int64_t D, const F* H, int64_t ts, int64_t ks, const F* A, int trans,
                     const F* b, const F* v, const F* g, F* dH, F* dA, F* db, F* dv, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const F* h = H + t * ts;
    const F* vt = v + t * D;
    const F* gt = g + t * n * D;
    if (dH) {
      for (int64_t k = 0; k < n; ++k) {
        F* dh = dH + (t * n + k) * D;
        if (!A) {
          for (int64_t d = 0; d < D; ++d) dh[d] = gt[k * D + d];
          continue;
        }
        const F a0 = coef(A, trans, n, t, 0, k);
        for (int64_t d = 0; d < D; ++d) dh[d] = a0 * gt[d];
        for (int64_t j = 1; j < n; ++j) {
          const F a = coef(A, trans, n, t, j, k);
          const F* gj = gt + j * D;
          for (int64_t d = 0; d < D; ++d) dh[d] += a * gj[d];
        }
      }
    }
    if (dA) {
      for (int64_t j = 0; j < n; ++j)
        for (int64_t k = 0; k < n; ++k) {
          const F s = dot(gt + j * D, h + k * ks, D);
          if (trans)
            dA[(t * n + k) * n + j] = s;
          else
            dA[(t * n + j) * n + k] = s;
        }
    }
    if (db)
      for (int64_t j = 0; j < n; ++j) db[t * n + j] = dot(gt + j * D, vt, D);
    if (dv) {
      F* o = dv + t * D;
      const F b0 = b[t * n];
      for (int64_t d = 0; d < D; ++d) o[d] = b0 * gt[d];
      for (int64_t j = 1; j < n; ++j) {
        const F bj = b[t * n + j];
        const F* gj = gt + j * D;
        for (int64_t d = 0; d < D; ++d) o[d] += bj * gj[d];
      }
    }
  }
}

template <typename F>
inline F sigmoid(F x) {
  return F(1) / (F(1) + std::exp(-x));
}

// Forward also writes the gates sigmoid(z) to s (when not null), so that backward computes no
// exponential: dR = s g / n;  dz = (g / n) R s (1 - s)
template <typename F>
void gated_forward(int64_t T, int64_t n, int64_t D, const F* R, const F* z, F* y, F* s, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    F* out = y + t * D;
    for (int64_t d = 0; d < D; ++d) out[d] = 0;
    for (int64_t k = 0; k < n; ++k) {
      const int64_t row = (t * n + k) * D;
      for (int64_t d = 0; d < D; ++d) {
        const F gate = sigmoid(z[row + d]);
        if (s) s[row + d] = gate;
        out[d] += gate * R[row + d];
      }
    }
    for (int64_t d = 0; d < D; ++d) out[d] /= F(n);
  }
}

template <typename F>
void gated_backward(int64_t T, int64_t n, int64_t D, const F* R, const F* s, const F* g, F* dR, F* dz,
                    int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const F* gt = g + t * D;
    for (int64_t k = 0; k < n; ++k) {
      const int64_t row = (t * n + k) * D;
      for (int64_t d = 0; d < D; ++d) {
        const F gn = gt[d] / F(n), gate = s[row + d];
        if (dR) dR[row + d] = gate * gn;
        if (dz) dz[row + d] = gn * R[row + d] * ((F(1) - gate) * gate);
      }
    }
  }
}

// The matrices' side n, known at compile time for the common sizes (the loops unroll and
// vectorize) or read at run time (NN = 0).
template <int NN>
inline int64_t side(int64_t n) {
  return NN ? NN : n;
}

// One half step in place: rows (col = 0) or columns (col = 1) of p [n, n] scaled to sum 1.
// Writes each line's reciprocal to inv[n] and whether its sum was above the clamp to live[n].
template <typename F, int NN>
inline void normalize(F* p, int64_t n_, int col, F* inv, unsigned char* live) {
  const int64_t n = side<NN>(n_);
  const F tiny = std::numeric_limits<F>::min();
  for (int64_t i = 0; i < n; ++i) {
    F s = 0;
    for (int64_t j = 0; j < n; ++j) s += col ? p[j * n + i] : p[i * n + j];
    live[i] = s >= tiny;
    inv[i] = F(1) / (s >= tiny ? s : tiny);
    for (int64_t j = 0; j < n; ++j) (col ? p[j * n + i] : p[i * n + j]) *= inv[i];
  }
}

// p = exp(x - max x) of one matrix; returns the max
template <typename F>
inline F shifted_exp(const F* x, int64_t nn, F* p) {
  F m = x[0];
  for (int64_t e = 1; e < nn; ++e) m = x[e] > m ? x[e] : m;
  for (int64_t e = 0; e < nn; ++e) p[e] = std::exp(x[e] - m);
  return m;
}

template <typename F, int NN>
void sinkhorn_forward(int64_t B, int64_t n_, int64_t iterations, const F* x, F* p, int threads) {
  const int64_t n = side<NN>(n_), nn = n * n;
#pragma omp parallel num_threads(threads)
  {
    std::vector<F> inv(n);
    std::vector<unsigned char> live(n);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      F* pb = p + b * nn;
      shifted_exp(x + b * nn, nn, pb);
      for (int64_t it = 0; it < iterations; ++it) {
        normalize<F, NN>(pb, n, 0, inv.data(), live.data());
        normalize<F, NN>(pb, n, 1, inv.data(), live.data());
      }
    }
  }
}

// Reverse mode through the iterations exactly as autograd differentiates the PyTorch loop: the
// forward is run again per matrix, keeping each half step's input and reciprocals (2 x
// iterations x (n^2 + 2n) numbers per thread), then each half step is reversed:
//   q = p * inv (per line),  inv = 1 / max(s, tiny),  s = sum over the line of p
//   dp = dq * inv + ds,  ds = -inv^2 * sum_line(dq * p)  (0 where s was clamped)
// and the shift: dx = dp0 * p0, with -sum(dp0 * p0) shared out over the maxima (amax's rule).
template <typename F, int NN>
void sinkhorn_backward(int64_t B, int64_t n_, int64_t iterations, const F* x, const F* gp, F* dx, int threads) {
  const int64_t n = side<NN>(n_), nn = n * n, steps = 2 * iterations;
#pragma omp parallel num_threads(threads)
  {
    std::vector<F> ps((steps + 1) * nn), invs(steps * n), dp(nn);
    std::vector<unsigned char> lives(steps * n);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      const F* xb = x + b * nn;
      const F m = shifted_exp(xb, nn, ps.data());
      for (int64_t s = 0; s < steps; ++s) {
        F* next = ps.data() + (s + 1) * nn;
        for (int64_t e = 0; e < nn; ++e) next[e] = ps[s * nn + e];
        normalize<F, NN>(next, n, int(s % 2), invs.data() + s * n, lives.data() + s * n);
      }
      for (int64_t e = 0; e < nn; ++e) dp[e] = gp[b * nn + e];
      for (int64_t s = steps - 1; s >= 0; --s) {
        const int col = int(s % 2);
        const F* p = ps.data() + s * nn;  // the half step's input
        const F* inv = invs.data() + s * n;
        const unsigned char* live = lives.data() + s * n;
        for (int64_t i = 0; i < n; ++i) {
          F acc = 0;
          for (int64_t j = 0; j < n; ++j) {
            const int64_t e = col ? j * n + i : i * n + j;
            acc += dp[e] * p[e];
          }
          const F dsum = live[i] ? -inv[i] * inv[i] * acc : F(0);
          for (int64_t j = 0; j < n; ++j) {
            const int64_t e = col ? j * n + i : i * n + j;
            dp[e] = dp[e] * inv[i] + dsum;
          }
        }
      }
      F* d = dx + b * nn;
      F total = 0;
      int64_t maxima = 0;
      for (int64_t e = 0; e < nn; ++e) {
        d[e] = dp[e] * ps[e];
        total += d[e];
        maxima += xb[e] == m;
      }
      const F share = -total / F(maxima);
      for (int64_t e = 0; e < nn; ++e)
        if (xb[e] == m) d[e] += share;
    }
  }
}

template <typename F>
void sinkhorn_forward_any(int64_t B, int64_t n, int64_t iterations, const F* x, F* p, int threads) {
  switch (n) {
    case 2: return sinkhorn_forward<F, 2>(B, n, iterations, x, p, threads);
    case 4: return sinkhorn_forward<F, 4>(B, n, iterations, x, p, threads);
    case 8: return sinkhorn_forward<F, 8>(B, n, iterations, x, p, threads);
    default: return sinkhorn_forward<F, 0>(B, n, iterations, x, p, threads);
  }
}

template <typename F>
void sinkhorn_backward_any(int64_t B, int64_t n, int64_t iterations, const F* x, const F* gp, F* dx, int threads) {
  switch (n) {
    case 2: return sinkhorn_backward<F, 2>(B, n, iterations, x, gp, dx, threads);
    case 4: return sinkhorn_backward<F, 4>(B, n, iterations, x, gp, dx, threads);
    case 8: return sinkhorn_backward<F, 8>(B, n, iterations, x, gp, dx, threads);
    default: return sinkhorn_backward<F, 0>(B, n, iterations, x, gp, dx, threads);
  }
}

}  // namespace

extern "C" {
#define ATTNRES_MULTI_STREAM(SUFFIX, F)                                                                          \
  void attnres_stream_mix_forward_##SUFFIX(int64_t T, int64_t n, int64_t D, const F* H, int64_t ts, int64_t ks,  \
                                           const F* w, F* y, int threads) {                                      \
    mix_forward<F>(T, n, D, H, ts, ks, w, y, threads);                                                           \
  }                                                                                                              \
  void attnres_stream_mix_backward_##SUFFIX(int64_t T, int64_t n, int64_t D, const F* H, int64_t ts, int64_t ks, \
                                            const F* w, const F* g, F* dH, F* dw, int threads) {                \
    mix_backward<F>(T, n, D, H, ts, ks, w, g, dH, dw, threads);                                                  \
  }                                                                                                              \
  void attnres_stream_update_forward_##SUFFIX(int64_t T, int64_t n, int64_t D, const F* H, int64_t ts,          \
                                              int64_t ks, const F* A, int trans, const F* b, const F* v, F* out, \
                                              int threads) {                                                     \
    update_forward<F>(T, n, D, H, ts, ks, A, trans, b, v, out, threads);                                         \
  }                                                                                                              \
  void attnres_stream_update_backward_##SUFFIX(int64_t T, int64_t n, int64_t D, const F* H, int64_t ts,         \
                                               int64_t ks, const F* A, int trans, const F* b, const F* v,        \
                                               const F* g, F* dH, F* dA, F* db, F* dv, int threads) {            \
    update_backward<F>(T, n, D, H, ts, ks, A, trans, b, v, g, dH, dA, db, dv, threads);                          \
  }                                                                                                              \
  void attnres_gated_mix_forward_##SUFFIX(int64_t T, int64_t n, int64_t D, const F* R, const F* z, F* y, F* s, \
                                          int threads) {                                                         \
    gated_forward<F>(T, n, D, R, z, y, s, threads);                                                              \
  }                                                                                                              \
  void attnres_gated_mix_backward_##SUFFIX(int64_t T, int64_t n, int64_t D, const F* R, const F* s, const F* g, \
                                           F* dR, F* dz, int threads) {                                          \
    gated_backward<F>(T, n, D, R, s, g, dR, dz, threads);                                                        \
  }                                                                                                              \
  void attnres_sinkhorn_forward_##SUFFIX(int64_t B, int64_t n, int64_t iterations, const F* x, F* p,            \
                                         int threads) {                                                          \
    sinkhorn_forward_any<F>(B, n, iterations, x, p, threads);                                                        \
  }                                                                                                              \
  void attnres_sinkhorn_backward_##SUFFIX(int64_t B, int64_t n, int64_t iterations, const F* x, const F* gp,    \
                                          F* dx, int threads) {                                                  \
    sinkhorn_backward_any<F>(B, n, iterations, x, gp, dx, threads);                                                  \
  }
ATTNRES_MULTI_STREAM(f32, float)
ATTNRES_MULTI_STREAM(f64, double)
#undef ATTNRES_MULTI_STREAM
}
