// Fused depth attention and two-phase merge for CPU tensors: one pass over the tokens per direction.
//
// The PyTorch path (ops/backends/torch.py) runs each product and sum as its own op over [tokens, D]
// tensors, so a source is read about twice in forward and six times in backward, and every
// intermediate is written to memory and read back. Here each token is one unit of work: the
// rows of all sources of a token (N x D numbers, a few KiB) stay in cache while the logits,
// the softmax, the weighted sums and, in backward, every gradient term are computed from them.
//
// Notation (per token t, source j, query s, head h; a head's slice is D / H numbers):
//   logit[j,s,h] = r_j * (qg_s[h] . v_j[h])          r_j = rsqrt(mean(v_j^2) + eps), or 1
//   p[j,s,h]     = softmax_j(logit) (or sigmoid)     lse[s,h] = logsumexp_j(logit) (or 0)
//   out_s[h]     = sum_j p[j,s,h] v_j[h]
// Query 0's output optionally goes through the next sublayer's RMSNorm (y = (out * rr) * w).
//
// Layouts: sources N pointers to [T, D] rows (row stride D, or 0 for one row shared by every
// token); logits [N, S, T, H]; lse [S, T, H]; outputs and gradients [T, D]; per-thread partial
// sums [threads, ...] (reduced by the caller). All floating-point arrays share one type F.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"

namespace {

using attnres::cpu::DepthArgs;
using attnres::cpu::MergeArgs;
using attnres::cpu::SourceGradArgs;

// The dot products and weighted sums run on vectors of B bytes (cpu_kernels.h's Vec), whose
// partial sums an array would keep in memory: ATTNRES_VEC_BYTES (one AVX-512 or AVX2 register)
// where the row's length is a multiple of such a vector, else 32 bytes (`wide` says which). A dot
// product adds its terms in DotOrder::chains (cpu_kernels.h).
using attnres::cpu::dot;
using attnres::cpu::DotOrder;
using attnres::cpu::load;
using attnres::cpu::store;
using attnres::cpu::Vec;
using attnres::cpu::wide;
constexpr DotOrder kDot = DotOrder::chains;

// The logit of head h of a query row qg against a source row v with inverse RMS r (1 without
// the key norm): r (qg[h] . v[h]). Every kernel scores through it, so that a logit computed
// again (backward, source_grad) has the bits forward computed.
template <typename F>
inline F head_logit(const F* qg, const F* v, F r, int64_t h, int64_t dh) {
  return r * dot<kDot>(qg + h * dh, v + h * dh, dh);
}

template <typename F>
inline void axpy(F alpha, const F* x, F* y, int64_t n) {  // y += alpha * x
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

template <typename F>
inline void scale(F alpha, const F* x, F* y, int64_t n) {  // y = alpha * x
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = alpha * x[i];
}

template <typename F>
inline F sigmoid(F x) {
  return F(1) / (F(1) + std::exp(-x));
}

// RMSNorm of one row: y = (x * rr) * w with rr = rsqrt(mean(x^2) + eps) (w = 1 without a
// gain; y may be x). Returns rr.
template <typename F>
F norm_row(const F* x, const F* w, F eps, int64_t D, F* y) {
  const F rr = F(1) / std::sqrt(dot<kDot>(x, x, D) / F(D) + eps);
  if (w) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) y[d] = (x[d] * rr) * w[d];
  } else {
    scale(rr, x, y, D);
  }
  return rr;
}

// The backward of y = (x * rr) * w (RMSNorm with the saved inverse RMS rr, w = 1 without a
// gain): dx = rr (dxn - xn mean(dxn xn)) with xn = x rr and dxn = dy w; adds dy xn to d_w.
template <typename F>
void norm_backward_row(const F* x, const F* dy, const F* w, F rr, int64_t D, F* dx, F* d_w) {
  F m = 0;
  for (int64_t d = 0; d < D; ++d) {
    const F xn = x[d] * rr;
    m += (w ? dy[d] * w[d] : dy[d]) * xn;
    if (d_w) d_w[d] += dy[d] * xn;
  }
  m /= F(D);
  for (int64_t d = 0; d < D; ++d) dx[d] = rr * ((w ? dy[d] * w[d] : dy[d]) - x[d] * rr * m);
}

template <typename F>
inline const F* row(const DepthArgs& a, int64_t j, int64_t t) {
  return static_cast<const F*>(a.src[j]) + t * a.src_stride[j];
}

template <typename F>
inline F inv_rms(const DepthArgs& a, int64_t j, int64_t t) {
  return a.key_norm ? static_cast<const F*>(a.rinv[j])[t * a.rinv_stride[j]] : F(1);
}

// The logits lg[(j * S + s) * H + h] of token t, as forward computed them (head_logit), so that
// backward keeps numbers per token instead of the [N, S, T, H] logits.
template <typename F>
void token_logits(const DepthArgs& a, int64_t t, F* lg) {
  const int64_t D = a.dim, N = a.n_src, S = a.n_q, H = a.heads, dh = D / H;
  const F* qg = static_cast<const F*>(a.qg);
  for (int64_t j = 0; j < N; ++j) {
    const F* v = row<F>(a, j, t);
    const F r = inv_rms<F>(a, j, t);
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h) lg[(j * S + s) * H + h] = head_logit(qg + s * D, v, r, h, dh);
  }
}

// The logits lg[k * H + h] of token t from precomputed ones given [K, T, H] (K = N * S rows).
template <typename F>
inline void given_logits(const F* given, int64_t K, int64_t T, int64_t H, int64_t t, F* lg) {
  for (int64_t k = 0; k < K; ++k)
    for (int64_t h = 0; h < H; ++h) lg[k * H + h] = given[(k * T + t) * H + h];
}

// The softmax (or sigmoid) weights p[(j * S + s) * H + h] of token t from its logits lg (same
// layout), and lse[s,h]. One exponential per logit: p = exp(l - m) / sum_j exp(l_j - m), as a
// decode read computes it; backward forms p again as exp(l - lse), equal to rounding.
template <typename F>
void weights(const DepthArgs& a, const F* lg, F* lse_out, int64_t t, F* p) {
  const int64_t T = a.tokens, N = a.n_src, S = a.n_q, H = a.heads, SH = S * H;
  for (int64_t k = 0; k < SH; ++k) {  // k = s * H + h
    if (a.sigmoid) {
      for (int64_t j = 0; j < N; ++j) p[j * SH + k] = sigmoid(lg[j * SH + k]);
      lse_out[(k / H * T + t) * H + k % H] = 0;
      continue;
    }
    F m = lg[k];
    for (int64_t j = 1; j < N; ++j) m = lg[j * SH + k] > m ? lg[j * SH + k] : m;
    F sum = 0;
    for (int64_t j = 0; j < N; ++j) sum += (p[j * SH + k] = std::exp(lg[j * SH + k] - m));
    for (int64_t j = 0; j < N; ++j) p[j * SH + k] /= sum;
    lse_out[(k / H * T + t) * H + k % H] = m + std::log(sum);
  }
}

// out[d] = sum_k w[k * ws + h] x_k[d] for every head h and d in its slice [h dh, (h + 1) dh), or
// out[d] += that sum when add. The sums stay in vector registers across the rows, four vectors at
// a time (an axpy per row would load and store out once per row); rows are added in order, the
// first one's term starting the sum when not add (which needs n >= 1). The compiler may fuse either
// of the first two products, so the bits need not be those of scale(w_0, x_0) then an axpy per row.
template <typename F, int B>
void weighted_rows_in(int64_t n, const F* const* x, const F* w, int64_t ws, int64_t H, int64_t dh, bool add,
                      F* out) {
  constexpr int64_t W = B / sizeof(F);
  const int64_t k0 = add ? 0 : 1;
  for (int64_t h = 0; h < H; ++h) {
    auto weight = [&](int64_t k) { return w[k * ws + h]; };
    const int64_t lo = h * dh, hi = lo + dh;
    int64_t d = lo;
    for (; d + 4 * W <= hi; d += 4 * W) {
      Vec<F, B> s0, s1, s2, s3;
      if (add) {
        s0 = load<F, B>(out + d);
        s1 = load<F, B>(out + d + W);
        s2 = load<F, B>(out + d + 2 * W);
        s3 = load<F, B>(out + d + 3 * W);
      } else {
        const F* v = x[0] + d;
        const F c = weight(0);
        s0 = c * load<F, B>(v);
        s1 = c * load<F, B>(v + W);
        s2 = c * load<F, B>(v + 2 * W);
        s3 = c * load<F, B>(v + 3 * W);
      }
      for (int64_t k = k0; k < n; ++k) {
        const F* v = x[k] + d;
        const F c = weight(k);
        s0 += c * load<F, B>(v);
        s1 += c * load<F, B>(v + W);
        s2 += c * load<F, B>(v + 2 * W);
        s3 += c * load<F, B>(v + 3 * W);
      }
      store<F, B>(out + d, s0);
      store<F, B>(out + d + W, s1);
      store<F, B>(out + d + 2 * W, s2);
      store<F, B>(out + d + 3 * W, s3);
    }
    for (; d + W <= hi; d += W) {
      Vec<F, B> s0 = add ? load<F, B>(out + d) : weight(0) * load<F, B>(x[0] + d);
      for (int64_t k = k0; k < n; ++k) s0 += weight(k) * load<F, B>(x[k] + d);
      store<F, B>(out + d, s0);
    }
    for (; d < hi; ++d) {
      F s0 = add ? out[d] : weight(0) * x[0][d];
      for (int64_t k = k0; k < n; ++k) s0 += weight(k) * x[k][d];
      out[d] = s0;
    }
  }
}

template <typename F>
void weighted_rows(int64_t n, const F* const* x, const F* w, int64_t ws, int64_t H, int64_t dh, bool add, F* out) {
  if (wide<F>(dh))
    weighted_rows_in<F, ATTNRES_VEC_BYTES>(n, x, w, ws, H, dh, add, out);
  else
    weighted_rows_in<F, 32>(n, x, w, ws, H, dh, add, out);
}

// The rows of token t of every source (sources in order).
template <typename F>
void token_rows(const DepthArgs& a, int64_t t, const F** rows) {
  for (int64_t j = 0; j < a.n_src; ++j) rows[j] = row<F>(a, j, t);
}

// out[h] = sum_j p[j,s,h] v_j[h] for query s of token t (sources in order, as the PyTorch path),
// from the token's rows.
template <typename F>
void mix_row(const DepthArgs& a, const F* const* rows, const F* p, int64_t s, F* out) {
  weighted_rows(a.n_src, rows, p + s * a.heads, a.n_q * a.heads, a.heads, a.dim / a.heads, false, out);
}

template <typename F>
void forward(const DepthArgs& a) {
  const int64_t T = a.tokens, D = a.dim, N = a.n_src, S = a.n_q, H = a.heads;
  const F* given = a.logits_given ? static_cast<const F*>(a.logits) : nullptr;
  const F* norm_w = static_cast<const F*>(a.norm_w);
  F* norm_rr = static_cast<F*>(a.norm_rr);
#pragma omp parallel num_threads(a.threads)
  {
    std::vector<F> lg(N * S * H), p(N * S * H);
    std::vector<const F*> rows(N);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      token_rows<F>(a, t, rows.data());
      if (given)  // precomputed [N, S, T, H]: for inference, or when each source was written
        given_logits(given, N * S, T, H, t, lg.data());
      else
        token_logits<F>(a, t, lg.data());
      weights<F>(a, lg.data(), static_cast<F*>(a.lse), t, p.data());
      for (int64_t s = 0; s < S; ++s) mix_row<F>(a, rows.data(), p.data(), s, static_cast<F*>(a.outs[s]) + t * D);
      if (norm_rr) {  // query 0's output through RMSNorm, in place
        F* o = static_cast<F*>(a.outs[0]) + t * D;
        norm_rr[t] = norm_row(o, norm_w, F(a.norm_eps), D, o);
      }
    }
  }
}

template <typename F>
void backward(const DepthArgs& a) {
  const int64_t T = a.tokens, D = a.dim, N = a.n_src, S = a.n_q, H = a.heads, dh = D / H;
  const F* given = a.logits_given ? static_cast<const F*>(a.logits) : nullptr;
  const F* lse = static_cast<const F*>(a.lse);
  const F* g_lse = static_cast<const F*>(a.g_lse);
  const F* qg = static_cast<const F*>(a.qg);
  const F* norm_w = static_cast<const F*>(a.norm_w);
  const F* norm_rr = static_cast<const F*>(a.norm_rr);
#pragma omp parallel num_threads(a.threads)
  {
    const int tid = omp_get_thread_num();
    F* d_qg = a.d_qg ? static_cast<F*>(a.d_qg) + tid * S * D : nullptr;
    F* d_norm_w = a.d_norm_w ? static_cast<F*>(a.d_norm_w) + tid * D : nullptr;
    std::vector<F> lg(N * S * H), p(N * S * H), gv(N * S * H), ds(N * S * H), rds(N * S * H), centre(S * H),
        out0(D), g0(D), dv_w((1 + 2 * S) * H);
    std::vector<const F*> g(S), rows(N), dv_x(1 + 2 * S);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      token_rows<F>(a, t, rows.data());
      if (given)  // scored when each source was written: the logits forward read
        given_logits(given, N * S, T, H, t, lg.data());
      else
        token_logits<F>(a, t, lg.data());
      for (int64_t s = 0; s < S; ++s)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t j = 0; j < N; ++j) {
            const int64_t i = (j * S + s) * H + h;
            p[i] = a.sigmoid ? sigmoid(lg[i]) : std::exp(lg[i] - lse[(s * T + t) * H + h]);
          }
      for (int64_t s = 0; s < S; ++s) g[s] = a.g_out[s] ? static_cast<const F*>(a.g_out[s]) + t * D : nullptr;
      if (norm_rr && g[0]) {  // query 0's norm, on out_0 recomputed (from exp(l - lse): equal to rounding)
        F* g0_row = a.g0_out ? static_cast<F*>(a.g0_out) + t * D : g0.data();
        mix_row<F>(a, rows.data(), p.data(), 0, out0.data());
        norm_backward_row(out0.data(), g[0], norm_w, norm_rr[t], D, g0_row, d_norm_w);
        g[0] = g0_row;
      }
      // g_s . v_j per head, and g_s . out_s = sum_j p (g_s . v_j)
      for (int64_t j = 0; j < N; ++j)
        for (int64_t s = 0; s < S; ++s)
          for (int64_t h = 0; h < H; ++h)
            gv[(j * S + s) * H + h] = g[s] ? dot<kDot>(g[s] + h * dh, rows[j] + h * dh, dh) : F(0);
      // d logit: softmax p (g . v_j - g . out + g_lse); sigmoid (g . v_j) p (1 - p)
      for (int64_t s = 0; s < S; ++s) {
        for (int64_t h = 0; h < H; ++h) {
          F c = 0;
          for (int64_t j = 0; j < N; ++j) c += p[(j * S + s) * H + h] * gv[(j * S + s) * H + h];
          if (g_lse) c -= g_lse[(s * T + t) * H + h];
          centre[s * H + h] = c;
        }
      }
      for (int64_t j = 0; j < N; ++j)
        for (int64_t k = 0; k < S * H; ++k) {
          const int64_t i = j * S * H + k;
          ds[i] = a.sigmoid ? gv[i] * p[i] * (F(1) - p[i]) : p[i] * (gv[i] - centre[k]);
        }
      if (a.ds_out)
        for (int64_t j = 0; j < N; ++j)
          for (int64_t s = 0; s < S; ++s)
            for (int64_t h = 0; h < H; ++h)
              static_cast<F*>(a.ds_out)[((j * S + s) * T + t) * H + h] = ds[(j * S + s) * H + h];
      // d qg_s[h] += sum_j r_j ds[j,s,h] v_j[h]
      for (int64_t j = 0; j < N; ++j) {
        const F r = inv_rms<F>(a, j, t);
        for (int64_t k = 0; k < S * H; ++k) rds[j * S * H + k] = r * ds[j * S * H + k];
      }
      if (d_qg)
        for (int64_t s = 0; s < S; ++s) weighted_rows(N, rows.data(), rds.data() + s * H, S * H, H, dh, true, d_qg + s * D);
      for (int64_t j = 0; j < N; ++j) {
        if (!a.d_src[j]) continue;
        // dv_j = coef v_j + sum_s (r ds qg_s + p g_s) per head, the first term through the inverse
        // RMS: d r / d v = -r^3 v / D, so coef = -(r^2 / D) sum_{s,h} ds logit
        const F r = inv_rms<F>(a, j, t);
        F coef = 0;
        if (a.key_norm) {
          for (int64_t k = 0; k < S * H; ++k) coef += ds[j * S * H + k] * lg[j * S * H + k];
          coef *= -r * r / F(D);
        }
        int64_t n = 0;  // the rows of the sum and their weights per head
        dv_x[n] = rows[j], std::fill_n(&dv_w[n++ * H], H, coef);
        for (int64_t s = 0; s < S; ++s) {
          const int64_t i = (j * S + s) * H;
          dv_x[n] = qg + s * D, std::copy_n(&rds[i], H, &dv_w[n++ * H]);
          if (g[s]) dv_x[n] = g[s], std::copy_n(&p[i], H, &dv_w[n++ * H]);
        }
        weighted_rows(n, dv_x.data(), dv_w.data(), H, H, dh, false, static_cast<F*>(a.d_src[j]) + t * D);
      }
    }
  }
}

// The gradient of one source from the reads that deferred it (their backward wrote dL/d logit
// instead of this source's gradient, ops/source_ledger.py): per token, the terms the backward
// above adds to dv_j, summed over the reads,
//   dv = grad_in + sum_{read, s, h} (r ds qg_s[h] + p g_s[h]) + coef v,  coef = -(r^2 / D) sum ds logit,
// with the logit and p as the read had them (given, or computed again). Layouts per read: qg
// [S, D]; this source's ds [S, T, H]; lse [S, T, H]; its logits [S, T, H] (or null); S pointers
// to dL/d(output s) [T, D] (null where unused), the reads' pointers one after another.
template <typename F>
void source_grad(const SourceGradArgs& a) {
  const int64_t T = a.tokens, D = a.dim, H = a.heads, dh = D / H;
  int64_t n_q = 0;
  for (int64_t i = 0; i < a.n_reads; ++i) n_q += a.n_q[i];
#pragma omp parallel num_threads(a.threads)
  {
    // the rows of the sum (a query and an upstream gradient per read and query, then v) and
    // their weights per head
    std::vector<const F*> x(2 * n_q + 1);
    std::vector<F> w((2 * n_q + 1) * H);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const F* v = static_cast<const F*>(a.src) + t * a.src_stride;
      const F r = a.rinv ? static_cast<const F*>(a.rinv)[t * a.rinv_stride] : F(1);
      F* dv = static_cast<F*>(a.d_src) + t * D;
      F coef = 0;
      int64_t n = 0;
      for (int64_t i = 0, q = 0; i < a.n_reads; ++i) {
        const F* qg = static_cast<const F*>(a.qg[i]);
        const F* lse = static_cast<const F*>(a.lse[i]);
        const F* ds = static_cast<const F*>(a.ds[i]);
        const F* given = a.logits ? static_cast<const F*>(a.logits[i]) : nullptr;
        for (int64_t s = 0; s < a.n_q[i]; ++s, ++q) {
          const F* g = static_cast<const F*>(a.g[q]);
          F* wq = &w[n * H];
          x[n++] = qg + s * D;
          F* wg = g ? &w[n * H] : nullptr;
          if (g) x[n++] = g + t * D;
          for (int64_t h = 0; h < H; ++h) {
            const int64_t k = (s * T + t) * H + h;
            // as the read had it: given (scored when the source was written), or computed again
            const F logit = given ? given[k] : head_logit(qg + s * D, v, r, h, dh);
            wq[h] = r * ds[k];
            if (wg) wg[h] = a.sigmoid ? sigmoid(logit) : std::exp(logit - lse[k]);
            coef += ds[k] * logit;
          }
        }
      }
      if (a.rinv) x[n] = v, std::fill_n(&w[n++ * H], H, -r * r / F(D) * coef);
      if (a.grad_in) std::copy_n(static_cast<const F*>(a.grad_in) + t * D, D, dv);
      weighted_rows(n, x.data(), w.data(), H, H, dh, a.grad_in != nullptr, dv);
    }
  }
}

// Phase 2 of the two-phase Block computation (ops/routing.py), per token and head:
//   r = rsqrt(mean(P^2) + eps) (or 1), s2 = r (qg[h] . P[h]),
//   softmax: w = sigmoid(lse1 - s2), h = lerp(P, o1, w);  sigmoid: w = sigmoid(s2), h = o1 + w P,
// optionally followed by the next sublayer's RMSNorm, y = (h * rr) * norm_w.
// Layouts: o1, partial, h, y and the gradients [T, D]; lse1, s2, w, d_lse1 [T, H]; r, rr [T].
template <typename F>
void merge_forward(const MergeArgs& a) {
  const int64_t T = a.tokens, D = a.dim, H = a.heads, dh = D / H;
  const F* qg = static_cast<const F*>(a.qg);
  const F* norm_w = static_cast<const F*>(a.norm_w);
#pragma omp parallel num_threads(a.threads)
  {
    std::vector<F> local(a.h ? 0 : D);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const F* P = static_cast<const F*>(a.partial) + t * D;
      const F* o1 = static_cast<const F*>(a.o1) + t * D;
      F* h = a.h ? static_cast<F*>(a.h) + t * D : local.data();
      const F r = a.key_norm ? F(1) / std::sqrt(dot<kDot>(P, P, D) / F(D) + F(a.eps)) : F(1);
      if (a.r) static_cast<F*>(a.r)[t] = r;
      for (int64_t k = 0; k < H; ++k) {
        const F s2 = head_logit(qg, P, r, k, dh);
        const F* Pk = P + k * dh;
        const F* ok = o1 + k * dh;
        F* hk = h + k * dh;
        F w;
        if (a.sigmoid) {
          w = sigmoid(s2);
#pragma omp simd
          for (int64_t d = 0; d < dh; ++d) hk[d] = ok[d] + w * Pk[d];
        } else {
          w = sigmoid(static_cast<const F*>(a.lse1)[t * H + k] - s2);
#pragma omp simd
          for (int64_t d = 0; d < dh; ++d) hk[d] = Pk[d] + w * (ok[d] - Pk[d]);
        }
        if (a.s2) static_cast<F*>(a.s2)[t * H + k] = s2;
        if (a.w) static_cast<F*>(a.w)[t * H + k] = w;
      }
      if (a.y) {
        const F rr = norm_row(h, norm_w, F(a.norm_eps), D, static_cast<F*>(a.y) + t * D);
        if (a.norm_rr) static_cast<F*>(a.norm_rr)[t] = rr;
      }
    }
  }
}

template <typename F>
void merge_backward(const MergeArgs& a) {
  const int64_t T = a.tokens, D = a.dim, H = a.heads, dh = D / H;
  const F* qg = static_cast<const F*>(a.qg);
  const F* norm_w = static_cast<const F*>(a.norm_w);
#pragma omp parallel num_threads(a.threads)
  {
    const int tid = omp_get_thread_num();
    F* d_qg = a.d_qg ? static_cast<F*>(a.d_qg) + tid * D : nullptr;
    F* d_norm_w = a.d_norm_w ? static_cast<F*>(a.d_norm_w) + tid * D : nullptr;
    std::vector<F> gh(D);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const F* P = static_cast<const F*>(a.partial) + t * D;
      const F* h = static_cast<const F*>(a.h) + t * D;
      const F* g = static_cast<const F*>(a.g) + t * D;
      if (a.norm_rr) {  // the fused norm's backward first: g becomes dL/dh
        norm_backward_row(h, g, norm_w, static_cast<const F*>(a.norm_rr)[t], D, gh.data(), d_norm_w);
        g = gh.data();
      }
      const F r = a.key_norm ? static_cast<const F*>(a.r)[t] : F(1);
      F coef = 0;
      F* dP = a.d_partial ? static_cast<F*>(a.d_partial) + t * D : nullptr;
      F* do1 = a.d_o1 ? static_cast<F*>(a.d_o1) + t * D : nullptr;
      for (int64_t k = 0; k < H; ++k) {
        const F* gk = g + k * dh;
        const F* Pk = P + k * dh;
        const F w = static_cast<const F*>(a.w)[t * H + k];
        F ds2, keep_o1, keep_P;  // d s2, and the weights of g in d o1 and d P
        if (a.sigmoid) {
          ds2 = dot<kDot>(gk, Pk, dh) * w * (F(1) - w);
          keep_o1 = F(1), keep_P = w;
        } else {  // dz = w (1 - w) g . (o1 - P) = (1 - w) g . (h - P), z = lse1 - s2
          const F dz = (dot<kDot>(gk, h + k * dh, dh) - dot<kDot>(gk, Pk, dh)) * (F(1) - w);
          if (a.d_lse1) static_cast<F*>(a.d_lse1)[t * H + k] = dz;
          ds2 = -dz;
          keep_o1 = w, keep_P = F(1) - w;
        }
        const F c = ds2 * r;  // d raw logit
        coef += ds2 * static_cast<const F*>(a.s2)[t * H + k];
        if (do1) scale(keep_o1, gk, do1 + k * dh, dh);
        if (dP) {
          F* dPk = dP + k * dh;
          const F* qk = qg + k * dh;
#pragma omp simd
          for (int64_t d = 0; d < dh; ++d) dPk[d] = keep_P * gk[d] + c * qk[d];
        }
        if (d_qg) axpy(c, Pk, d_qg + k * dh, dh);
      }
      if (dP && a.key_norm) axpy(-coef * r * r / F(D), P, dP, D);  // d r / d P = -r^3 P / D
    }
  }
}


// One read of a decode step (autograd off, one position per sequence): the mix of n sources
// kept one after another in a buffer (source j of token t at src + j * src_stride + t * D, the
// open block's partial being the last of them), optionally as base + gate * mix (Delta) and
// through an RMSNorm (has_norm; gain norm_w, or none). Nothing is kept: the logits and weights
// of a token live in a few numbers on the stack of its loop.
template <typename F>
void decode_read(int64_t tokens, int64_t D, int64_t heads, int64_t n, const F* src, int64_t src_stride, const F* qg,
                 int32_t key_norm, F eps, int32_t sigmoid_score, const F* base, F gate, int32_t has_norm,
                 const F* norm_w, F norm_eps, F* out, int32_t threads) {
  const int64_t Dh = D / heads;
#pragma omp parallel num_threads(threads) if (tokens > 1 && tokens * n * D >= (1 << 16))
  {
    std::vector<F> p(n * heads);
    std::vector<const F*> rows(n);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t j = 0; j < n; ++j) {
        const F* v = src + j * src_stride + t * D;
        const F r = key_norm ? F(1) / std::sqrt(dot<kDot>(v, v, D) / F(D) + eps) : F(1);
        for (int64_t h = 0; h < heads; ++h) p[j * heads + h] = head_logit(qg, v, r, h, Dh);
      }
      for (int64_t h = 0; h < heads; ++h) {
        if (sigmoid_score) {
          for (int64_t j = 0; j < n; ++j) p[j * heads + h] = sigmoid(p[j * heads + h]);
          continue;
        }
        F m = p[h];
        for (int64_t j = 1; j < n; ++j) m = std::max(m, p[j * heads + h]);
        F sum = 0;
        for (int64_t j = 0; j < n; ++j) sum += (p[j * heads + h] = std::exp(p[j * heads + h] - m));
        for (int64_t j = 0; j < n; ++j) p[j * heads + h] /= sum;
      }
      F* y = out + t * D;
      for (int64_t j = 0; j < n; ++j) rows[j] = src + j * src_stride + t * D;
      weighted_rows(n, rows.data(), p.data(), heads, heads, Dh, false, y);
      if (base) {
        const F* b = base + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) y[d] = b[d] + gate * y[d];
      }
      if (has_norm) norm_row(y, norm_w, norm_eps, D, y);
    }
  }
}
}  // namespace

// The entry points (cpu_kernels.h), for float and double; `::` names this file's kernels above.
namespace attnres::cpu {
template <typename F>
void depth_forward(const DepthArgs& a) {
  forward<F>(a);
}
template <typename F>
void depth_backward(const DepthArgs& a) {
  backward<F>(a);
}
template <typename F>
void source_grad(const SourceGradArgs& a) {
  ::source_grad<F>(a);
}
template <typename F>
void merge_forward(const MergeArgs& a) {
  ::merge_forward<F>(a);
}
template <typename F>
void merge_backward(const MergeArgs& a) {
  ::merge_backward<F>(a);
}
template <typename F>
void decode_read(int64_t tokens, int64_t D, int64_t heads, int64_t n, const F* src, int64_t src_stride, const F* qg,
                 int32_t key_norm, double eps, int32_t sigmoid_score, const F* base, double gate, int32_t has_norm,
                 const F* norm_w, double norm_eps, F* out, int32_t threads) {
  ::decode_read<F>(tokens, D, heads, n, src, src_stride, qg, key_norm, F(eps), sigmoid_score, base, F(gate), has_norm,
                   norm_w, F(norm_eps), out, threads);
}

#define ATTNRES_DEPTH_ATTENTION(F)                                                                                    \
  template void depth_forward<F>(const DepthArgs&);                                                                   \
  template void depth_backward<F>(const DepthArgs&);                                                                  \
  template void source_grad<F>(const SourceGradArgs&);                                                                \
  template void merge_forward<F>(const MergeArgs&);                                                                   \
  template void merge_backward<F>(const MergeArgs&);                                                                  \
  template void decode_read<F>(int64_t, int64_t, int64_t, int64_t, const F*, int64_t, const F*, int32_t, double,     \
                               int32_t, const F*, double, int32_t, const F*, double, F*, int32_t);
ATTNRES_DEPTH_ATTENTION(float)
ATTNRES_DEPTH_ATTENTION(double)
#undef ATTNRES_DEPTH_ATTENTION
}  // namespace attnres::cpu
