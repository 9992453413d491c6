// C++ kernels for the depth mix on CPU (ATTNRES_KERNEL=cpu), built and wrapped by depth_kernels_cpu.py, which
// says what they compute and why; the math they fuse is depth_core.py's, the buffers they read depth_cpu.py's.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

namespace {

constexpr int64_t kMaxSources = 1024;  // Full AttnRes on 500 layers

// Coefficients in place of the scores l[0..n): n alpha_i - 1 (count scaling) or alpha_i.
inline void coefficients(float* l, int64_t n, bool count) {
  float top = l[0];
  for (int64_t i = 1; i < n; ++i) top = std::max(top, l[i]);
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) { l[i] = std::exp(l[i] - top); total += l[i]; }
  const float fn = static_cast<float>(n);
  // (n e_i - sum e) / sum e: exactly 0 for equal scores, whatever the rounding.
  for (int64_t i = 0; i < n; ++i) l[i] = count ? (l[i] * fn - total) / total : l[i] / total;
}

// out = H + sum_i c_i k_i (count scaling) or sum_i c_i k_i, one source after the other (fused multiply-adds,
// written out: the build turns off contraction for the norm's sake; fma(0, k, h) is still h exactly): each is read once, in
// order, while the output row stays in L1 (measured on 512 tokens: as fast as accumulating chunks of D in
// registers over all sources at 5 sources, 1.5x faster at the 61 of Full AttnRes, where that reads 61 rows at once).
inline void weighted_sum(float* __restrict out, const float* __restrict h, const float* const* keys, const float* c,
                         int64_t n, int64_t d, bool count) {
  const float* __restrict k = keys[0];
  const float c0 = c[0];
  if (count) {
    for (int64_t j = 0; j < d; ++j) out[j] = std::fma(c0, k[j], h[j]);
  } else {
    for (int64_t j = 0; j < d; ++j) out[j] = c0 * k[j];
  }
  for (int64_t i = 1; i < n; ++i) {
    const float* __restrict ki = keys[i];
    const float ci = c[i];
    for (int64_t j = 0; j < d; ++j) out[j] = std::fma(ci, ki[j], out[j]);
  }
}

inline void dot_and_square(const float* __restrict x, const float* __restrict q, int64_t d, float& dot, float& square) {
  float a = 0.f, b = 0.f;
#pragma omp simd reduction(+ : a, b)
  for (int64_t j = 0; j < d; ++j) { a = std::fma(x[j], q[j], a); b = std::fma(x[j], x[j], b); }
  dot = a;
  square = b;
}

inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t v = static_cast<uint64_t>(x - 1); v; v >>= 1) ++bits;
  return bits;
}

// sum_j x_j^2 over a contiguous row, added in the order torch's CPU sum adds them (aten/src/ATen/native/cpu/
// SumKernel.cpp: vectorized_inner_sum over row_sum over multi_row_sum, a 4-level cascade of 4 accumulators of
// L-lane vectors, then the tail, then the lanes), so a fused RMSNorm gives the bits the norm module gives.
// Rows under 2^15 elements only (torch splits longer single rows between threads). `fused_norm` checks the
// result against the module before any forward uses it, and picks L.
template <int L>
float square_sum(const float* x, int64_t d) {
  const int64_t vectors = d / L, rows = vectors / 4;
  float acc[4][4][L] = {};
  const int64_t power = std::max<int64_t>(4, ceil_log2(rows) / 4), step = int64_t(1) << power, mask = step - 1;
  auto add_row = [&](int64_t i) {
    for (int k = 0; k < 4; ++k) {
      const float* v = x + (4 * i + k) * L;
      for (int l = 0; l < L; ++l) acc[0][k][l] += v[l] * v[l];
    }
  };
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; ++j, ++i) add_row(i);
    for (int j = 1; j < 4; ++j) {
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < L; ++l) { acc[j][k][l] += acc[j - 1][k][l]; acc[j - 1][k][l] = 0.f; }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < rows; ++i) add_row(i);
  for (int j = 1; j < 4; ++j)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < L; ++l) acc[0][k][l] += acc[j][k][l];
  for (int64_t v = rows * 4; v < vectors; ++v)
    for (int l = 0; l < L; ++l) acc[0][0][l] += x[v * L + l] * x[v * L + l];
  for (int k = 1; k < 4; ++k)
    for (int l = 0; l < L; ++l) acc[0][0][l] += acc[0][k][l];
  float total = 0.f;
  for (int64_t j = vectors * L; j < d; ++j) total += x[j] * x[j];
  for (int l = 0; l < L; ++l) total += acc[0][0][l];
  return total;
}

// A norm module's RMSNorm, fused: weight * (x * rsqrt(mean(x^2) + eps)), rounded as its operations round.
struct Norm {
  const float* weight = nullptr;
  float eps = 0.f;
  int64_t lanes = 8;
};

inline void normalize(float* x, int64_t d, const Norm& norm) {
  const float s = norm.lanes == 16 ? square_sum<16>(x, d) : norm.lanes == 4 ? square_sum<4>(x, d) : square_sum<8>(x, d);
  const float inv = 1.f / std::sqrt(s / static_cast<float>(d) + norm.eps);
  const float* __restrict w = norm.weight;
  for (int64_t j = 0; j < d; ++j) x[j] = w[j] * (x[j] * inv);
}

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.stride(-1) == 1, name, " must have unit stride in its last dimension");
}

// An empty weight: no norm. Otherwise a float32 [D] weight, its eps and the lanes of torch's sum (see square_sum).
Norm norm_of(const at::Tensor& weight, double eps, int64_t lanes, int64_t d) {
  Norm norm;
  if (weight.numel() == 0) return norm;
  check_float(weight, "norm weight");
  TORCH_CHECK(weight.numel() == d && weight.is_contiguous(), "norm weight must be a contiguous [D]");
  TORCH_CHECK(lanes == 4 || lanes == 8 || lanes == 16, "lanes must be 4, 8 or 16");
  norm.weight = weight.data_ptr<float>();
  norm.eps = static_cast<float>(eps);
  norm.lanes = lanes;
  return norm;
}

}  // namespace

// A few-token forward's reader: padded [B, T, >= n, D + 1] token-major sources, each row ending in the
// constant sqrt(D eps); q [D + 1] the folded query times sqrt(D) with a 0 for the constant; stream [B, T, D].
// With `added` [B, T, D] (the previous sublayer's output, not empty), first the residual adds of that
// output, as the eager path makes them: padded[:, :, slot] += added and stream += added.
// With a norm weight (not empty), the sublayer's RMSNorm of the mix is returned instead of the mix.
at::Tensor step_mix(const at::Tensor& padded, int64_t n, const at::Tensor& q, const at::Tensor& stream, bool count,
                    const at::Tensor& added, int64_t slot, const at::Tensor& norm_weight, double norm_eps,
                    int64_t lanes) {
  check_float(padded, "padded"); check_float(q, "q"); check_float(stream, "stream");
  const bool add = added.numel() > 0;
  if (add) {
    check_float(added, "added");
    TORCH_CHECK(added.sizes() == stream.sizes() && slot >= 0 && slot < padded.size(2), "step_mix: bad added output");
  }
  TORCH_CHECK(padded.dim() == 4 && stream.dim() == 3 && n >= 1 && n <= padded.size(2) && n <= kMaxSources,
              "step_mix: bad shapes");
  const int64_t B = padded.size(0), T = padded.size(1), d1 = padded.size(3), d = d1 - 1;
  TORCH_CHECK(stream.size(0) == B && stream.size(1) == T && stream.size(2) == d && q.numel() == d1,
              "step_mix: stream and query do not match the sources");
  const Norm norm = norm_of(norm_weight, norm_eps, lanes, d);
  auto out = at::empty({B, T, d}, stream.options());
  const float* P = padded.data_ptr<float>(); const float* Q = q.data_ptr<float>();
  float* H = stream.data_ptr<float>(); float* O = out.data_ptr<float>();
  float c[kMaxSources];
  const float* keys[kMaxSources];
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const float* base = P + b * padded.stride(0) + t * padded.stride(1);
      if (add) {
        // The slot and the stream may be rows of the same buffer, never the same row.
        float* part = const_cast<float*>(base) + slot * padded.stride(2);
        float* h = H + b * stream.stride(0) + t * stream.stride(1);
        const float* y = added.data_ptr<float>() + b * added.stride(0) + t * added.stride(1);
        for (int64_t j = 0; j < d; ++j) { part[j] += y[j]; h[j] += y[j]; }
      }
      for (int64_t i = 0; i < n; ++i) {
        keys[i] = base + i * padded.stride(2);
        float dot, square;
        dot_and_square(keys[i], Q, d1, dot, square);  // |k, c| = sqrt(D) rms(k)
        c[i] = dot / std::sqrt(square);
      }
      coefficients(c, n, count);
      float* o = O + (b * T + t) * d;
      weighted_sum(o, H + b * stream.stride(0) + t * stream.stride(1), keys, c, n, d, count);
      if (norm.weight) normalize(o, d, norm);
    }
  }
  return out;
}

// A many-token forward's reader on the source-major buffer: sources [K, BT, D] (m completed, then the
// partial sum when has_partial); their scores from table [K, BT] (this reader's column of the score table,
// any strides) or, when table is empty, q . k * inv_rms [K, BT]; stream [BT, D].
// With `added` [BT, D] (the previous sublayer's output, not empty), first the residual adds of that output into
// the partial sum (sources[m], written instead when `init`: the first output of a block) and the stream, as the
// eager path makes them, in the same pass over each token's rows. With a norm weight, as step_mix.
at::Tensor buffer_mix(const at::Tensor& sources, int64_t m, bool has_partial, const at::Tensor& q,
                      const at::Tensor& stream, double eps, bool count, const at::Tensor& table,
                      const at::Tensor& inv_rms, const at::Tensor& added, bool init, const at::Tensor& norm_weight,
                      double norm_eps, int64_t lanes) {
  check_float(sources, "sources"); check_float(q, "q"); check_float(stream, "stream");
  const bool use_table = table.defined() && table.numel() > 0;
  const bool add = added.numel() > 0;
  const int64_t n = m + (has_partial ? 1 : 0);
  TORCH_CHECK(sources.dim() == 3 && stream.dim() == 2 && n >= 1 && n <= sources.size(0) && n <= kMaxSources,
              "buffer_mix: bad shapes");
  const int64_t BT = sources.size(1), d = sources.size(2);
  TORCH_CHECK(stream.size(0) == BT && stream.size(1) == d && q.numel() == d, "buffer_mix: stream and query do not match");
  if (add) {
    check_float(added, "added");
    TORCH_CHECK(has_partial && added.dim() == 2 && added.size(0) == BT && added.size(1) == d,
                "buffer_mix: the added output must be [BT, D] and go to a partial sum");
  }
  const at::Tensor& stats = use_table ? table : inv_rms;
  TORCH_CHECK(m == 0 || (stats.dim() == 2 && stats.size(1) == BT && stats.scalar_type() == at::kFloat),
              "buffer_mix: scores or inverse rms [K, BT] needed");
  const Norm norm = norm_of(norm_weight, norm_eps, lanes, d);
  auto out = at::empty({BT, d}, stream.options());
  const float* S = sources.data_ptr<float>(); const float* Q = q.data_ptr<float>();
  const float* H = stream.data_ptr<float>(); float* O = out.data_ptr<float>();
  const float* stat = m > 0 ? stats.data_ptr<float>() : nullptr;
  const int64_t sk = sources.stride(0), st = sources.stride(1), hs = stream.stride(0);
  const int64_t ak = m > 0 ? stats.stride(0) : 0, at_ = m > 0 ? stats.stride(1) : 0;
  const float feps = static_cast<float>(eps), fd = static_cast<float>(d);
  const float* Y = add ? added.data_ptr<float>() : nullptr;
  const int64_t ys = add ? added.stride(0) : 0;
  at::parallel_for(0, BT, 16, [&](int64_t begin, int64_t end) {
    float c[kMaxSources];
    const float* keys[kMaxSources];
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < n; ++i) keys[i] = S + i * sk + t * st;
      if (add) {
        // The partial sum and the stream are different rows of one buffer.
        float* part = const_cast<float*>(keys[m]);
        float* h = const_cast<float*>(H) + t * hs;
        const float* y = Y + t * ys;
        if (init) {
          for (int64_t j = 0; j < d; ++j) { part[j] = y[j]; h[j] += y[j]; }
        } else {
          for (int64_t j = 0; j < d; ++j) { part[j] += y[j]; h[j] += y[j]; }
        }
      }
      for (int64_t i = 0; i < m; ++i) {
        const float s = stat[i * ak + t * at_];
        if (use_table) {
          c[i] = s;
        } else {
          float dot, square;
          dot_and_square(keys[i], Q, d, dot, square);
          c[i] = dot * s;
        }
      }
      if (has_partial) {
        float dot, square;
        dot_and_square(keys[m], Q, d, dot, square);
        c[m] = dot / std::sqrt(square / fd + feps);
      }
      coefficients(c, n, count);
      weighted_sum(O + t * d, H + t * hs, keys, c, n, d, count);
      if (norm.weight) normalize(O + t * d, d, norm);
    }
  });
  return out;
}

// A block's close on the source-major buffer: partial [BT, D] becomes a completed source. With `added` [BT, D]
// (the pending output, not empty), first its residual adds into the partial sum (written when `init`) and the
// stream, as buffer_mix makes them; in the same pass over each row, its 1 / rms into inv_rms [BT].
void close_source(const at::Tensor& partial, const at::Tensor& stream, const at::Tensor& added, bool init,
                  const at::Tensor& inv_rms, double eps) {
  check_float(partial, "partial"); check_float(stream, "stream"); check_float(inv_rms, "inv_rms");
  TORCH_CHECK(partial.dim() == 2 && stream.sizes() == partial.sizes() && inv_rms.numel() == partial.size(0)
              && inv_rms.is_contiguous(), "close_source: bad shapes");
  const bool add = added.numel() > 0;
  if (add) {
    check_float(added, "added");
    TORCH_CHECK(added.sizes() == partial.sizes(), "close_source: the added output must be [BT, D]");
  }
  const int64_t BT = partial.size(0), d = partial.size(1);
  float* P = partial.data_ptr<float>(); float* H = stream.data_ptr<float>(); float* R = inv_rms.data_ptr<float>();
  const float* Y = add ? added.data_ptr<float>() : nullptr;
  const int64_t ps = partial.stride(0), hs = stream.stride(0), ys = add ? added.stride(0) : 0;
  const float feps = static_cast<float>(eps), fd = static_cast<float>(d);
  at::parallel_for(0, BT, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* part = P + t * ps;
      if (add) {
        float* h = H + t * hs;
        const float* y = Y + t * ys;
        if (init) {
          for (int64_t j = 0; j < d; ++j) { part[j] = y[j]; h[j] += y[j]; }
        } else {
          for (int64_t j = 0; j < d; ++j) { part[j] += y[j]; h[j] += y[j]; }
        }
      }
      float square = 0.f;
#pragma omp simd reduction(+ : square)
      for (int64_t j = 0; j < d; ++j) square += part[j] * part[j];
      R[t] = 1.f / std::sqrt(square / fd + feps);
    }
  });
}

// The fused norm alone, on contiguous rows [..., D]: what `fused_norm` compares with the module.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t lanes) {
  check_float(x, "x");
  TORCH_CHECK(x.is_contiguous() && weight.numel() > 0, "rms_norm: contiguous rows and a weight needed");
  const int64_t d = x.size(-1), rows = x.numel() / d;
  const Norm norm = norm_of(weight, eps, lanes, d);
  auto out = x.clone();
  float* O = out.data_ptr<float>();
  for (int64_t t = 0; t < rows; ++t) normalize(O + t * d, d, norm);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("step_mix", &step_mix);
  module.def("buffer_mix", &buffer_mix);
  module.def("rms_norm", &rms_norm);
  module.def("close_source", &close_source);
}
