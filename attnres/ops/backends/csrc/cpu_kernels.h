// The CPU kernels' interface: the argument structures and entry points of depth_attention_cpu.cpp
// and multi_stream_cpu.cpp, which cpu_ops.cpp (the attnres:: operators) fills and calls; and the
// vectors and the dot product both kernel files compute with (at the end). Plain C++, no PyTorch
// headers, as the kernel files themselves.
//
// Every entry point is a template over F, the type of all its floating-point arrays, instantiated
// for float and double in its kernel file. The equations and layouts are in the kernel files;
// a null pointer marks an absent input or an output not asked for.
#pragma once

#include <cstdint>

// The width in bytes of the kernels' vectors (Vec's and LANES's, below): one register of the
// instruction set the build compiles for (ops/backends/cpu_build.py's ATTNRES_CPU_ISA, -march): 64
// with AVX-512, else 32 (AVX2; a pair of 16-byte registers on SSE and NEON).
#ifndef ATTNRES_VEC_BYTES
#if defined(__AVX512F__)
#define ATTNRES_VEC_BYTES 64
#else
#define ATTNRES_VEC_BYTES 32
#endif
#endif

namespace attnres::cpu {

// -- depth_attention_cpu.cpp ----------------------------------------------------------------------

// Depth attention of S queries over N sources: forward writes the outputs and lse, backward the
// gradients (and, for a ledger, dL/d logit).
struct DepthArgs {
  int64_t tokens, dim, n_src, n_q, heads;
  const void* const* src;      // n_src pointers to rows of dim numbers
  const int64_t* src_stride;   // per source: row stride (dim, or 0)
  const void* const* rinv;     // per source: inverse RMS per token (unused without key norm)
  const int64_t* rinv_stride;  // per source: 1, or 0
  const void* qg;              // [S, D] queries with the key-norm gain folded in
  const void* logits;          // [N, S, T, H] precomputed (read when logits_given: inference, or scored when
                               // each source was written), or null: scored per token
  void* lse;                   // [S, T, H]
  void* const* outs;           // forward: S pointers to [T, D]
  const void* norm_w;          // [D] gain of query 0's norm, or null (no gain)
  void* norm_rr;               // [T] inverse RMS of out_0 (null: no fused norm)
  double norm_eps;
  const void* const* g_out;    // backward: S pointers to dL/d(output s), null where unused
  const void* g_lse;           // [S, T, H] or null
  void* const* d_src;          // backward: N pointers to [T, D], null where not needed
  void* d_qg;                  // [threads, S, D] partial sums, or null
  void* d_norm_w;              // [threads, D] partial sums, or null
  int32_t key_norm, sigmoid, logits_given, threads;
  void* ds_out;                // backward: [N, S, T, H] dL/d logit, written when not null
  void* g0_out;                // backward: [T, D] dL/d out_0 before its fused norm, written when not null
};

// The gradient of one source from the reads that deferred it to a ledger.
struct SourceGradArgs {
  int64_t tokens, dim, heads, n_reads;
  const void* src;            // the source's rows
  int64_t src_stride;         // dim, or 0
  const void* rinv;           // its inverse RMS per token (null: no key norm)
  int64_t rinv_stride;        // 1, or 0
  const int64_t* n_q;         // per read: S
  const void* const* qg;      // per read
  const void* const* lse;     // per read
  const void* const* ds;      // per read
  const void* const* logits;  // per read: this source's [S, T, H] logits, or null: scored again per token
  const void* const* g;       // sum of the reads' S pointers
  const void* grad_in;        // [T, D] added, or null
  void* d_src;                // [T, D] written
  int32_t sigmoid, threads;
};

// Phase 2 of the two-phase Block computation and its backward.
struct MergeArgs {
  int64_t tokens, dim, heads;
  const void* o1;
  const void* lse1;
  const void* partial;
  const void* qg;     // [D]: query with the key-norm gain folded in
  double eps;         // key norm
  void* h;            // forward: the merged read (null: not kept; then y must be set)
  void* y;            // forward: its norm (null: no fused norm)
  const void* norm_w; // [D] or null (no gain)
  double norm_eps;
  void* norm_rr;      // [T]: written by forward, read by backward (null: no fused norm)
  void* s2;           // [T, H] (null: not kept)
  void* w;            // [T, H]
  void* r;            // [T]
  const void* g;      // backward: dL/dy with a fused norm, else dL/dh
  void* d_o1;         // each gradient output may be null (not needed)
  void* d_lse1;
  void* d_partial;
  void* d_qg;         // [threads, D] partial sums
  void* d_norm_w;     // [threads, D] partial sums
  int32_t key_norm, sigmoid, threads;
};

template <typename F>
void depth_forward(const DepthArgs& a);
template <typename F>
void depth_backward(const DepthArgs& a);
template <typename F>
void source_grad(const SourceGradArgs& a);
template <typename F>
void merge_forward(const MergeArgs& a);
template <typename F>
void merge_backward(const MergeArgs& a);
// One read of a decode step: the first n sources of a buffer (source j of token t at
// src + j * src_stride + t * D), optionally base + gate * mix and through an RMSNorm (has_norm).
// eps, gate and norm_eps are rounded to F.
template <typename F>
void decode_read(int64_t tokens, int64_t D, int64_t heads, int64_t n, const F* src, int64_t src_stride, const F* qg,
                 int32_t key_norm, double eps, int32_t sigmoid_score, const F* base, double gate, int32_t has_norm,
                 const F* norm_w, double norm_eps, F* out, int32_t threads);

// -- multi_stream_cpu.cpp -------------------------------------------------------------------------
// T tokens of n streams of D numbers: H read with token stride ts and stream stride ks, every other
// array contiguous.

template <typename F>
void stream_mix_forward(int64_t T, int64_t n, int64_t D, const F* H, int64_t ts, int64_t ks, const F* w, F* y,
                        int threads);
template <typename F>
void stream_mix_backward(int64_t T, int64_t n, int64_t D, const F* H, int64_t ts, int64_t ks, const F* w, const F* g,
                         F* dH, F* dw, int threads);
// A given transposed when trans, null: the identity
template <typename F>
void stream_update_forward(int64_t T, int64_t n, int64_t D, const F* H, int64_t ts, int64_t ks, const F* A, int trans,
                           const F* b, const F* v, F* out, int threads);
template <typename F>
void stream_update_backward(int64_t T, int64_t n, int64_t D, const F* H, int64_t ts, int64_t ks, const F* A,
                            int trans, const F* b, const F* v, const F* g, F* dH, F* dA, F* db, F* dv, int threads);
template <typename F>
void gated_mix_forward(int64_t T, int64_t n, int64_t D, const F* R, const F* z, F* y, int threads);
template <typename F>
void gated_mix_backward(int64_t T, int64_t n, int64_t D, const F* R, const F* z, const F* g, F* dR, F* dz,
                        int threads);
// upT [r, mp]: U^T padded with zero columns to whole 64-byte vectors; d_upT [threads, r, mp] partial sums
template <typename F>
void gated_lowrank_forward(int64_t T, int64_t n, int64_t D, int64_t r, const F* R, const F* h, const F* upT, F* y,
                           int threads);
template <typename F>
void gated_lowrank_backward(int64_t T, int64_t n, int64_t D, int64_t r, const F* R, const F* h, const F* upT,
                            const F* g, F* dR, F* dh, F* d_upT, int threads);
// eps is rounded to F
template <typename F>
void rms_norm_forward(int64_t rows, int64_t D, const F* x, const F* w, double eps, F* y, F* rr, int threads);
template <typename F>
void rms_norm_backward(int64_t rows, int64_t D, const F* x, const F* w, const F* rr, const F* dy, F* dx, F* dw,
                       int threads);
template <typename F>
void sinkhorn_forward(int64_t B, int64_t n, int64_t iterations, const F* x, F* p, int threads);
template <typename F>
void sinkhorn_backward(int64_t B, int64_t n, int64_t iterations, const F* x, const F* gp, F* dx, int threads);


// -- the vectors and the dot product of both kernel files ------------------------------------------

// A vector of B bytes of F (GCC's and Clang's vector extension), loaded from and stored to
// unaligned memory.
template <typename F, int B>
struct VecOf {
  typedef F type __attribute__((vector_size(B)));
};
template <typename F, int B>
using Vec = typename VecOf<F, B>::type;

template <typename F, int B>
inline Vec<F, B> load(const F* p) {
  Vec<F, B> v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

template <typename F, int B>
inline void store(F* p, Vec<F, B> v) {
  __builtin_memcpy(p, &v, sizeof(v));
}

// Whether rows of n numbers are whole vectors of ATTNRES_VEC_BYTES when that is wider than 32
// bytes: the depth kernels' choice of vector (a function of the shapes alone), below.
template <typename F>
inline bool wide(int64_t n) {
  return ATTNRES_VEC_BYTES > 32 && n % (ATTNRES_VEC_BYTES / int64_t(sizeof(F))) == 0;
}

// The numbers of F in one register (ATTNRES_VEC_BYTES): 16 fp32 or 8 fp64 with AVX-512.
template <typename F>
constexpr int LANES = ATTNRES_VEC_BYTES / sizeof(F);

// The sum of LANES partial sums: halves added pairwise, the same order every call.
template <typename F>
inline F lane_sum(F* acc) {
  for (int h = LANES<F> / 2; h > 0; h /= 2)
    for (int w = 0; w < h; ++w) acc[w] += acc[w + h];
  return acc[0];
}

// The order in which a dot product adds its terms, which fixes its bits. Each kernel file keeps
// the order it was tuned and checked with, as its other kernels must reproduce it:
enum class DotOrder {
  // depth_attention_cpu.cpp: four chains of vectors of B bytes (one accumulator would wait on
  // the latency of every add), ATTNRES_VEC_BYTES where n is a whole number of them (`wide`), else
  // 32 (a head of 24 numbers would run one 16-wide vector and a scalar tail of 8, where 8-wide
  // vectors cover it whole); the chains added (s0 + s1) + (s2 + s3), the result's lanes summed in
  // order, then the terms past the last whole vector one by one. Every logit is such a dot
  // (head_logit), so that a logit computed again in backward has the bits forward computed.
  chains,
  // multi_stream_cpu.cpp: one chain of LANES lanes, the terms past the last whole vector added
  // to lanes 0, 1, ..., the lanes summed by lane_sum's tree: what its blocked products of many
  // pairs (`dots`) compute, so that a product gives the same bits in either.
  lanes,
};

template <typename F, int B>
inline F dot_chains(const F* a, const F* b, int64_t n) {
  constexpr int64_t W = B / sizeof(F);
  Vec<F, B> s0 = {}, s1 = {}, s2 = {}, s3 = {};
  int64_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
    s0 += load<F, B>(a + i) * load<F, B>(b + i);
    s1 += load<F, B>(a + i + W) * load<F, B>(b + i + W);
    s2 += load<F, B>(a + i + 2 * W) * load<F, B>(b + i + 2 * W);
    s3 += load<F, B>(a + i + 3 * W) * load<F, B>(b + i + 3 * W);
  }
  for (; i + W <= n; i += W) s0 += load<F, B>(a + i) * load<F, B>(b + i);
  const Vec<F, B> s = (s0 + s1) + (s2 + s3);
  F acc = 0;
  for (int64_t k = 0; k < W; ++k) acc += s[k];
  for (; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

template <typename F>
inline F dot_lanes(const F* a, const F* b, int64_t n) {
  constexpr int W = LANES<F>;
  F acc[W] = {};
  int64_t d = 0;
  for (; d + W <= n; d += W)
    for (int w = 0; w < W; ++w) acc[w] += a[d + w] * b[d + w];
  for (int w = 0; d < n; ++d, ++w) acc[w] += a[d] * b[d];
  return lane_sum(acc);
}

// a . b over n numbers, its terms added in the order O
template <DotOrder O, typename F>
inline F dot(const F* a, const F* b, int64_t n) {
  if constexpr (O == DotOrder::chains)
    return wide<F>(n) ? dot_chains<F, ATTNRES_VEC_BYTES>(a, b, n) : dot_chains<F, 32>(a, b, n);
  else
    return dot_lanes(a, b, n);
}

}  // namespace attnres::cpu
