"""The Triton backend of the depth mix: the launchers of depth_triton_kernels.py's programs, and the inference buffer
that runs on them (the training state, depth_training.py, calls the same launchers).

One reader of the eager path is a chain of small operations (norm, scores, softmax, the count-scaled mix, then the
partial-sum and stream updates after its sublayer): on a GPU each is a kernel launch, and a decoding step is bound
by launches. Here a reader is one launch (`mix`), which first applies the previous sublayer's output; a block
boundary is one (`close`); a reader's backward is one (`mix_backward`).

This file ships next to converted weights and is imported only when `triton` is importable and selected
(ATTNRES_KERNEL, see depth_backends.kernels_for).
"""

from __future__ import annotations

import torch
import triton

from .depth_eager import SourceBuffer
from .depth_triton_kernels import close_kernel, mix_backward_kernel, mix_kernel


class TritonBuffer(SourceBuffer):
    """The buffer of a forward without autograd on the Triton kernels: source-major for any number of tokens,
    [K, BT, D] (inv_rms [K, BT], scores [K, BT, R]). An output joins the partial sum and the stream inside the
    next kernel, which writes the new stream out of place (`previous` + output into `stream`); until then it is
    kept as `added` (`current_stream` applies it for anyone who reads the stream before).

    kernels: the backend's `Kernels` (depth_backends.py), as TrainState holds them."""

    __slots__ = ("kernels", "added", "added_first", "previous")

    @classmethod
    def start(cls, embeddings: torch.Tensor, eps: float, capacity: int, queries, recorder, kernels) -> TritonBuffer:
        """The embedding closed into slot 0 (with its scores, phase 1) by the close kernel."""
        tokens, d = embeddings.shape[:-1].numel(), embeddings.shape[-1]
        sources = embeddings.new_empty(capacity, tokens, d, dtype=torch.float32)
        inv_rms = sources.new_empty(capacity, tokens)
        scores = None if queries is None else sources.new_empty(capacity, tokens, queries.shape[0])
        close(embeddings, sources[0], inv_rms[0], eps, queries=queries, table=None if scores is None else scores[0])
        state = cls(sources, inv_rms, 1, False, embeddings, queries, scores, recorder=recorder)
        state.kernels, state.added, state.added_first, state.previous = kernels, None, False, None
        return state

    def take(self):
        """(output, first, previous stream) of the output not yet applied, which the caller applies; or None."""
        if self.added is None:
            return None
        taken, self.added = (self.added, self.added_first, self.previous), None
        return taken

    def close(self, eps: float, first: int = 0) -> TritonBuffer:
        if not self.has_partial:
            return self
        slot, taken = self.sources[self.count], self.take()
        close(
            slot, slot, self.inv_rms[self.count], eps,
            new=None if taken is None else taken[0], init_partial=taken is not None and taken[1],
            stream=None if taken is None else taken[2], stream_out=self.stream,
            queries=self.queries, table=None if self.scores is None else self.scores[self.count],
        )
        self.count, self.has_partial = self.count + 1, False
        return self

    def mix(self, q: torch.Tensor, eps: float, scaling: str, reader: int | None = None, norm: tuple = ()) -> torch.Tensor:
        """One launch, which first applies the kept output."""
        m, taken = self.count, self.take()
        table = self.scores[:m, :, reader] if self.scores is not None and reader is not None else None
        mixed, weights, _, _ = mix(
            self.sources, m, q, self.stream if taken is None else taken[2], eps, scaling == "count",
            inv_rms=self.inv_rms if table is None else None, table=table,
            partial=self.sources[m] if self.has_partial else None,
            new=None if taken is None else taken[0], init_partial=taken is not None and taken[1],
            stream_out=None if taken is None else self.stream, save=self.recorder is not None,
        )
        if self.recorder is not None:
            self.recorder.add(weights.t().reshape(-1, *self.stream.shape[:-1]))
        return mixed

    def add(self, output: torch.Tensor) -> TritonBuffer:
        if self.added is not None:
            self.apply_added()  # not taken by a kernel (a caller read no mix in between): applied here
        dtype = torch.promote_types(self.stream.dtype, output.dtype)
        stream = torch.empty(self.stream.shape, dtype=dtype, device=self.stream.device)
        self.added, self.added_first, self.previous = output, not self.has_partial, self.stream
        self.stream, self.has_partial = stream, True
        return self

    def apply_added(self) -> None:
        """The kept output's adds, in operations of their own: into the partial sum (or as it) and the stream."""
        taken = self.take()
        if taken is not None:
            new, first, previous = taken
            slot = self.sources[self.count]
            flat = new.reshape(slot.shape)
            slot.copy_(flat) if first else slot.add_(flat)
            torch.add(previous, new, out=self.stream)

    def current_stream(self) -> torch.Tensor:
        self.apply_added()
        return self.stream


def _launch(d: int) -> dict:
    block = triton.next_power_of_2(d)
    return {"BLOCK_D": block, "num_warps": min(16, max(4, block // 256))}


def _rows(x: torch.Tensor | None, d: int) -> torch.Tensor | None:
    """A tensor [..., D] as [BT, D] rows (a view where the layout allows it)."""
    return None if x is None else x.reshape(-1, d)


def mix(
    keys: torch.Tensor,
    m: int,
    q: torch.Tensor,
    stream: torch.Tensor,
    eps: float,
    count: bool,
    *,
    inv_rms: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
    partial: torch.Tensor | None = None,
    new: torch.Tensor | None = None,
    init_partial: bool = False,
    stream_out: torch.Tensor | None = None,
    save: bool = False,
):
    """One reader's depth mix. keys: completed sources as [>= m, BT, D] (last stride 1, any other
    strides); inv_rms [>= m, BT] (without a table) or table [>= m, BT] (this reader's scores); partial:
    [..., D], written in place when `new` is given (then init_partial says whether it starts at `new`);
    stream [..., D]; stream_out: where stream + new goes. Returns (mix, weights, scores, partial 1/rms),
    the last three [BT, n], [BT, n], [BT] when `save`, else None."""
    d = stream.shape[-1]
    tokens = stream.numel() // d
    flat_stream, flat_part, flat_new = _rows(stream, d), _rows(partial, d), _rows(new, d)
    out = torch.empty_like(stream)
    n = m + int(partial is not None)
    f32 = dict(device=stream.device, dtype=torch.float32)
    weights = torch.empty(tokens, n, **f32) if save else None
    logits = torch.empty(tokens, n, **f32) if save else None
    inv_partial = torch.empty(tokens, **f32) if save and partial is not None else None
    flat_out = _rows(stream_out, d) if stream_out is not None else flat_stream
    mix_kernel[(tokens,)](
        keys, keys.stride(0), keys.stride(1),
        inv_rms if inv_rms is not None else q, *(inv_rms.stride() if inv_rms is not None else (0, 0)),
        table if table is not None else q, *(table.stride() if table is not None else (0, 0)),
        flat_part if partial is not None else q, flat_part.stride(0) if partial is not None else 0,
        flat_new if new is not None else q, flat_new.stride(0) if new is not None else 0,
        flat_stream, flat_stream.stride(0),
        flat_out, flat_out.stride(0),
        q,
        out, d,
        weights if save else q, logits if save else q, inv_partial if inv_partial is not None else q,
        m, d, eps,
        HAS_PART=partial is not None, HAS_NEW=new is not None, INIT_PART=init_partial,
        USE_TABLE=table is not None, COUNT=count, SAVE=save,
        BLOCK_N=max(2, triton.next_power_of_2(n)), **_launch(d),
    )
    return out, weights, logits, inv_partial


def close(
    source: torch.Tensor,
    dst: torch.Tensor,
    inv_out: torch.Tensor,
    eps: float,
    *,
    new: torch.Tensor | None = None,
    init_partial: bool = False,
    stream: torch.Tensor | None = None,
    stream_out: torch.Tensor | None = None,
    queries: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
) -> None:
    """A source completes: dst [BT, D] float32 = source (+ new, which also moves stream to stream_out),
    inv_out [BT] its 1 / rms, and with queries [R, D] its scores into table [BT, R] (unit column stride)."""
    d = dst.shape[-1]
    tokens = dst.shape[0]
    flat_source, flat_new = _rows(source, d), _rows(new, d)
    has_new = new is not None
    flat_stream = _rows(stream, d) if has_new else None
    flat_out = _rows(stream_out, d) if has_new else None
    has_table = queries is not None
    rows = queries.shape[0] if has_table else 1
    block_r = triton.next_power_of_2(rows)
    # The D chunk keeps the [R, chunk] tile of queries small.
    block_d = min(triton.next_power_of_2(d), max(16, 8192 // block_r))
    close_kernel[(tokens,)](
        flat_source, flat_source.stride(0),
        flat_new if has_new else dst, flat_new.stride(0) if has_new else 0,
        flat_stream if has_new else dst, flat_stream.stride(0) if has_new else 0,
        flat_out if has_new else dst, flat_out.stride(0) if has_new else 0,
        dst, dst.stride(0),
        inv_out, inv_out.stride(0),
        queries.contiguous() if has_table else dst, rows,
        table if has_table else dst, table.stride(0) if has_table else 0,
        d, eps,
        HAS_NEW=has_new, INIT_PART=init_partial, HAS_TABLE=has_table, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4,
    )


def mix_backward(
    grad: torch.Tensor,
    keys: torch.Tensor,
    m: int,
    q: torch.Tensor,
    weights: torch.Tensor,
    logits: torch.Tensor,
    count: bool,
    block_grad: torch.Tensor,
    *,
    inv_rms: torch.Tensor | None = None,
    rms_grad: torch.Tensor | None = None,
    score_grad: torch.Tensor | None = None,
    partial: torch.Tensor | None = None,
    inv_partial: torch.Tensor | None = None,
):
    """The backward of `mix` on a training cache: adds to block_grad [>= m, BT, D] and to score_grad
    [>= m, BT] (with a table) or rms_grad [>= m, BT] (without), in place. Returns (d partial, d q)."""
    d = keys.shape[-1]
    tokens = keys.shape[1]
    flat_grad, flat_part = _rows(grad, d), _rows(partial, d)
    dpartial = torch.empty_like(partial) if partial is not None else None
    flat_dpart = _rows(dpartial, d) if partial is not None else None
    dq = torch.empty(tokens, d, device=keys.device, dtype=torch.float32)
    n = weights.shape[-1]
    use_table = score_grad is not None
    mix_backward_kernel[(tokens,)](
        flat_grad, flat_grad.stride(0),
        keys, keys.stride(0), keys.stride(1),
        inv_rms if not use_table else q, *(inv_rms.stride() if not use_table else (0, 0)),
        flat_part if partial is not None else q, flat_part.stride(0) if partial is not None else 0,
        q, weights, logits, inv_partial if inv_partial is not None else q,
        block_grad, block_grad.stride(0), block_grad.stride(1),
        rms_grad if not use_table else q, *(rms_grad.stride() if not use_table else (0, 0)),
        score_grad if use_table else q, *(score_grad.stride() if use_table else (0, 0)),
        flat_dpart if partial is not None else q, flat_dpart.stride(0) if partial is not None else 0,
        dq, d,
        m, d,
        HAS_PART=partial is not None, USE_TABLE=use_table, COUNT=count,
        BLOCK_N=max(2, triton.next_power_of_2(n)), **_launch(d),
    )
    return dpartial, dq.sum(0)
