// The CPU kernels as PyTorch operators, attnres::cpu_*: each one's schema (TORCH_LIBRARY) and its CPU
// implementation (TORCH_LIBRARY_IMPL), which brings the tensors to the layout its kernel reads
// (contiguous rows in one dtype; a row shared by every token, or a broadcast embedding's streams,
// read in place), allocates the outputs, fills the kernel's arguments (cpu_kernels.h) and calls it
// for fp32 or fp64. The fake (meta) implementations and the autograd formulas are registered from
// Python, where each operator's math is written (ops/backends/cpu_ops.py, cpu_streams.py).
//
// An operator returns tensors, never None: an output not asked for (or without its option) is an
// empty tensor, and the optional inputs that come from such outputs (norm_rr, r, rr) count as
// absent when empty. Per-thread partial sums (the gradients of a query or a gain, summed over
// tokens) are reduced here, in thread order.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <tuple>
#include <vector>

#include "cpu_kernels.h"

namespace {

using at::Tensor;
using at::TensorList;
using OptionalTensor = std::optional<Tensor>;
using attnres::cpu::DepthArgs;
using attnres::cpu::MergeArgs;
using attnres::cpu::SourceGradArgs;

// Calls fn(F()) with F the kernels' element type for dtype: float for fp32, double for fp64.
template <typename Fn>
void with_type(at::ScalarType dtype, const char* op, Fn&& fn) {
  if (dtype == at::kFloat) return fn(float());
  if (dtype == at::kDouble) return fn(double());
  TORCH_CHECK(false, "attnres::", op, ": the CPU kernels take fp32 or fp64 tensors, given ", dtype);
}

int threads() { return at::get_num_threads(); }

bool sigmoid_score(c10::string_view score) { return score != "softmax"; }

// The tensor, or an undefined one for None.
Tensor given(const OptionalTensor& t) { return t ? *t : Tensor(); }

// The tensor, or an undefined one when it is empty (an operator's "none").
Tensor unless_empty(const Tensor& t) { return t.defined() && t.numel() > 0 ? t : Tensor(); }

Tensor contiguous(const Tensor& t) { return t.defined() ? t.contiguous() : t; }

// An optional input in dtype dt, contiguous (undefined stays undefined).
Tensor prepared(const Tensor& t, at::ScalarType dt) { return t.defined() ? t.to(dt).contiguous() : t; }

// An operator's output: the tensor, or an empty one where it is undefined (never shared: an
// operator's outputs may not alias each other).
Tensor or_empty(const Tensor& t, const Tensor& like) { return t.defined() ? t : at::empty({0}, like.options()); }

void* ptr(const Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

template <typename F>
F* data(const Tensor& t) {
  return t.defined() ? t.data_ptr<F>() : nullptr;
}

// {pre..., lead..., post...}
std::vector<int64_t> sizes(std::initializer_list<int64_t> pre, at::IntArrayRef lead,
                           std::initializer_list<int64_t> post = {}) {
  std::vector<int64_t> out(pre);
  out.insert(out.end(), lead.begin(), lead.end());
  out.insert(out.end(), post);
  return out;
}

// The leading dims of t [..., D].
at::IntArrayRef lead_of(const Tensor& t) { return t.sizes().slice(0, t.dim() - 1); }

Tensor empty(at::IntArrayRef shape, const Tensor& like) { return at::empty(shape, like.options()); }

// Sums per-thread partial sums [threads, ...] over the threads (undefined stays undefined).
Tensor thread_sum(const Tensor& partial) { return partial.defined() ? partial.sum(at::IntArrayRef{0}) : partial; }

// t as rows of `width` numbers per token (1 for a number per token) and the row stride: width when
// contiguous, 0 when one row is broadcast to every token (Delta's null source, expanded), else a
// contiguous copy.
std::pair<Tensor, int64_t> as_rows(const Tensor& t, int64_t width) {
  if (t.is_contiguous()) return {t, width};
  const at::IntArrayRef strides = t.strides();
  const at::IntArrayRef token = width > 1 ? strides.slice(0, strides.size() - 1) : strides;
  const bool broadcast = (width == 1 || strides.back() == 1) &&
                         std::all_of(token.begin(), token.end(), [](int64_t s) { return s == 0; });
  if (broadcast) return {t, 0};
  return {t.contiguous(), width};
}

// The sources, in the first one's dtype, and their inverse RMS as the depth kernels read them:
// pointer and stride arrays that DepthArgs points into, alive as long as this is.
struct SourceRows {
  std::vector<Tensor> tensors;
  std::vector<const void*> src, rinv;
  std::vector<int64_t> src_stride, rinv_stride;
};

SourceRows source_rows(TensorList sources, TensorList inv_rms, bool key_norm) {
  SourceRows rows;
  const at::ScalarType dt = sources[0].scalar_type();
  const int64_t D = sources[0].size(-1);
  for (const Tensor& v : sources) {
    auto [t, stride] = as_rows(v.to(dt), D);
    rows.tensors.push_back(t), rows.src.push_back(t.data_ptr()), rows.src_stride.push_back(stride);
  }
  if (key_norm)
    for (const Tensor& r : inv_rms) {
      auto [t, stride] = as_rows(r.to(dt), 1);
      rows.tensors.push_back(t), rows.rinv.push_back(t.data_ptr()), rows.rinv_stride.push_back(stride);
    }
  return rows;
}

// The arguments that the depth kernels' forward and backward share.
DepthArgs depth_args(const SourceRows& rows, const Tensor& source, const Tensor& qg, const Tensor& lse, int64_t heads,
                     c10::string_view score, bool key_norm) {
  DepthArgs a{};
  a.dim = source.size(-1);
  a.tokens = source.numel() / a.dim;
  a.n_src = static_cast<int64_t>(rows.src.size());
  a.n_q = lse.size(0);
  a.heads = heads;
  a.src = rows.src.data(), a.src_stride = rows.src_stride.data();
  a.rinv = key_norm ? rows.rinv.data() : nullptr, a.rinv_stride = key_norm ? rows.rinv_stride.data() : nullptr;
  a.qg = ptr(qg), a.lse = lse.data_ptr();
  a.key_norm = key_norm, a.sigmoid = sigmoid_score(score), a.threads = threads();
  return a;
}

// -- depth attention -------------------------------------------------------------------------------------

std::tuple<std::vector<Tensor>, Tensor, Tensor> cpu_attend(const OptionalTensor& qg, TensorList sources,
                                                           TensorList inv_rms, const OptionalTensor& logits,
                                                           const OptionalTensor& norm_weight,
                                                           std::optional<double> norm_eps, int64_t heads,
                                                           c10::string_view score, bool key_norm) {
  TORCH_CHECK(!sources.empty(), "attnres::cpu_attend: no sources");
  const Tensor& first = sources[0];
  const at::ScalarType dt = first.scalar_type();
  const Tensor scores = prepared(given(logits), dt);  // [N, S, ..., H] precomputed, or undefined
  const Tensor q = scores.defined() ? Tensor() : given(qg).contiguous();
  const int64_t S = scores.defined() ? scores.size(1) : q.size(0);
  const Tensor lse = empty(sizes({S}, lead_of(first), {heads}), first);
  std::vector<Tensor> outs;
  std::vector<void*> out_ptrs;
  for (int64_t s = 0; s < S; ++s) outs.push_back(empty(first.sizes(), first)), out_ptrs.push_back(outs.back().data_ptr());
  const SourceRows rows = source_rows(sources, inv_rms, key_norm);
  DepthArgs a = depth_args(rows, first, q, lse, heads, score, key_norm);
  a.outs = out_ptrs.data();
  a.logits = ptr(scores), a.logits_given = scores.defined();
  Tensor weight, norm_rr;
  if (norm_eps) {  // query 0's output through the next sublayer's RMSNorm
    weight = prepared(given(norm_weight), dt);
    norm_rr = empty(sizes({}, lead_of(first), {1}), first);
    a.norm_w = ptr(weight), a.norm_rr = norm_rr.data_ptr(), a.norm_eps = *norm_eps;
  }
  with_type(dt, "cpu_attend", [&](auto f) { attnres::cpu::depth_forward<decltype(f)>(a); });
  return {outs, lse, or_empty(norm_rr, first)};
}

std::tuple<Tensor, std::vector<Tensor>, Tensor, Tensor, Tensor> cpu_attend_backward(
    const c10::List<OptionalTensor>& grad_outs, const OptionalTensor& grad_lse, const Tensor& qg_, TensorList sources,
    TensorList inv_rms, const Tensor& lse_, const OptionalTensor& norm_weight, const OptionalTensor& norm_rr_,
    std::optional<double> norm_eps, int64_t heads, c10::string_view score, bool key_norm,
    c10::List<bool> sources_need, bool qg_needs, bool weight_needs, bool for_ledger, const OptionalTensor& logits) {
  const Tensor& first = sources[0];
  const at::ScalarType dt = first.scalar_type();
  const Tensor qg = qg_.contiguous(), lse = lse_.contiguous();
  const int64_t S = qg.size(0), D = qg.size(1), N = static_cast<int64_t>(sources.size());
  const Tensor norm_rr = contiguous(unless_empty(given(norm_rr_)));
  const Tensor weight = prepared(given(norm_weight), dt);
  std::vector<Tensor> g_outs;
  std::vector<const void*> g_ptrs;
  for (size_t s = 0; s < grad_outs.size(); ++s) {
    g_outs.push_back(prepared(given(grad_outs.get(s)), dt)), g_ptrs.push_back(ptr(g_outs.back()));
  }
  weight_needs = weight_needs && norm_rr.defined() && weight.defined() && g_outs[0].defined();
  const int n_threads = threads();
  std::vector<Tensor> d_src;
  std::vector<void*> d_ptrs;
  for (int64_t j = 0; j < N; ++j) {
    d_src.push_back(sources_need.get(j) ? empty(first.sizes(), first) : Tensor()), d_ptrs.push_back(ptr(d_src.back()));
  }
  const Tensor d_qg = qg_needs ? at::zeros({n_threads, S, D}, qg.options()) : Tensor();
  const Tensor d_norm_w = weight_needs ? at::zeros({n_threads, D}, qg.options()) : Tensor();
  const Tensor g_lse = prepared(given(grad_lse), dt);
  const Tensor scores = prepared(given(logits), dt);  // [N, S, ..., H] as forward read them, or undefined
  const SourceRows rows = source_rows(sources, inv_rms, key_norm);
  DepthArgs a = depth_args(rows, first, qg, lse, heads, score, key_norm);
  a.logits = ptr(scores), a.logits_given = scores.defined();
  a.g_out = g_ptrs.data(), a.g_lse = ptr(g_lse), a.d_src = d_ptrs.data();
  a.d_qg = ptr(d_qg), a.d_norm_w = ptr(d_norm_w);
  if (norm_rr.defined()) a.norm_w = ptr(weight), a.norm_rr = norm_rr.data_ptr(), a.norm_eps = norm_eps.value();
  a.threads = n_threads;
  Tensor ds, g0;  // for a ledger: dL/d logit [N, S, ..., H], and query 0's gradient before its fused norm
  if (for_ledger) {
    ds = empty(sizes({N}, lse.sizes()), first);
    a.ds_out = ds.data_ptr();
    if (norm_rr.defined() && g_outs[0].defined()) g0 = empty(first.sizes(), first), a.g0_out = g0.data_ptr();
  }
  with_type(dt, "cpu_attend_backward", [&](auto f) { attnres::cpu::depth_backward<decltype(f)>(a); });
  for (Tensor& d : d_src) d = or_empty(d, qg);
  return {or_empty(thread_sum(d_qg), qg), d_src, or_empty(thread_sum(d_norm_w), qg), or_empty(ds, qg),
          or_empty(g0, qg)};
}

Tensor cpu_source_grad(const Tensor& source, const OptionalTensor& inv_rms, TensorList queries_, TensorList lse_,
                       TensorList ds_, const c10::List<OptionalTensor>& grads_, const OptionalTensor& grad,
                       int64_t heads, c10::string_view score, bool key_norm,
                       const c10::List<OptionalTensor>& logits_) {
  const at::ScalarType dt = queries_[0].scalar_type();
  const int64_t D = source.size(-1);
  const auto [v, v_stride] = as_rows(source.to(dt), D);
  const auto [rinv, rinv_stride] = key_norm ? as_rows(given(inv_rms).to(dt), 1) : std::pair<Tensor, int64_t>{};
  std::vector<Tensor> keep;
  std::vector<int64_t> n_q;
  std::vector<const void*> queries, lse, ds, grads, logits;
  TORCH_CHECK(logits_.size() == 0 || logits_.size() == queries_.size(),
              "attnres::cpu_source_grad: logits for ", logits_.size(), " of ", queries_.size(), " reads");
  for (size_t i = 0; i < queries_.size(); ++i) {
    keep.push_back(prepared(queries_[i], dt)), queries.push_back(keep.back().data_ptr());
    n_q.push_back(queries_[i].size(0));
    keep.push_back(prepared(lse_[i], dt)), lse.push_back(keep.back().data_ptr());
    keep.push_back(prepared(ds_[i], dt)), ds.push_back(keep.back().data_ptr());
    if (logits_.size()) keep.push_back(prepared(given(logits_.get(i)), dt)), logits.push_back(ptr(keep.back()));
  }
  for (size_t i = 0; i < grads_.size(); ++i) keep.push_back(prepared(given(grads_.get(i)), dt)), grads.push_back(ptr(keep.back()));
  const Tensor grad_in = prepared(given(grad), dt);
  const Tensor out = at::empty(source.sizes(), source.options().dtype(dt));
  SourceGradArgs a{};
  a.tokens = out.numel() / D, a.dim = D, a.heads = heads, a.n_reads = static_cast<int64_t>(queries.size());
  a.src = v.data_ptr(), a.src_stride = v_stride, a.rinv = ptr(rinv), a.rinv_stride = rinv_stride;
  a.n_q = n_q.data(), a.qg = queries.data(), a.lse = lse.data(), a.ds = ds.data(), a.g = grads.data();
  a.logits = logits.empty() ? nullptr : logits.data();
  a.grad_in = ptr(grad_in), a.d_src = out.data_ptr(), a.sigmoid = sigmoid_score(score), a.threads = threads();
  with_type(dt, "cpu_source_grad", [&](auto f) { attnres::cpu::source_grad<decltype(f)>(a); });
  return out;
}

Tensor cpu_decode_read(const Tensor& sources, int64_t count, const Tensor& query, int64_t heads, double eps,
                       c10::string_view score, bool key_norm, const OptionalTensor& base, double gate,
                       const OptionalTensor& norm_weight, std::optional<double> norm_eps) {
  const at::ScalarType dt = sources.scalar_type();
  const int64_t D = sources.size(-1);
  const Tensor out = empty(sources.sizes().slice(1), sources);
  const int64_t tokens = out.numel() / D;
  const Tensor q = prepared(query, dt), b = prepared(given(base), dt), weight = prepared(given(norm_weight), dt);
  with_type(dt, "cpu_decode_read", [&](auto f) {
    using F = decltype(f);
    attnres::cpu::decode_read<F>(tokens, D, heads, count, sources.data_ptr<F>(), tokens * D, q.data_ptr<F>(), key_norm,
                                 eps, sigmoid_score(score), data<F>(b), gate, norm_eps.has_value(), data<F>(weight),
                                 norm_eps.value_or(0.0), out.data_ptr<F>(), threads());
  });
  return out;
}

// -- the two-phase merge -------------------------------------------------------------------------------------

MergeArgs merge_args(const Tensor& partial, const Tensor& qg, int64_t heads, double eps, c10::string_view score,
                     bool key_norm, const Tensor& weight, std::optional<double> norm_eps) {
  MergeArgs a{};
  a.dim = partial.size(-1), a.tokens = partial.numel() / a.dim, a.heads = heads;
  a.partial = partial.data_ptr(), a.qg = qg.data_ptr(), a.eps = eps;
  a.norm_w = ptr(weight), a.norm_eps = norm_eps.value_or(0.0);
  a.key_norm = key_norm, a.sigmoid = sigmoid_score(score), a.threads = threads();
  return a;
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> cpu_merge(const Tensor& o1_, const Tensor& lse1_,
                                                                     const Tensor& partial_, const Tensor& qg_,
                                                                     const OptionalTensor& norm_weight,
                                                                     std::optional<double> norm_eps, int64_t heads,
                                                                     double eps, c10::string_view score, bool key_norm,
                                                                     bool keep) {
  const at::ScalarType dt = partial_.scalar_type();
  const Tensor o1 = prepared(o1_, dt), lse1 = prepared(lse1_, dt), partial = partial_.contiguous();
  const Tensor qg = prepared(qg_, dt), weight = prepared(given(norm_weight), dt);
  const at::IntArrayRef lead = lead_of(partial);
  MergeArgs a = merge_args(partial, qg, heads, eps, score, key_norm, weight, norm_eps);
  a.o1 = o1.data_ptr(), a.lse1 = lse1.data_ptr();
  const Tensor out = empty(partial.sizes(), partial);
  Tensor h, s2, w, r, rr;  // what backward needs (keep): per token s2, w [..., H], r, rr [...]; h [..., D]
  if (keep) {
    h = norm_eps ? empty(partial.sizes(), partial) : out;
    s2 = empty(sizes({}, lead, {heads}), partial), w = empty(sizes({}, lead, {heads}), partial);
    if (key_norm) r = empty(lead, partial);
    if (norm_eps) rr = empty(lead, partial);
    a.h = h.data_ptr(), a.s2 = s2.data_ptr(), a.w = w.data_ptr(), a.r = ptr(r), a.norm_rr = ptr(rr);
  }
  if (norm_eps)
    a.y = out.data_ptr();
  else
    a.h = out.data_ptr();
  with_type(dt, "cpu_merge", [&](auto f) { attnres::cpu::merge_forward<decltype(f)>(a); });
  return {out, norm_eps ? or_empty(h, out) : or_empty(Tensor(), out), or_empty(s2, out), or_empty(w, out),
          or_empty(r, out), or_empty(rr, out)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> cpu_merge_backward(
    const Tensor& grad, const Tensor& partial_, const Tensor& qg_, const OptionalTensor& norm_weight, const Tensor& h,
    const Tensor& s2, const Tensor& w, const Tensor& r_, const Tensor& rr_, std::optional<double> norm_eps,
    int64_t heads, double eps, c10::string_view score, bool key_norm, bool o1_needs, bool lse1_needs,
    bool partial_needs, bool qg_needs, bool weight_needs) {
  const at::ScalarType dt = partial_.scalar_type();
  const Tensor partial = partial_.contiguous(), qg = prepared(qg_, dt), weight = prepared(given(norm_weight), dt);
  const Tensor r = contiguous(unless_empty(r_)), rr = contiguous(unless_empty(rr_));
  const Tensor kept_h = h.contiguous(), kept_s2 = s2.contiguous(), kept_w = w.contiguous();
  const at::IntArrayRef lead = lead_of(partial);
  const int64_t D = partial.size(-1);
  const int n_threads = threads();
  weight_needs = weight_needs && rr.defined() && weight.defined();
  const Tensor d_o1 = o1_needs ? empty(partial.sizes(), partial) : Tensor();
  const Tensor d_lse1 = lse1_needs && !sigmoid_score(score) ? empty(sizes({}, lead, {heads}), partial) : Tensor();
  const Tensor d_partial = partial_needs ? empty(partial.sizes(), partial) : Tensor();
  const Tensor d_qg = qg_needs ? at::zeros({n_threads, D}, partial.options()) : Tensor();
  const Tensor d_norm_w = weight_needs ? at::zeros({n_threads, D}, partial.options()) : Tensor();
  const Tensor g = grad.to(dt).contiguous();
  MergeArgs a = merge_args(partial, qg, heads, eps, score, key_norm, weight, norm_eps);
  a.h = kept_h.data_ptr(), a.norm_rr = ptr(rr), a.g = g.data_ptr();
  a.s2 = kept_s2.data_ptr(), a.w = kept_w.data_ptr(), a.r = ptr(r);
  a.d_o1 = ptr(d_o1), a.d_lse1 = ptr(d_lse1), a.d_partial = ptr(d_partial);
  a.d_qg = ptr(d_qg), a.d_norm_w = ptr(d_norm_w), a.threads = n_threads;
  with_type(dt, "cpu_merge_backward", [&](auto f) { attnres::cpu::merge_backward<decltype(f)>(a); });
  return {or_empty(d_o1, partial), or_empty(d_lse1, partial), or_empty(d_partial, partial),
          or_empty(thread_sum(d_qg), partial), or_empty(thread_sum(d_norm_w), partial)};
}

// -- the multi-stream designs' per-token work ---------------------------------------------------------------

// H [..., n, D] as [T, n, D] rows and its token and stream strides: read in place when its rows are
// contiguous and its leading dims fold into one token stride (the stream stride 0 for an embedding
// broadcast to every stream), else a contiguous copy.
struct Streams {
  Tensor rows;
  int64_t T, n, D, ts, ks;
};

Streams streams(const Tensor& H) {
  const int64_t n = H.size(-2), D = H.size(-1);
  Tensor rows = H.reshape({-1, n, D});
  if (rows.stride(-1) != 1 || (n > 1 && rows.stride(1) != 0 && rows.stride(1) != D)) rows = rows.contiguous();
  return {rows, rows.size(0), n, D, rows.stride(0), n > 1 ? rows.stride(1) : D};
}

Tensor cpu_stream_mix(const Tensor& H, const Tensor& w_) {
  const Streams x = streams(H);
  const Tensor w = w_.contiguous();
  const Tensor y = empty(sizes({}, H.sizes().slice(0, H.dim() - 2), {x.D}), H);
  with_type(H.scalar_type(), "cpu_stream_mix", [&](auto f) {
    using F = decltype(f);
    attnres::cpu::stream_mix_forward<F>(x.T, x.n, x.D, x.rows.data_ptr<F>(), x.ts, x.ks, w.data_ptr<F>(),
                                        y.data_ptr<F>(), threads());
  });
  return y;
}

std::tuple<Tensor, Tensor> cpu_stream_mix_backward(const Tensor& H, const Tensor& w_, const Tensor& g_, bool H_needs,
                                                   bool w_needs) {
  const Streams x = streams(H);
  const Tensor w = w_.contiguous(), g = g_.contiguous();
  const Tensor dH = H_needs ? empty(H.sizes(), H) : Tensor();
  const Tensor dw = w_needs ? empty(w.sizes(), w) : Tensor();
  with_type(H.scalar_type(), "cpu_stream_mix_backward", [&](auto f) {
    using F = decltype(f);
    attnres::cpu::stream_mix_backward<F>(x.T, x.n, x.D, x.rows.data_ptr<F>(), x.ts, x.ks, w.data_ptr<F>(),
                                         g.data_ptr<F>(), data<F>(dH), data<F>(dw), threads());
  });
  return {or_empty(dH, H), or_empty(dw, H)};
}

Tensor cpu_stream_update(const Tensor& H, const OptionalTensor& A_, const Tensor& b_, const Tensor& v_,
                         bool transposed) {
  const Streams x = streams(H);
  const Tensor A = contiguous(given(A_)), b = b_.contiguous(), v = v_.contiguous();
  const Tensor out = empty(sizes({}, H.sizes().slice(0, H.dim() - 2), {x.n, x.D}), H);
  with_type(H.scalar_type(), "cpu_stream_update", [&](auto f) {
    using F = decltype(f);
    attnres::cpu::stream_update_forward<F>(x.T, x.n, x.D, x.rows.data_ptr<F>(), x.ts, x.ks, data<F>(A), transposed,
                                           b.data_ptr<F>(), v.data_ptr<F>(), out.data_ptr<F>(), threads());
  });
  return out;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> cpu_stream_update_backward(const Tensor& H, const OptionalTensor& A_,
                                                                      const Tensor& b_, const Tensor& v_,
                                                                      bool transposed, const Tensor& g_, bool H_needs,
                                                                      bool A_needs, bool b_needs, bool v_needs) {
  const Streams x = streams(H);
  const Tensor A = contiguous(given(A_)), b = b_.contiguous(), v = v_.contiguous();
  const Tensor g = g_.contiguous();
  const Tensor dH = H_needs ? empty(H.sizes(), H) : Tensor();
  const Tensor dA = A_needs && A.defined() ? empty(A.sizes(), A) : Tensor();
  const Tensor db = b_needs ? empty(b.sizes(), b) : Tensor();
  const Tensor dv = v_needs ? empty(v.sizes(), v) : Tensor();
  with_type(H.scalar_type(), "cpu_stream_update_backward", [&](auto f) {
    using F = decltype(f);
    attnres::cpu::stream_update_backward<F>(x.T, x.n, x.D, x.rows.data_ptr<F>(), x.ts, x.ks, data<F>(A), transposed,
                                            b.data_ptr<F>(), v.data_ptr<F>(), g.data_ptr<F>(), data<F>(dH),
                                            data<F>(dA), data<F>(db), data<F>(dv), threads());
  });
  return {or_empty(dH, H), or_empty(dA, H), or_empty(db, H), or_empty(dv, H)};
}

Tensor cpu_gated_mix(const Tensor& R_, const Tensor& z_) {
  const Tensor R = R_.contiguous(), z = z_.to(R.scalar_type()).contiguous();
  const int64_t n = R.size(-2), D = R.size(-1);
  const Tensor y = empty(sizes({}, R.sizes().slice(0, R.dim() - 2), {D}), R);
  with_type(R.scalar_type(), "cpu_gated_mix", [&](auto f) {
    using F = decltype(f);
    attnres::cpu::gated_mix_forward<F>(R.numel() / (n * D), n, D, R.data_ptr<F>(), z.data_ptr<F>(), y.data_ptr<F>(),
                                       threads());
  });
  return y;
}

std::tuple<Tensor, Tensor> cpu_gated_mix_backward(const Tensor& R_, const Tensor& z_, const Tensor& g_, bool R_needs,
                                                  bool z_needs) {
  const Tensor R = R_.contiguous(), z = z_.to(R.scalar_type()).contiguous(), g = g_.contiguous();
  const int64_t n = R.size(-2), D = R.size(-1);
  const Tensor dR = R_needs ? empty(R.sizes(), R) : Tensor();
  const Tensor dz = z_needs ? empty(z.sizes(), z) : Tensor();
  with_type(R.scalar_type(), "cpu_gated_mix_backward", [&](auto f) {
    using F = decltype(f);
    attnres::cpu::gated_mix_backward<F>(R.numel() / (n * D), n, D, R.data_ptr<F>(), z.data_ptr<F>(), g.data_ptr<F>(),
                                        data<F>(dR), data<F>(dz), threads());
  });
  return {or_empty(dR, R), or_empty(dz, R)};
}

// U^T [r, mp] from the up-projection U [n D, r]: padded with zero columns to whole vectors of
// ATTNRES_VEC_BYTES (cpu_kernels.h), the low-rank kernel's unit.
Tensor padded_up_t(const Tensor& up) {
  const int64_t m = up.size(0), r = up.size(1), lanes = ATTNRES_VEC_BYTES / up.element_size();
  Tensor upT = at::zeros({r, (m + lanes - 1) / lanes * lanes}, up.options());
  upT.slice(1, 0, m).copy_(up.t());
  return upT;
}

Tensor cpu_gated_mix_lowrank(const Tensor& R_, const Tensor& h_, const Tensor& up) {
  const Tensor R = R_.contiguous(), h = h_.contiguous(), upT = padded_up_t(up);
  const int64_t n = R.size(-2), D = R.size(-1), r = h.size(-1);
  const Tensor y = empty(sizes({}, R.sizes().slice(0, R.dim() - 2), {D}), R);
  with_type(R.scalar_type(), "cpu_gated_mix_lowrank", [&](auto f) {
    using F = decltype(f);
    attnres::cpu::gated_lowrank_forward<F>(R.numel() / (n * D), n, D, r, R.data_ptr<F>(), h.data_ptr<F>(),
                                           upT.data_ptr<F>(), y.data_ptr<F>(), threads());
  });
  return y;
}

std::tuple<Tensor, Tensor, Tensor> cpu_gated_mix_lowrank_backward(const Tensor& R_, const Tensor& h_,
                                                                  const Tensor& up, const Tensor& g_, bool R_needs,
                                                                  bool h_needs, bool up_needs) {
  const Tensor R = R_.contiguous(), h = h_.contiguous(), upT = padded_up_t(up), g = g_.contiguous();
  const int64_t n = R.size(-2), D = R.size(-1), r = h.size(-1), m = n * D;
  const int n_threads = threads();
  const Tensor dR = R_needs ? empty(R.sizes(), R) : Tensor();
  const Tensor dh = h_needs ? empty(h.sizes(), h) : Tensor();
  const Tensor d_upT = up_needs ? at::zeros({n_threads, r, upT.size(1)}, R.options()) : Tensor();
  with_type(R.scalar_type(), "cpu_gated_mix_lowrank_backward", [&](auto f) {
    using F = decltype(f);
    attnres::cpu::gated_lowrank_backward<F>(R.numel() / m, n, D, r, R.data_ptr<F>(), h.data_ptr<F>(),
                                            upT.data_ptr<F>(), g.data_ptr<F>(), data<F>(dR), data<F>(dh),
                                            data<F>(d_upT), n_threads);
  });
  const Tensor d_up = up_needs ? thread_sum(d_upT).slice(1, 0, m).t() : Tensor();
  return {or_empty(dR, R), or_empty(dh, R), or_empty(d_up, R)};
}

std::tuple<Tensor, Tensor> cpu_rms_norm(const Tensor& x_, const Tensor& weight_, double eps) {
  const Tensor x = x_.contiguous(), weight = weight_.contiguous();
  const int64_t D = x.size(-1);
  const Tensor y = empty(x.sizes(), x), rr = empty(lead_of(x), x);
  with_type(x.scalar_type(), "cpu_rms_norm", [&](auto f) {
    using F = decltype(f);
    attnres::cpu::rms_norm_forward<F>(x.numel() / D, D, x.data_ptr<F>(), weight.data_ptr<F>(), eps, y.data_ptr<F>(),
                                      rr.data_ptr<F>(), threads());
  });
  return {y, rr};
}

std::tuple<Tensor, Tensor> cpu_rms_norm_backward(const Tensor& x_, const Tensor& weight_, const Tensor& rr_,
                                                 const Tensor& g_, bool x_needs, bool weight_needs) {
  const Tensor x = x_.contiguous(), weight = weight_.contiguous(), rr = rr_.contiguous(), g = g_.contiguous();
  const int64_t D = x.size(-1);
  const Tensor dx = x_needs ? empty(x.sizes(), x) : Tensor();
  const Tensor dw = weight_needs ? empty(weight.sizes(), weight) : Tensor();
  with_type(x.scalar_type(), "cpu_rms_norm_backward", [&](auto f) {
    using F = decltype(f);
    attnres::cpu::rms_norm_backward<F>(x.numel() / D, D, x.data_ptr<F>(), weight.data_ptr<F>(), rr.data_ptr<F>(),
                                       g.data_ptr<F>(), data<F>(dx), data<F>(dw), threads());
  });
  return {or_empty(dx, x), or_empty(dw, x)};
}

Tensor cpu_sinkhorn(const Tensor& x_, int64_t iterations) {
  const Tensor x = x_.contiguous();
  const int64_t n = x.size(-1);
  const Tensor p = empty(x.sizes(), x);
  with_type(x.scalar_type(), "cpu_sinkhorn", [&](auto f) {
    using F = decltype(f);
    attnres::cpu::sinkhorn_forward<F>(x.numel() / (n * n), n, iterations, x.data_ptr<F>(), p.data_ptr<F>(), threads());
  });
  return p;
}

Tensor cpu_sinkhorn_backward(const Tensor& x_, const Tensor& g_, int64_t iterations) {
  const Tensor x = x_.contiguous(), g = g_.contiguous();
  const int64_t n = x.size(-1);
  const Tensor dx = empty(x.sizes(), x);
  with_type(x.scalar_type(), "cpu_sinkhorn_backward", [&](auto f) {
    using F = decltype(f);
    attnres::cpu::sinkhorn_backward<F>(x.numel() / (n * n), n, iterations, x.data_ptr<F>(), g.data_ptr<F>(),
                                       dx.data_ptr<F>(), threads());
  });
  return dx;
}

}  // namespace

TORCH_LIBRARY(attnres, m) {
  m.def("cpu_attend(Tensor? qg, Tensor[] sources, Tensor[] inv_rms, Tensor? logits, Tensor? norm_weight, "
        "float? norm_eps, int heads, str score, bool key_norm) -> (Tensor[] outs, Tensor lse, Tensor norm_rr)");
  m.def("cpu_attend_backward(Tensor?[] grad_outs, Tensor? grad_lse, Tensor qg, Tensor[] sources, Tensor[] inv_rms, "
        "Tensor lse, Tensor? norm_weight, Tensor? norm_rr, float? norm_eps, int heads, str score, bool key_norm, "
        "bool[] sources_need, bool qg_needs, bool weight_needs, bool for_ledger=False, Tensor? logits=None) "
        "-> (Tensor d_qg, Tensor[] d_sources, Tensor d_weight, Tensor ds, Tensor g0)");
  m.def("cpu_source_grad(Tensor source, Tensor? inv_rms, Tensor[] queries, Tensor[] lse, Tensor[] ds, "
        "Tensor?[] grads, Tensor? grad, int heads, str score, bool key_norm, Tensor?[] logits) -> Tensor");
  m.def("cpu_decode_read(Tensor sources, int count, Tensor query, int heads, float eps, str score, bool key_norm, "
        "Tensor? base, float gate, Tensor? norm_weight, float? norm_eps) -> Tensor");
  m.def("cpu_merge(Tensor o1, Tensor lse1, Tensor partial, Tensor qg, Tensor? norm_weight, float? norm_eps, "
        "int heads, float eps, str score, bool key_norm, bool keep=True) "
        "-> (Tensor out, Tensor h, Tensor s2, Tensor w, Tensor r, Tensor rr)");
  m.def("cpu_merge_backward(Tensor grad, Tensor partial, Tensor qg, Tensor? norm_weight, Tensor h, Tensor s2, "
        "Tensor w, Tensor r, Tensor rr, float? norm_eps, int heads, float eps, str score, bool key_norm, "
        "bool o1_needs, bool lse1_needs, bool partial_needs, bool qg_needs, bool weight_needs) "
        "-> (Tensor d_o1, Tensor d_lse1, Tensor d_partial, Tensor d_qg, Tensor d_weight)");
  m.def("cpu_stream_mix(Tensor H, Tensor w) -> Tensor");
  m.def("cpu_stream_mix_backward(Tensor H, Tensor w, Tensor g, bool H_needs, bool w_needs) -> (Tensor, Tensor)");
  m.def("cpu_stream_update(Tensor H, Tensor? A, Tensor b, Tensor v, bool transposed) -> Tensor");
  m.def("cpu_stream_update_backward(Tensor H, Tensor? A, Tensor b, Tensor v, bool transposed, Tensor g, "
        "bool H_needs, bool A_needs, bool b_needs, bool v_needs) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("cpu_gated_mix(Tensor R, Tensor z) -> Tensor");
  m.def("cpu_gated_mix_backward(Tensor R, Tensor z, Tensor g, bool R_needs, bool z_needs) -> (Tensor, Tensor)");
  m.def("cpu_gated_mix_lowrank(Tensor R, Tensor h, Tensor up) -> Tensor");
  m.def("cpu_gated_mix_lowrank_backward(Tensor R, Tensor h, Tensor up, Tensor g, bool R_needs, bool h_needs, "
        "bool up_needs) -> (Tensor, Tensor, Tensor)");
  m.def("cpu_rms_norm(Tensor x, Tensor weight, float eps) -> (Tensor y, Tensor rr)");
  m.def("cpu_rms_norm_backward(Tensor x, Tensor weight, Tensor rr, Tensor g, bool x_needs, bool weight_needs) "
        "-> (Tensor, Tensor)");
  m.def("cpu_sinkhorn(Tensor x, int iterations) -> Tensor");
  m.def("cpu_sinkhorn_backward(Tensor x, Tensor g, int iterations) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnres, CPU, m) {
  m.impl("cpu_attend", &cpu_attend);
  m.impl("cpu_attend_backward", &cpu_attend_backward);
  m.impl("cpu_source_grad", &cpu_source_grad);
  m.impl("cpu_decode_read", &cpu_decode_read);
  m.impl("cpu_merge", &cpu_merge);
  m.impl("cpu_merge_backward", &cpu_merge_backward);
  m.impl("cpu_stream_mix", &cpu_stream_mix);
  m.impl("cpu_stream_mix_backward", &cpu_stream_mix_backward);
  m.impl("cpu_stream_update", &cpu_stream_update);
  m.impl("cpu_stream_update_backward", &cpu_stream_update_backward);
  m.impl("cpu_gated_mix", &cpu_gated_mix);
  m.impl("cpu_gated_mix_backward", &cpu_gated_mix_backward);
  m.impl("cpu_gated_mix_lowrank", &cpu_gated_mix_lowrank);
  m.impl("cpu_gated_mix_lowrank_backward", &cpu_gated_mix_lowrank_backward);
  m.impl("cpu_rms_norm", &cpu_rms_norm);
  m.impl("cpu_rms_norm_backward", &cpu_rms_norm_backward);
  m.impl("cpu_sinkhorn", &cpu_sinkhorn);
  m.impl("cpu_sinkhorn_backward", &cpu_sinkhorn_backward);
}
