"""Which modules form each residual sublayer: the plan the forward executes.

A sublayer is what adds one output to the residual stream: one or more branches, each
`scale * post(module(norm(h)))`, summed. A parallel-residual layer (GPT-NeoX with use_parallel_residual,
Phi-1/2, GPT-J) has one sublayer with two branches read from the same input. Norms applied to a branch's
output (Gemma 2/3 and GLM-4 post-norms, residual dropouts) and residual multipliers (Granite) belong to
the branch.

A `ModelPlan` says where the decoder stack, final norm and head are and which sublayers every decoder
layer has (layers of one model may differ). Conversion finds it from the model itself, proves it layer by
layer and records it in the converted config (`structure`), so the forward needs nothing else.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Branch:
    # Attribute of the decoder layer: the PreNorm that reads the residual stream; "" (RAW_STREAM) where the module
    # reads the stream itself (Gemma 4's per-layer-input gate).
    norm: str
    module: str  # attention or MLP module
    # Modules applied to the branch output before it joins the stream; an entry `*name` multiplies the branch's
    # value by the layer's argument `name` (Gemma 4's gate times its `per_layer_input`).
    post: tuple[str, ...] = ()
    attention: bool = False  # receives the layer's call arguments (mask, positions, cache)
    scale: float | None = None  # residual multiplier applied to the branch output (Granite)
    # (module keyword, layer keyword) pairs where the module takes the layer's arguments under other names
    # (Falcon-H1's Mamba mixer), and (module keyword, value) constants; None: the layer's arguments as they are.
    arguments: tuple[tuple[str, str], ...] | None = None
    constants: tuple[tuple[str, object], ...] = ()
    # Post-modules that take the layer's arguments too (Inkling's short convolutions): (name, arguments, constants).
    post_arguments: tuple[tuple[str, tuple | None, tuple], ...] = ()
    # > 0: the index of a bias in the module's output tuple, added to its output (GPT-NeoX-Japanese's attention).
    output_bias: int = 0
    # (position in the layer's output, index in the module's): outputs the layer returns too (RWKV's state).
    returns: tuple[tuple[int, int], ...] = ()
    # The norm reads the stream flattened to [tokens, width] (Gemma 4's experts); the output gets its shape back.
    flat: bool = False

    @classmethod
    def from_dict(cls, data: dict) -> Branch:
        """A branch as the config's `structure` records it: its fields by name, mappings as dicts, lists for tuples."""
        items = lambda mapping: None if mapping is None else tuple(mapping.items())  # noqa: E731
        post_arguments = tuple(
            (name, items(spec["arguments"]), items(spec["constants"]))
            for name, spec in data.get("post_arguments", {}).items()
        )
        fields = {
            "post": tuple(data.get("post", ())),
            "arguments": items(data.get("arguments")),
            "constants": items(data.get("constants", {})),
        }
        fields |= {"returns": tuple(map(tuple, data.get("returns", ()))), "post_arguments": post_arguments}
        return cls(**{**data, **fields})

    def call_kwargs(self, layer_kwargs: dict, x) -> dict:
        """The keyword arguments the module takes, from the layer's (X: the module's input, for the markers below)."""
        return _kwargs(self.arguments, self.constants, layer_kwargs, x)

    def post_kwargs(self, post: str, layer_kwargs: dict, x) -> dict | None:
        """The keyword arguments post-module POST takes, or None where it takes only the branch's output."""
        for name, arguments, constants in self.post_arguments:
            if name == post:
                return _kwargs(arguments, constants, layer_kwargs, x)
        return None


def _kwargs(arguments, constants, layer_kwargs: dict, x) -> dict:
    if arguments is None:
        return layer_kwargs
    kwargs = {name: _argument(source, layer_kwargs, x) for name, source in arguments}
    return {**kwargs, **dict(constants)}


RAW_STREAM = ""  # Branch.norm of a module that reads the residual stream itself
OUTPUT = "<output:"  # a module argument that is a side module's output: `<output:NAME:INDEX>` (Sublayer.side)


def output_of(module: str, index: int) -> str:
    return f"{OUTPUT}{module}:{index}>"


TIMES = "*"  # prefix of a Branch.post entry that multiplies by a layer argument


def times_argument(post: str) -> str | None:
    """The layer argument a post entry `*name` multiplies by, or None for a module's name."""
    return post[len(TIMES) :] if post.startswith(TIMES) else None


# Sources of a module argument that are not the layer's: the module's own input again (CTRL's attention takes
# v, k, q), or the residual stream that the module adds to its output itself (Bloom, MPT's MLP): zeros stand in
# for it, so the module returns its own output, which AttnRes adds as a source.
INPUT, RESIDUAL = "<input>", "<residual>"


def _argument(source: str, layer_kwargs: dict, x):
    if source == INPUT:
        return x
    if source == RESIDUAL:
        return x.new_zeros(x.shape)
    return layer_kwargs.get(source)


@dataclass(frozen=True)
class Sublayer:
    name: str  # prefix of its AttnRes parameters: "self_attention" or "mlp"
    branches: tuple[Branch, ...]
    # Modules applied to the sum of the branches before it joins the stream (Gemma 4's MoE block normalises the
    # sum of its dense MLP and its experts).
    post: tuple[str, ...] = ()
    # Side modules: (name, flat) for a module that reads the sublayer's input itself (flattened to [tokens, width]
    # where flat) and whose outputs a branch's module takes as arguments (`<output:NAME:INDEX>`): Gemma 4's router.
    side: tuple[tuple[str, bool], ...] = ()

    @classmethod
    def from_dict(cls, data: dict) -> Sublayer:
        branches = tuple(Branch.from_dict(branch) for branch in data["branches"])
        return cls(data["name"], branches, tuple(data.get("post", ())), tuple(map(tuple, data.get("side", ()))))


@dataclass(frozen=True)
class ModelPlan:
    """Where a causal LM keeps its decoder stack, final norm and head (dotted attribute paths), and each layer's
    sublayers: `kinds`, the distinct layouts, `layer_kinds`, each layer's. The converted config's `structure`."""

    layer_kinds: tuple[int, ...]
    kinds: tuple[tuple[Sublayer, ...], ...]
    eps: float  # the base model's norm eps, for the key norms
    base_model: str = "model"
    layers: str = "layers"  # relative to the base model
    final_norm: str = "norm"  # relative to the base model
    lm_head: str = "lm_head"
    logit_scale: float | None = None  # logits * scale (Cohere)
    logit_divisor: float | None = None  # logits / divisor (Granite)
    logit_softcap: float | None = None  # tanh(logits / cap) * cap (Gemma 2)
    tuple_output: int = 0  # the layers return a tuple of this length and the base model unpacks it; 0: a tensor
    # A module of the first decoder layer whose output replaces the stream it receives (RWKV's `pre_ln`): applied
    # to the embeddings, it makes the first source, as it makes the first stream of the base model.
    stream_start: str | None = None
    # Per decoder layer, the factor it multiplies the whole stream by before returning it (Gemma 4's
    # `layer_scalar`); None: 1 everywhere. See `stream_scales`.
    layer_scalars: tuple[float, ...] | None = None

    def sublayers(self, layer_index: int) -> tuple[Sublayer, ...]:
        return self.kinds[self.layer_kinds[layer_index]]

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def num_sublayers(self) -> int:
        return sum(len(self.kinds[kind]) for kind in self.layer_kinds)

    def stream_scales(self) -> tuple[tuple[float, ...], float]:
        """(P_k per layer, P for the final norm): the product of the earlier layers' `layer_scalars`. Layer k's
        outputs join the sources divided by P_k and its readers read P_k times their mix, so the sources stay in
        the embedding's units and, at zero queries, a reader reads exactly the base model's (scaled) stream."""
        scales, product = [], 1.0
        for scalar in self.layer_scalars or (1.0,) * self.num_layers:
            scales.append(product)
            product *= scalar
        return tuple(scales), product

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's own scalars, applied as the base causal LM applies them."""
        logits = logits if self.logit_scale is None else logits * self.logit_scale
        logits = logits if self.logit_divisor is None else logits / self.logit_divisor
        return logits if self.logit_softcap is None else torch.tanh(logits / self.logit_softcap) * self.logit_softcap

    @classmethod
    def from_dict(cls, data: dict) -> ModelPlan:
        """The plan the config's `structure` records: its fields by name."""
        kinds = tuple(tuple(Sublayer.from_dict(s) for s in kind) for kind in data["kinds"])
        scalars = data.get("layer_scalars")
        fields = {"kinds": kinds, "layer_kinds": tuple(data["layer_kinds"]), "eps": float(data["eps"])}
        fields["layer_scalars"] = None if scalars is None else tuple(float(value) for value in scalars)
        return cls(**{**data, **fields, "tuple_output": int(data.get("tuple_output", 0))})


def module_at(root, path: str):
    """The submodule at a dotted attribute path; a plain child name from the module's dict (every forward's lookup)."""
    if not path:
        return root
    if "." not in path:
        found = getattr(root, "_modules", {}).get(path)
        return found if found is not None else getattr(root, path)
    return functools.reduce(getattr, path.split("."), root)
