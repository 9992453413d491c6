"""The buffer of a forward of few tokens (a decoding step) without autograd: token-major, so that one product scores
a token's sources and one mixes them. Such a forward pays per operation, which the source-major SourceBuffer
spends more of. Picked by `inference_state` where the attnres package is installed.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from ..modeling.modeling_attnres import ModelRuntime, SourceBuffer, pseudo_query

SMALL_STEP_TOKENS = 64


def few_tokens(x: torch.Tensor) -> bool:
    return x.shape[:2].numel() <= SMALL_STEP_TOKENS


class StepBuffer(SourceBuffer):
    """The buffer of a forward of few tokens (a decoding step), token-major: [B, T, K, D] sources, a view of a
    [B, T, K, D + 1] buffer (see StepViews). Such a forward pays per operation, and a token's n sources are one
    [n, D] matrix: one product scores them and one mixes them. Readers recompute the statistics of every source
    (fewer operations than merging cached ones), so `inv_rms` and `scores` are unused.

    step: the constants and views its readers use, made once per forward (see StepViews).
    """

    __slots__ = ("step",)

    @classmethod
    def start(cls, embeddings: torch.Tensor, eps: float, capacity: int, queries=None, runtime=None):
        """The buffer of a few-token forward; `runtime`, the model's, keeps it for the next one (see `step_buffer`)."""
        shared = embeddings.dtype == torch.float32
        d = embeddings.shape[-1]
        padded, step = step_buffer(embeddings, capacity + int(shared), eps, queries, shared, runtime)
        step.slots[0].copy_(embeddings)
        stream = embeddings
        if shared:
            stream = step.slots[capacity]
            stream.copy_(embeddings)
        state = cls(padded[..., :d], padded.new_empty(0), 1, False, stream, queries, shared_stream=shared)
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

    def mix(
        self, q: torch.Tensor, eps: float, scaling: str, reader: int | None = None, norm: tuple = ()
    ) -> torch.Tensor:
        return step_mix(self.step, self.count + int(self.has_partial), q, self.stream, scaling)

    def slot(self, j: int) -> torch.Tensor:
        return self.step.slots[j]

    def with_stream(self, j: int) -> torch.Tensor:
        return self.step.pairs[j]


class StepViews(NamedTuple):
    """What the readers of a few-token forward use, made once per forward instead of once per reader.
    Such a forward pays per operation, and making a view, or wrapping a Python number into a tensor, is
    an operation.

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
            pairs = tuple(padded[..., j :: last - j, :d].movedim(-2, 0) for j in range(last))
        # Index n for n sources (no reader has none).
        return cls(
            (None,) + constants[1:],
            (None,) + prefixes,
            rows,
            (None,) + flat,
            slots,
            scaled,
            constants[0],
            pairs,
            query_rows,
        )

    def write_queries(self, queries: torch.Tensor | None) -> None:
        """A later forward's folded queries [R, D], times sqrt(D), into the rows the `queries` views read (their
        last column stays 0; the same bits as `of` makes): one operation, so the views of a kept buffer serve
        every forward's queries."""
        if queries is not None:
            torch.mul(queries, self.root_d, out=self.query_rows[:, :-1])


def pad_query(q: torch.Tensor) -> torch.Tensor:
    """A query [..., D] with a 0 for the constant column of a decoding step's buffer."""
    return torch.nn.functional.pad(q, (0, 1))


def step_buffer(embeddings: torch.Tensor, rows: int, eps: float, queries, shared: bool, runtime: ModelRuntime | None):
    """The token-major buffer [B, T, rows, D + 1] of a few-token forward and its StepViews: the previous
    forward's where it had the same shape (making them is ~70 operations and views, which a decoding step pays
    for). Kept in the model's `runtime` per thread, so
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
        kept, thread = runtime.steps, threading.get_ident()
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


def step_mix(step: StepViews, n: int, q: torch.Tensor, stream: torch.Tensor, scaling: str) -> torch.Tensor:
    """The depth mix of a reader of n sources in a few-token forward (token-major: one product scores a token's
    n sources, one mixes them)."""
    weights = torch.softmax(_few_token_logits(step, n, q), dim=-1)
    return _fused_mix(stream, weights, step.flat[n], scaling, step.inverse[n])


def _few_token_logits(step: StepViews, n: int, q: torch.Tensor) -> torch.Tensor:
    """Scores of the first n sources in a decoding step, [B, T, n], for q = (w * g) sqrt(D) padded with a 0.
    Recomputing every source's statistics takes fewer operations than merging cached ones, and such a
    step pays per operation, so this is written for the fewest: q . k / rms(k) = (q sqrt(D)) . k / |k, c|
    with c = sqrt(D eps) the buffer's constant column (two operations where the plain form takes five)."""
    keys = step.padded[n]
    norms = torch.linalg.vector_norm(keys, dim=-1)  # sqrt(D) rms(k)
    if step.rows is not None:
        return torch.mv(step.rows[n], q) / norms
    return (keys * q).sum(-1).div_(norms)


def _fused_mix(
    stream: torch.Tensor, weights: torch.Tensor, flat: torch.Tensor, scaling: str, inverse: torch.Tensor
) -> torch.Tensor:
    """n * sum_i alpha_i k_i as H + n * sum_i (alpha_i - 1/n) k_i in one product (exactly H at zero
    queries), for few tokens. flat: the keys as [B*T, n, D], a view of the token-major buffer; inverse:
    1/n as a tensor. (Dtype conversions are skipped where there is none to do: each is an operation.)"""
    n, d = flat.shape[-2], flat.shape[-1]
    one_token = stream.shape[1] == 1  # decoding: [B, 1, *] already has bmm's shapes, no views needed
    same = stream.dtype == torch.float32
    base = stream if same else stream.float()
    base = base if one_token else base.reshape(-1, 1, d)
    weights = weights if one_token else weights.reshape(-1, 1, n)
    if scaling == "count":  # the weights are this function's own: in place
        mixed = torch.baddbmm(base, weights.sub_(inverse), flat, alpha=n)
    else:
        mixed = torch.bmm(weights, flat)
    mixed = mixed if one_token else mixed.view(stream.shape)
    return mixed if same else mixed.to(stream.dtype)
