"""The inference buffers on the eager path (no autograd): every source of a forward in one preallocated float32
buffer, written in place. `SourceBuffer` lays it out source-major for a forward of many tokens (a prefill),
`StepBuffer` token-major for a forward of few (a decoding step); the C++ and Triton backends (depth_cpu.py,
depth_triton.py) subclass them. The math is depth_core.py's, in the operations each forward pays least for.

This file ships next to converted weights: it imports torch and the standard library only.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from .depth_core import Recorder, inverse_rms, pseudo_query

# Up to this many tokens per forward (a decoding step), operation count dominates: a reader then
# recomputes every source's statistics in a few large operations instead of reusing cached ones.
SMALL_STEP_TOKENS = 64


def few_tokens(x: torch.Tensor) -> bool:
    return x.shape[:2].numel() <= SMALL_STEP_TOKENS


class SourceBuffer:
    """The state of a forward without autograd (inference, generation), source-major: a block boundary is a
    counter increment, a reader's sources are a view and the partial sum accumulates in its slot, so nothing is
    concatenated or copied per sublayer (Full AttnRes with BlockState would copy the growing block tensor at
    every sublayer). In-place updates are safe only without autograd; training uses TrainState (BlockState
    under torch.compile). Many tokens make a forward bound by memory traffic; every source is one contiguous
    tensor, so the partial sum's update and score, and the mix as a chain of elementwise multiply-adds, run at
    memory speed (measured per 512-token reader: a strided slot's norm 85 us against 47, its add 96 against 66,
    and the mix of 3 sources 145 us against 242 for one batched product over a token-major buffer).

    sources:     [K, B, T, D] float32; completed sources in slots [0, count), the partial sum in slot count; K
                 slots, the most sources any reader has (and one more for the stream, see shared_stream).
    inv_rms:     1 / rms of the completed sources ([K, B, T]), written once when a source completes.
    count:       the number of completed sources (embedding + completed blocks).
    has_partial: whether slot `count` holds a partial sum (False right after a block boundary).
    stream:      [B, T, D] the plain residual stream, as in BlockState.
    queries:     [R, D] the folded pseudo-queries of all R sublayers, or None (then each reader folds its own).
    scores:      [K, B, T, R] with queries: the scores (q_r . k_i * inv_rms_i) of each completed source
                 for every sublayer r, written when the source completes (phase 1 of the two-phase
                 computation: a completed block is read once by one product with all queries, not
                 once per reader); a reader adds only its partial sum's score (phase 2).
    shared_stream: the stream is the buffer's last slot (a float32 model: the buffer's dtype is the
                 stream's), so an output joins the partial sum and the stream in one in-place add over a
                 view of both slots (the partial slots start at zero). One operation less per sublayer, which
                 a decoding step pays for; `current_stream` hands out copies.
    recorder:    where the readers' weights go (`record_depth_weights`), or None.
    """

    __slots__ = ("sources", "inv_rms", "count", "has_partial", "stream", "queries", "scores", "shared_stream", "recorder")
    zeroed = True  # partial sums start by adding to zeros where the stream is shared (see `start`)

    def __init__(self, sources, inv_rms, count: int, has_partial: bool, stream, queries=None, scores=None,
                 shared_stream: bool = False, recorder: Recorder | None = None):
        self.sources, self.inv_rms, self.count, self.has_partial, self.stream = sources, inv_rms, count, has_partial, stream
        self.queries, self.scores, self.shared_stream, self.recorder = queries, scores, shared_stream, recorder

    @classmethod
    def start(cls, embeddings: torch.Tensor, eps: float, capacity: int, queries=None, recorder=None) -> SourceBuffer:
        """The buffer of a many-token forward, the embedding in slot 0 (with its scores where there are queries)."""
        shared = embeddings.dtype == torch.float32
        rows, stream = capacity + int(shared), embeddings
        # Zeros where partial sums start by adding (an eager shared stream); the C++ kernels write a block's first output.
        new = embeddings.new_zeros if shared and cls.zeroed else embeddings.new_empty
        sources = new(rows, *embeddings.shape, dtype=torch.float32)
        sources[0] = embeddings
        if shared:
            stream = sources[capacity]
            stream.copy_(embeddings)
        inv_rms = sources.new_empty(sources.shape[:-1])
        inv_rms[0] = inverse_rms(sources[0], eps)
        state = cls(sources, inv_rms, 1, False, stream, shared_stream=shared, recorder=recorder)
        if queries is not None:
            state.queries, state.scores = queries, sources.new_empty(*sources.shape[:-1], queries.shape[0])
            state.score_source(0)
        return state

    def score_source(self, slot: int, first: int = 0) -> None:
        """Phase 1 for a completed source: its scores by readers `first`.. (the ones after it; earlier columns stay
        unwritten and unread), written into the table's strided rows by the scaling product itself."""
        key, table = self.sources[slot], self.scores[slot]
        d, readers = key.shape[-1], table.shape[-1]
        scores = torch.mm(key.reshape(-1, d), self.queries[first:].t())
        torch.mul(scores, self.inv_rms[slot].reshape(-1, 1), out=table.view(-1, readers)[:, first:])

    def close(self, eps: float, first: int = 0) -> SourceBuffer:
        """At a block boundary the partial sum becomes a completed source, with its statistics and scores (phase 1)
        for reader `first` and the readers after it."""
        if not self.has_partial:
            return self
        count = self.count
        self.inv_rms[count] = inverse_rms(self.sources[count], eps)
        if self.scores is not None:
            self.score_source(count, first)
        self.count, self.has_partial = count + 1, False
        return self

    def query(self, reader: int) -> torch.Tensor:
        """Reader `reader`'s query from the ones folded once per forward."""
        return self.queries[reader]

    def fold(self, query: torch.Tensor, key_norm_weight: torch.Tensor | None) -> torch.Tensor:
        """A reader's query w (and key norm g) as `mix` takes it: (w * g), or `query` where it is folded already."""
        return query if key_norm_weight is None else pseudo_query(query, key_norm_weight)

    def mix(self, q: torch.Tensor, eps: float, scaling: str, reader: int | None = None, norm: tuple = ()) -> torch.Tensor:
        """Source-major scores [n, B, T], from the table where there is one (phase 2: only the partial sum is
        scored here), else one product over the n contiguous sources; then the chained mix."""
        n = self.count + int(self.has_partial)
        m, d = self.count, self.sources.shape[-1]
        if self.scores is not None and reader is not None:
            logits = self.scores[:m, ..., reader]
            if self.has_partial:
                partial = self.sources[m]
                partial_logit = (partial @ q).mul_(inverse_rms(partial, eps))
                logits = torch.cat([logits, partial_logit.unsqueeze(0)])
        else:
            if self.has_partial:
                self.inv_rms[m] = inverse_rms(self.sources[m], eps)
            logits = torch.mv(self.sources[:n].view(-1, d), q).view(self.inv_rms[:n].shape).mul_(self.inv_rms[:n])
        weights = torch.softmax(logits, dim=0)
        if self.recorder is not None:
            self.recorder.add(weights.clone())
        return _chained_mix(self.stream, weights, self.sources, scaling)

    def slot(self, j: int) -> torch.Tensor:
        """Source j, [B, T, D]."""
        return self.sources[j]

    def with_stream(self, j: int) -> torch.Tensor:
        """Source j and the shared stream as one [2, B, T, D] view."""
        last = self.sources.shape[0] - 1
        return self.sources[j::last - j]

    def add(self, output: torch.Tensor) -> SourceBuffer:
        """The output joins the partial sum of the current block and the stream, in place."""
        if self.shared_stream:
            self.with_stream(self.count).add_(output)  # both in one operation
        else:
            slot = self.slot(self.count)
            if self.has_partial:
                slot.add_(output)
            else:  # the first output of a block initialises its slot (the buffer is allocated uninitialised)
                slot.copy_(output)
            self.stream = self.stream + output
        self.has_partial = True
        return self

    def current_stream(self) -> torch.Tensor:
        """The plain residual stream (a copy where it is the buffer's slot, which later outputs update in place)."""
        return self.stream.clone() if self.shared_stream else self.stream


class StepBuffer(SourceBuffer):
    """The buffer of a forward of few tokens (a decoding step), token-major: [B, T, K, D] sources, a view of a
    [B, T, K, D + 1] buffer (see StepViews). Such a forward pays per operation, and a token's n sources are one
    [n, D] matrix: one product scores them and one mixes them. Readers recompute the statistics of every source
    (fewer operations than merging cached ones), so `inv_rms` and `scores` are unused.

    step: the constants and views its readers use, made once per forward (see StepViews).
    """

    __slots__ = ("step",)

    @classmethod
    def start(cls, embeddings: torch.Tensor, eps: float, capacity: int, queries=None, recorder=None, runtime=None):
        """The buffer of a few-token forward; `runtime`, the model's, keeps it for the next one (see `step_buffer`)."""
        shared = embeddings.dtype == torch.float32
        d = embeddings.shape[-1]
        padded, step = step_buffer(embeddings, capacity + int(shared), eps, queries, shared, runtime)
        step.slots[0].copy_(embeddings)
        stream = embeddings
        if shared:
            stream = step.slots[capacity]
            stream.copy_(embeddings)
        state = cls(padded[..., :d], padded.new_empty(0), 1, False, stream, queries, shared_stream=shared, recorder=recorder)
        state.step = step
        return state

    def close(self, eps: float, first: int = 0) -> StepBuffer:
        if self.has_partial:
            self.count, self.has_partial = self.count + 1, False
        return self

    def query(self, reader: int) -> torch.Tensor:
        return self.step.queries[reader]

    def fold(self, query: torch.Tensor, key_norm_weight: torch.Tensor | None) -> torch.Tensor:
        q = query if key_norm_weight is None else pseudo_query(query, key_norm_weight)
        return pad_query(q * self.step.root_d)  # see _few_token_logits

    def mix(self, q: torch.Tensor, eps: float, scaling: str, reader: int | None = None, norm: tuple = ()) -> torch.Tensor:
        return step_mix(self.step, self.count + int(self.has_partial), q, self.stream, scaling, self.recorder)

    def slot(self, j: int) -> torch.Tensor:
        return self.step.slots[j]

    def with_stream(self, j: int) -> torch.Tensor:
        return self.step.pairs[j]


class StepViews(NamedTuple):
    """What the readers of a few-token forward use, made once per forward instead of once per reader.
    Such a forward pays per operation (1-3 us each on CPU alone, 5-7 inside the model, whose weights
    evict the caches between readers), and making a view, or wrapping a Python number into a tensor, is
    an operation. Measured on a SmolLM2 decoding step (61 readers, AttnRes work alone): 2.5 -> 1.9 ms.

    The buffer behind it is [B, T, K, D + 1]: each source's row ends in a constant sqrt(D * eps), so one
    norm of the padded row is sqrt(|k|^2 + D eps) = sqrt(D) rms(k), the key statistic in one operation.

    inverse:   inverse[n] = 1/n, 0-dim float32 tensors.
    padded:    padded[n] = the n sources a reader reads with their constant, [B, T, n, D + 1].
    rows:      with one token, rows[n] = padded[n] as [n, D + 1], for one matrix-vector product with the
               query (a batched product is slower; with more tokens the scores are a product and a sum).
    flat:      flat[n], the n sources without the constant as [B*T, n, D], for the batched product of the mix.
    slots:     slots[j] = source j without the constant, [B, T, D], where outputs accumulate.
    queries:   every sublayer's folded query times sqrt(D), with a 0 for the constant (see
               `_few_token_logits`), one view each of `query_rows`; or None.
    root_d:    sqrt(D), a 0-dim float32 tensor.
    pairs:     with the stream in the buffer's last row (see SourceBuffer.shared_stream), pairs[j] = slot j
               and the stream as one [2, B, T, D] view, so an output joins both in one operation.
    query_rows: the [R, D + 1] tensor behind `queries`, which `write_queries` fills (or None).
    """

    inverse: tuple[torch.Tensor, ...]
    padded: tuple[torch.Tensor, ...]
    rows: tuple[torch.Tensor, ...] | None
    flat: tuple[torch.Tensor, ...]
    slots: tuple[torch.Tensor, ...]
    queries: tuple[torch.Tensor, ...] | None
    root_d: torch.Tensor
    pairs: tuple[torch.Tensor, ...] | None = None
    query_rows: torch.Tensor | None = None

    @classmethod
    def of(
        cls, padded: torch.Tensor, eps: float, queries: torch.Tensor | None = None, shared_stream: bool = False
    ) -> StepViews:
        """Views of a token-major buffer [B, T, K, D + 1], whose constant column this fills."""
        capacity, d, tokens = padded.shape[-2], padded.shape[-1] - 1, padded.shape[:-2].numel()
        padded[..., d] = (d * eps) ** 0.5
        constants = torch.tensor([d**0.5] + [1.0 / n for n in range(1, capacity + 1)], device=padded.device).unbind()
        prefixes = tuple(padded.narrow(-2, 0, n) for n in range(1, capacity + 1))
        rows = (None,) + tuple(p.view(n, d + 1) for n, p in enumerate(prefixes, 1)) if tokens == 1 else None
        flat = tuple(p.view(tokens, n, d + 1)[..., :d] for n, p in enumerate(prefixes, 1))
        slots = padded[..., :d].unbind(-2)
        query_rows = None if queries is None else pad_query(queries * constants[0])  # traceable: no out= here
        scaled = None if query_rows is None else query_rows.unbind()
        pairs = None
        if shared_stream:
            last = capacity - 1
            pairs = tuple(padded[..., j::last - j, :d].movedim(-2, 0) for j in range(last))
        # Index n for n sources (no reader has none).
        return cls((None,) + constants[1:], (None,) + prefixes, rows, (None,) + flat, slots, scaled, constants[0], pairs, query_rows)

    def write_queries(self, queries: torch.Tensor | None) -> None:
        """A later forward's folded queries [R, D], times sqrt(D), into the rows the `queries` views read (their
        last column stays 0; the same bits as `of` makes): one operation, so the views of a kept buffer serve
        every forward's queries."""
        if queries is not None:
            torch.mul(queries, self.root_d, out=self.query_rows[:, :-1])


def pad_query(q: torch.Tensor) -> torch.Tensor:
    """A query [..., D] with a 0 for the constant column of a decoding step's buffer."""
    return torch.nn.functional.pad(q, (0, 1))


def step_buffer(embeddings: torch.Tensor, rows: int, eps: float, queries, shared: bool, runtime: dict | None):
    """The token-major buffer [B, T, rows, D + 1] of a few-token forward and its StepViews: the previous
    forward's where it had the same shape (making them is ~70 operations and views, which a decoding step pays
    for: 0.4 ms of a SmolLM2 decoding step under cProfile). Kept in the model's `runtime` per thread, so
    concurrent forwards never share one; a forward hands out no view of it (`current_stream` copies), so reusing
    it in the next is safe. Nothing in it derives from the weights across forwards: this forward's queries are
    written into it (`StepViews.write_queries`) and the partial-sum slots are zeroed again (outputs are added to
    them); what it keeps depends only on the key (shapes, eps, dtype, device, inference mode)."""
    d = embeddings.shape[-1]
    keep = runtime is not None and not torch.compiler.is_compiling()  # a traced forward allocates its own
    if keep:
        # Under inference_mode the buffer is an inference tensor, which a later forward outside it may not write.
        inference = torch.is_inference_mode_enabled()
        readers = None if queries is None else tuple(queries.shape)
        key = (tuple(embeddings.shape), embeddings.device, rows, shared, eps, inference, readers)
        kept, thread = runtime.setdefault("steps", {}), threading.get_ident()
        entry = kept.get(thread)
        if entry is not None and entry[0] == key:
            padded, step = entry[1], entry[2]
            if shared:
                padded[..., :d].zero_()
            step.write_queries(queries)
            return padded, step
    new = embeddings.new_zeros if shared else embeddings.new_empty
    padded = new(*embeddings.shape[:-1], rows, d + 1, dtype=torch.float32)
    step = StepViews.of(padded, eps, queries, shared)
    if keep:
        if thread not in kept:  # a thread's first: the threads that have ended leave (a thread's id may be reused)
            alive = {t.ident for t in threading.enumerate()}
            for gone in [t for t in kept if t not in alive]:
                del kept[gone]
        kept[thread] = (key, padded, step)
    return padded, step


def step_mix(step: StepViews, n: int, q: torch.Tensor, stream: torch.Tensor, scaling: str, recorder=None) -> torch.Tensor:
    """The depth mix of a reader of n sources in a few-token forward (token-major: one product scores a token's
    n sources, one mixes them)."""
    weights = torch.softmax(_few_token_logits(step, n, q), dim=-1)
    if recorder is not None:
        recorder.add(weights.movedim(-1, 0).clone())
    return _fused_mix(stream, weights, step.flat[n], scaling, step.inverse[n])


def _chained_mix(stream: torch.Tensor, weights: torch.Tensor, sources: torch.Tensor, scaling: str) -> torch.Tensor:
    """n * sum_i alpha_i k_i as H + sum_i n (alpha_i - 1/n) k_i (exactly H at zero queries), as one
    elementwise multiply-add per source over a source-major buffer: weights [n, B, T] (this function's
    own, changed in place), sources [K, B, T, D]. Measured per 512-token reader, cold caches: faster than
    one batched product ([B*T, 1, n] @ [B*T, n, D] runs as B*T tiny matrix products) up to n = 9."""
    n = weights.shape[0]
    if scaling == "count":
        coef = weights.sub_(1.0 / n).mul_(n).unsqueeze(-1)
        mixed = torch.addcmul(stream.float(), coef[0], sources[0])
    else:
        coef = weights.unsqueeze(-1)
        mixed = sources[0] * coef[0]
    for i in range(1, n):
        mixed.addcmul_(coef[i], sources[i])
    return mixed.to(stream.dtype)


def _few_token_logits(step: StepViews, n: int, q: torch.Tensor) -> torch.Tensor:
    """Scores of the first n sources in a decoding step, [B, T, n], for q = (w * g) sqrt(D) padded with a 0.
    Recomputing every source's statistics takes fewer operations than merging cached ones, and such a
    step pays per operation, so this is written for the fewest: q . k / rms(k) = (q sqrt(D)) . k / |k, c|
    with c = sqrt(D eps) the buffer's constant column. Measured per reader of 6 sources (alone): norm,
    addcmul, rsqrt_, mv, mul_ took 7.8 us; this 5.1."""
    keys = step.padded[n]
    norms = torch.linalg.vector_norm(keys, dim=-1)  # sqrt(D) rms(k)
    if step.rows is not None:
        return torch.mv(step.rows[n], q) / norms
    return (keys * q).sum(-1).div_(norms)


def _fused_mix(stream: torch.Tensor, weights: torch.Tensor, flat: torch.Tensor, scaling: str, inverse: torch.Tensor) -> torch.Tensor:
    """n * sum_i alpha_i k_i as H + n * sum_i (alpha_i - 1/n) k_i in one product (exactly H at zero
    queries), for few tokens. flat: the keys as [B*T, n, D], a view of the token-major buffer; inverse:
    1/n as a tensor. (Dtype conversions are skipped where there is none to do: each is an operation.)"""
    n, d = flat.shape[-2], flat.shape[-1]
    one_token = stream.shape[1] == 1  # decoding: [B, 1, *] already has bmm's shapes, no views needed
    same = stream.dtype == torch.float32
    base = stream if same else stream.float()
    base = base if one_token else base.reshape(-1, 1, d)
    weights = weights if one_token else weights.reshape(-1, 1, n)
    if scaling == "count":  # the weights are this function's own (recorders got a copy): in place
        mixed = torch.baddbmm(base, weights.sub_(inverse), flat, alpha=n)
    else:
        mixed = torch.bmm(weights, flat)
    mixed = mixed if one_token else mixed.view(stream.shape)
    return mixed if same else mixed.to(stream.dtype)
