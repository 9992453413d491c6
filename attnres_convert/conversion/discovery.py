"""Find a causal LM's residual structure from the model itself: the plan a converted model runs.

Each decoder layer is run on random hidden states with hooks on its child modules (trace.py): which child
reads what tells the sublayers apart. A child reading the residual stream must be a norm (PreNorm); the
modules fed by that norm's output are the branch's module, and the modules fed by the module's output are
its post-modules (sandwich norms, residual dropouts). Branches reading the same stream form one sublayer
(parallel residual). The next stream is what the next norm reads (or the layer returns); its difference
from the previous stream, against the branch's output, gives the residual multiplier (Granite), snapped to
the config value it comes from.

`find_plan` tries the architecture table's plan first, then the discovered one, and accepts only a plan
that proof.py proves exact on every decoder layer.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..architectures import (
    OUTPUT,
    RAW_STREAM,
    TIMES,
    Branch,
    ModelPlan,
    Sublayer,
    UnsupportedModelError,
    Where,
    config_refusal,
    family_for,
    is_norm,
    locate,
    module_at,
    norm_eps,
    reads_raw_stream,
)
from ..errors import first_line
from . import stream_settings
from .proof import LayerFailure, StructureError, prove, relative_difference
from .trace import (
    LayerCall,
    ModelTrace,
    call_model,
    evaluating,
    first_tensor,
    logits_of,
    probe_hidden,
    probe_ids,
    run_probes,
    trace_layer,
    trace_model,
)

CONFIG_EPS_KEYS = (
    "rms_norm_eps",
    "layer_norm_eps",
    "layer_norm_epsilon",
    "norm_epsilon",
    "norm_eps",
    "rms_norm_epsilon",
)


# --- one layer's sublayers from its children's data flow -------------------------------------------


@dataclass
class _Branch:
    stream: int
    norm: str
    module: str | None = None
    post: list[str] = field(default_factory=list)
    attention: bool = False
    tail: int = -1  # index of the call whose output is the branch's current value
    norm_call: int = -1
    arguments: tuple | None = None  # how the module took the layer's arguments (trace.argument_map)
    constants: tuple = ()
    adds_residual: bool = False  # the module adds the stream to its output itself (Bloom)
    post_arguments: list = field(default_factory=list)  # post-modules called with the layer's arguments
    output_bias: int = 0  # index of a bias in the module's output tuple that the layer adds (GPT-NeoX-Japanese)
    module_call: int = -1  # index of the module's call
    returns: list = field(default_factory=list)  # (layer output position, module output index), see Branch.returns
    flat: bool = False  # the norm reads the stream flattened to [tokens, width] (Branch.flat)


def _output_bias(entry, y: torch.Tensor, delta: torch.Tensor) -> int:
    """The index of the vector in ENTRY's outputs the layer adds to its output Y (the step DELTA = Y + it), or 0."""
    if (delta - y).abs().max() <= 1e-6 * y.abs().max():
        return 0
    for index, value in enumerate(entry.outputs[1:], start=1):
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape[-1] == y.shape[-1]:
            if torch.allclose(y + value.double(), delta, rtol=1e-5, atol=1e-6):
                return index
    return 0


def _stream_scale(previous: torch.Tensor, y: torch.Tensor, returned: torch.Tensor, limit: float) -> float | None:
    """The factor c where a layer returns c * (stream + output) instead of stream + output (Gemma 4's
    `layer_scalar`), or None where what it returns is not that (within LIMIT relative: the layer's precision) for
    a c other than 1."""
    total = previous + y
    denominator = (total * total).sum().item()
    if denominator == 0:
        return None
    factor = (returned * total).sum().item() / denominator
    if abs(factor - 1.0) < 1e-4 or not (returned - factor * total).abs().max() <= limit * returned.abs().max():
        return None
    return factor


def _layer_scalar(layer: nn.Module, factor: float, limit: float) -> float:
    """The layer's one-element tensor (Gemma 4's `layer_scalar`) that FACTOR is, within LIMIT; else FACTOR."""
    for tensor in [*layer.buffers(recurse=False), *layer.parameters(recurse=False)]:
        if tensor.numel() == 1 and tensor.is_floating_point():
            value = float(tensor.item())
            if abs(value - factor) <= limit * abs(value):
                return value
    return factor


def _copy_of(ref, calls, streams) -> torch.Tensor | None:
    """The values of tensor REF as the layer held them: a stream, or a child's recorded input or output."""
    for stream in streams:
        if stream is ref:
            return stream
    for entry in calls:
        if entry.x_ref is ref:
            return entry.x
        if entry.y_ref is ref:
            return entry.y
    return ref if isinstance(ref, torch.Tensor) else None


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and a.shape == b.shape and torch.equal(a, b)


def _same_reshaped(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """A is B in another shape (the stream flattened to [tokens, width], or an output given the stream's shape)."""
    return (
        a is not None
        and b is not None
        and a.shape != b.shape
        and a.numel() == b.numel()
        and torch.equal(a.reshape(b.shape), b)
    )


def _side_modules(calls: list) -> set[str]:
    """The children whose outputs a later child takes as arguments (Gemma 4's router, for its experts)."""
    return {source.split(":")[1] for entry in calls for _, source in entry.arguments or () if source.startswith(OUTPUT)}


def _branch_sum(x: torch.Tensor, group: list, calls: list) -> bool:
    """Whether X is the sum, in their order, of the current outputs of a stream's several branches."""
    if len(group) < 2 or any(b.module is None for b in group):
        return False
    total = calls[group[0].tail].y
    for branch in group[1:]:
        total = total + calls[branch.tail].y.reshape(total.shape)
    return _same(x, total)


def _config_floats(config) -> list[float]:
    """The config's float settings, and each divided by sqrt(num_hidden_layers) (MiniCPM's depth-scaled
    residual multiplier), as the Python floats the base model's code multiplies by."""
    values = [v for v in config.to_dict().values() if isinstance(v, float) and v not in (0.0, 1.0)]
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > 1:
        values += [v / math.sqrt(layers) for v in values]
    return values


def _snap(value: float, config, limit: float = 1e-4) -> float | None:
    """A residual multiplier as the config states it (bit-exact: the closest config value within LIMIT relative),
    or None for 1. LIMIT is the measurement's precision: a half-precision layer's rounded adds put the ratio of a
    plain residual add a few 1e-4 away from 1."""
    if abs(value - 1.0) < limit:
        return None
    close = [c for c in _config_floats(config) if abs(value - c) <= limit * abs(c)]
    return min(close, key=lambda c: abs(value - c)) if close else value


@dataclass(frozen=True)
class LayerStructure:
    """One decoder layer as discovery found it: its sublayers and, for the first layer only, the module whose
    output replaces the stream it receives (ModelPlan.stream_start)."""

    sublayers: tuple[Sublayer, ...]
    stream_start: str | None = None
    layer_scalar: float | None = None  # the factor the layer multiplies the whole stream by before returning it


def _stream_start(layer: nn.Module, calls: list, h0: torch.Tensor) -> str | None:
    """The name of a norm that reads the layer's input and whose output another norm reads (RWKV's first block:
    `pre_ln`, then `ln1`): the norm's output is the stream from there on, not a branch's input."""
    if len(calls) < 2 or calls[0].x_ref is not h0 or calls[1].x_ref is not calls[0].y_ref:
        return None
    first, second = module_at(layer, calls[0].name), module_at(layer, calls[1].name)
    return calls[0].name if is_norm(first) and is_norm(second) else None


def _returns(calls: list, out, branches: list) -> None:
    """Mark on its branch each value the layer returns after the stream that one of its branch modules returned
    (a recurrent state the base model keeps: RWKV's, xLSTM's); values found nowhere are left to the proof."""
    if not isinstance(out, tuple):
        return
    for position, value in enumerate(out[1:], start=1):
        if value is None:
            continue
        for branch in branches:
            entry = calls[branch.module_call] if branch.module_call >= 0 else None
            index = next((i for i, ref in enumerate(entry.output_refs) if i and ref is value), None) if entry else None
            if index is not None:
                branch.returns.append((position, index))
                break


def _product_with_argument(x: torch.Tensor, produced: list, values: list, arguments: dict) -> tuple[int, str] | None:
    """(index into VALUES, argument name) where X is a value a child returned times one of the layer's tensor
    arguments (Gemma 4: its per-layer-input gate's activation times the layer's `per_layer_input`), the latest
    such value first; None where X is no such product."""
    tensors = {
        name: value
        for name, value in arguments.items()
        if isinstance(value, torch.Tensor) and value.is_floating_point()
    }
    for index in range(len(values) - 1, -1, -1):
        if produced[index][0] != "call":
            continue
        for name, value in tensors.items():
            try:
                product = values[index] * value
            except RuntimeError:  # shapes that do not broadcast
                continue
            if product.shape == x.shape and torch.equal(product, x):
                return index, name
    return None


def _post_norm_refusal(layer: nn.Module, reader: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"the residual stream is read by `{reader}` ({type(module_at(layer, reader)).__name__}) directly, not through "
        "a norm (a post-norm layer): AttnRes converts a layer whose sublayers read its stream through scale-invariant "
        "norms (a module beside them may read the raw stream, as Gemma 4's per-layer-input gate does)"
    )


def _source(entry, streams, produced, values, refs, branches, calls, group_tails, arguments):
    """((kind, index), flat, times): what a call reads, among the values the layer's calls produced so far, newest
    first: the same object, the same values (a view, a copy), the same values in another shape (FLAT: a stream
    flattened to [tokens, width]), the sum of a stream's branches (Gemma 4's MoE block), a product with the layer's
    argument TIMES, or else a new residual stream (the previous one plus the outputs added since), appended."""
    source = next((produced[i] for i in range(len(refs) - 1, -1, -1) if entry.x_ref is refs[i]), None)
    flat = False
    if source is None:
        for kind_index in range(len(values) - 1, -1, -1):
            if _same(entry.x, values[kind_index]):
                source = produced[kind_index]
                break
    if source is None:
        for kind_index in range(len(values) - 1, -1, -1):
            if _same_reshaped(entry.x, values[kind_index]):
                source, flat = produced[kind_index], entry.x.dim() == 2
                break
    if source is None and entry.x is not None:
        stream_index = next(
            (
                s
                for s in range(len(streams) - 1, -1, -1)
                if s not in group_tails and _branch_sum(entry.x, [b for b in branches if b.stream == s], calls)
            ),
            None,
        )
        if stream_index is not None:
            source = ("sum", stream_index)
    times = None
    if source is None and entry.x is not None:
        product = _product_with_argument(entry.x, produced, values, arguments)
        if product is not None:
            source, times = produced[product[0]], product[1]
    if source is None:
        if entry.x is None:
            raise UnsupportedModelError(f"`{entry.name}` is called without a tensor input")
        streams.append(entry.x)
        produced.append(("stream", len(streams) - 1))
        values.append(entry.x)
        refs.append(entry.x_ref)
        source = produced[-1]
    return source, flat, times


def _fit_sublayers(layer, config, h0, streams, branches, calls, group_tails, group_posts, sides):
    """(sublayers, layer scalar): the branches grouped by the stream they read, each sublayer named, and the scalars
    fitted from the streams: a branch's residual multiplier, an output bias, the layer's scalar on its stream."""
    sublayers: list[Sublayer] = []
    used: set[str] = set()
    layer_scalar = None
    # How closely a half-precision layer's rounded arithmetic shows a factor: scalars and multipliers are told from
    # 1 and matched to the values they come from at the layer's precision (the proof then checks them at it).
    limit = 1e-5 if h0.dtype in (torch.float32, torch.float64) else 1e-2
    for stream in range(len(streams) - 1):
        group = [b for b in branches if b.stream == stream]
        if not group:
            raise UnsupportedModelError(f"residual stream {stream} of the layer is read by no branch")
        scales: list[float | None] = [None] * len(group)
        y = None  # what the sublayer adds, where it can be told from its calls
        delta = streams[stream + 1].double() - streams[stream].double()
        if stream in group_tails:
            y = calls[group_tails[stream]].y.double()
        elif len(group) == 1:
            y = calls[group[0].tail].y.double()
            if group[0].adds_residual:
                y = y - streams[stream].double()
            elif not group[0].post:
                group[0].output_bias = _output_bias(calls[group[0].tail], y, delta)
                if group[0].output_bias:
                    y = y + calls[group[0].tail].outputs[group[0].output_bias].double()
        if y is not None:
            y = y.reshape(delta.shape)
            if stream == len(streams) - 2:
                factor = _stream_scale(streams[stream].double(), y, streams[stream + 1].double(), limit)
                if factor is not None:  # what the layer returns is factor * (stream + y): the stream before it
                    layer_scalar = _layer_scalar(layer, factor, max(limit, 1e-4))
                    delta = streams[stream + 1].double() / layer_scalar - streams[stream].double()
            denominator = (y * y).sum().item()
            if denominator > 0 and len(group) == 1 and stream not in group_tails:
                scales[0] = _snap((delta * y).sum().item() / denominator, config, max(limit, 1e-4))
            elif (
                denominator > 0 and _snap((delta * y).sum().item() / denominator, config, max(limit, 1e-4)) is not None
            ):
                raise UnsupportedModelError(
                    f"the sum of the branches reading residual stream {stream} is scaled before it joins the stream"
                )
        # "self_attention" where a branch takes the layer's arguments (not only a side module's outputs), else "mlp"
        takes_layer = any(
            b.attention and not (b.arguments and all(source.startswith(OUTPUT) for _, source in b.arguments))
            for b in group
        )
        name = "self_attention" if takes_layer else "mlp"
        if name in used:
            name = f"{name}_{stream + 1}"
        used.add(name)
        sublayers.append(
            Sublayer(
                name,
                tuple(
                    Branch(
                        b.norm,
                        b.module,
                        tuple(b.post),
                        b.attention,
                        scale,
                        b.arguments,
                        b.constants,
                        tuple(b.post_arguments),
                        b.output_bias,
                        tuple(b.returns),
                        b.flat,
                    )
                    for b, scale in zip(group, scales)
                ),
                tuple(group_posts.get(stream, ())),
                tuple((name_, flat_) for s_, name_, flat_ in sides if s_ == stream),
            )
        )
    if not sublayers:
        raise UnsupportedModelError("the decoder layer adds nothing to the residual stream")
    return sublayers, layer_scalar


def discover_layer(
    layer: nn.Module, call: LayerCall, config, h0: torch.Tensor, expand: tuple[str, ...] = (), first: bool = False
) -> LayerStructure:
    """The sublayers of one decoder layer, from its children's data flow on hidden states h0. A child that
    reads the stream itself and holds a norm (a block with its norm, mixer and residual add inside: CPM-Ant)
    is looked into: its children are the branch's norm and module (EXPAND names such children). The FIRST
    layer may replace the stream it receives by a norm's output (`_stream_start`)."""
    calls, output = trace_layer(layer, call, h0, expand)
    out = first_tensor(output)
    stream_start = _stream_start(layer, calls, h0)
    if stream_start is not None and not first:
        raise UnsupportedModelError(
            f"`{stream_start}` replaces the residual stream by its norm inside the model, not at its start: the stream "
            "is no longer the sum of the embeddings and the sublayer outputs"
        )
    start_ref: object = h0
    if stream_start is not None:  # the norm's output is the first stream; the norm is no branch's
        h0, start_ref, calls = calls[0].y, calls[0].y_ref, calls[1:]
    streams: list[torch.Tensor] = [h0]
    branches: list[_Branch] = []
    raw_readers: list[str] = []  # modules that read the stream without a norm
    produced: list[tuple[str, int]] = [("stream", 0)]  # in order: what each value is
    values: list[torch.Tensor] = [h0]
    refs: list[object] = [start_ref]
    arguments = call.call_kwargs(call.args, call.kwargs)
    side_names = _side_modules(calls)
    sides: list[tuple[int, str, bool]] = []  # (stream, side module, reads it flat)
    group_posts: dict[int, list[str]] = {}  # stream -> modules applied to the sum of its branches
    group_tails: dict[int, int] = {}  # stream -> the call whose output is that sum's current value
    for index, entry in enumerate(calls):
        module = module_at(layer, entry.name)
        (kind, ref), flat, times = _source(
            entry, streams, produced, values, refs, branches, calls, group_tails, arguments
        )
        if entry.name in side_names:  # its outputs are a module's arguments, not a value of the flow
            if kind != "stream":
                raise UnsupportedModelError(
                    f"`{entry.name}` gives another module its arguments but does not read the stream"
                )
            sides.append((ref, entry.name, flat))
            continue
        if kind == "sum" or (kind == "call" and any(tail == ref for tail in group_tails.values())):
            stream_index = ref if kind == "sum" else next(s for s, tail in group_tails.items() if tail == ref)
            group_posts.setdefault(stream_index, []).append(entry.name)
            group_tails[stream_index] = index
        elif kind == "stream":
            if not is_norm(module) and "." not in entry.name and any(is_norm(inner) for inner in module.children()):
                return discover_layer(layer, call, config, h0, (*expand, entry.name), first)
            if not is_norm(module):
                # A module that reads the raw stream: a branch of its own, without a norm (refused below where no
                # norm reads the layer's stream at all).
                if "." in entry.name:  # a block looked into (it holds norms) whose norm does not read the stream first
                    raise _post_norm_refusal(layer, entry.name.split(".")[0])
                if entry.residual is not None:
                    raise UnsupportedModelError(
                        f"`{entry.name}` reads the raw residual stream and takes it a second time"
                    )
                raw_readers.append(entry.name)
                branches.append(
                    _Branch(
                        ref,
                        RAW_STREAM,
                        entry.name,
                        [],
                        entry.extra,
                        index,
                        -1,
                        entry.arguments,
                        entry.constants,
                        module_call=index,
                    )
                )
            else:
                branches.append(_Branch(ref, entry.name, tail=index, norm_call=index, flat=flat))
        else:
            owner = next((b for b in branches if b.tail == ref), None)
            norm_owner = next((b for b in branches if b.norm_call == ref), None)
            if times is not None:
                if owner is None or owner.module is None:
                    raise UnsupportedModelError(
                        f"`{entry.name}` reads a product with the layer's argument `{times}` that is not a module's output"
                    )
                owner.post.append(TIMES + times)
            if owner is not None and owner.module is None:
                owner.module, owner.attention, owner.tail, owner.module_call = entry.name, entry.extra, index, index
                owner.arguments, owner.constants = entry.arguments, entry.constants
                if entry.residual is not None:
                    if not _same(_copy_of(entry.residual, calls, streams), streams[owner.stream]):
                        raise UnsupportedModelError(
                            f"`{entry.name}` takes a second tensor like its input that is not the residual stream"
                        )
                    owner.adds_residual = True
            elif owner is not None:
                owner.post.append(entry.name)
                owner.tail = index
                if entry.extra:
                    owner.post_arguments.append((entry.name, entry.arguments, entry.constants))
            elif norm_owner is not None:  # a second module fed by one norm (GPT-J, Phi: parallel branches)
                branches.append(
                    _Branch(
                        norm_owner.stream,
                        norm_owner.norm,
                        entry.name,
                        [],
                        entry.extra,
                        index,
                        ref,
                        entry.arguments,
                        entry.constants,
                        module_call=index,
                    )
                )
            else:
                raise UnsupportedModelError(f"cannot place `{entry.name}` in the layer's data flow")
        if entry.y is not None and entry.residual is not None and kind != "stream":
            # Its output already holds the stream: it is the next residual stream.
            streams.append(entry.y)
            produced.append(("stream", len(streams) - 1))
            values.append(entry.y)
            refs.append(entry.y_ref)
        elif entry.y is not None:
            produced.append(("call", index))
            values.append(entry.y)
            refs.append(entry.y_ref)
    if raw_readers and all(b.norm == RAW_STREAM for b in branches):
        raise _post_norm_refusal(layer, raw_readers[0])
    if any(b.module is None for b in branches):
        lone = next(b for b in branches if b.module is None)
        if output is calls[lone.norm_call].y_ref or out is calls[lone.norm_call].y_ref:
            raise UnsupportedModelError(
                f"the layer returns the output of its norm `{lone.norm}`, and its sublayers read the stream before a norm "
                "(a post-norm layer, `x = norm(x + sublayer(x))`): AttnRes converts a layer whose sublayers read its "
                "stream through scale-invariant norms (PreNorm, `x = x + sublayer(norm(x))`)"
            )
        raise UnsupportedModelError(f"the output of norm `{lone.norm}` feeds no module")
    if not _same(out, streams[-1]):
        streams.append(out)
    _returns(calls, output, branches)
    sublayers, layer_scalar = _fit_sublayers(
        layer, config, h0, streams, branches, calls, group_tails, group_posts, sides
    )
    return LayerStructure(tuple(sublayers), stream_start, layer_scalar)


# --- the head --------------------------------------------------------------------------------------


def _head_transform(model: nn.Module, where: Where, trace: ModelTrace) -> dict:
    """The scalars the causal LM applies to lm_head's output (Cohere's logit_scale, Granite's
    logits_scaling, Gemma 2's soft cap), checked against the model's own logits."""
    with torch.no_grad():
        raw = module_at(model, where.lm_head)(trace.last_hidden).float()
    want = trace.logits

    def close(got):
        return got.shape == want.shape and relative_difference(got, want)[1] <= 1e-5

    if close(raw):
        return {}
    config = model.config
    floats = _config_floats(config)
    for value in floats:
        if close(torch.tanh(raw / value) * value):
            return {"logit_softcap": value}
        if close(raw * value):
            return {"logit_scale": value}
        if close(raw / value):
            return {"logit_divisor": value}
    ratio = ((raw.double() * want.double()).sum() / (raw.double() ** 2).sum()).item()
    if close(raw * ratio):
        return {"logit_scale": ratio}
    raise UnsupportedModelError(
        f"{type(model).__name__} transforms lm_head's output in a way this tool does not recognise "
        f"(max difference {relative_difference(raw, want)[0]:.2e})"
    )


# --- the plan --------------------------------------------------------------------------------------


def _eps(layer: nn.Module, sublayers: tuple[Sublayer, ...], config) -> float:
    for sublayer in sublayers:
        for branch in sublayer.branches:
            if reads_raw_stream(branch):
                continue
            value = norm_eps(module_at(layer, branch.norm))
            if value is not None:
                return value
    for key in CONFIG_EPS_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, float):
            return value
    return 1e-6


def discovered_plan(model: nn.Module, where: Where, trace: ModelTrace, head: dict) -> ModelPlan:
    """The plan read from every decoder layer's data flow (not yet proven), with HEAD's logit transform."""
    base = module_at(model, where.base_model)
    layers = module_at(base, where.layers)
    per_layer, stream_start, scalars = [], None, []
    for index, (layer, call) in enumerate(zip(layers, trace.calls)):
        try:
            found = discover_layer(layer, call, model.config, probe_hidden(call, seed=index), first=index == 0)
        except UnsupportedModelError as error:
            raise StructureError(str(LayerFailure(index, None, str(error)))) from error
        per_layer.append(found.sublayers)
        stream_start = stream_start or found.stream_start
        scalars.append(1.0 if found.layer_scalar is None else found.layer_scalar)
    kinds = list(dict.fromkeys(per_layer))
    return ModelPlan(
        tuple(kinds.index(s) for s in per_layer),
        tuple(kinds),
        _eps(layers[0], per_layer[0], model.config),
        base_model=where.base_model,
        layers=where.layers,
        final_norm=trace.final_norm,
        lm_head=where.lm_head,
        tuple_output=trace.tuple_output,
        stream_start=stream_start,
        layer_scalars=tuple(scalars) if any(scalar != 1.0 for scalar in scalars) else None,
        **head,
    )


def check_input_embeddings(model: nn.Module) -> None:
    """UnsupportedModelError where the causal LM's `get_input_embeddings` gives no token embedding (a model with
    its own code that defines it nowhere): the probes and the converted model find the embedding through it."""
    try:
        embeddings = model.get_input_embeddings()
        problem = (
            None
            if isinstance(getattr(embeddings, "weight", None), torch.Tensor)
            else f"returns {type(embeddings).__name__}"
        )
    except (AttributeError, NotImplementedError) as error:
        problem = f"fails ({first_line(error, with_type=True)})"
    if problem is not None:
        raise UnsupportedModelError(
            f"{type(model).__name__}.get_input_embeddings {problem}: the model's code names no token embedding. Define "
            "get_input_embeddings on the causal LM class (returning its token embedding module), then convert again"
        )


def find_plan(model: nn.Module) -> tuple[ModelPlan, ModelTrace]:
    """The proven structure plan of a loaded causal LM (and the trace it was proven on: the probe's logits
    check the converted model), or UnsupportedModelError saying why not."""
    config = model.config
    refusal = config_refusal(config)
    if refusal:
        raise UnsupportedModelError(refusal)
    check_input_embeddings(model)
    stream_settings.settle(model)  # traced as the converted model will run
    with evaluating(model):
        try:
            where = locate(model)
        except UnsupportedModelError as error:  # no head the module tree names: the one that makes the logits
            head = run_probes(model, head_from_logits, model)
            if head is None:
                raise UnsupportedModelError(
                    f"{error}, and no single one of its Linear modules outputs the model's logits"
                ) from error
            where = locate(model, lm_head=head)
        return run_probes(model, _find_plan, model, where)


@torch.no_grad()
def head_from_logits(model: nn.Module) -> str | None:
    """The LM head of a model whose module tree does not tell it (no `get_output_embeddings`, several Linears
    from the hidden size to the vocabulary, a head nested in a module of its own, a config that does not name
    its vocabulary): of its Linear modules, the one whose output on the probe tokens is the model's logits (same
    shape, up to a soft cap or a scale, which the head transform then finds). None where no one output matches."""
    outputs: dict[str, torch.Tensor] = {}
    hooks = [
        module.register_forward_hook(lambda _m, _a, out, name=name: outputs.setdefault(name, out))
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
    ]
    try:
        logits = logits_of(call_model(model, probe_ids(model)))
    finally:
        for hook in hooks:
            hook.remove()
    matches = []
    flat = logits.double().flatten()
    for name, out in outputs.items():
        if isinstance(out, torch.Tensor) and out.shape == logits.shape:
            if torch.corrcoef(torch.stack([out.double().flatten(), flat]))[0, 1] > 0.999:
                matches.append(name)
    return matches[0] if len(matches) == 1 else None


def _find_plan(model: nn.Module, where: Where) -> tuple[ModelPlan, ModelTrace]:
    config = model.config
    trace = trace_model(model, where)
    if trace.final_norm is None:
        reader = f"`{trace.final_reader}`" if trace.final_reader else "the head"
        raise UnsupportedModelError(f"the last decoder layer's output is read by {reader}, not by a final norm")
    head = _head_transform(model, where, trace)
    failures: list[str] = []
    for plan in _candidates(model, where, trace, head, failures):
        failure = prove(model, plan, trace)
        if failure is None:
            return plan, trace
        failures.append(str(failure))
    raise StructureError(
        f"{config.model_type}: no candidate structure reproduces the model's decoder layers exactly: "
        + "; ".join(dict.fromkeys(failures))
    )


def _candidates(model: nn.Module, where: Where, trace: ModelTrace, head: dict, failures: list[str]):
    """The architecture table's layout where it has one, then the discovered one (found only if needed)."""
    try:
        family = family_for(model.config)
    except UnsupportedModelError:
        family = None
    if family is not None:
        try:
            yield dataclasses.replace(family.plan(model.config, model), tuple_output=trace.tuple_output)
        except UnsupportedModelError as error:
            failures.append(str(error))
    try:
        yield discovered_plan(model, where, trace, head)
    except UnsupportedModelError as error:
        failures.append(str(error))
