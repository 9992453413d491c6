"""What attnres's training and inspection do to a forward's depth mixes, as a state around the forward's own: the
depth gate of a training schedule (`set_depth_gate`: a reader reads stream + gate * (mix - stream)) and recorders
of the depth-attention weights (`record_depth_weights`). modeling_attnres.start_state asks for it only while one of
them is set on the model's runtime, so a plain forward never pays for either.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..modeling.modeling_attnres import BlockState, ModelRuntime, no_autocast, token_queries


class Recorder(list):
    """The softmax weights [n, B, T] of every reader of the forwards run while it is open, in order. `open` turns
    False when the recording ends (a checkpointed layer replayed by a later backward records nothing)."""

    open = True

    def add(self, weights: torch.Tensor) -> None:
        if self.open:
            self.append(weights)


class ControlledState(NamedTuple):
    """A forward's state (`inner`) under a depth gate and a recorder. While recording, the inner state is a
    BlockState, whose mix gives its weights."""

    inner: object
    gate: float
    recorder: Recorder | None

    @property
    def queries(self):
        return self.inner.queries

    @property
    def stream(self) -> torch.Tensor:
        return self.inner.stream

    def close(self, eps: float, first: int = 0) -> ControlledState:
        return self._replace(inner=self.inner.close(eps, first))

    def query(self, reader: int) -> torch.Tensor:
        return self.inner.query(reader)

    def fold(self, query, key_norm_weight):
        return self.inner.fold(query, key_norm_weight)

    def mix(self, q, eps: float, scaling: str, reader: int | None = None, norm: tuple = ()) -> torch.Tensor:
        if self.recorder is None:
            return self._gated(self.inner.mix(q, eps, scaling, reader))
        mixed, weights = self.inner.mix_and_weights(q, eps, scaling)
        self._record(weights)
        return self._gated(mixed)

    def mix_token_queries(self, query, key_norm_weight, projection, eps: float, scaling: str) -> torch.Tensor:
        if self.recorder is None:
            return self._gated(self.inner.mix_token_queries(query, key_norm_weight, projection, eps, scaling))
        with no_autocast(self.stream):
            q = token_queries(self.stream, query, key_norm_weight, *projection, eps)
            mixed, weights = self.inner.mix_and_weights(q, eps, scaling)
        self._record(weights)
        return self._gated(mixed)

    def additive_mix_and_weights(self, query, key_norm_weight, projection, gate, eps: float):
        mixed, weights = self.inner.additive_mix_and_weights(query, key_norm_weight, projection, gate, eps)
        if self.recorder is not None:
            self._record(weights)
        return self._gated(mixed), weights

    def add(self, output: torch.Tensor) -> ControlledState:
        return self._replace(inner=self.inner.add(output))

    def current_stream(self) -> torch.Tensor:
        return self.inner.current_stream()

    def received(self) -> ControlledState:
        received = getattr(self.inner, "received", None)
        return self if received is None else self._replace(inner=received())

    def _gated(self, mix: torch.Tensor) -> torch.Tensor:
        # In one operation; at gate 0 it is the plain residual stream exactly (0 times a finite difference adds 0).
        return mix if self.gate == 1.0 else torch.lerp(self.inner.current_stream(), mix, self.gate)

    def _record(self, weights: torch.Tensor) -> None:
        """Token-major weights [B*T, n] as [n, B, T]."""
        self.recorder.add(weights.detach().movedim(-1, 0).reshape(-1, *self.stream.shape[:-1]))


def controlled_state(state, embeddings: torch.Tensor, eps: float, runtime: ModelRuntime) -> ControlledState:
    """STATE under the runtime's depth gate and its newest recorder (on a BlockState, for the weights)."""
    recorder = runtime.recorders[-1] if runtime.recorders else None
    if recorder is not None and not isinstance(state, BlockState):
        state = BlockState.start(embeddings, eps)
    return ControlledState(state, float(runtime.gate), recorder)
