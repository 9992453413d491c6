"""The inference buffers on the C++ kernels (float32 on CPU, where they are built or ATTNRES_KERNEL=cpu; the kernels
are cpu.py's). The buffers are the eager path's (modeling_attnres.py's SourceBuffer and step.py's); what changes is
who makes the residual adds: a sublayer's output is kept as the buffer's `added` output, and the next kernel (the
next reader's mix, or the block's close) adds it to the partial sum and the stream in the same pass over each row
that reads them. `current_stream` makes the adds for anyone who reads the stream before (output_hidden_states, a depth
gate).
"""

from __future__ import annotations

import torch

from ..modeling.modeling_attnres import SourceBuffer
from .cpu import NO_NORM, NONE, buffer_mix, fused_norm
from .step import StepBuffer


class _Added:
    """What the C++ buffers add to SourceBuffer's fields: the kernels, and the output not yet added."""

    __slots__ = ()

    def take(self):
        """(output, slot, first) of the output not yet added, which the caller adds; or None."""
        if self.added is None:
            return None
        taken, self.added = (self.added, self.added_slot, self.added_first), None
        return taken

    def add(self, output: torch.Tensor):
        """Keeps the output for the next kernel to add (float32: under autocast the eager add upcasts it the same)."""
        if self.added is not None:
            self.apply_added()  # not taken by a kernel (nothing read the mix in between): added here
        output = output if output.dtype == torch.float32 else output.float()
        # The kernels read rows of contiguous floats; a sublayer may return a strided view (Inkling's attention).
        self.added = output if output.stride(-1) == 1 else output.contiguous()
        self.added_slot, self.added_first = self.count, self.first_output()
        self.has_partial = True
        return self

    def apply_added(self) -> None:
        """The residual adds of the kept output, in place: into its partial sum (or as it) and into the stream."""
        taken = self.take()
        if taken is not None:
            new, slot, first = taken
            partial = self.slot(slot)
            new = new.reshape(partial.shape)
            partial.copy_(new) if first else partial.add_(new)
            self.stream.add_(new)

    def fuse_norm(self, norm: torch.nn.Module) -> tuple:
        """A reader's norm for the kernel to apply to its mix in the same pass (`fused_norm`), or ()."""
        return fused_norm(self.native, norm)

    def current_stream(self) -> torch.Tensor:
        self.apply_added()
        return self.stream.clone()  # the buffer's slot, updated in place by later outputs


class CpuBuffer(_Added, SourceBuffer):
    """A many-token forward on the C++ kernels (source-major, as SourceBuffer). A block's first output is written
    into its slot by the kernel that adds it (the slots are not zeroed)."""

    __slots__ = ("native", "added", "added_slot", "added_first")
    zeroed = False

    @classmethod
    def start(cls, embeddings: torch.Tensor, eps: float, capacity: int, queries=None, native=None) -> CpuBuffer:
        state = super().start(embeddings, eps, capacity, queries)
        state.native, state.added = native, None
        return state

    def first_output(self) -> bool:
        return not self.has_partial

    def close(self, eps: float, first: int = 0) -> CpuBuffer:
        """The kept output's adds and the new source's 1 / rms, in one pass."""
        if not self.has_partial:
            return self
        count, taken = self.count, self.take()
        d = self.sources.shape[-1]
        self.native.close_source(
            self.sources[count].view(-1, d),
            self.stream.view(-1, d),
            NONE if taken is None else taken[0].reshape(-1, d),
            taken is not None and taken[2],
            self.inv_rms[count].view(-1),
            eps,
        )
        if self.scores is not None:
            self.score_source(count, first)
        self.count, self.has_partial = count + 1, False
        return self

    def mix(
        self, q: torch.Tensor, eps: float, scaling: str, reader: int | None = None, norm: tuple = ()
    ) -> torch.Tensor:
        """One kernel call, which first adds the kept output; with `norm` (a `fused_norm`), the sublayer's norm of
        the mix."""
        table = self.scores[..., reader] if self.scores is not None and reader is not None else None
        taken = self.take()
        return buffer_mix(
            self.native,
            self.sources,
            self.count,
            self.has_partial,
            q,
            self.stream,
            eps,
            scaling == "count",
            table=table,
            inv_rms=self.inv_rms if table is None else None,
            added=None if taken is None else taken[0],
            init=taken is not None and taken[2],
            norm=norm,
        )


class CpuStepBuffer(_Added, StepBuffer):
    """A few-token forward on the C++ kernels (token-major, as StepBuffer): a reader is one call, which also makes
    the residual adds of the output before it, and the sublayer's norm where it is fused."""

    __slots__ = ("native", "added", "added_slot", "added_first")

    @classmethod
    def start(cls, embeddings, eps: float, capacity: int, queries=None, native=None, runtime=None) -> CpuStepBuffer:
        state = super().start(embeddings, eps, capacity, queries, runtime)
        state.native, state.added = native, None
        return state

    def first_output(self) -> bool:
        return False  # a decoding step's buffer starts at zero

    def mix(
        self, q: torch.Tensor, eps: float, scaling: str, reader: int | None = None, norm: tuple = ()
    ) -> torch.Tensor:
        n, taken = self.count + int(self.has_partial), self.take()
        added, slot = (NONE, 0) if taken is None else taken[:2]
        return self.native.step_mix(
            self.step.padded[n], n, q, self.stream, scaling == "count", added, slot, *(norm or NO_NORM)
        )
