"""The math: a reader mixes its sources k_i (embedding, completed blocks, partial sum) as h = n * sum_i alpha_i k_i,
alpha = softmax_i((w * g) . k_i / rms(k_i)) in float32; at w = 0 that is the exact residual sum.

A PreNorm decoder feeds sublayer l the plain sum of every earlier output; AttnRes replaces that sum with a
per-token softmax over *sources*, scored by a static pseudo-query w against RMS-normalised keys. With w = 0 every
source weighs 1/n, and the factor n (the number of sources) turns the mix back into the exact residual sum, so a
converted model reproduces its base model. Scores and softmax run in float32 whatever the model dtype.

This section holds the math once, as plain tensor operations (`mix_blocks`), and the state that carries it
between sublayers as plain tensors (`BlockState`, traced by torch.compile and differentiated by autograd).
The other states compute the same function faster, each for the forwards it serves, behind the same calls
(`DepthState`).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch


def inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    # One reduction pass (no squared copy of x to write, keep for backward and read back).
    x = x.float()
    return torch.rsqrt(torch.linalg.vector_norm(x, dim=-1).square() / x.shape[-1] + eps)


def pseudo_query(query: torch.Tensor, key_norm_weight: torch.Tensor) -> torch.Tensor:
    """(w * g), float32 [D] (or [R, D]): (w * g) . (k / rms(k)) is ((w * g) . k) * inv_rms(k)."""
    return query.reshape(key_norm_weight.shape).float() * key_norm_weight.float()


def source_scores(keys: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """q . k for every source of every token, token-major keys [B, T, c, D] -> [B, T, c], reading them in place."""
    d = keys.shape[-1]
    if torch.compiler.is_compiling():  # a sum of products, which the compiler fuses (a bmm stays a library call)
        return (keys * (q if q.dim() == 1 else q.view(*keys.shape[:-2], 1, d))).sum(-1)
    flat = keys.reshape(-1, keys.shape[-2], d)
    q = q.view(1, 1, d).expand(flat.shape[0], 1, d) if q.dim() == 1 else q.view(-1, 1, d)  # [D], or one per token
    return torch.bmm(q, flat.transpose(1, 2)).view(keys.shape[:-1])


def token_queries(stream, query, key_norm_weight, down, up, eps: float) -> torch.Tensor:
    """Input-dependent queries, folded with the key norm: q_t = (w + B A x_t / rms(x_t)) * g, [B*T, D] float32, for
    x_t the plain residual stream (its rms taken out: it grows with depth). B (`up`) starts at zero, so q_t = w and
    the converted model stays the base model bit for bit; A (`down`) starts random, as LoRA's."""
    x = stream.reshape(-1, stream.shape[-1]).float()
    x = x * inverse_rms(x, eps)[:, None]
    q = torch.addmm(query.reshape(1, -1).float(), x @ down.float().t(), up.float().t())
    return q * key_norm_weight.float()


def mix_blocks(keys, inv_rms, partial, stream, q, eps: float, scaling: str, table=None):
    """The mix over completed blocks keys [BT, m, D] (1/rms [BT, m], or their scores `table`) and the partial sum,
    for q [D] or [BT, D]: (mix, weights [BT, n], scores, the partial's 1/rms). "count": n * sum_i alpha_i k_i as
    H + sum_i (n alpha_i - 1) k_i (H the stream): at zero queries the base model's stream bit for bit."""
    m, d = keys.shape[-2], keys.shape[-1]
    # Completed blocks: cached statistics; the partial sum (changed since the boundary) joins one softmax over them.
    logits = source_scores(keys, q) * inv_rms if table is None else table
    inv_partial = None
    if partial is not None:
        p = partial.reshape(-1, d).float()
        inv_partial = inverse_rms(p, eps)
        partial_score = p @ q if q.dim() == 1 else torch.linalg.vecdot(p, q)
        logits = torch.cat([logits, (partial_score * inv_partial).unsqueeze(-1)], dim=-1)
    weights = torch.softmax(logits, dim=-1)  # float32
    n = weights.shape[-1]
    # One batched product over the completed blocks, [BT, 1, m] @ [BT, m, D], added to the stream ("count").
    coef = weights * n - 1.0 if scaling == "count" else weights
    start = stream.float().reshape(-1, 1, d) if scaling == "count" else None
    if torch.compiler.is_compiling():  # as a sum of products, fused with the softmax (see `source_scores`)
        mixed = (coef[:, :m, None] * keys).sum(1, keepdim=True) + (0.0 if start is None else start)
    else:
        mixed = torch.bmm(coef[:, None, :m], keys) if start is None else torch.baddbmm(start, coef[:, None, :m], keys)
    if partial is not None:
        # In place: the product's backward does not need its output.
        mixed.addcmul_(coef[:, m:, None], p.unsqueeze(1))
    return mixed.view(stream.shape).to(stream.dtype), weights, logits, inv_partial


def no_autocast(like: torch.Tensor):
    """Autocast off on `like`'s device: depth-attention statistics stay float32 whatever the model dtype."""
    device = like.device.type
    return torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext()


def join(partial: torch.Tensor | None, stream: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sublayer's output joins the partial sum of its block (or starts it) and the residual stream, out of place
    (the states with autograd; the inference buffers make the same two adds in place)."""
    return (output if partial is None else partial + output), stream + output


class BlockState(NamedTuple):
    """The plain-tensor state (autograd, torch.compile), an immutable value passed from layer to layer, so gradient
    checkpointing replays see the forward's state. blocks [B, T, m, D] float32 (embedding, completed blocks) with
    their inv_rms [B, T, m]; partial [B, T, D] (model dtype) or None; stream, as the base model adds it. `count`:
    without autograd, blocks [.., :count, :] of one buffer for the forward, written in place (a cat copies them all at
    every close, and past 32 MB each copy is a fresh mapping whose pages fault in on every forward). `table`
    [B, T, capacity, R]: each block's scores by later readers' `queries` [R, D], made as it closes (a mix reads it)."""

    blocks: torch.Tensor
    inv_rms: torch.Tensor
    partial: torch.Tensor | None
    stream: torch.Tensor
    count: int | None = None
    queries: torch.Tensor | None = None  # None: each reader folds its own query
    table: torch.Tensor | None = None

    @classmethod
    def start(cls, embeddings: torch.Tensor, eps: float, capacity: int | None = None, queries=None) -> BlockState:
        """The embedding b_0 is always its own source; `capacity`: the buffer's (no autograd), `queries` its table's."""
        if capacity is None:
            first = embeddings.unsqueeze(-2).to(torch.float32, copy=True)  # not a view: FSDP2 warns of returned views
            return cls(first, inverse_rms(first, eps), None, embeddings)
        shape = (*embeddings.shape[:-1], capacity)  # an empty buffer, the embedding closed into it as a partial sum
        empty = embeddings.new_empty(*shape, embeddings.shape[-1], dtype=torch.float32)
        table = None if queries is None else empty.new_empty(*shape, queries.shape[0])
        return cls(empty, empty.new_empty(shape), embeddings, embeddings, 0, queries, table).close(eps)

    def close(self, eps: float, first: int = 0) -> BlockState:
        """At a block boundary the partial sum becomes a completed block (in a table, scored by readers first..)."""
        if self.partial is None:
            return self
        if self.count is not None:
            self.blocks[..., self.count, :] = self.partial
            self.inv_rms[..., self.count] = inv_rms = inverse_rms(self.partial, eps)
            if self.table is not None:
                scores = self.partial.float() @ self.queries[first:].t()  # earlier readers' columns stay unread
                self.table[..., self.count, first:] = scores * inv_rms[..., None]
            return self._replace(partial=None, count=self.count + 1)
        new = self.partial.float().unsqueeze(-2)
        blocks = torch.cat([self.blocks, new], dim=-2)
        inv_rms = torch.cat([self.inv_rms, inverse_rms(new, eps)], dim=-1)
        return BlockState(blocks, inv_rms, None, self.stream)

    def query(self, reader: int) -> torch.Tensor:
        return self.queries[reader]

    def fold(self, query: torch.Tensor, key_norm_weight: torch.Tensor | None) -> torch.Tensor:
        """A reader's query as this state's `mix` takes it (see `depth_mix`)."""
        return query if key_norm_weight is None else pseudo_query(query, key_norm_weight)

    def mix(self, q, eps: float, scaling: str, reader: int | None = None, norm: tuple = ()) -> torch.Tensor:
        return self.mix_and_weights(q, eps, scaling, reader)[0]

    def mix_token_queries(self, query, key_norm_weight, projection, eps: float, scaling: str) -> torch.Tensor:
        """The mix with one query per token (`token_queries`), in float32 whatever the model dtype."""
        with no_autocast(self.stream):
            q = token_queries(self.stream, query, key_norm_weight, *projection, eps)
            return self.mix_and_weights(q, eps, scaling)[0]

    def additive_mix_and_weights(self, query, key_norm_weight, projection, gate, eps: float):
        """Additive (AttnResConfig.additive): (the stream + `gate` * the mix of the embedding and completed blocks, the
        weights [B*T, m]). Exact at gate 0; the partial sum is left out, as the stream's direction the norm ignores."""
        with no_autocast(self.stream):
            q = self.fold(query, key_norm_weight) if projection is None else None
            q = token_queries(self.stream, query, key_norm_weight, *projection, eps) if q is None else q
            mixed, weights = self._replace(partial=None).mix_and_weights(q, eps, "mean")
        return self.stream + gate.to(self.stream.dtype) * mixed, weights

    def mix_and_weights(self, q, eps: float, scaling: str, reader=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The mix and its softmax weights [B*T, n]; the completed blocks' scores from the table where it has them."""
        m, d = self.count or self.blocks.shape[-2], self.blocks.shape[-1]
        blocks, inv_rms = self.blocks[..., :m, :].reshape(-1, m, d), self.inv_rms[..., :m].reshape(-1, m)
        table = None if self.table is None or reader is None else self.table[..., :m, reader].reshape(-1, m)
        return mix_blocks(blocks, inv_rms, self.partial, self.stream, q, eps, scaling, table)[:2]

    def add(self, output: torch.Tensor) -> BlockState:
        partial, stream = join(self.partial, self.stream, output)
        return self._replace(partial=partial, stream=stream)

    def received(self) -> BlockState:  # FSDP2 hands a layer its inputs as views: see the kernels' TrainState
        views = self.blocks._base is not None
        return self._replace(blocks=self.blocks.clone(), inv_rms=self.inv_rms.clone()) if views else self

    def current_stream(self) -> torch.Tensor:
        return self.stream
