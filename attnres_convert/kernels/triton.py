"""The Triton backend of the depth mix: the launchers of triton_kernels.py's programs, and the inference buffer
that runs on them (the training state, training.py, calls the same launchers).

One reader of the eager path is a chain of small operations (norm, scores, softmax, the count-scaled mix, then the
partial-sum and stream updates after its sublayer): on a GPU each is a kernel launch, and a decoding step is bound
by launches. Here a reader is one launch (`mix`), which first applies the previous sublayer's output; a block
boundary is one (`close`); a reader's backward is one (`mix_backward`).
"""

from __future__ import annotations

import torch

from ..modeling.modeling_attnres import SourceBuffer
from .triton_check import PROBE_TOKENS, compare, run_both, trusted
from .triton_kernels import close_kernel, mix_backward_kernel, mix_kernel
from .triton_reference import close as reference_close
from .triton_reference import mix as reference_mix
from .triton_reference import mix_backward as reference_mix_backward


class TritonBuffer(SourceBuffer):
    """The buffer of a forward without autograd on the Triton kernels: source-major for any number of tokens,
    [K, BT, D] (inv_rms [K, BT], scores [K, BT, R]). An output joins the partial sum and the stream inside the
    next kernel, which writes the new stream out of place (`previous` + output into `stream`); until then it is
    kept as `added` (`current_stream` applies it for anyone who reads the stream before).

    kernels: the backend's `Kernels` (depth_backends.py), as TrainState holds them."""

    __slots__ = ("kernels", "added", "added_first", "previous")

    @classmethod
    def start(cls, embeddings: torch.Tensor, eps: float, capacity: int, queries, kernels) -> TritonBuffer:
        """The embedding closed into slot 0 (with its scores, phase 1) by the close kernel."""
        tokens, d = embeddings.shape[:-1].numel(), embeddings.shape[-1]
        sources = embeddings.new_empty(capacity, tokens, d, dtype=torch.float32)
        inv_rms = sources.new_empty(capacity, tokens)
        scores = None if queries is None else sources.new_empty(capacity, tokens, queries.shape[0])
        close(embeddings, sources[0], inv_rms[0], eps, queries=queries, table=None if scores is None else scores[0])
        state = cls(sources, inv_rms, 1, False, embeddings, queries, scores)
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
            slot,
            slot,
            self.inv_rms[self.count],
            eps,
            new=None if taken is None else taken[0],
            init_partial=taken is not None and taken[1],
            stream=None if taken is None else taken[2],
            stream_out=self.stream,
            queries=self.queries,
            table=None if self.scores is None else self.scores[self.count],
        )
        self.count, self.has_partial = self.count + 1, False
        return self

    def mix(
        self, q: torch.Tensor, eps: float, scaling: str, reader: int | None = None, norm: tuple = ()
    ) -> torch.Tensor:
        """One launch, which first applies the kept output."""
        m, taken = self.count, self.take()
        table = self.scores[:m, :, reader] if self.scores is not None and reader is not None else None
        mixed, weights, _, _ = mix(
            self.sources,
            m,
            q,
            self.stream if taken is None else taken[2],
            eps,
            scaling == "count",
            inv_rms=self.inv_rms if table is None else None,
            table=table,
            partial=self.sources[m] if self.has_partial else None,
            new=None if taken is None else taken[0],
            init_partial=taken is not None and taken[1],
            stream_out=None if taken is None else self.stream,
            save=False,
        )
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


# One program per token holds the scores over at most MAX_SOURCES sources and walks its row of D values in chunks of
# BLOCK_D (any D). More sources, or more sublayer queries than MAX_QUERIES for the score table, run the reference
# (triton_reference.py) with a warning, as a variant that fails its self-check does.
MAX_SOURCES = 256  # Full AttnRes of a 127-layer model: 254 sublayers and the embedding
MAX_QUERIES = 256
# The kernels' floating-point policy, stated at every launch: no multiply and add contracted into an FMA, so each
# operation rounds as written, as the reference's (and the interpreter's, which never contracts) do.
FP_POLICY = {"enable_fp_fusion": False}


class Unsupported(ValueError):
    """Inputs beyond what one program holds (MAX_SOURCES, MAX_QUERIES)."""


def _tier(size: int, limit: int, what: str, tiers: tuple[int, ...]) -> int:
    if size > limit:  # the message is part of the variant's key: one warning for all sizes over the limit
        raise Unsupported(f"more {what} than the kernels' limit of {limit}")
    return next(tier for tier in tiers if size <= tier)


def row_config(d: int, n: int) -> dict:
    """The block sizes and warps of `mix` and `mix_backward` for rows of d values and n sources: one program whatever
    the size, so that what a launch can choose is compiled ahead of time by tests/test_kernels_aot.py."""
    return {"BLOCK_N": _tier(n, MAX_SOURCES, "sources", (MAX_SOURCES,)), "BLOCK_D": 1024, "num_warps": 4}


def close_config(d: int, r: int) -> dict:
    """The block sizes of `close` for rows of d values and r queries: D in chunks that keep the [R, chunk] tile of
    queries at 8192 values."""
    block_r = _tier(r, MAX_QUERIES, "sublayer queries", (16, MAX_QUERIES))
    return {"BLOCK_R": block_r, "BLOCK_D": 8192 // block_r, "num_warps": 4}


def _rows(x: torch.Tensor | None, d: int) -> torch.Tensor | None:
    """A tensor [..., D] as [BT, D] rows (a view where the layout allows it)."""
    return None if x is None else x.reshape(-1, d)


def launch_mix(
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
    """`mix` on the kernel, unchecked. An absent tensor is stood in for by one of the same dtype (the stream for the
    output and stream_out, q for the float32 ones), so the flags never change the compiled program."""
    d = stream.shape[-1]
    tokens = stream.numel() // d
    flat_stream, flat_part, flat_new = _rows(stream, d), _rows(partial, d), _rows(new, d)
    out = torch.empty_like(stream)
    n = m + int(partial is not None)
    config = row_config(d, n)
    f32 = dict(device=stream.device, dtype=torch.float32)
    weights = torch.empty(tokens, n, **f32) if save else None
    logits = torch.empty(tokens, n, **f32) if save else None
    inv_partial = torch.empty(tokens, **f32) if save and partial is not None else None
    flat_out = _rows(stream_out, d) if new is not None else flat_stream
    mix_kernel[(tokens,)](
        keys,
        keys.stride(0),
        keys.stride(1),
        inv_rms if inv_rms is not None else q,
        *(inv_rms.stride() if inv_rms is not None else (0, 0)),
        table if table is not None else q,
        *(table.stride() if table is not None else (0, 0)),
        flat_part if partial is not None else q,
        flat_part.stride(0) if partial is not None else 0,
        flat_new if new is not None else flat_stream,
        flat_new.stride(0) if new is not None else 0,
        flat_stream,
        flat_stream.stride(0),
        flat_out,
        flat_out.stride(0),
        q,
        out,
        d,
        weights if save else q,
        logits if save else q,
        inv_partial if inv_partial is not None else q,
        m,
        d,
        eps,
        partial is not None,
        new is not None,
        init_partial and new is not None,
        table is not None,
        count,
        save,
        **config,
        **FP_POLICY,
    )
    return out, weights, logits, inv_partial


def launch_close(
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
    """`close` on the kernel, unchecked. Absent tensors are stood in for by ones of the same dtype (the source for
    the output and the streams, dst for the float32 ones)."""
    d = dst.shape[-1]
    tokens = dst.shape[0]
    flat_source, flat_new = _rows(source, d), _rows(new, d)
    has_new = new is not None
    flat_stream = _rows(stream, d) if has_new else flat_source
    flat_out = _rows(stream_out, d) if has_new else flat_source
    has_table = queries is not None
    rows = queries.shape[0] if has_table else 1
    close_kernel[(tokens,)](
        flat_source,
        flat_source.stride(0),
        flat_new if has_new else flat_source,
        flat_new.stride(0) if has_new else 0,
        flat_stream,
        flat_stream.stride(0) if has_new else 0,
        flat_out,
        flat_out.stride(0) if has_new else 0,
        dst,
        dst.stride(0),
        inv_out,
        inv_out.stride(0),
        queries.contiguous() if has_table else dst,
        rows,
        table if has_table else dst,
        table.stride(0) if has_table else 0,
        d,
        eps,
        has_new,
        init_partial and has_new,
        has_table,
        **close_config(d, rows),
        **FP_POLICY,
    )


def launch_mix_backward(
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
    """`mix_backward` on the kernel, unchecked. Absent tensors are stood in for by ones of the same dtype (the
    gradient for the partial sum's, q for the float32 ones)."""
    d = keys.shape[-1]
    tokens = keys.shape[1]
    flat_grad, flat_part = _rows(grad, d), _rows(partial, d)
    dpartial = torch.empty_like(partial) if partial is not None else None
    flat_dpart = _rows(dpartial, d) if partial is not None else None
    dq = torch.empty(tokens, d, device=keys.device, dtype=torch.float32)
    n = weights.shape[-1]
    use_table = score_grad is not None
    mix_backward_kernel[(tokens,)](
        flat_grad,
        flat_grad.stride(0),
        keys,
        keys.stride(0),
        keys.stride(1),
        inv_rms if not use_table else q,
        *(inv_rms.stride() if not use_table else (0, 0)),
        flat_part if partial is not None else flat_grad,
        flat_part.stride(0) if partial is not None else 0,
        q,
        weights,
        logits,
        inv_partial if inv_partial is not None else q,
        block_grad,
        block_grad.stride(0),
        block_grad.stride(1),
        rms_grad if not use_table else q,
        *(rms_grad.stride() if not use_table else (0, 0)),
        score_grad if use_table else q,
        *(score_grad.stride() if use_table else (0, 0)),
        flat_dpart if partial is not None else flat_grad,
        flat_dpart.stride(0) if partial is not None else 0,
        dq,
        d,
        m,
        d,
        partial is not None,
        use_table,
        count,
        **row_config(d, n),
        **FP_POLICY,
    )
    return dpartial, dq.sum(0)


def _variant(kernel: str, device: torch.device, config, flags: dict, *tensors) -> tuple:
    """What makes a launch a variant of its own: the kernel, its compiled program (block sizes, or why there is
    none), the flags it sets, its tensors' dtypes and the device."""
    dtypes = tuple(None if x is None else x.dtype for x in tensors)
    return (kernel, config, tuple(name for name, on in flags.items() if on), dtypes, str(device))


def _config_or_reason(choose, *sizes):
    try:
        return tuple(sorted(choose(*sizes).items()))
    except Unsupported as error:
        return str(error)


def _random(device: torch.device, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def make(*shape, dtype=torch.float32, scale: float = 1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)

    return make


def _unsupported(config):
    def launch(**kwargs):
        raise Unsupported(config)

    return launch


def mix(
    keys,
    m,
    q,
    stream,
    eps,
    count,
    *,
    inv_rms=None,
    table=None,
    partial=None,
    new=None,
    init_partial=False,
    stream_out=None,
    save=False,
):
    """One reader's depth mix. keys: completed sources as [>= m, BT, D] (last stride 1, any other strides);
    inv_rms [>= m, BT] (without a table) or table [>= m, BT] (this reader's scores); partial: [..., D], written in
    place when `new` is given (then init_partial says whether it starts at `new`); stream [..., D]; stream_out:
    where stream + new goes. Returns (mix, weights, scores, partial 1/rms), the last three [BT, n], [BT, n], [BT]
    when `save`, else None. The kernel once its variant passed the self-check, else the reference."""
    d = stream.shape[-1]
    has_part, has_new, use_table = partial is not None, new is not None, table is not None
    init = init_partial and has_new
    config = _config_or_reason(row_config, d, m + int(has_part))
    flags = dict(has_part=has_part, has_new=has_new, init_part=init, use_table=use_table, count=count, save=save)
    key = _variant("mix_kernel", stream.device, config, flags, stream, partial, new, stream_out, keys)

    def probe():
        make, tokens = _random(stream.device), PROBE_TOKENS
        keys_ = make(m, tokens, d, dtype=keys.dtype)
        inputs = dict(
            keys=keys_,
            m=m,
            stream=make(tokens, d, dtype=stream.dtype),
            eps=eps,
            count=count,
            inv_rms=torch.rsqrt(keys_.float().pow(2).mean(-1) + eps) if not use_table else None,
            table=make(m, tokens) if use_table else None,
            partial=make(tokens, d, dtype=partial.dtype) if has_part else None,
            new=make(tokens, d, dtype=new.dtype) if has_new else None,
            init_partial=init,
            stream_out=torch.empty(tokens, d, dtype=stream_out.dtype, device=stream.device) if has_new else None,
            save=save,
        )
        launch = launch_mix if isinstance(config, tuple) else _unsupported(config)
        for q_ in (make(d, scale=0.5), torch.zeros(d, device=stream.device)):
            got, want = run_both(
                launch,
                reference_mix,
                dict(inputs, q=q_),
                ("out", "weights", "logits", "inv_partial"),
                ("partial", "stream_out"),
            )
            exact = ("stream_out", "out") if count and not use_table and not q_.any() else ("stream_out",)
            difference = compare(got, want, exact)
            if difference is not None:
                return difference + (" at zero queries" if not q_.any() else "")
        return None

    run = launch_mix if trusted(key, "mix_kernel", stream.device, probe) else reference_mix
    return run(
        keys,
        m,
        q,
        stream,
        eps,
        count,
        inv_rms=inv_rms,
        table=table,
        partial=partial,
        new=new,
        init_partial=init_partial,
        stream_out=stream_out,
        save=save,
    )


def close(
    source, dst, inv_out, eps, *, new=None, init_partial=False, stream=None, stream_out=None, queries=None, table=None
) -> None:
    """A source completes: dst [BT, D] float32 = source (+ new, which also moves stream to stream_out),
    inv_out [BT] its 1 / rms, and with queries [R, D] its scores into table [BT, R] (unit column stride).
    The kernel once its variant passed the self-check, else the reference."""
    d = dst.shape[-1]
    has_new, has_table = new is not None, queries is not None
    rows = queries.shape[0] if has_table else 1
    config = _config_or_reason(close_config, d, rows)
    init = init_partial and has_new
    flags = dict(has_new=has_new, init_part=init, has_table=has_table)
    key = _variant("close_kernel", dst.device, config, flags, source, new, stream, stream_out, queries)

    def probe():
        make, tokens = _random(dst.device), PROBE_TOKENS
        inputs = dict(
            source=make(tokens, d, dtype=source.dtype),
            dst=torch.empty(tokens, d, device=dst.device),
            inv_out=torch.empty(tokens, device=dst.device),
            eps=eps,
            new=make(tokens, d, dtype=new.dtype) if has_new else None,
            init_partial=init,
            stream=make(tokens, d, dtype=stream.dtype) if has_new else None,
            stream_out=torch.empty(tokens, d, dtype=stream_out.dtype, device=dst.device) if has_new else None,
            queries=make(rows, d, scale=0.5) if has_table else None,
            table=torch.empty(tokens, rows, device=dst.device) if has_table else None,
        )
        launch = launch_close if isinstance(config, tuple) else _unsupported(config)
        got, want = run_both(launch, reference_close, inputs, (), ("dst", "inv_out", "table", "stream_out"))
        return compare(got, want, exact=("stream_out",))

    run = launch_close if trusted(key, "close_kernel", dst.device, probe) else reference_close
    run(
        source,
        dst,
        inv_out,
        eps,
        new=new,
        init_partial=init_partial,
        stream=stream,
        stream_out=stream_out,
        queries=queries,
        table=table,
    )


def mix_backward(
    grad,
    keys,
    m,
    q,
    weights,
    logits,
    count,
    block_grad,
    *,
    inv_rms=None,
    rms_grad=None,
    score_grad=None,
    partial=None,
    inv_partial=None,
):
    """The backward of `mix` on a training cache: adds to block_grad [>= m, BT, D] and to score_grad
    [>= m, BT] (with a table) or rms_grad [>= m, BT] (without), in place. Returns (d partial, d q).
    The kernel once its variant passed the self-check, else the reference."""
    d, n = keys.shape[-1], weights.shape[-1]
    has_part, use_table = partial is not None, score_grad is not None
    config = _config_or_reason(row_config, d, n)
    flags = dict(has_part=has_part, use_table=use_table, count=count)
    key = _variant("mix_backward_kernel", grad.device, config, flags, grad, partial, keys)

    def probe():
        make, tokens = _random(grad.device), PROBE_TOKENS
        keys_ = make(m, tokens, d, dtype=keys.dtype)
        logits_ = make(tokens, n)
        inputs = dict(
            grad=make(tokens, d, dtype=grad.dtype),
            keys=keys_,
            m=m,
            q=make(d, scale=0.5),
            weights=torch.softmax(logits_, -1),
            logits=logits_,
            count=count,
            block_grad=make(m, tokens, d, scale=0.1),
            inv_rms=torch.rsqrt(keys_.float().pow(2).mean(-1) + 1e-6),
            rms_grad=None if use_table else make(m, tokens, scale=0.1),
            score_grad=make(m, tokens, scale=0.1) if use_table else None,
            partial=make(tokens, d, dtype=partial.dtype) if has_part else None,
            inv_partial=make(tokens).abs() + 0.5 if has_part else None,
        )
        launch = launch_mix_backward if isinstance(config, tuple) else _unsupported(config)
        got, want = run_both(
            launch, reference_mix_backward, inputs, ("dpartial", "dq"), ("block_grad", "rms_grad", "score_grad")
        )
        return compare(got, want)

    run = launch_mix_backward if trusted(key, "mix_backward_kernel", grad.device, probe) else reference_mix_backward
    return run(
        grad,
        keys,
        m,
        q,
        weights,
        logits,
        count,
        block_grad,
        inv_rms=inv_rms,
        rms_grad=rms_grad,
        score_grad=score_grad,
        partial=partial,
        inv_partial=inv_partial,
    )
