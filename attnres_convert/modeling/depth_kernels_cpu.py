"""C++ kernels for the depth mix on CPU, compiled on first use (ATTNRES_KERNEL=cpu; see depth_attention.py
for the math and the states they serve).

On CPU the eager reader is a chain of small operations, and both forwards pay for it in their own way:

* a decoding step pays per operation (5-7 us each inside the model): a reader's norm, scores, softmax and
  count-scaled mix are six of them. `step_mix` is one call.
* a prefill is bound by memory traffic: the eager mix is a chain of multiply-adds over whole sources, each
  reading and writing the running sum again. `buffer_mix` reads each source once per token, merges the
  reader's score table (phase 1) with the partial sum's score, and writes the mix once.

Both compute h = H + sum_i (n alpha_i - 1) k_i with n alpha_i - 1 = (n e_i - sum e) / sum e, exactly 0 when
all scores are equal: at zero queries h is the stream H bit for bit, as on the eager path. Inference only
(no backward): forwards with autograd run the eager path. float32 only: the buffers the eager path keeps
for a float32 model are what these read.

The source is compiled by torch.utils.cpp_extension on the first call in a process that selected it, once
per machine (cached under TORCH_EXTENSIONS_DIR, about 25 s on 2 cores); it needs a C++ compiler, ninja and
the Python headers. This file ships next to converted weights: it imports torch and the standard library only.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time

import torch

logger = logging.getLogger(__name__)

SOURCE = r"""
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

// out = H + sum_i c_i k_i (count scaling) or sum_i c_i k_i, one source after the other: each is read once, in
// order, while the output row stays in L1 (measured on 512 tokens: as fast as accumulating chunks of D in
// registers over all sources at 5 sources, 1.5x faster at the 61 of Full AttnRes, where that reads 61 rows at once).
inline void weighted_sum(float* __restrict out, const float* __restrict h, const float* const* keys, const float* c,
                         int64_t n, int64_t d, bool count) {
  const float* __restrict k = keys[0];
  const float c0 = c[0];
  if (count) {
    for (int64_t j = 0; j < d; ++j) out[j] = h[j] + c0 * k[j];
  } else {
    for (int64_t j = 0; j < d; ++j) out[j] = c0 * k[j];
  }
  for (int64_t i = 1; i < n; ++i) {
    const float* __restrict ki = keys[i];
    const float ci = c[i];
    for (int64_t j = 0; j < d; ++j) out[j] += ci * ki[j];
  }
}

inline void dot_and_square(const float* __restrict x, const float* __restrict q, int64_t d, float& dot, float& square) {
  float a = 0.f, b = 0.f;
#pragma omp simd reduction(+ : a, b)
  for (int64_t j = 0; j < d; ++j) { a += x[j] * q[j]; b += x[j] * x[j]; }
  dot = a;
  square = b;
}

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.stride(-1) == 1, name, " must have unit stride in its last dimension");
}

}  // namespace

// A few-token forward's reader: padded [B, T, >= n, D + 1] token-major sources, each row ending in the
// constant sqrt(D eps); q [D + 1] the folded query times sqrt(D) with a 0 for the constant; stream [B, T, D].
// With `added` [B, T, D] (the previous sublayer's output, not empty), first the residual adds of that
// output, as the eager path makes them: padded[:, :, slot] += added and stream += added.
at::Tensor step_mix(const at::Tensor& padded, int64_t n, const at::Tensor& q, const at::Tensor& stream, bool count,
                    const at::Tensor& added, int64_t slot) {
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
      weighted_sum(O + (b * T + t) * d, H + b * stream.stride(0) + t * stream.stride(1), keys, c, n, d, count);
    }
  }
  return out;
}

// A many-token forward's reader on the source-major buffer: sources [K, BT, D] (m completed, then the
// partial sum when has_partial); their scores from table [K, BT] (this reader's column of the score table,
// any strides) or, when table is empty, q . k * inv_rms [K, BT]; stream [BT, D].
// With `added` [BT, D] (the previous sublayer's output, not empty), first the residual adds of that output into
// the partial sum (sources[m], written instead when `init`: the first output of a block) and the stream, as the
// eager path makes them, in the same pass over each token's rows.
at::Tensor buffer_mix(const at::Tensor& sources, int64_t m, bool has_partial, const at::Tensor& q,
                      const at::Tensor& stream, double eps, bool count, const at::Tensor& table,
                      const at::Tensor& inv_rms, const at::Tensor& added, bool init) {
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
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("step_mix", &step_mix);
  module.def("buffer_mix", &buffer_mix);
}
"""

_BUILT: list = []  # the compiled module, or the build's exception, once per process
_LOCK = threading.Lock()

# The vector instructions of torch's own CPU capability (the one its kernels run with here), so a build cached
# in a folder shared between machines runs on each machine whose torch picks the same capability.
# -mtune=native only orders instructions. -fopenmp: the token loop runs on ATen's thread pool (the build links
# to the OpenMP runtime torch ships and has already loaded).
_VECTOR_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512vl", "-mavx512dq", "-mavx512bw", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


def _flags() -> list[str]:
    vector = _VECTOR_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])
    return ["-O3", "-fopenmp", *vector, "-mtune=native"]


def build():
    """The compiled kernels (built on the first call in this process, from torch's extension cache after the
    first build on this machine). Raises RuntimeError saying what is missing where the build fails."""
    with _LOCK:
        if not _BUILT:
            _BUILT.append(_build())
    if isinstance(_BUILT[0], Exception):
        raise _BUILT[0]
    return _BUILT[0]


def _build():
    from torch.utils.cpp_extension import load_inline

    flags = _flags()
    # The torch install is in the name too: a build is made against its headers, and two environments sharing one
    # cache would otherwise rebuild it in turn.
    digest = hashlib.sha1("\0".join([SOURCE, torch.__version__, torch.__file__, *flags]).encode()).hexdigest()[:12]
    logger.info("AttnRes: loading the C++ depth-mix kernels (compiled on their first use on a machine)")
    start = time.perf_counter()
    try:
        kernels = load_inline(
            f"attnres_depth_cpu_{digest}", cpp_sources=[SOURCE], extra_cflags=flags, extra_ldflags=["-fopenmp"]
        )
    except Exception as error:  # noqa: BLE001 - compiler missing, headers missing, ...: all mean the same to a user
        return RuntimeError(
            f"ATTNRES_KERNEL=cpu: building the C++ depth-mix kernels failed ({type(error).__name__}: "
            f"{str(error).strip()[-500:]}). They need a C++ compiler (g++ or clang++), ninja on the PATH and the "
            f"Python headers (python3-dev); install them, or unset ATTNRES_KERNEL to run the eager path."
        )
    seconds = time.perf_counter() - start
    if seconds > 5:
        logger.warning(
            "AttnRes: compiled the C++ depth-mix kernels in %.0f s, once for this machine (torch keeps the build in "
            "its extension cache, TORCH_EXTENSIONS_DIR)", seconds
        )
    return kernels


def buffer_mix(
    kernels,
    sources: torch.Tensor,
    m: int,
    has_partial: bool,
    q: torch.Tensor,
    stream: torch.Tensor,
    eps: float,
    count: bool,
    table: torch.Tensor | None = None,
    inv_rms: torch.Tensor | None = None,
    added: torch.Tensor | None = None,
    init: bool = False,
) -> torch.Tensor:
    """A many-token reader with the `build()` kernels: sources [K, B, T, D] source-major, stream [B, T, D];
    table [K, B, T] (this reader's scores of the completed sources) or inv_rms [K, B, T]; added [B, T, D], the
    previous output, which first joins the partial sum (slot m; `init`: becomes it) and the stream. Returns the
    mix [B, T, D]. (A few-token reader calls `kernels.step_mix(padded, n, q, stream, count, added, slot)`
    directly, with `NONE` for no added output.)"""
    d = sources.shape[-1]
    flat = kernels.buffer_mix(
        sources.reshape(sources.shape[0], -1, d), m, has_partial, q, stream.reshape(-1, d), eps, count,
        NONE if table is None else table.reshape(table.shape[0], -1),
        NONE if inv_rms is None else inv_rms.reshape(inv_rms.shape[0], -1),
        NONE if added is None else added.reshape(-1, d), init,
    )
    return flat.view(stream.shape)


NONE = torch.empty(0)  # an absent optional tensor argument
