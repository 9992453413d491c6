"""The depth mix of a training forward on CUDA from fla-core (flash-linear-attention's `fused_attnres`), where it
is installed: one Triton launch per reader forward and backward, maintained by that project.

fla-core computes the "mean" mix, sum_i alpha_i k_i, with the same scores as `mix_blocks` (the key norm's weight
folded into the query, 1 / rms(k) with the model's eps, float32 scores and softmax). The "count" mix is n times
it: the same function, equal to float32 rounding rather than bit for bit (at zero queries it is the stream to
within float32 rounding, where the built-in paths give the stream exactly). The sources it reads are float32, as
the other states keep them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..modeling.modeling_attnres import join, no_autocast

# Process-wide on purpose: fla-core is importable or not for the whole process; a failed import is not retried.
_FLA: list = []


def fla_attnres():
    """fla-core's `fused_attnres`, or the reason it cannot be imported (a string)."""
    if not _FLA:
        try:
            from fla.ops.attnres import fused_attnres
        except ImportError as error:
            _FLA.append(f"fla-core is not installed ({error}; pip install fla-core)")
        except Exception as error:  # noqa: BLE001 - a broken install: its reason, and the built-in path
            _FLA.append(f"fla-core cannot be imported ({type(error).__name__}: {error})")
        else:
            _FLA.append(fused_attnres)
    return _FLA[0]


def fla_refusal(embeddings: torch.Tensor) -> str | None:
    """None where fla-core can run this forward's depth mixes, else why not."""
    if embeddings.device.type != "cuda":
        return f"fla-core's kernels run on CUDA tensors, and these are on {embeddings.device.type}"
    found = fla_attnres()
    return found if isinstance(found, str) else None


class FlaState(NamedTuple):
    """The state of a training forward on fla-core: the embedding and the completed blocks as float32 tensors of
    their own (fla-core reads a list of sources), the partial sum and the stream as BlockState keeps them."""

    sources: tuple[torch.Tensor, ...]
    partial: torch.Tensor | None
    stream: torch.Tensor

    queries = None  # each reader passes its own query and key norm

    @classmethod
    def start(cls, embeddings: torch.Tensor, eps: float) -> FlaState:
        return cls((embeddings.float(),), None, embeddings)

    def close(self, eps: float, first: int = 0) -> FlaState:
        if self.partial is None:
            return self
        return FlaState(self.sources + (self.partial.float(),), None, self.stream)

    def fold(self, query: torch.Tensor, key_norm_weight: torch.Tensor | None):
        """(w, g): fla-core folds the key norm's weight into the query itself."""
        if key_norm_weight is None:  # folded already
            return query, torch.ones_like(query)
        return query, key_norm_weight

    def mix(self, q, eps: float, scaling: str, reader: int | None = None, norm: tuple = ()) -> torch.Tensor:
        query, key_norm_weight = q
        sources = self.sources if self.partial is None else self.sources + (self.partial.float(),)
        with no_autocast(self.stream):
            mixed = fla_attnres()(query.reshape(-1), sources, key_norm_weight.reshape(-1), rms_eps=eps)
        if scaling == "count":
            mixed = mixed * len(sources)
        return mixed.to(self.stream.dtype)

    def add(self, output: torch.Tensor) -> FlaState:
        partial, stream = join(self.partial, self.stream, output)
        return self._replace(partial=partial, stream=stream)

    def current_stream(self) -> torch.Tensor:
        return self.stream
