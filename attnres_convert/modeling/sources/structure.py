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


@dataclass(frozen=True)
class Branch:
    # Attribute of the decoder layer: the PreNorm that reads the residual stream; "" (RAW_STREAM) where the module
    # reads the stream itself (Gemma 4's per-layer-input gate). With source_scaling "count" the depth mix at zero
    # queries is the stream itself, so such a reader still reads exactly what it read in the base model.
    norm: str
    module: str  # attention or MLP module
    # Modules applied to the branch output before it joins the stream; an entry `*name` multiplies the branch's
    # value by the layer's argument `name` (Gemma 4's gate times its `per_layer_input`).
    post: tuple[str, ...] = ()
    attention: bool = False  # receives the layer's call arguments (mask, positions, cache)
    scale: float | None = None  # residual multiplier applied to the branch output (Granite)
    # Where the module takes the layer's arguments under other names (Falcon-H1's Mamba mixer gets the layer's
    # `mamba_attention_mask` as `attention_mask`, its cache as `cache_params`): (module keyword, layer keyword)
    # pairs, and (module keyword, value) constants the layer passes; None: the layer's arguments as they are.
    arguments: tuple[tuple[str, str], ...] | None = None
    constants: tuple[tuple[str, object], ...] = ()
    # Post-modules that take the layer's arguments too (Inkling's short convolutions after attention and the MLP
    # keep their state in the cache): (post name, arguments as above, constants).
    post_arguments: tuple[tuple[str, tuple | None, tuple], ...] = ()
    # > 0: the module returns a bias at this index of its output tuple, which the layer adds to its output
    # (GPT-NeoX-Japanese's attention).
    output_bias: int = 0
    # Values of the module's output tuple that the decoder layer returns after the stream, for the base model to
    # keep (a recurrent state: RWKV's, xLSTM's): (position in the layer's output tuple, index in the module's).
    returns: tuple[tuple[int, int], ...] = ()
    # The norm reads the stream flattened to [tokens, width] (Gemma 4's experts take their tokens flat); the
    # branch's output is given the stream's shape again.
    flat: bool = False

    @classmethod
    def from_dict(cls, data: dict) -> Branch:
        arguments = data.get("arguments")
        post_arguments = tuple(
            (
                name,
                None if spec["arguments"] is None else tuple(spec["arguments"].items()),
                tuple(spec["constants"].items()),
            )
            for name, spec in data.get("post_arguments", {}).items()
        )
        return cls(
            data["norm"],
            data["module"],
            tuple(data.get("post", ())),
            bool(data.get("attention", False)),
            data.get("scale"),
            None if arguments is None else tuple(arguments.items()),
            tuple(data.get("constants", {}).items()),
            post_arguments,
            int(data.get("output_bias", 0)),
            tuple((int(p), int(i)) for p, i in data.get("returns", ())),
            bool(data.get("flat", False)),
        )

    def call_kwargs(self, layer_kwargs: dict, x) -> dict:
        """The keyword arguments the module takes, from those the decoder layer was called with (X: the module's
        input, for the markers below)."""
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


def reads_raw_stream(branch: Branch) -> bool:
    return branch.norm == RAW_STREAM


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
        return cls(
            data["name"],
            tuple(Branch.from_dict(branch) for branch in data["branches"]),
            tuple(data.get("post", ())),
            tuple((name, bool(flat)) for name, flat in data.get("side", ())),
        )


@dataclass(frozen=True)
class ModelPlan:
    """Where a causal LM keeps its decoder stack, final norm and head (attribute paths, dotted where nested),
    and every decoder layer's sublayers: `kinds` lists the distinct layer layouts, `layer_kinds` the layout
    of each layer. Serialised into the converted config as `structure`."""

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
    tuple_output: int = (
        0  # the layers return a tuple of this length (True: 1) and the base model unpacks it; 0: a tensor
    )
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
        """(P_k for each decoder layer, P for the final norm): how much the base model's stream has been scaled by the
        layer scalars of the layers before (the product of their `layer_scalars`). Layer k's outputs join the
        sources divided by P_k and its readers read P_k times their mix, so every source stays in the units of the
        embedding and, at zero queries, a reader reads exactly the base model's (scaled) stream."""
        scales, product = [], 1.0
        for scalar in self.layer_scalars or (1.0,) * self.num_layers:
            scales.append(product)
            product *= scalar
        return tuple(scales), product

    @classmethod
    def from_dict(cls, data: dict) -> ModelPlan:
        kinds = tuple(tuple(Sublayer.from_dict(s) for s in kind) for kind in data["kinds"])
        optional = {
            k: data[k]
            for k in ("logit_scale", "logit_divisor", "logit_softcap", "tuple_output", "stream_start")
            if data.get(k) is not None
        }
        if data.get("layer_scalars") is not None:
            optional["layer_scalars"] = tuple(float(v) for v in data["layer_scalars"])
        return cls(
            tuple(data["layer_kinds"]),
            kinds,
            float(data["eps"]),
            data["base_model"],
            data["layers"],
            data["final_norm"],
            data["lm_head"],
            **optional,
        )


def module_at(root, path: str):
    """The submodule at a dotted attribute path ("model.decoder.layers"). A plain child name is read from the
    module's dict first: this runs for every branch of every sublayer in every forward."""
    if not path:
        return root
    if "." not in path:
        found = getattr(root, "_modules", {}).get(path)
        return found if found is not None else getattr(root, path)
    return functools.reduce(getattr, path.split("."), root)
