"""The inference buffer (no autograd): every source of a forward in one preallocated float32 buffer, written in place,
source-major. The attnres package's kernels subclass it (a token-major buffer for decoding steps, C++, Triton)."""

from __future__ import annotations

import torch

from .depth_math import inverse_rms, pseudo_query


class SourceBuffer:
    """The state of a forward without autograd, updated in place. sources [K, B, T, D] float32: the completed sources
    in slots [0, count), the partial sum in slot `count`; inv_rms [K, B, T] their 1/rms; scores [K, B, T, R] (with
    `queries` [R, D]): each completed source scored by every reader as it completes (phase 1 of the two-phase mix;
    a reader scores only its partial sum, phase 2). shared_stream: the stream is the last slot (float32 models), so
    an output joins the partial sum and the stream in one add."""

    __slots__ = ("sources", "inv_rms", "count", "has_partial", "stream", "queries", "scores", "shared_stream")
    zeroed = True  # partial sums start by adding to zeros where the stream is shared (see `start`)

    def __init__(self, sources, inv_rms, count, has_partial, stream, queries=None, scores=None, shared_stream=False):
        self.sources, self.inv_rms, self.count, self.has_partial = sources, inv_rms, count, has_partial
        self.stream, self.queries, self.scores, self.shared_stream = stream, queries, scores, shared_stream

    @classmethod
    def start(cls, embeddings: torch.Tensor, eps: float, capacity: int, queries=None) -> SourceBuffer:
        """The buffer of a many-token forward, the embedding in slot 0 (with its scores where there are queries)."""
        shared = embeddings.dtype == torch.float32
        rows, stream = capacity + int(shared), embeddings
        # Zeros where partial sums start by adding (a shared stream); a kernel backend writes a block's first output.
        new = embeddings.new_zeros if shared and cls.zeroed else embeddings.new_empty
        sources = new(rows, *embeddings.shape, dtype=torch.float32)
        sources[0] = embeddings
        if shared:
            stream = sources[capacity]
            stream.copy_(embeddings)
        inv_rms = sources.new_empty(sources.shape[:-1])
        inv_rms[0] = inverse_rms(sources[0], eps)
        state = cls(sources, inv_rms, 1, False, stream, shared_stream=shared)
        if queries is not None:
            state.queries, state.scores = queries, sources.new_empty(*sources.shape[:-1], queries.shape[0])
            state.score_source(0)
        return state

    def score_source(self, slot: int, first: int = 0) -> None:
        """Phase 1 for a completed source: its scores by readers `first`.. (earlier columns stay unread)."""
        key, table = self.sources[slot], self.scores[slot]
        d, readers = key.shape[-1], table.shape[-1]
        scores = torch.mm(key.reshape(-1, d), self.queries[first:].t())
        torch.mul(scores, self.inv_rms[slot].reshape(-1, 1), out=table.view(-1, readers)[:, first:])

    def close(self, eps: float, first: int = 0) -> SourceBuffer:
        """The partial sum becomes a completed source, with its statistics and scores for readers `first`.."""
        if not self.has_partial:
            return self
        count = self.count
        self.inv_rms[count] = inverse_rms(self.sources[count], eps)
        if self.scores is not None:
            self.score_source(count, first)
        self.count, self.has_partial = count + 1, False
        return self

    def query(self, reader: int) -> torch.Tensor:
        return self.queries[reader]

    def fold(self, query: torch.Tensor, key_norm_weight: torch.Tensor | None) -> torch.Tensor:
        return query if key_norm_weight is None else pseudo_query(query, key_norm_weight)

    def mix(self, q, eps: float, scaling: str, reader: int | None = None, norm: tuple = ()) -> torch.Tensor:
        """Scores [n, B, T] from the table (phase 2: only the partial sum is scored here) or one product; the mix."""
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
        return _chained_mix(self.stream, weights, self.sources, scaling)

    def slot(self, j: int) -> torch.Tensor:
        return self.sources[j]

    def with_stream(self, j: int) -> torch.Tensor:
        """Source j and the shared stream as one [2, B, T, D] view."""
        last = self.sources.shape[0] - 1
        return self.sources[j :: last - j]

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


def _chained_mix(stream: torch.Tensor, weights: torch.Tensor, sources: torch.Tensor, scaling: str) -> torch.Tensor:
    """n * sum_i alpha_i k_i as H + sum_i n (alpha_i - 1/n) k_i (exactly H at zero queries), weights [n, B, T] its own:
    for few tokens one batched product (a decoding step pays per operation), else a multiply-add per source."""
    n, d = weights.shape[0], sources.shape[-1]
    if scaling == "count" and weights[0].numel() <= 64:
        coef, keys = weights.sub_(1.0 / n).mul_(n).view(n, -1, 1).movedim(0, -1), sources[:n].view(n, -1, d)
        return (
            torch.baddbmm(stream.float().view(-1, 1, d), coef, keys.transpose(0, 1)).view(stream.shape).to(stream.dtype)
        )
    if scaling == "count":
        coef = weights.sub_(1.0 / n).mul_(n).unsqueeze(-1)
        mixed = torch.addcmul(stream.float(), coef[0], sources[0])
    else:
        coef = weights.unsqueeze(-1)
        mixed = sources[0] * coef[0]
    for i in range(1, n):
        mixed.addcmul_(coef[i], sources[i])
    return mixed.to(stream.dtype)
