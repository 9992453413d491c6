"""Running a causal LM on probe tokens with hooks: what discovery and the proof read from the model itself.

`trace_model` runs the model once on a few tokens (with a cache, as generation runs it) and records, for
every decoder layer, its real call arguments (mask, positions, cache), which module reads the last layer's
output, the logits, and the logits of one more token through the cache. `trace_layer` runs one decoder
layer on given hidden states with hooks on its direct children, recording what each child reads and
returns: the data flow discovery.py reads the sublayers from. Probes run in eval mode (`evaluating`) and,
on the CPU, on one thread of their own (`run_probes`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from ..architectures import UnsupportedModelError, Where, is_norm, module_at, vocab_size_of
from ..modeling.modeling_attnres import INPUT, RESIDUAL, cache_keyword, cache_of, output_of, positional_argnames
from .single_thread import run_single_threaded

PROBE_TOKENS = 6


def first_tensor(value):
    """The hidden states in a module's output (a tensor, a tuple starting with one, or a model output)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return getattr(value, "last_hidden_state", None)


# --- calling a causal LM as its own forward takes its inputs ----------------------------------------


def _forward_parameters(model: nn.Module):
    try:
        return inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None


def takes_input(model: nn.Module, name: str) -> bool:
    """Whether MODEL's forward takes the keyword NAME (it names it, or takes **kwargs)."""
    parameters = _forward_parameters(model)
    if parameters is None:
        return True
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def call_model(model: nn.Module, ids: torch.Tensor, **inputs):
    """MODEL on token IDS, as its own forward takes them: under `input_ids` where it names that, else as its first
    argument (a model with its own code: `forward(tokens)`, `forward(idx, targets=None)`); INPUTS (`use_cache`...)
    only where it takes them, and left out where a forward that takes **kwargs passes them on to a module that
    does not."""
    parameters = _forward_parameters(model)
    given = {name: value for name, value in inputs.items() if takes_input(model, name)}
    by_name = parameters is None or "input_ids" in parameters

    def run(extra):
        return model(input_ids=ids, **extra) if by_name else model(ids, **extra)

    if not given:
        return run({})
    try:
        return run(given)
    except TypeError as error:
        if "argument" not in str(error):
            raise
        return run({})


def logits_of(output) -> torch.Tensor:
    """The logits in a causal LM's output: its `logits`, or, from a model with its own code, the output itself (a
    tensor) or the first 3-d tensor of the tuple it returns (`logits, loss`)."""
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        found = next((v for v in output if isinstance(v, torch.Tensor) and v.dim() == 3), None)
        if found is not None:
            return found
    raise UnsupportedModelError(f"its forward returns {type(output).__name__}, in which there are no logits")


# --- the real call arguments of every layer --------------------------------------------------------


@dataclass
class LayerCall:
    """How the model called one decoder layer in the traced forward: what a probe of the layer replays."""

    hidden: torch.Tensor  # the hidden states the layer received (shape, dtype, device for the probes)
    args: tuple
    kwargs: dict
    argnames: tuple[str, ...]  # the layer's positional parameter names after hidden_states

    def fresh(self) -> tuple[tuple, dict]:
        """The arguments, with a fresh copy of any cache or recurrent state (a replay writes to it)."""
        kwargs = {k: _snapshot(v) for k, v in self.kwargs.items()}
        args = tuple(_snapshot(v) for v in self.args)
        return args, kwargs

    def call_kwargs(self, args: tuple, kwargs: dict) -> dict:
        return dict(zip(self.argnames, args), **kwargs) if args else kwargs


def _is_cache(value) -> bool:
    return hasattr(value, "update") and hasattr(value, "get_seq_length")


def _snapshot(value):
    """A copy of a layer argument that the forward may write to: a cache, or a recurrent state kept as a list or
    tuple of tensors (RWKV writes its layer's column in place; the xLSTM model copies the new state into the one
    it passed). Anything else as it is."""
    if _is_cache(value) or (isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value)):
        return copy.deepcopy(value)
    return value


@dataclass
class ModelTrace:
    """What one forward of the whole model on the probe tokens showed: the layers' calls, what reads the last
    layer's output, and the logits the converted model must reproduce."""

    calls: list[LayerCall]
    final_norm: str | None  # relative to the base model
    final_reader: str | None  # what reads the last layer's output when that is not a norm
    logits: torch.Tensor
    last_hidden: torch.Tensor
    tuple_output: int  # the length of the tuples the layers return (0: a tensor)
    step_logits: torch.Tensor | None = None  # one decoding step after the probe, with the KV cache
    # The base model returned a model output with `last_hidden_state` (not a bare tensor): what the converted
    # model's own call of the base model reads (see surgery.runs_outer_forward).
    base_output: bool = True


def probe_ids(model: nn.Module, tokens: int = PROBE_TOKENS) -> torch.Tensor:
    """The probe tokens: the same random ids (past the usual special tokens) for the original and the converted model."""
    vocab = int(vocab_size_of(model))
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
    tuple_output: list[int] = []
    readers: list[str] = []
    last_hidden: list[torch.Tensor] = []
    hooks = []

    def before_layer(module, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        rest = dict(kwargs)
        rest.pop("hidden_states", None)
        snapshot = {k: _snapshot(v) for k, v in rest.items()}
        positional = tuple(_snapshot(v) for v in args[1:])
        calls.append(LayerCall(hidden.detach().clone(), positional, snapshot, positional_argnames(type(module))))

    def after_last(module, args, kwargs, output):
        last_output.append(first_tensor(output).detach().clone())
        tuple_output.append(len(output) if isinstance(output, tuple) else 0)

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
    base_outputs: list = []

    def after_base(module, args, output):
        last_hidden.append(first_tensor(output))
        base_outputs.append(getattr(output, "last_hidden_state", None) is not None)

    hooks.append(base.register_forward_hook(after_base))
    # Some causal LMs call a submodule of the base model (OPT: model.decoder); the head's input then stands
    # in for the base model's output.
    head_input: list[torch.Tensor] = []
    hooks.append(module_at(model, where.lm_head).register_forward_pre_hook(lambda m, a: head_input.append(a[0])))
    try:
        output = call_model(model, probe_ids(model), use_cache=True)
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
        calls,
        final_norm,
        name,
        logits_of(output).float(),
        (last_hidden or head_input)[0],
        tuple_output[0] if tuple_output else 0,
        one_more_token_logits(model, output),
        base_output=not base_outputs or base_outputs[0],  # OPT's causal LM calls a submodule of its base model
    )


def one_more_token_logits(model: nn.Module, prefill) -> torch.Tensor | None:
    """Logits of one more token through the cache the probe filled (None where the model keeps no cache)."""
    cache = cache_of(prefill)
    if cache is None:
        return None
    ids = probe_ids(model, PROBE_TOKENS + 1)
    keyword = cache_keyword(model.forward)
    unused = copy.deepcopy(cache)  # a step that fails may have written to the cache already
    try:
        return model(input_ids=ids[:, -1:], use_cache=True, **{keyword: cache}).logits.float()
    except (RuntimeError, ValueError, IndexError):
        # A model whose forward slices the cached prefix off itself takes the whole sequence at every step
        # (CPM-Ant: its prompt and position bias are built from all the tokens).
        return model(input_ids=ids, use_cache=True, **{keyword: unused}).logits.float()[:, -1:]


# --- one layer's children, in call order -----------------------------------------------------------


@dataclass
class ChildCall:
    """One call of a decoder layer's direct child: what it read and what it returned."""

    name: str
    x: torch.Tensor  # a copy (a later in-place add must not change what was read)
    x_ref: object  # the tensor object itself: identity tells apart equal values (two norms with equal weights)
    extra: bool  # called with more than the hidden states (the layer's mask, positions, cache...)
    y: torch.Tensor | None = None
    y_ref: object = None
    # How it took the layer's arguments where not under their own names (see `argument_map`), else None.
    arguments: tuple[tuple[str, str], ...] | None = None
    constants: tuple[tuple[str, object], ...] = ()
    residual: object = None  # the tensor passed as RESIDUAL (discovery checks that it is the residual stream)
    outputs: tuple = ()  # copies of the tensors of its output tuple (None elsewhere), where it returns one
    output_refs: tuple = ()  # the objects of its output tuple themselves (what the layer may return after the stream)


def probe_hidden(call: LayerCall, seed: int) -> torch.Tensor:
    """Random hidden states of the shape, dtype and device the layer received, drawn in fp32 from SEED."""
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(call.hidden.shape, generator=generator, dtype=torch.float32)
    return h.to(device=call.hidden.device, dtype=call.hidden.dtype)


@torch.no_grad()
def trace_layer(
    layer: nn.Module, call: LayerCall, h0: torch.Tensor, expand: tuple[str, ...] = ()
) -> tuple[list[ChildCall], object]:
    """The layer's direct children, in call order, with their inputs and outputs; and the layer's output as it
    returns it (a tensor or a tuple). A child named in EXPAND is traced through its own children instead
    (`block.norm`, `block.attention`)."""
    calls: list[ChildCall] = []
    hooks = []

    def pre(name):
        def hook(module, args, kwargs):
            x = (
                args[0]
                if args
                else kwargs.get(
                    "hidden_states", next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
                )
            )
            extra = len(args) > 1 or any(k != "hidden_states" for k in kwargs)
            copy_ = x.detach().clone() if isinstance(x, torch.Tensor) else None
            earlier = {
                id(v): (entry.name, i)
                for entry in calls
                for i, v in enumerate(entry.output_refs)
                if i and isinstance(v, torch.Tensor)
            }
            mapped = argument_map(name, module, args, kwargs, layer_kwargs, earlier) if extra else None
            arguments, constants, residual = mapped or (None, (), None)
            calls.append(ChildCall(name, copy_, x, extra, arguments=arguments, constants=constants, residual=residual))

        return hook

    def post(module, args, kwargs, output):
        y = first_tensor(output)
        for entry in reversed(calls):
            if entry.y is None:
                entry.y = y.detach().clone() if isinstance(y, torch.Tensor) else None
                entry.y_ref = y
                if isinstance(output, tuple):
                    entry.outputs = tuple(v.detach().clone() if isinstance(v, torch.Tensor) else None for v in output)
                    entry.output_refs = output
                break

    traced = [
        (f"{name}.{inner}" if name in expand else name, module)
        for name, child in layer.named_children()
        for inner, module in (child.named_children() if name in expand else [(name, child)])
    ]
    for name, child in traced:
        hooks.append(child.register_forward_pre_hook(pre(name), with_kwargs=True))
        hooks.append(child.register_forward_hook(post, with_kwargs=True))
    args, kwargs = call.fresh()
    layer_kwargs = call.call_kwargs(args, kwargs)
    try:
        out = layer(h0, *args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return calls, out


_LITERALS = (bool, int, float, str)


def argument_map(
    child: str, module: nn.Module, args: tuple, kwargs: dict, layer_kwargs: dict, earlier: dict | None = None
):
    """How MODULE (the layer's child CHILD) took the decoder layer's arguments (LAYER_KWARGS) besides the hidden states: None where it took
    them under their own names (the layer's keywords are passed on as they are), else (pairs, constants): for
    each argument, the layer's keyword of the very same object, or a literal value (None, a flag) to pass as is.
    None too where an argument is something the layer computed (the proof then judges the plain pass-on)."""
    received = {k: v for k, v in kwargs.items() if k != "hidden_states"}
    if len(args) > 1:
        names = positional_argnames(type(module))
        if len(names) < len(args) - 1:
            return None
        received.update(zip(names, args[1:]))
    if (
        len(args) <= 1
        and _takes_all(module, layer_kwargs)
        and all(
            k in layer_kwargs and layer_kwargs[k] is v and not (v is None and f"{child}_{k}" in layer_kwargs)
            for k, v in received.items()
        )
    ):
        return None
    pairs, constants, residual = [], [], None
    x = args[0] if args else kwargs.get("hidden_states")
    for name, value in received.items():
        same = [k for k, v in layer_kwargs.items() if v is value and (value is not None or k == name)]
        own = f"{child}_{name}"  # a layer argument named for the module: Falcon-H1's `mamba_attention_mask`
        if own in layer_kwargs and layer_kwargs[own] is value:
            pairs.append((name, own))
        elif same:
            pairs.append((name, name if name in same else same[0]))
        elif value is None or isinstance(value, _LITERALS):
            constants.append((name, value))
        elif value is x:
            pairs.append((name, INPUT))
        elif earlier and id(value) in earlier:  # what an earlier child returned (Gemma 4's router, for its experts)
            pairs.append((name, output_of(*earlier[id(value)])))
        elif (
            residual is None
            and isinstance(value, torch.Tensor)
            and isinstance(x, torch.Tensor)
            and value.shape == x.shape
        ):
            pairs.append((name, RESIDUAL))
            residual = value
        else:
            return None
    return tuple(pairs), tuple(constants), residual


def _takes_all(module: nn.Module, layer_kwargs: dict) -> bool:
    """Whether MODULE's forward accepts every keyword the layer was called with (it takes **kwargs, or names
    them all): RWKV's attention takes the layer's `state` and `use_cache` but not its `output_attentions`."""
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return True
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return True
    return set(layer_kwargs) <= set(parameters)


@contextlib.contextmanager
def evaluating(model: nn.Module):
    """Probes run without dropout, whatever mode the caller left the model in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def run_probes(model: nn.Module, work, *args):
    """WORK(*ARGS), probes of MODEL, on one CPU thread (single_thread.py) where MODEL computes on the CPU;
    inline on an accelerator, whose speed does not hang on CPU threads and whose per-thread state (current
    device and stream) stays the caller's."""
    if all(param.device.type == "cpu" for param in model.parameters()):
        return run_single_threaded(work, *args)
    return work(*args)
