"""The state of an eager training forward (autograd on): completed blocks in one cache outside autograd, and the
readers' backward written by hand (`_DepthMix`, `_CloseBlock`), on the eager operations of modeling_attnres.py or on
the Triton kernels (triton.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from ..modeling.modeling_attnres import inverse_rms, join, mix_blocks, no_autocast, pseudo_query


def table_scores(keys: torch.Tensor, queries: torch.Tensor, inv_rms: torch.Tensor) -> torch.Tensor:
    """Phase 1: a completed source [BT, D] scored by every sublayer's query [R, D] in one product, with
    its 1 / rms [BT]: the [BT, R] rows of a score table."""
    return torch.mm(keys, queries.t()).mul_(inv_rms[:, None])


class BlockCache:
    """The completed blocks of one training forward, kept outside autograd (see `TrainState`).

    values:   [BT, M, D] float32, slot j holds completed source j (0 is the embedding), written once
              by `_CloseBlock` when the block completes and only read afterwards.
    inv_rms:  [BT, M] float32, their 1 / rms.
    grad:     [M, BT, D] float32, the gradient every reader's backward adds for each completed block;
              allocated by the first backward (after the forward's peak), handed to the block's producer
              by `_CloseBlock.backward` once all its readers are done. Source-major, so a reader's
              slots [:m] are one contiguous tensor, updated in place by plain elementwise kernels (a
              strided token-major [BT, :m, D] view made the in-place batched product fall back to one
              small matrix product per token).
    rms_grad: [M, BT] the per-token coefficient of k_j in that gradient (from the key statistics):
              every reader's term is a multiple of the same k_j, so it is summed as one scalar per token
              and applied once instead of once per reader.
    scores:   [BT, M, R] or None: the score table, as in SourceBuffer: each completed block scored by
              all R sublayers' queries in one product when it completes, so a reader reads its column
              instead of every completed block (the two-phase computation).
    score_grad: [BT, M, R], each reader's gradient for its column, turned into the block's and the
              queries' gradients by the block's `_CloseBlock.backward` in two products.
    """

    __slots__ = ("values", "inv_rms", "grad", "rms_grad", "scores", "score_grad")

    def __init__(self, values: torch.Tensor, inv_rms: torch.Tensor, scores: torch.Tensor | None = None):
        self.values, self.inv_rms, self.scores = values, inv_rms, scores
        self.grad: torch.Tensor | None = None
        self.rms_grad: torch.Tensor | None = None
        self.score_grad: torch.Tensor | None = None

    def gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.grad is None:
            self.grad = self.values.new_zeros(self.values.shape[1], *self.values.shape[::2])
            self.rms_grad = self.inv_rms.new_zeros(self.inv_rms.shape[::-1])
            if self.scores is not None:
                self.score_grad = torch.zeros_like(self.scores)
        return self.grad, self.rms_grad


class TrainState(NamedTuple):
    """The state of an eager training forward. Completed blocks live in one preallocated BlockCache
    instead of a BlockState's growing tensor (which copies all blocks at every boundary: 36 block
    copies for 8 blocks, ~1,900 for Full AttnRes), and the readers' gradients for them are
    accumulated in place in one buffer instead of one [BT, m, D] tensor per reader summed by autograd.
    Autograd still orders everything: each completed block is represented by a `handle` (an empty
    tensor returned by `_CloseBlock`) that its readers take as input, so a block's gradient is handed
    on only after every reader has added to it.

    The cache is written only when a block completes and never changed afterwards, so gradient
    checkpointing replays (which rewrite the slots they close with identical values) see the forward's
    state: the immutability that BlockState gives, for the blocks, by construction.
    """

    cache: BlockCache
    handles: tuple[torch.Tensor, ...]  # one per completed block, in order
    partial: torch.Tensor | None
    stream: torch.Tensor
    queries: torch.Tensor | None = None  # [R, D] all sublayers' folded queries, for the cache's score table
    kernels: object | None = None  # the Triton kernels (depth_triton), or None for the eager path

    @classmethod
    def start(cls, embeddings: torch.Tensor, eps: float, capacity: int, queries, kernels) -> TrainState:
        """The cache for `capacity` sources, the embedding closed into its first slot."""
        tokens, d = embeddings.shape[:-1].numel(), embeddings.shape[-1]
        values = embeddings.new_empty(tokens, capacity, d, dtype=torch.float32)
        scores = None if queries is None else values.new_empty(tokens, capacity, queries.shape[0])
        cache = BlockCache(values, values.new_empty(tokens, capacity), scores)
        return cls(cache, (), embeddings, embeddings, queries, kernels).close(eps)

    def close(self, eps: float, first: int = 0) -> TrainState:
        if self.partial is None:
            return self
        handle = _CloseBlock.apply(self.partial, self.queries, self.cache, len(self.handles), eps, self.kernels)
        return self._replace(handles=self.handles + (handle,), partial=None)

    def query(self, reader: int) -> torch.Tensor:
        return self.queries[reader]

    def fold(self, query: torch.Tensor, key_norm_weight: torch.Tensor | None) -> torch.Tensor:
        return query if key_norm_weight is None else pseudo_query(query, key_norm_weight)

    def mix(
        self, q: torch.Tensor, eps: float, scaling: str, reader: int | None = None, norm: tuple = ()
    ) -> torch.Tensor:
        column = None if self.queries is None else reader
        mixed, weights = _DepthMix.apply(
            q, self.stream, self.partial, self.cache, eps, scaling, column, self.kernels, *self.handles
        )
        return mixed

    def add(self, output: torch.Tensor) -> TrainState:
        partial, stream = join(self.partial, self.stream, output)
        return self._replace(partial=partial, stream=stream)

    def current_stream(self) -> torch.Tensor:
        return self.stream

    def received(self) -> TrainState:
        """This state as a decoder layer takes it in. FSDP2 passes a wrapped layer's inputs through an autograd
        Function (its post-backward hook) that returns them as views, so a layer handing its handles and queries
        on unchanged would return views, which FSDP2 rejects with a warning that gradients may be wrong (an
        in-place op on one would skip its pre-backward all-gather). Own copies instead: the handles are empty
        and the queries one [R, D] tensor, so copying them costs nothing; without FSDP2 nothing is a view here."""
        if self.queries is None or self.queries._base is None:
            if all(handle._base is None for handle in self.handles):
                return self
        return self._replace(
            handles=tuple(handle if handle._base is None else handle.clone() for handle in self.handles),
            queries=self.queries if self.queries is None or self.queries._base is None else self.queries.clone(),
        )


class _CloseBlock(torch.autograd.Function):
    """A completed block enters the TrainState's cache (and, with queries [R, D], is scored by every
    sublayer into the cache's score table); returns its handle (an empty tensor).

    What a backward reads of the cache is saved with save_for_backward (views, no copies), so saved-tensor
    hooks see it: activation offloading (save_on_cpu) moves it and hands back what the backward reads.
    The cache is written through `.data` aliases (kernels write through pointers): a later block's write
    goes to other slots than the ones saved, and must not count as a change of the saved views."""

    @staticmethod
    def forward(ctx, block, queries, cache: BlockCache, slot: int, eps: float, kernels=None):
        values, inv_rms, scores = cache.values[:, slot], cache.inv_rms[:, slot], None
        if queries is not None:
            scores = cache.scores[:, slot]
        if kernels is not None:
            kernels.close(block, values, inv_rms, eps, queries=queries, table=scores)
        else:
            with no_autocast(block):
                flat = block.reshape(-1, block.shape[-1]).float()
                values.data.copy_(flat)
                inv_rms.data.copy_(inverse_rms(flat, eps))
                if queries is not None:
                    scores.data.copy_(table_scores(flat, queries, inv_rms))
        ctx.save_for_backward(queries, values, inv_rms, scores)
        ctx.cache, ctx.slot, ctx.shape, ctx.dtype = cache, slot, block.shape, block.dtype
        return values.new_empty(0)

    @staticmethod
    @once_differentiable
    def backward(ctx, _):
        cache, slot = ctx.cache, ctx.slot
        queries, values, inv_rms, scores = ctx.saved_tensors
        if cache.grad is None:  # no reader contributed (the loss does not depend on this block)
            return torch.zeros(ctx.shape, dtype=ctx.dtype, device=values.device), None, None, None, None, None
        with no_autocast(cache.grad):
            rms_grad = cache.rms_grad[slot]
            dqueries = None
            if queries is not None:
                # The score table's gradient: s_r = (q_r . k) inv_rms, so ds_r/dk = inv_rms q_r - s_r inv_rms^2 k / D.
                dscores = cache.score_grad[:, slot]  # [BT, R]
                via_query = dscores * inv_rms[:, None]
                rms_grad.sub_((via_query * scores).sum(-1).mul_(inv_rms / values.shape[-1]))
                cache.grad[slot].addmm_(via_query, queries)
                dqueries = torch.mm(via_query.t(), values)
                dscores.zero_()
            grad = cache.grad[slot].addcmul(values, rms_grad[:, None])
            # Consumed: cleared, so that a second backward through the same graph (retain_graph) adds up anew.
            cache.grad[slot].zero_()
            rms_grad.zero_()
        return grad.view(ctx.shape).to(ctx.dtype), dqueries, None, None, None, None


class _DepthMix(torch.autograd.Function):
    """depth_mix on a TrainState, with a hand-written backward. Autograd through the plain formulation
    writes two [BT, m, D] gradients per reader (one from the scores, one from the mix), sums them and
    the readers' results block by block; here each reader adds its mix term to the cache's gradient
    buffer in place, and its scores' gradient to its column of the score table's gradient (turned into
    the blocks' and queries' gradients once per block, by `_CloseBlock.backward`). Saves only the
    partial sum, the [BT, n] weights and scores, and views of the cache's completed blocks.
    Measured on the default SmolLM2 training step: step peak memory 1.118x -> 1.076x of the base
    model's, and the AttnRes operations of a forward + backward (61 readers, 4 x 256 tokens, alone)
    in 244 ms against 525 ms through autograd on BlockState (306 ms without the table).
    Without a score table (reader None: the output aggregation, or queries that are not whole tensors
    on this device) a reader scores the completed blocks itself and adds that gradient too.
    Runs with autocast off: the design keeps depth-attention statistics in float32 whatever the
    model dtype, and under mixed precision autocast would run the score and mix products in bfloat16.
    With kernels, the forward and the backward are one Triton launch each.

    Returns (mix, weights [BT, n]); the weights are for recorders only (not differentiable)."""

    @staticmethod
    def forward(ctx, q, stream, partial, cache: BlockCache, eps: float, scaling: str, reader, kernels, *handles):
        m = len(handles)
        keys, inv_rms = cache.values[:, :m], cache.inv_rms[:, :m]
        table = None if reader is None else cache.scores[:, :m, reader]
        if kernels is not None:
            mixed, weights, logits, inv_partial = kernels.mix(
                keys.transpose(0, 1),
                m,
                q,
                stream,
                eps,
                scaling == "count",
                inv_rms=None if table is not None else inv_rms.t(),
                table=None if table is None else table.t(),
                partial=partial,
                save=True,
            )
        else:
            with no_autocast(stream):
                mixed, weights, logits, inv_partial = mix_blocks(keys, inv_rms, partial, stream, q, eps, scaling, table)
            if table is not None and partial is None:
                logits = None  # a view of the table, which later blocks write to; unused by the backward
        ctx.save_for_backward(q, partial, weights, logits, inv_partial, keys, inv_rms)
        ctx.cache, ctx.scaling, ctx.m, ctx.reader, ctx.kernels = cache, scaling, m, reader, kernels
        ctx.mark_non_differentiable(weights)
        return mixed, weights

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, _):
        if ctx.kernels is not None:
            return _DepthMix._kernel_backward(ctx, grad)
        with no_autocast(grad):
            return _DepthMix._backward(ctx, grad)

    @staticmethod
    def _kernel_backward(ctx, grad):
        q, partial, weights, logits, inv_partial, keys, inv_rms = ctx.saved_tensors
        cache, m, count, reader = ctx.cache, ctx.m, ctx.scaling == "count", ctx.reader
        grads, rms_grads = cache.gradients()
        dpartial, dq = ctx.kernels.mix_backward(
            grad,
            keys.transpose(0, 1),
            m,
            q,
            weights,
            logits,
            count,
            grads,
            inv_rms=inv_rms.t(),
            rms_grad=rms_grads,
            score_grad=None if reader is None else cache.score_grad[:, :m, reader].t(),
            partial=partial,
            inv_partial=inv_partial,
        )
        return (dq, grad if count else None, dpartial, None, None, None, None, None) + (None,) * m

    @staticmethod
    def _backward(ctx, grad):
        q, partial, weights, logits, inv_partial, keys, inv = ctx.saved_tensors
        cache, m, count, reader = ctx.cache, ctx.m, ctx.scaling == "count", ctx.reader
        tokens, n, d = keys.shape[0], weights.shape[-1], keys.shape[-1]
        g = grad.reshape(tokens, 1, d).float()
        # d(mix)/d(alpha_i) = (n) k_i, then the softmax's backward.
        dweights = torch.bmm(g, keys.transpose(1, 2)).view(tokens, m)
        if partial is not None:
            p = partial.reshape(tokens, d).float()
            # (A batched product of 1 x D by D x 1 runs six times slower than this, measured.)
            dweights = torch.cat([dweights, torch.linalg.vecdot(g.view(tokens, d), p).unsqueeze(-1)], dim=-1)
        if count:
            dweights = dweights * n
        dlogits = weights * (dweights - (weights * dweights).sum(-1, keepdim=True))
        coef = weights * n - 1.0 if count else weights
        grads, rms_grads = cache.gradients()
        grads[:m].addcmul_(coef[:, :m].t().unsqueeze(-1), g.view(1, tokens, d))
        # A score s_i = (q . k_i) inv_i has d s_i / d k_i = inv_i q - s_i inv_i^2 k_i / D, so the
        # gradient of k_i is coef_i g + (dlogit_i inv_i) q - (dlogit_i s_i inv_i^2 / D) k_i.
        dq = None
        if reader is not None:
            cache.score_grad[:, :m, reader] += dlogits[:, :m]
        else:
            via_query = dlogits[:, :m] * inv
            grads[:m].addcmul_(via_query.t().unsqueeze(-1), q.view(1, 1, d))
            rms_grads[:m] -= (via_query * logits[:, :m] * inv).t() / d
            dq = torch.bmm(via_query[:, None, :], keys).view(tokens, d).sum(0)
        dpartial = None
        if partial is not None:
            via_query = dlogits[:, m] * inv_partial
            dq = via_query @ p if dq is None else dq + via_query @ p
            via_rms = -(via_query * logits[:, m] * inv_partial) / d
            dpartial = (via_rms[:, None] * p).addcmul_(coef[:, m, None], g.view(tokens, d))
            dpartial = dpartial.addcmul_(via_query[:, None], q).view(partial.shape).to(partial.dtype)
        dstream = grad if count else None
        return (dq, dstream, dpartial, None, None, None, None, None) + (None,) * m
