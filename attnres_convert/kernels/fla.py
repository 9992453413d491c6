"""The depth mix of a training forward on CUDA from fla-core's fused AttnRes kernels (`fla.ops.attnres.fused_attnres`,
Triton forward and backward, MIT; pip install 'attnres[cuda]'), behind the same calls as modeling_attnres.BlockState.

fla computes, per token, o = sum_i p_i v_i with p = softmax_i(scale * ((q * w) . v_i) * rsqrt(mean(v_i^2) + eps)) in
float32, output in the sources' dtype. With q the reader's pseudo-query w, w its key norm's weight g, scale 1 and the
sources the embedding, the completed blocks and the partial sum, that is our "mean" mix (`mix_blocks`);
our "count" mix is n times it. Equal up to float32 rounding, not bit for bit: BlockState computes the count mix as
the stream plus a correction, so that at zero queries it is the base model's own stream exactly; here it is n times a
float32 mean, rounded once to the model dtype.

fla folds q * w itself (and returns both gradients), so `fold` hands on the pair (w, g) unmultiplied. Recording the
depth weights runs BlockState instead (kernels/controls.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..modeling.modeling_attnres import join, no_autocast

# Process-wide on purpose, as kernels._KERNELS: importing fla gives the same answer for every model in the
# process, and a failed import is not retried at every forward. Holds the function, or the text of the failure.
_FLA: list = []


def fla_mix_function():
    """fla's `fused_attnres`, or None where fla-core cannot be imported (see `fla_import_error` for why)."""
    if not _FLA:
        try:
            from fla.ops.attnres import fused_attnres
        except ImportError as error:  # fla-core (or einops, or triton) not installed
            _FLA.append(f"fla-core is not installed ({error}); pip install 'attnres[cuda]'")
        except Exception as error:  # noqa: BLE001 - installed but broken (a triton it does not support...)
            _FLA.append(f"fla-core failed to import: {type(error).__name__}: {error}")
        else:
            _FLA.append(fused_attnres)
    found = _FLA[0]
    return None if isinstance(found, str) else found


def fla_import_error() -> str | None:
    """Why `fla_mix_function` returned None, or None where it did not."""
    fla_mix_function()
    return _FLA[0] if isinstance(_FLA[0], str) else None


def fla_fits(embeddings: torch.Tensor, query_rank: int = 0) -> str | None:
    """None where a FlaState can run this forward, else the reason it cannot.

    - CUDA tensors only: fla refuses any other device itself (also under TRITON_INTERPRET=1, which the tests get
      round by patching that one check, see tests/test_fla.py).
    - static queries only: input-dependent queries (query_rank > 0) score one query per token, which fla does not.
    - not under torch.compile: fla's entry point is excluded from compiled graphs (a graph break per reader), while
      the plain-tensor BlockState compiles.
    - fla-core importable.
    Any model dtype fits: the sources are float32 (as in BlockState), the mix is returned in the model dtype."""
    if query_rank > 0:
        return "input-dependent queries (query_rank > 0): fla scores one static query per reader"
    if embeddings.device.type != "cuda":
        return f"fla's kernels need CUDA tensors (these are on {embeddings.device.type})"
    if torch.compiler.is_compiling():
        return "under torch.compile, which fuses the plain-tensor depth mix itself"
    if fla_mix_function() is None:
        return fla_import_error()
    return None


def _source(x: torch.Tensor) -> torch.Tensor:
    """A source as fla reads it: float32, contiguous, 16-byte aligned (fla asserts it; a view into a larger
    tensor may start anywhere)."""
    x = x.float().contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


class FlaState(NamedTuple):
    """The state of a training forward whose depth mixes run on fla's kernels (autograd through fla's own
    backward, to the queries, the key norms, the sources and so to the sublayers).

    sources: the embedding and every completed block, each [B, T, D] float32 contiguous (converted once, when the
             block completes, as BlockState's blocks). A tuple, grown by one per block; nothing is stacked.
    partial: [B, T, D] running sum of the current block's outputs (model dtype), or None after a block boundary.
    stream:  [B, T, D] the plain residual stream (model dtype), as BlockState's.

    An immutable value threaded through the layers, as BlockState (gradient checkpointing replays see the forward's
    state)."""

    sources: tuple[torch.Tensor, ...]
    partial: torch.Tensor | None
    stream: torch.Tensor

    queries = None  # each reader folds its own query (fla folds it with the key norm's weight itself)

    @classmethod
    def start(cls, embeddings: torch.Tensor, eps: float) -> FlaState:
        """The embedding b_0 is always its own source."""
        return cls((_source(embeddings),), None, embeddings)

    def close(self, eps: float, first: int = 0) -> FlaState:
        """At a block boundary the partial sum becomes a completed block."""
        if self.partial is None:
            return self
        return FlaState(self.sources + (_source(self.partial),), None, self.stream)

    def fold(self, query: torch.Tensor, key_norm_weight: torch.Tensor | None) -> tuple:
        """The pair (w, g), unmultiplied: fla multiplies them in its kernel and returns both gradients. With
        key_norm_weight None the query is the folded `pseudo_query` already (g = 1)."""
        return query, key_norm_weight

    def mix(self, q: tuple, eps: float, scaling: str, reader: int | None = None, norm: tuple = ()) -> torch.Tensor:
        """The reader's mix in the stream's shape and dtype. `reader` and `norm` are for other states (score tables,
        the C++ kernels' fused norm) and unused here: the result is always the mix itself."""
        query, key_norm_weight = q
        d = self.stream.shape[-1]
        query = query.reshape(d)
        if key_norm_weight is None:
            key_norm_weight = torch.ones(d, dtype=torch.float32, device=query.device)
        sources = self.sources if self.partial is None else self.sources + (_source(self.partial),)
        fused_attnres = fla_mix_function()
        if fused_attnres is None:
            raise RuntimeError(f"FlaState needs fla-core: {fla_import_error()}")
        with no_autocast(self.stream):  # statistics in float32 whatever the model dtype
            mixed = fused_attnres(query, sources, key_norm_weight, rms_eps=eps, scale=1.0)
        if scaling == "count":
            mixed = mixed * len(sources)
        return mixed.to(self.stream.dtype)

    def add(self, output: torch.Tensor) -> FlaState:
        partial, stream = join(self.partial, self.stream, output)
        return self._replace(partial=partial, stream=stream)

    def current_stream(self) -> torch.Tensor:
        return self.stream
