"""Find a causal LM's residual structure from the model itself, and prove it layer by layer.

Discovery runs the model once on a few tokens and records, for every decoder layer, its real call
arguments (mask, positions, cache). Each layer is then run on random hidden states with hooks on its
child modules: which child reads what tells the sublayers apart. A child reading the residual stream
must be a norm (PreNorm); the modules fed by that norm's output are the branch's module, and the
modules fed by the module's output are its post-modules (sandwich norms, residual dropouts). Branches
reading the same stream form one sublayer (parallel residual). The next stream is what the next norm
reads (or the layer returns); its difference from the previous stream, against the branch's output,
gives the residual multiplier (Granite), snapped to the config value it comes from.

A candidate plan, discovered or from the table in architectures.py, is accepted only when every
decoder layer, run on random hidden states with its real arguments, gives the same output through the
rewritten sublayers (`run_sublayer`, the function the converted model runs) as through its own forward,
both as a plain sum and as a depth-attention mix with zero queries: fp32 bit-equal or within 1e-6
relative. A failing candidate is never used; when none passes, the refusal names the layer, the
sublayer and the difference.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..modeling.architectures import (
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
)
from ..modeling.depth_attention import add_output, close_block, depth_mix, start_state
from ..modeling.modeling_attnres import positional_argnames, run_sublayer

RELATIVE_TOLERANCE = 1e-6  # fp32: bit-equal, or this close where the base forward orders its adds differently
HALF_RELATIVE_TOLERANCE = 1e-2  # bf16 / fp16: a reordered add rounds at the format's precision (2^-8)
LOGIT_TOLERANCE = 1e-4  # fp32, the whole converted model on the probe tokens
PROBE_TOKENS = 6
CONFIG_EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon", "norm_eps", "rms_norm_epsilon")


class StructureError(UnsupportedModelError):
    """No candidate structure reproduces the model's decoder layers; the message names where and by how much."""


def first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return getattr(value, "last_hidden_state", None)


# --- the real call arguments of every layer --------------------------------------------------------


@dataclass
class LayerCall:
    hidden: torch.Tensor  # the hidden states the layer received (shape, dtype, device for the probes)
    args: tuple
    kwargs: dict
    argnames: tuple[str, ...]  # the layer's positional parameter names after hidden_states

    def fresh(self) -> tuple[tuple, dict]:
        """The arguments, with a fresh copy of any cache (a replay appends to it)."""
        kwargs = {k: (copy.deepcopy(v) if _is_cache(v) else v) for k, v in self.kwargs.items()}
        args = tuple(copy.deepcopy(v) if _is_cache(v) else v for v in self.args)
        return args, kwargs

    def call_kwargs(self, args: tuple, kwargs: dict) -> dict:
        return dict(zip(self.argnames, args), **kwargs) if args else kwargs


def _is_cache(value) -> bool:
    return hasattr(value, "update") and hasattr(value, "get_seq_length")


@dataclass
class ModelTrace:
    calls: list[LayerCall]
    final_norm: str | None  # relative to the base model
    final_reader: str | None  # what reads the last layer's output when that is not a norm
    logits: torch.Tensor
    last_hidden: torch.Tensor
    tuple_output: bool  # the layers return tuples
    step_logits: torch.Tensor | None = None  # one decoding step after the probe, with the KV cache


def probe_ids(model: nn.Module, tokens: int = PROBE_TOKENS) -> torch.Tensor:
    vocab = int(getattr(model.config.get_text_config(), "vocab_size", None) or model.get_input_embeddings().weight.shape[0])
    generator = torch.Generator().manual_seed(0)
    device = model.get_input_embeddings().weight.device
    return torch.randint(min(3, vocab - 1), vocab, (1, tokens), generator=generator).to(device)


@torch.no_grad()
def trace_model(model: nn.Module, where: Where) -> ModelTrace:
    """One forward on a few tokens (with a cache, as generation runs it), recording each layer's call
    arguments, which module reads the last layer's output, the logits and the base model's last hidden state."""
    base = module_at(model, where.base_model)
    layers = module_at(base, where.layers)
    inside = {id(m) for layer in layers for m in layer.modules()}
    calls: list[LayerCall] = []
    last_output: list[torch.Tensor] = []
    tuple_output: list[bool] = []
    readers: list[str] = []
    last_hidden: list[torch.Tensor] = []
    hooks = []

    def before_layer(module, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        rest = dict(kwargs)
        rest.pop("hidden_states", None)
        snapshot = {k: (copy.deepcopy(v) if _is_cache(v) else v) for k, v in rest.items()}
        positional = tuple(copy.deepcopy(v) if _is_cache(v) else v for v in args[1:])
        calls.append(LayerCall(hidden.detach().clone(), positional, snapshot, positional_argnames(type(module))))

    def after_last(module, args, kwargs, output):
        last_output.append(first_tensor(output).detach().clone())
        tuple_output.append(isinstance(output, tuple))

    def reader(name):
        def hook(module, args, kwargs):
            x = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
            if last_output and not readers and isinstance(x, torch.Tensor) and x.shape == last_output[0].shape:
                if torch.equal(x, last_output[0]):
                    readers.append(name)

        return hook

    for layer in layers:
        hooks.append(layer.register_forward_pre_hook(before_layer, with_kwargs=True))
    hooks.append(layers[-1].register_forward_hook(after_last, with_kwargs=True))
    for name, module in base.named_modules():
        if name and id(module) not in inside and module is not layers:
            hooks.append(module.register_forward_pre_hook(reader(name), with_kwargs=True))
    hooks.append(base.register_forward_hook(lambda m, a, o: last_hidden.append(first_tensor(o))))
    # Some causal LMs call a submodule of the base model (OPT: model.decoder); the head's input then stands
    # in for the base model's output.
    head_input: list[torch.Tensor] = []
    hooks.append(module_at(model, where.lm_head).register_forward_pre_hook(lambda m, a: head_input.append(a[0])))
    try:
        output = model(input_ids=probe_ids(model), use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    if len(calls) != len(layers):
        raise UnsupportedModelError(
            f"{type(model).__name__}: {len(calls)} decoder layer calls for {len(layers)} layers in one forward"
        )
    name = readers[0] if readers else None
    final_norm = name if name is not None and is_norm(module_at(base, name)) else None
    return ModelTrace(
        calls, final_norm, name, output.logits.float(), (last_hidden or head_input)[0],
        bool(tuple_output and tuple_output[0]), _decoding_step(model, output),
    )


def _decoding_step(model: nn.Module, prefill) -> torch.Tensor | None:
    """Logits of one more token through the cache the probe filled (None where the model keeps no cache)."""
    cache = getattr(prefill, "past_key_values", None)
    if cache is None:
        return None
    ids = probe_ids(model, PROBE_TOKENS + 1)
    return model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True).logits.float()


# --- one layer's sublayers from its children's data flow -------------------------------------------


@dataclass
class _Call:
    name: str
    x: torch.Tensor  # a copy (a later in-place add must not change what was read)
    x_ref: object  # the tensor object itself: identity tells apart equal values (two norms with equal weights)
    extra: bool  # called with more than the hidden states (the layer's mask, positions, cache...)
    y: torch.Tensor | None = None
    y_ref: object = None


@dataclass
class _Branch:
    stream: int
    norm: str
    module: str | None = None
    post: list[str] = field(default_factory=list)
    attention: bool = False
    tail: int = -1  # index of the call whose output is the branch's current value
    norm_call: int = -1


def probe_hidden(call: LayerCall, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(call.hidden.shape, generator=generator, dtype=torch.float32)
    return h.to(device=call.hidden.device, dtype=call.hidden.dtype)


@torch.no_grad()
def trace_layer(layer: nn.Module, call: LayerCall, h0: torch.Tensor) -> tuple[list[_Call], torch.Tensor]:
    """The layer's direct children, in call order, with their inputs and outputs; and the layer's output."""
    calls: list[_Call] = []
    hooks = []

    def pre(name):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states", next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None))
            extra = len(args) > 1 or any(k != "hidden_states" for k in kwargs)
            copy_ = x.detach().clone() if isinstance(x, torch.Tensor) else None
            calls.append(_Call(name, copy_, x, extra))

        return hook

    def post(module, args, kwargs, output):
        y = first_tensor(output)
        for entry in reversed(calls):
            if entry.y is None:
                entry.y = y.detach().clone() if isinstance(y, torch.Tensor) else None
                entry.y_ref = y
                break

    for name, child in layer.named_children():
        hooks.append(child.register_forward_pre_hook(pre(name), with_kwargs=True))
        hooks.append(child.register_forward_hook(post, with_kwargs=True))
    try:
        args, kwargs = call.fresh()
        out = first_tensor(layer(h0, *args, **kwargs))
    finally:
        for hook in hooks:
            hook.remove()
    return calls, out


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and a.shape == b.shape and torch.equal(a, b)


def _config_floats(config) -> list[float]:
    """The config's float settings, and each divided by sqrt(num_hidden_layers) (MiniCPM's depth-scaled
    residual multiplier), as the Python floats the base model's code multiplies by."""
    values = [v for v in config.to_dict().values() if isinstance(v, float) and v not in (0.0, 1.0)]
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > 1:
        values += [v / math.sqrt(layers) for v in values]
    return values


def _snap(value: float, config) -> float | None:
    """A residual multiplier as the config states it (bit-exact), or None for 1."""
    if abs(value - 1.0) < 1e-4:
        return None
    for candidate in _config_floats(config):
        if abs(value - candidate) <= 1e-4 * abs(candidate):
            return candidate
    return value


def discover_layer(layer: nn.Module, call: LayerCall, config, h0: torch.Tensor) -> tuple[Sublayer, ...]:
    """The sublayers of one decoder layer, from its children's data flow on hidden states h0."""
    calls, out = trace_layer(layer, call, h0)
    streams: list[torch.Tensor] = [h0]
    branches: list[_Branch] = []
    produced: list[tuple[str, int]] = [("stream", 0)]  # in order: what each value is
    values: list[torch.Tensor] = [h0]
    refs: list[object] = [h0]
    for index, entry in enumerate(calls):
        module = getattr(layer, entry.name)
        source = next((produced[i] for i in range(len(refs) - 1, -1, -1) if entry.x_ref is refs[i]), None)
        if source is None:  # not the same object: the same values (a view, a copy)
            for kind_index in range(len(values) - 1, -1, -1):
                if _same(entry.x, values[kind_index]):
                    source = produced[kind_index]
                    break
        if source is None:  # a new residual stream: the previous one plus the outputs added since
            if entry.x is None:
                raise UnsupportedModelError(f"`{entry.name}` is called without a tensor input")
            streams.append(entry.x)
            produced.append(("stream", len(streams) - 1))
            values.append(entry.x)
            refs.append(entry.x_ref)
            source = produced[-1]
        kind, ref = source
        if kind == "stream":
            if not is_norm(module):
                raise UnsupportedModelError(
                    f"the residual stream is read by `{entry.name}` ({type(module).__name__}) directly, not through "
                    "a norm: a post-norm layer (or one whose norm lives inside that module)"
                )
            branches.append(_Branch(ref, entry.name, tail=index, norm_call=index))
        else:
            owner = next((b for b in branches if b.tail == ref), None)
            norm_owner = next((b for b in branches if b.norm_call == ref), None)
            if owner is not None and owner.module is None:
                owner.module, owner.attention, owner.tail = entry.name, entry.extra, index
            elif owner is not None:
                owner.post.append(entry.name)
                owner.tail = index
            elif norm_owner is not None:  # a second module fed by one norm (GPT-J, Phi: parallel branches)
                branches.append(_Branch(norm_owner.stream, norm_owner.norm, entry.name, [], entry.extra, index, ref))
            else:
                raise UnsupportedModelError(f"cannot place `{entry.name}` in the layer's data flow")
        if entry.y is not None:
            produced.append(("call", index))
            values.append(entry.y)
            refs.append(entry.y_ref)
    if any(b.module is None for b in branches):
        lone = next(b for b in branches if b.module is None)
        raise UnsupportedModelError(f"the output of norm `{lone.norm}` feeds no module")
    if not _same(out, streams[-1]):
        streams.append(out)
    sublayers: list[Sublayer] = []
    used: set[str] = set()
    for stream in range(len(streams) - 1):
        group = [b for b in branches if b.stream == stream]
        if not group:
            raise UnsupportedModelError(f"residual stream {stream} of the layer is read by no branch")
        scales: list[float | None] = [None] * len(group)
        if len(group) == 1:
            y = calls[group[0].tail].y.double()
            delta = streams[stream + 1].double() - streams[stream].double()
            denominator = (y * y).sum().item()
            if denominator > 0:
                scales[0] = _snap((delta * y).sum().item() / denominator, config)
        name = "self_attention" if any(b.attention for b in group) else "mlp"
        if name in used:
            name = f"{name}_{stream + 1}"
        used.add(name)
        sublayers.append(Sublayer(name, tuple(
            Branch(b.norm, b.module, tuple(b.post), b.attention, scale) for b, scale in zip(group, scales)
        )))
    if not sublayers:
        raise UnsupportedModelError("the decoder layer adds nothing to the residual stream")
    return tuple(sublayers)


# --- the proof -------------------------------------------------------------------------------------


def tolerance(dtype: torch.dtype) -> float:
    return RELATIVE_TOLERANCE if dtype in (torch.float32, torch.float64) else HALF_RELATIVE_TOLERANCE


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    diff = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    return diff, diff / scale if scale > 0 else diff


@dataclass(frozen=True)
class LayerFailure:
    layer: int
    sublayer: int | None  # 1-based inside the layer; None: the structure itself could not be found
    description: str
    difference: float | None = None
    relative: float | None = None
    tolerance: float = RELATIVE_TOLERANCE

    def __str__(self) -> str:
        if self.sublayer is None:
            return f"decoder layer {self.layer}: {self.description}"
        if self.difference is None:
            return f"decoder layer {self.layer}, sublayer {self.sublayer}: {self.description}"
        return (
            f"decoder layer {self.layer}, sublayer {self.sublayer} ({self.description}): the rewritten layer differs "
            f"from the original by {self.difference:.2e} (relative {self.relative:.1e} > {self.tolerance:.0e})"
        )


@torch.no_grad()
def prove_layer(layer: nn.Module, index: int, sublayers: tuple[Sublayer, ...], call: LayerCall, eps: float) -> LayerFailure | None:
    """Run the layer's own forward and the rewritten sublayers on the same random hidden states and real
    arguments: as a plain residual sum (locates the sublayer that differs), and as the depth-attention mix
    with zero queries, every output its own source (what the converted layer computes)."""
    h0 = probe_hidden(call, seed=1000 + index)
    args, kwargs = call.fresh()
    want, inputs = _run_recording_inputs(layer, sublayers, h0, args, kwargs)
    args, kwargs = call.fresh()
    call_kwargs = call.call_kwargs(args, kwargs)
    limit = tolerance(h0.dtype)
    h = h0
    for sub_index, sublayer in enumerate(sublayers):
        try:
            h = h + run_sublayer(layer, sublayer, h, call_kwargs)
        except Exception as error:  # noqa: BLE001 - a candidate that cannot even run is a failed candidate
            return LayerFailure(index, sub_index + 1, f"the rewritten {sublayer.describe()} raised {first_line(error)}")
        # The original's stream where the next sublayer reads it, else (last sublayer) the layer's output.
        reference = inputs.get(sub_index + 1) if sub_index + 1 < len(sublayers) else want
        if reference is not None and reference.shape == h.shape:
            difference, relative = relative_difference(h, reference)
            if not relative <= limit:
                return LayerFailure(index, sub_index + 1, sublayer.describe(), difference, relative, limit)
    difference, relative = relative_difference(h, want)
    if not relative <= limit:
        return LayerFailure(index, len(sublayers), sublayers[-1].describe(), difference, relative, limit)
    args, kwargs = call.fresh()
    call_kwargs = call.call_kwargs(args, kwargs)
    hidden = h0.shape[-1]
    query, key_norm = h0.new_zeros(1, hidden), h0.new_ones(hidden)
    state = start_state(h0, eps)
    for sublayer in sublayers:
        state = close_block(state, eps)
        state = add_output(state, run_sublayer(layer, sublayer, depth_mix(state, query, key_norm, eps, "count"), call_kwargs))
    mixed = depth_mix(close_block(state, eps), query, key_norm, eps, "count")
    difference, relative = relative_difference(mixed, want)
    if not relative <= limit:
        return LayerFailure(index, len(sublayers), "depth mix with zero queries: " + sublayers[-1].describe(),
                            difference, relative, limit)
    return None


def first_line(error: BaseException) -> str:
    """`Type: first line of the message`, for a one-line report."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _run_recording_inputs(layer, sublayers, h0, args, kwargs) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The layer's own output, and the stream each sublayer after the first reads in the original forward
    (the input of its first norm), to name the sublayer where the rewritten layer departs from it."""
    inputs: dict[int, torch.Tensor] = {}
    hooks = []
    for position, sublayer in enumerate(sublayers[1:], start=1):
        def hook(module, hook_args, position=position):
            if position not in inputs and hook_args and isinstance(hook_args[0], torch.Tensor):
                inputs[position] = hook_args[0].detach().clone()

        hooks.append(module_at(layer, sublayer.branches[0].norm).register_forward_pre_hook(hook))
    try:
        return first_tensor(layer(h0, *args, **kwargs)), inputs
    finally:
        for handle in hooks:
            handle.remove()


def prove(model: nn.Module, plan: ModelPlan, trace: ModelTrace) -> LayerFailure | None:
    layers = module_at(module_at(model, plan.base_model), plan.layers)
    for index, (layer, call) in enumerate(zip(layers, trace.calls)):
        failure = prove_layer(layer, index, plan.sublayers(index), call, plan.eps)
        if failure is not None:
            return failure
    return None


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


# --- everything ------------------------------------------------------------------------------------


@contextlib.contextmanager
def evaluating(model: nn.Module):
    """Probes run without dropout, whatever mode the caller left the model in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _eps(layer: nn.Module, sublayers: tuple[Sublayer, ...], config) -> float:
    for sublayer in sublayers:
        for branch in sublayer.branches:
            value = norm_eps(module_at(layer, branch.norm))
            if value is not None:
                return value
    for key in CONFIG_EPS_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, float):
            return value
    return 1e-6


def discovered_plan(model: nn.Module, where: Where, trace: ModelTrace, head: dict) -> ModelPlan:
    base = module_at(model, where.base_model)
    layers = module_at(base, where.layers)
    per_layer = []
    for index, (layer, call) in enumerate(zip(layers, trace.calls)):
        try:
            per_layer.append(discover_layer(layer, call, model.config, probe_hidden(call, seed=index)))
        except UnsupportedModelError as error:
            raise StructureError(str(LayerFailure(index, None, str(error)))) from error
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
        **head,
    )


def find_plan(model: nn.Module) -> tuple[ModelPlan, ModelTrace]:
    """The proven structure plan of a loaded causal LM (and the trace it was proven on: the probe's logits
    check the converted model), or UnsupportedModelError saying why not."""
    config = model.config
    refusal = config_refusal(config)
    if refusal:
        raise UnsupportedModelError(refusal)
    where = locate(model)
    with evaluating(model), one_thread():
        return _find_plan(model, where)


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


@contextlib.contextmanager
def one_thread():
    """The probes are a few tokens: on CPU one thread runs their small operations fastest, and several threads
    per operation on a busy machine wait on each other (measured 10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def check_converted(converted: nn.Module, trace: ModelTrace) -> None:
    """The converted model on the probe tokens gives the original's logits (fp32): what the per-layer proof
    cannot see, such as a base model that touches the hidden states between its layers."""
    if next(converted.parameters()).dtype != torch.float32:
        return  # half precision: `attnres convert`'s verification judges the distribution instead
    with evaluating(converted), one_thread():
        prefill = converted(input_ids=probe_ids(converted), use_cache=trace.step_logits is not None)
        step = _decoding_step(converted, prefill) if trace.step_logits is not None else None
    difference = relative_difference(prefill.logits.float(), trace.logits)[0]
    if step is not None and step.shape == trace.step_logits.shape:
        step_difference = relative_difference(step, trace.step_logits)[0]
        if not step_difference <= LOGIT_TOLERANCE:
            raise StructureError(
                f"{converted.config.base_model_type}: every decoder layer is reproduced, but a decoding step with the "
                f"KV cache differs from the original's by {step_difference:.2e} in the logits (> {LOGIT_TOLERANCE:.0e}): "
                "a module outside the plan's arguments keeps state in the cache"
            )
    if not difference <= LOGIT_TOLERANCE:
        raise StructureError(
            f"{converted.config.base_model_type}: every decoder layer is reproduced, but the whole converted model "
            f"differs from the original by {difference:.2e} in the logits (> {LOGIT_TOLERANCE:.0e}): the base model "
            "does more between its layers than pass the hidden states on"
        )
