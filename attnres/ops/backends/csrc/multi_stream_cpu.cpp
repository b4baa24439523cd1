// The per-token work of the multi-stream designs (HC, mHC, GR) for CPU tensors: one pass over
// the tokens per direction.
//
// A token's streams are n rows of D numbers (a few KiB): the PyTorch path makes a pass over
// [tokens, n, D] memory per product and sum and writes every intermediate back, where here a
// token's rows stay in cache while every term of the mix, the update or their gradients is
// formed from them. Sinkhorn-Knopp runs its iterations on a chunk of matrices at a time, one
// vector register per entry, where the PyTorch path launches four ops per half step over all
// matrices.
//
// Notation (per token t; streams k, j; d in [0, D)):
//   mix:      y[d] = sum_k w[k] H[k, d]
//   update:   out[j, d] = sum_k A[j, k] H[k, d] + b[j] v[d]     (A given transposed, or the identity)
//   gated:    y[d] = (1/n) sum_k s[k, d] R[k, d]                 (GR's read: gates s = sigmoid(z),
//             z given, or z = U h from GR's low-rank layer h [T, r])
//   sinkhorn: p = exp(x - max x); then `iterations` times: rows, then columns, scaled to sum 1
//             (each sum clamped below at the smallest normal number, multiplied by its reciprocal)
//   rms_norm: y[d] = x[d] rr w[d], rr = 1 / sqrt(mean_d x[d]^2 + eps)  (per row of D numbers)
//
// Layouts: H rows of D contiguous numbers, token stride `ts` and stream stride `ks` (0 for the
// embedding broadcast to every stream); every other array contiguous: w, b [T, n]; A [T, n, n];
// v, y [T, D]; out, dH, and GR's R and z [T, n, D]; logits and p [B, n, n]; rms_norm's x and y
// [rows, D]. Null outputs are not computed.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_kernels.h"

namespace {

// Lanes of a chunk: LANES (cpu_kernels.h), one vector register of F of the instruction set the
// build compiles for (ATTNRES_VEC_BYTES: 64 bytes with AVX-512, 16 fp32 or 8 fp64; 32 bytes with
// AVX2). Wider chunks than the registers cost more than they save: their shuffles and
// conversions are not single instructions there, and the Sinkhorn and gated kernels ran 3 to 4
// times slower on AVX2 with 64-byte chunks. Sums over d run in LANES independent chains, added in
// a fixed tree at the end (lane_sum), so that the compiler vectorizes them (the order of a float
// sum is otherwise fixed, and one chain waits on every add): a dot product adds its terms in
// DotOrder::lanes (cpu_kernels.h).
using attnres::cpu::dot;
using attnres::cpu::DotOrder;
using attnres::cpu::lane_sum;
using attnres::cpu::LANES;
constexpr DotOrder kDot = DotOrder::lanes;

template <typename F>
struct Lanes;  // one vector of LANES F (GCC's and Clang's vector extension)
template <>
struct Lanes<float> {
  typedef float type __attribute__((vector_size(ATTNRES_VEC_BYTES)));
  typedef int32_t mask __attribute__((vector_size(ATTNRES_VEC_BYTES)));  // lane indices for a shuffle
};
template <>
struct Lanes<double> {
  typedef double type __attribute__((vector_size(ATTNRES_VEC_BYTES)));
  typedef int64_t mask __attribute__((vector_size(ATTNRES_VEC_BYTES)));
};
template <typename F>
using lanes = typename Lanes<F>::type;

// unaligned loads and stores of a vector
template <typename F>
inline lanes<F> load_lanes(const F* p) {
  lanes<F> v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

template <typename F>
inline void store_lanes(F* p, lanes<F> v) {
  __builtin_memcpy(p, &v, sizeof(v));
}

// Lane sums of many vectors at once, in lane_sum's tree: `fold<G>(x, y)` takes two vectors of
// groups of G lanes (each group one sum's partial lanes) and returns one vector of groups of G/2,
// x's groups then y's, each the group's low half plus its high half, which is the tree's step
// for every group in one add. log2(LANES) folds leave each sum in one lane, in order.
// the index in x ++ y (2 W lanes) of the low (or high) summand of result lane i, at group size G
constexpr int half_lane(int W, int G, bool high, int i) {
  const int from_y = i >= W / 2, j = i % (W / 2), h = G / 2;
  return from_y * W + (j / h) * G + j % h + (high ? h : 0);
}

template <typename F, int G, size_t... I>
inline lanes<F> fold(lanes<F> x, lanes<F> y, std::index_sequence<I...>) {
  constexpr int W = LANES<F>;
#if defined(__clang__)
  return __builtin_shufflevector(x, y, half_lane(W, G, false, I)...) +
         __builtin_shufflevector(x, y, half_lane(W, G, true, I)...);
#else  // GCC's own form: it has had __builtin_shuffle since 4.7, __builtin_shufflevector only since 12
  using mask = typename Lanes<F>::mask;
  return __builtin_shuffle(x, y, mask{half_lane(W, G, false, I)...}) +
         __builtin_shuffle(x, y, mask{half_lane(W, G, true, I)...});
#endif
}

// v[0 .. count) folded in pairs at group size G (a zero vector added to an odd count); the count
// of vectors left
template <typename F, int G>
inline int fold_all(lanes<F>* v, int count) {
  if (count & 1) v[count++] = lanes<F>{};
  for (int m = 0; m < count / 2; ++m)
    v[m] = fold<F, G>(v[2 * m], v[2 * m + 1], std::make_index_sequence<LANES<F>>());
  return count / 2;
}

template <typename F, int G>
inline void fold_levels(lanes<F>* v, int count) {
  count = fold_all<F, G>(v, count);
  if constexpr (G > 2) fold_levels<F, G / 2>(v, count);
}

// out[i * os + j] = dot(a_i, b_j, D) for i < NA, j < NB, with a_i = a + i * as and b_j = b + j * bs:
// every pair in one pass over d (each a_i and b_j chunk loaded once for all pairs), with the
// same lanes and tree as DotOrder::lanes, so that it gives dot's numbers. The sums are vectors, kept in
// registers across the chunks where they fit (n = 4: 16 vectors, in AVX-512's 32 registers or
// spilling some of AVX2's 16) and their lanes are summed together (`fold`).
template <typename F, int NA, int NB>
inline void dots(const F* a, int64_t as, const F* b, int64_t bs, int64_t D, F* out, int64_t os) {
  constexpr int W = LANES<F>, P = NA * NB;
  lanes<F> acc[P + 1] = {};  // pair (i, j) at i * NB + j; one more for an odd count's zero
  int64_t d = 0;
  for (; d + W <= D; d += W) {
    lanes<F> bv[NB];
    for (int j = 0; j < NB; ++j) bv[j] = load_lanes(b + j * bs + d);
    for (int i = 0; i < NA; ++i) {
      const lanes<F> av = load_lanes(a + i * as + d);
      for (int j = 0; j < NB; ++j) acc[i * NB + j] += av * bv[j];
    }
  }
  for (int w = 0; d < D; ++d, ++w)
    for (int i = 0; i < NA; ++i)
      for (int j = 0; j < NB; ++j) acc[i * NB + j][w] += a[i * as + d] * b[j * bs + d];
  fold_levels<F, W>(acc, P);
  for (int i = 0; i < NA; ++i)
    for (int j = 0; j < NB; ++j) out[i * os + j] = acc[(i * NB + j) / W][(i * NB + j) % W];
}

// out_k = sum_j c(k, j) x(j) for k < nk, j < nj (rows of D numbers: row j at x(j), out_k at
// out + k * os). Each number's sum starts at zero and adds the terms in order of j as fused
// multiply-adds: fma(c, x, 0) is the rounded product c x (but for the sign of a zero), so the first
// product is rounded as a loop over whole rows rounds it, and the compiler has no choice of which
// product of `c0 x0 + c1 x1` to fuse. With NK and NJ known at compile time (> 0), a chunk of every
// out_k is held in registers while the x(j) chunks are loaded once for all of them, and each out_k
// chunk is stored once; otherwise (counts read at run time) the rows are formed one at a time.
template <typename F, int NK, int NJ, typename Row, typename Coef>
inline void combine_rows(int64_t nk, int64_t nj, Row x, Coef c, F* out, int64_t os, int64_t D) {
  constexpr int W = LANES<F>;
  if constexpr (NK > 0 && NJ > 0) {
    int64_t d = 0;
    for (; d + W <= D; d += W) {
      lanes<F> xv[NJ];
      for (int j = 0; j < NJ; ++j) xv[j] = load_lanes(x(j) + d);
      for (int k = 0; k < NK; ++k) {
        lanes<F> acc = {};
        for (int j = 0; j < NJ; ++j) acc += c(k, j) * xv[j];
        store_lanes(out + k * os + d, acc);
      }
    }
    for (; d < D; ++d)
      for (int k = 0; k < NK; ++k) {
        F acc = 0;
        for (int j = 0; j < NJ; ++j) acc += c(k, j) * x(j)[d];
        out[k * os + d] = acc;
      }
  } else {
    for (int64_t k = 0; k < nk; ++k) {
      F* o = out + k * os;
      for (int64_t d = 0; d < D; ++d) o[d] = 0;
      for (int64_t j = 0; j < nj; ++j) {
        const F a = c(k, j);
        const F* xj = x(j);
        for (int64_t d = 0; d < D; ++d) o[d] += a * xj[d];
      }
    }
  }
}

// `dots` for na x nb pairs: blocked when the counts are known at compile time (NA, NB > 0),
// pair by pair otherwise
template <typename F, int NA, int NB>
inline void dots_any(const F* a, int64_t as, int64_t na, const F* b, int64_t bs, int64_t nb, int64_t D, F* out,
                     int64_t os) {
  if constexpr (NA > 0 && NB > 0) {
    dots<F, NA, NB>(a, as, b, bs, D, out, os);
  } else {
    for (int64_t i = 0; i < na; ++i)
      for (int64_t j = 0; j < nb; ++j) out[i * os + j] = dot<kDot>(a + i * as, b + j * bs, D);
  }
}

// Calls f(std::integral_constant<int, NN>()) with NN = n for the common sizes (the loops over
// streams unroll), NN = 0 (n read at run time) for the others.
template <typename Fn>
inline void with_side(int64_t n, Fn&& f) {
  switch (n) {
    case 2: return f(std::integral_constant<int, 2>());
    case 4: return f(std::integral_constant<int, 4>());
    case 8: return f(std::integral_constant<int, 8>());
    default: return f(std::integral_constant<int, 0>());
  }
}

template <typename F, int NN>
void mix_forward(int64_t T, int64_t n, int64_t D, const F* H, int64_t ts, int64_t ks, const F* w, F* y,
                 int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const F* h = H + t * ts;
    const F* wt = w + t * n;
    combine_rows<F, 1, NN>(
        1, n, [&](int64_t k) { return h + k * ks; }, [&](int64_t, int64_t k) { return wt[k]; }, y + t * D, D, D);
  }
}

template <typename F, int NN>
void mix_backward(int64_t T, int64_t n_, int64_t D, const F* H, int64_t ts, int64_t ks, const F* w, const F* g,
                  F* dH, F* dw, int threads) {
  const int64_t n = NN ? NN : n_;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const F* gt = g + t * D;
    if (dH)
      for (int64_t k = 0; k < n; ++k) {
        const F a = w[t * n + k];
        F* dh = dH + (t * n + k) * D;
        for (int64_t d = 0; d < D; ++d) dh[d] = a * gt[d];
      }
    if (dw) dots_any<F, 1, NN>(gt, 0, 1, H + t * ts, ks, n, D, dw + t * n, n);
  }
}

// A[j, k] of token t: A given as [T, n, n] rows j (trans = 0) or rows k (trans = 1), not null
// (the identity, A null, is written out where it applies)
template <typename F>
inline F coef(const F* A, int trans, int64_t n, int64_t t, int64_t j, int64_t k) {
  return trans ? A[(t * n + k) * n + j] : A[(t * n + j) * n + k];
}

template <typename F, int NN>
void update_forward(int64_t T, int64_t n_, int64_t D, const F* H, int64_t ts, int64_t ks, const F* A, int trans,
                    const F* b, const F* v, F* out, int threads) {
  const int64_t n = NN ? NN : n_;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const F* h = H + t * ts;
    const F* vt = v + t * D;
    if (A) {  // out_j over the rows [v, H_0 .. H_{n-1}] with [b_j, A[j, 0] .. A[j, n-1]]
      combine_rows<F, NN, NN ? NN + 1 : 0>(
          n, n + 1, [&](int64_t k) { return k ? h + (k - 1) * ks : vt; },
          [&](int64_t j, int64_t k) { return k ? coef(A, trans, n, t, j, k - 1) : b[t * n + j]; }, out + t * n * D,
          D, D);
      continue;
    }
    for (int64_t j = 0; j < n; ++j) {  // the identity: out_j = b_j v + H_j, no product with a zero
      F* o = out + (t * n + j) * D;
      const F bj = b[t * n + j];
      const F* hj = h + j * ks;
      for (int64_t d = 0; d < D; ++d) o[d] = bj * vt[d];
      for (int64_t d = 0; d < D; ++d) o[d] += hj[d];
    }
  }
}

template <typename F, int NN>
void update_backward(int64_t T, int64_t n_, int64_t D, const F* H, int64_t ts, int64_t ks, const F* A, int trans,
                     const F* b, const F* v, const F* g, F* dH, F* dA, F* db, F* dv, int threads) {
  const int64_t n = NN ? NN : n_;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const F* h = H + t * ts;
    const F* vt = v + t * D;
    const F* gt = g + t * n * D;
    if (dH && !A) {
      for (int64_t d = 0; d < n * D; ++d) dH[t * n * D + d] = gt[d];
    } else if (dH) {  // dH_k = sum_j A[j, k] g_j
      combine_rows<F, NN, NN>(
          n, n, [&](int64_t j) { return gt + j * D; }, [&](int64_t k, int64_t j) { return coef(A, trans, n, t, j, k); },
          dH + t * n * D, D, D);
    }
    if (dA) {  // dA[j, k] = g_j . h_k, written [j, k] or transposed [k, j]
      if (trans)
        dots_any<F, NN, NN>(h, ks, n, gt, D, n, D, dA + t * n * n, n);
      else
        dots_any<F, NN, NN>(gt, D, n, h, ks, n, D, dA + t * n * n, n);
    }
    if (db) dots_any<F, NN, 1>(gt, D, n, vt, 0, 1, D, db + t * n, 1);
    if (dv)  // dv = sum_j b_j g_j
      combine_rows<F, 1, NN>(
          1, n, [&](int64_t j) { return gt + j * D; }, [&](int64_t, int64_t j) { return b[t * n + j]; }, dv + t * D, D,
          D);
  }
}

// exp(x) lane by lane. fp32: Cephes' expf on the whole vector (x = k ln2 + r with |r| <= ln2/2,
// a degree-6 polynomial in r, 2^k put in the exponent bits), x clamped to [-87, 88] so that
// 2^k stays a normal number (a NaN stays NaN); within a few units in the last place of
// std::exp. fp64 (the reference dtype): std::exp per lane.
inline lanes<float> exp_lanes(lanes<float> x) {
  typedef int32_t ints __attribute__((vector_size(ATTNRES_VEC_BYTES)));
  const lanes<float> hi = lanes<float>{} + 88.0f, lo = lanes<float>{} - 87.0f;
  x = x > hi ? hi : x;  // written so that a NaN, false in every comparison, passes through
  x = x < lo ? lo : x;
  const lanes<float> round = lanes<float>{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const lanes<float> k = (x * 1.44269504088896341f + round) - round;
  lanes<float> r = x - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  lanes<float> p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const lanes<float> y = p * (r * r) + r + 1.0f;
  const ints bits = (__builtin_convertvector(k, ints) + 127) << 23;
  lanes<float> scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

inline lanes<double> exp_lanes(lanes<double> x) {
  for (int l = 0; l < LANES<double>; ++l) x[l] = std::exp(x[l]);
  return x;
}

template <typename F>
inline lanes<F> sigmoid_lanes(lanes<F> z) {
  const lanes<F> one = lanes<F>{} + F(1);
  return one / (one + exp_lanes(-z));
}

// s = sigmoid(z) = 1 / (1 + exp(-z)) over m numbers, a vector at a time (the last one padded)
template <typename F>
inline void sigmoid_row(const F* z, int64_t m, F* s) {
  constexpr int64_t W = LANES<F>;
  int64_t i = 0;
  for (; i + W <= m; i += W) store_lanes(s + i, sigmoid_lanes<F>(load_lanes(z + i)));
  if (i < m) {
    lanes<F> x = {};
    for (int64_t l = 0; i + l < m; ++l) x[l] = z[i + l];
    x = sigmoid_lanes<F>(x);
    for (int64_t l = 0; i + l < m; ++l) s[i + l] = x[l];
  }
}

// GR's read from the logits z of its gates, s = sigmoid(z) formed token by token in the kernel
// (vectorized, in forward and again in backward: nothing but R and z is kept):
//   y = (1/n) sum_k s_k R_k;  dR = s g / n;  dz = (g / n) R s (1 - s)
// One token: R, s, dR and dz n rows of D numbers; dR and dz may be null (not needed).
template <typename F>
inline void gated_row(int64_t n, int64_t D, const F* __restrict R, const F* __restrict s, F* __restrict y) {
  for (int64_t d = 0; d < D; ++d) y[d] = 0;
  for (int64_t k = 0; k < n; ++k)
    for (int64_t d = 0; d < D; ++d) y[d] += s[k * D + d] * R[k * D + d];
  for (int64_t d = 0; d < D; ++d) y[d] /= F(n);
}

template <typename F>
inline void gated_row_backward(int64_t n, int64_t D, const F* __restrict R, const F* __restrict s,
                               const F* __restrict g, F* __restrict gn, F* __restrict dR, F* __restrict dz) {
  for (int64_t d = 0; d < D; ++d) gn[d] = g[d] / F(n);
  for (int64_t k = 0; k < n; ++k) {
    const F* sk = s + k * D;
    if (dR)
      for (int64_t d = 0; d < D; ++d) dR[k * D + d] = sk[d] * gn[d];
    if (dz)
      for (int64_t d = 0; d < D; ++d) dz[k * D + d] = gn[d] * R[k * D + d] * ((F(1) - sk[d]) * sk[d]);
  }
}

template <typename F>
void gated_forward(int64_t T, int64_t n, int64_t D, const F* R, const F* z, F* y, int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<F> s(n * D);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      sigmoid_row(z + t * n * D, n * D, s.data());
      gated_row(n, D, R + t * n * D, s.data(), y + t * D);
    }
  }
}

template <typename F>
void gated_backward(int64_t T, int64_t n, int64_t D, const F* R, const F* z, const F* g, F* dR, F* dz,
                    int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<F> s(n * D), gn(D);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      sigmoid_row(z + t * n * D, n * D, s.data());
      gated_row_backward(n, D, R + t * n * D, s.data(), g + t * D, gn.data(), dR ? dR + t * n * D : nullptr,
                         dz ? dz + t * n * D : nullptr);
    }
  }
}

// GR's read with its gates' logits formed in the kernel from the low-rank hidden layer h [T, r]
// and the up-projection, given transposed and padded (U^T [r, mp], m = n D numbers, then zeros up
// to mp, a whole number of vectors; likewise the partial sums of dU^T): z = sum_j h_j U^T_j for a
// block of tokens at a time, in forward and again in backward, so that neither z nor the gates
// pass through memory. Backward: dR and dz as above, then dh_j = dz . U^T_j and
// dU^T_j += h_j dz for the block (per-thread partial sums [threads, r, mp], added by the caller).
// the padded width of m numbers: a whole number of vectors
template <typename F>
constexpr int64_t padded(int64_t m) {
  return (m + LANES<F> - 1) / LANES<F> * LANES<F>;
}

constexpr int64_t kTokenBlock = 4;

// The gates of a block of kTokenBlock tokens, s_b = sigmoid(h_b U) (mp numbers each, the first m
// of them gates), from their hidden layers hb [kTokenBlock, r] (rows past the block's tokens
// zero): a vector of each token's logits in a register across the r terms, each vector of U^T
// loaded once for the block's tokens.
template <typename F>
inline void lowrank_gates(const F* __restrict hb, const F* __restrict upT, int64_t r, int64_t mp, F* __restrict s) {
  constexpr int64_t W = LANES<F>, B = kTokenBlock;
  for (int64_t i = 0; i < mp; i += W) {
    lanes<F> z[B];
    const lanes<F> u0 = load_lanes(upT + i);
    for (int64_t b = 0; b < B; ++b) z[b] = hb[b * r] * u0;
    for (int64_t j = 1; j < r; ++j) {
      const lanes<F> u = load_lanes(upT + j * mp + i);
      for (int64_t b = 0; b < B; ++b) z[b] += hb[b * r + j] * u;
    }
    for (int64_t b = 0; b < B; ++b) store_lanes(s + b * mp + i, sigmoid_lanes<F>(z[b]));
  }
}

// the hidden layers of the block of tokens t0.. (nb of them) as kTokenBlock rows, zeros past nb
template <typename F>
inline const F* block_rows(const F* h, int64_t t0, int64_t nb, int64_t r, std::vector<F>& padded_rows) {
  if (nb == kTokenBlock) return h + t0 * r;
  std::fill(padded_rows.begin(), padded_rows.end(), F(0));
  std::copy(h + t0 * r, h + (t0 + nb) * r, padded_rows.begin());
  return padded_rows.data();
}

template <typename F>
void gated_lowrank_forward(int64_t T, int64_t n, int64_t D, int64_t r, const F* R, const F* h, const F* upT, F* y,
                           int threads) {
  constexpr int64_t B = kTokenBlock;
  const int64_t m = n * D, mp = padded<F>(m), blocks = (T + B - 1) / B;
#pragma omp parallel num_threads(threads)
  {
    std::vector<F> s(B * mp), rows(B * r);
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t t0 = blk * B, nb = T - t0 < B ? T - t0 : B;
      lowrank_gates(block_rows(h, t0, nb, r, rows), upT, r, mp, s.data());
      for (int64_t b = 0; b < nb; ++b) gated_row(n, D, R + (t0 + b) * m, s.data() + b * mp, y + (t0 + b) * D);
    }
  }
}

template <typename F>
void gated_lowrank_backward(int64_t T, int64_t n, int64_t D, int64_t r, const F* R, const F* h, const F* upT,
                            const F* g, F* dR, F* dh, F* d_upT, int threads) {
  constexpr int64_t W = LANES<F>, B = kTokenBlock;
  const int64_t m = n * D, mp = padded<F>(m), blocks = (T + B - 1) / B;
#pragma omp parallel num_threads(threads)
  {
    F* d_up = d_upT ? d_upT + omp_get_thread_num() * r * mp : nullptr;
    std::vector<F> s(B * mp), dz(B * mp), gn(D), rows(B * r);  // dz past m, and past nb tokens, is 0
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t t0 = blk * B, nb = T - t0 < B ? T - t0 : B;
      const F* hb = block_rows(h, t0, nb, r, rows);
      lowrank_gates(hb, upT, r, mp, s.data());
      if (nb < B) std::fill(dz.begin(), dz.end(), F(0));
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t t = t0 + b;
        gated_row_backward(n, D, R + t * m, s.data() + b * mp, g + t * D, gn.data(), dR ? dR + t * m : nullptr,
                           dz.data() + b * mp);
      }
      if (dh)  // dh_b,j = dz_b . U^T_j: the block's sums in registers, each vector of U^T loaded once
        for (int64_t j = 0; j < r; ++j) {
          lanes<F> acc[B] = {};
          for (int64_t i = 0; i < mp; i += W) {
            const lanes<F> u = load_lanes(upT + j * mp + i);
            for (int64_t b = 0; b < B; ++b) acc[b] += load_lanes(dz.data() + b * mp + i) * u;
          }
          for (int64_t b = 0; b < nb; ++b) {
            F lane[LANES<F>];
            __builtin_memcpy(lane, &acc[b], sizeof(lane));
            dh[(t0 + b) * r + j] = lane_sum(lane);
          }
        }
      if (d_up)  // dU^T_j += sum_b h_b,j dz_b: one load and store of dU^T per block
        for (int64_t j = 0; j < r; ++j)
          for (int64_t i = 0; i < mp; i += W) {
            lanes<F> u = load_lanes(d_up + j * mp + i);
            for (int64_t b = 0; b < B; ++b) u += hb[b * r + j] * load_lanes(dz.data() + b * mp + i);
            store_lanes(d_up + j * mp + i, u);
          }
    }
  }
}

// Sinkhorn runs on a chunk of LANES matrices at a time, entry-major: c[e] is one vector holding
// entry e of the chunk's LANES matrices, so that every step of the iteration is one vector
// operation over the chunk while each matrix sees exactly the operations, in the order, of the
// scalar loop. A chunk's last matrices past B are padded with zero logits and never written back.

// c[e][l] = x[l][e] for l < count, 0 beyond (x: the chunk's first matrix, nn entries each)
template <typename F>
inline void load_chunk(const F* x, int64_t nn, int64_t count, lanes<F>* c) {
  for (int64_t e = 0; e < nn; ++e)
    for (int64_t l = 0; l < LANES<F>; ++l) c[e][l] = l < count ? x[l * nn + e] : F(0);
}

template <typename F>
inline void store_chunk(const lanes<F>* c, int64_t nn, int64_t count, F* x) {
  for (int64_t l = 0; l < count; ++l)
    for (int64_t e = 0; e < nn; ++e) x[l * nn + e] = c[e][l];
}

// p = exp(x - max x) per matrix of the chunk, in place; returns the maxima
template <typename F>
inline lanes<F> shifted_exp(lanes<F>* c, int64_t nn) {
  lanes<F> m = c[0];
  for (int64_t e = 1; e < nn; ++e) m = c[e] > m ? c[e] : m;
  for (int64_t e = 0; e < nn; ++e) {
    const lanes<F> shifted = c[e] - m;
    for (int l = 0; l < LANES<F>; ++l) c[e][l] = std::exp(shifted[l]);
  }
  return m;
}

// One half step of the chunk in place: rows (COL = 0) or columns (COL = 1) scaled to sum 1.
// Each sum is clamped below at the smallest normal number and its line multiplied by the
// reciprocal, written to inv[n]; live[n] is 1 where the sum was above the clamp, else 0.
template <typename F, int NN, int COL>
inline void normalize_lines(lanes<F>* __restrict c, int64_t n_, lanes<F>* __restrict inv,
                            lanes<F>* __restrict live) {
  const int64_t n = NN ? NN : n_;
  const lanes<F> tiny = lanes<F>{} + std::numeric_limits<F>::min(), one = lanes<F>{} + F(1), zero = {};
  for (int64_t i = 0; i < n; ++i) {
    lanes<F> s = {};
    for (int64_t j = 0; j < n; ++j) s += c[COL ? j * n + i : i * n + j];
    const auto above = s >= tiny;
    live[i] = above ? one : zero;
    inv[i] = one / (above ? s : tiny);
    for (int64_t j = 0; j < n; ++j) c[COL ? j * n + i : i * n + j] *= inv[i];
  }
}

template <typename F, int NN>
inline void normalize(lanes<F>* c, int64_t n, int col, lanes<F>* inv, lanes<F>* live) {
  if (col)
    normalize_lines<F, NN, 1>(c, n, inv, live);
  else
    normalize_lines<F, NN, 0>(c, n, inv, live);
}

template <typename F, int NN>
void sinkhorn_forward(int64_t B, int64_t n_, int64_t iterations, const F* x, F* p, int threads) {
  constexpr int L = LANES<F>;
  const int64_t n = NN ? NN : n_, nn = n * n, chunks = (B + L - 1) / L;
#pragma omp parallel num_threads(threads)
  {
    std::vector<lanes<F>> c(nn), inv(n), live(n);
#pragma omp for schedule(static)
    for (int64_t k = 0; k < chunks; ++k) {
      const int64_t b0 = k * L, count = B - b0 < L ? B - b0 : L;
      load_chunk<F>(x + b0 * nn, nn, count, c.data());
      shifted_exp<F>(c.data(), nn);
      for (int64_t it = 0; it < iterations; ++it) {
        normalize<F, NN>(c.data(), n, 0, inv.data(), live.data());
        normalize<F, NN>(c.data(), n, 1, inv.data(), live.data());
      }
      store_chunk<F>(c.data(), nn, count, p + b0 * nn);
    }
  }
}

// Reverse mode through the iterations exactly as autograd differentiates the PyTorch loop: the
// forward is run again per chunk, keeping each half step's input and reciprocals (2 x
// iterations x (n^2 + 2n) vectors per thread), then each half step is reversed:
//   q = p * inv (per line),  inv = 1 / max(s, tiny),  s = sum over the line of p
//   dp = dq * inv + ds,  ds = -inv^2 * sum_line(dq * p)  (0 where s was clamped)
// and the shift: dx = dp0 * p0, with -sum(dp0 * p0) shared out over the maxima (amax's rule).
template <typename F, int NN>
void sinkhorn_backward(int64_t B, int64_t n_, int64_t iterations, const F* x, const F* gp, F* dx, int threads) {
  constexpr int L = LANES<F>;
  const int64_t n = NN ? NN : n_, nn = n * n, steps = 2 * iterations, chunks = (B + L - 1) / L;
#pragma omp parallel num_threads(threads)
  {
    std::vector<lanes<F>> xs(nn), ps((steps + 1) * nn), invs(steps * n), lives(steps * n), dp(nn);
#pragma omp for schedule(static)
    for (int64_t k = 0; k < chunks; ++k) {
      const int64_t b0 = k * L, count = B - b0 < L ? B - b0 : L;
      load_chunk<F>(x + b0 * nn, nn, count, xs.data());
      for (int64_t e = 0; e < nn; ++e) ps[e] = xs[e];
      const lanes<F> m = shifted_exp<F>(ps.data(), nn);
      for (int64_t s = 0; s < steps; ++s) {
        lanes<F>* next = ps.data() + (s + 1) * nn;
        for (int64_t e = 0; e < nn; ++e) next[e] = ps[s * nn + e];
        normalize<F, NN>(next, n, int(s % 2), invs.data() + s * n, lives.data() + s * n);
      }
      load_chunk<F>(gp + b0 * nn, nn, count, dp.data());
      const lanes<F> zero = {};
      for (int64_t s = steps - 1; s >= 0; --s) {
        const int col = int(s % 2);
        const lanes<F>* p = ps.data() + s * nn;  // the half step's input
        const lanes<F>* inv = invs.data() + s * n;
        const lanes<F>* live = lives.data() + s * n;
        for (int64_t i = 0; i < n; ++i) {
          lanes<F> acc = {};
          for (int64_t j = 0; j < n; ++j) {
            const int64_t e = col ? j * n + i : i * n + j;
            acc += dp[e] * p[e];
          }
          const lanes<F> dsum = live[i] != zero ? -inv[i] * inv[i] * acc : zero;
          for (int64_t j = 0; j < n; ++j) {
            const int64_t e = col ? j * n + i : i * n + j;
            dp[e] = dp[e] * inv[i] + dsum;
          }
        }
      }
      lanes<F> total = {}, maxima = {};
      for (int64_t e = 0; e < nn; ++e) {
        dp[e] *= ps[e];
        total += dp[e];
        maxima += xs[e] == m ? lanes<F>{} + F(1) : zero;
      }
      const lanes<F> share = -total / maxima;
      for (int64_t e = 0; e < nn; ++e) dp[e] += xs[e] == m ? share : zero;
      store_chunk<F>(dp.data(), nn, count, dx + b0 * nn);
    }
  }
}

// RMSNorm of rows with a gain (GR's per-branch norm), in F, one pass per direction:
//   rr = 1 / sqrt(mean_d x[d]^2 + eps);  y = (x rr) w
// backward, with xn = x rr and dxn = dy w:
//   dx = (dxn - xn mean_d(dxn xn)) rr;  dw = sum over the rows of dy xn
// dw is summed per thread over its rows (a static split), then over the threads in order.
template <typename F>
void rms_norm_forward(int64_t rows, int64_t D, const F* x, const F* w, F eps, F* y, F* rr, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const F* xr = x + r * D;
    const F q = F(1) / std::sqrt(dot<kDot>(xr, xr, D) / F(D) + eps);
    rr[r] = q;
    F* yr = y + r * D;
    for (int64_t d = 0; d < D; ++d) yr[d] = xr[d] * q * w[d];
  }
}

template <typename F>
void rms_norm_backward(int64_t rows, int64_t D, const F* x, const F* w, const F* rr, const F* dy, F* dx, F* dw,
                       int threads) {
  std::vector<F> partial(dw ? threads * D : 0, F(0));
#pragma omp parallel num_threads(threads)
  {
    F* acc = dw ? partial.data() + omp_get_thread_num() * D : nullptr;
    std::vector<F> xn(D), dxn(D);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const F q = rr[r];
      const F* xr = x + r * D;
      const F* g = dy + r * D;
      for (int64_t d = 0; d < D; ++d) {
        xn[d] = xr[d] * q;
        dxn[d] = g[d] * w[d];
      }
      if (acc)
        for (int64_t d = 0; d < D; ++d) acc[d] += g[d] * xn[d];
      if (dx) {
        const F m = dot<kDot>(dxn.data(), xn.data(), D) / F(D);
        F* o = dx + r * D;
        for (int64_t d = 0; d < D; ++d) o[d] = (dxn[d] - xn[d] * m) * q;
      }
    }
  }
  if (dw)
    for (int64_t d = 0; d < D; ++d) {
      F sum = 0;
      for (int t = 0; t < threads; ++t) sum += partial[t * D + d];
      dw[d] = sum;
    }
}

}  // namespace

// The entry points (cpu_kernels.h), for float and double; `::` names this file's kernels above.
namespace attnres::cpu {
template <typename F>
void stream_mix_forward(int64_t T, int64_t n, int64_t D, const F* H, int64_t ts, int64_t ks, const F* w, F* y,
                        int threads) {
  with_side(n, [&](auto NN) { mix_forward<F, decltype(NN)::value>(T, n, D, H, ts, ks, w, y, threads); });
}
template <typename F>
void stream_mix_backward(int64_t T, int64_t n, int64_t D, const F* H, int64_t ts, int64_t ks, const F* w, const F* g,
                         F* dH, F* dw, int threads) {
  with_side(n, [&](auto NN) { mix_backward<F, decltype(NN)::value>(T, n, D, H, ts, ks, w, g, dH, dw, threads); });
}
template <typename F>
void stream_update_forward(int64_t T, int64_t n, int64_t D, const F* H, int64_t ts, int64_t ks, const F* A, int trans,
                           const F* b, const F* v, F* out, int threads) {
  with_side(n, [&](auto NN) {
    update_forward<F, decltype(NN)::value>(T, n, D, H, ts, ks, A, trans, b, v, out, threads);
  });
}
template <typename F>
void stream_update_backward(int64_t T, int64_t n, int64_t D, const F* H, int64_t ts, int64_t ks, const F* A,
                            int trans, const F* b, const F* v, const F* g, F* dH, F* dA, F* db, F* dv, int threads) {
  with_side(n, [&](auto NN) {
    update_backward<F, decltype(NN)::value>(T, n, D, H, ts, ks, A, trans, b, v, g, dH, dA, db, dv, threads);
  });
}
template <typename F>
void gated_mix_forward(int64_t T, int64_t n, int64_t D, const F* R, const F* z, F* y, int threads) {
  gated_forward<F>(T, n, D, R, z, y, threads);
}
template <typename F>
void gated_mix_backward(int64_t T, int64_t n, int64_t D, const F* R, const F* z, const F* g, F* dR, F* dz,
                        int threads) {
  gated_backward<F>(T, n, D, R, z, g, dR, dz, threads);
}
template <typename F>
void gated_lowrank_forward(int64_t T, int64_t n, int64_t D, int64_t r, const F* R, const F* h, const F* upT, F* y,
                           int threads) {
  ::gated_lowrank_forward<F>(T, n, D, r, R, h, upT, y, threads);
}
template <typename F>
void gated_lowrank_backward(int64_t T, int64_t n, int64_t D, int64_t r, const F* R, const F* h, const F* upT,
                            const F* g, F* dR, F* dh, F* d_upT, int threads) {
  ::gated_lowrank_backward<F>(T, n, D, r, R, h, upT, g, dR, dh, d_upT, threads);
}
template <typename F>
void rms_norm_forward(int64_t rows, int64_t D, const F* x, const F* w, double eps, F* y, F* rr, int threads) {
  ::rms_norm_forward<F>(rows, D, x, w, F(eps), y, rr, threads);
}
template <typename F>
void rms_norm_backward(int64_t rows, int64_t D, const F* x, const F* w, const F* rr, const F* dy, F* dx, F* dw,
                       int threads) {
  ::rms_norm_backward<F>(rows, D, x, w, rr, dy, dx, dw, threads);
}
template <typename F>
void sinkhorn_forward(int64_t B, int64_t n, int64_t iterations, const F* x, F* p, int threads) {
  with_side(n, [&](auto NN) { ::sinkhorn_forward<F, decltype(NN)::value>(B, n, iterations, x, p, threads); });
}
template <typename F>
void sinkhorn_backward(int64_t B, int64_t n, int64_t iterations, const F* x, const F* gp, F* dx, int threads) {
  with_side(n, [&](auto NN) { ::sinkhorn_backward<F, decltype(NN)::value>(B, n, iterations, x, gp, dx, threads); });
}

#define ATTNRES_MULTI_STREAM(F)                                                                                       \
  template void stream_mix_forward<F>(int64_t, int64_t, int64_t, const F*, int64_t, int64_t, const F*, F*, int);     \
  template void stream_mix_backward<F>(int64_t, int64_t, int64_t, const F*, int64_t, int64_t, const F*, const F*,   \
                                       F*, F*, int);                                                                  \
  template void stream_update_forward<F>(int64_t, int64_t, int64_t, const F*, int64_t, int64_t, const F*, int,      \
                                         const F*, const F*, F*, int);                                                \
  template void stream_update_backward<F>(int64_t, int64_t, int64_t, const F*, int64_t, int64_t, const F*, int,     \
                                          const F*, const F*, const F*, F*, F*, F*, F*, int);                         \
  template void gated_mix_forward<F>(int64_t, int64_t, int64_t, const F*, const F*, F*, int);                        \
  template void gated_mix_backward<F>(int64_t, int64_t, int64_t, const F*, const F*, const F*, F*, F*, int);         \
  template void gated_lowrank_forward<F>(int64_t, int64_t, int64_t, int64_t, const F*, const F*, const F*, F*, int); \
  template void gated_lowrank_backward<F>(int64_t, int64_t, int64_t, int64_t, const F*, const F*, const F*,         \
                                          const F*, F*, F*, F*, int);                                                 \
  template void rms_norm_forward<F>(int64_t, int64_t, const F*, const F*, double, F*, F*, int);                      \
  template void rms_norm_backward<F>(int64_t, int64_t, const F*, const F*, const F*, const F*, F*, F*, int);         \
  template void sinkhorn_forward<F>(int64_t, int64_t, int64_t, const F*, F*, int);                                   \
  template void sinkhorn_backward<F>(int64_t, int64_t, int64_t, const F*, const F*, F*, int);
ATTNRES_MULTI_STREAM(float)
ATTNRES_MULTI_STREAM(double)
#undef ATTNRES_MULTI_STREAM
}  // namespace attnres::cpu
