"""What a Block AttnRes model does with depth: the learned depth-attention weights, and per-sublayer
magnitudes and gradients compared with the original residual model.

* Depth weights: the softmax weights of every reader (sublayers 1..L, then the output aggregation),
  averaged over the tokens of a sample text, as a matrix reader x source. Source column k is block k
  (column 0 the embedding); a reader's own block enters as its running partial sum, in its block's
  column, so the matrix is a staircase, as in the AttnRes paper's figure.
* Profiles: for each sublayer, the RMS of the stream its norm reads (in a PreNorm model it grows with
  depth, so each new output is a shrinking share of it: PreNorm dilution), the RMS of what it adds, and
  the gradient norm of its parameters under the LM loss. "Original" is the same model with its
  pseudo-queries set to zero, which computes the plain residual sum with the same weights (count
  scaling): exactly the base model for a converted model or one whose base weights were not trained,
  so no second checkpoint is needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..block_sizes import source_ranges
from ..conversion.surgery import ConversionSummary, summarize
from ..depth_controls import record_depth_weights
from ..errors import SourceError
from ..modeling.modeling_attnres import AttnResForCausalLM, AttnResQuery, module_at, times_argument


@dataclass
class DepthWeights:
    readers: list[str]  # "layer 3 attention", ..., "output"
    kinds: list[str]  # per reader: "attention", "mlp", "attention+mlp" or "output"
    layers: list[int]  # per reader: its decoder layer (0-based); -1 for the output aggregation
    columns: list[str]  # "embedding", "block 1", ...
    matrix: np.ndarray  # [readers, columns], NaN where the reader does not read that source
    tokens: int

    def to_dict(self) -> dict:
        data = asdict(self)
        data["matrix"] = [[None if np.isnan(v) else round(float(v), 6) for v in row] for row in self.matrix]
        return data


@dataclass
class SublayerProfile:
    stream_rms: list[float]  # RMS of the input each sublayer's norm reads
    output_rms: list[float]  # RMS of what each sublayer adds
    grad_norm: list[float]  # L2 norm of the LM-loss gradient of each sublayer's parameters
    loss: float

    @property
    def output_share(self) -> list[float]:
        return [out / max(stream, 1e-12) for out, stream in zip(self.output_rms, self.stream_rms)]


@dataclass
class Inspection:
    name: str
    summary: ConversionSummary
    kinds: list[str]  # per sublayer
    queries_zero: bool  # freshly converted: the model computes exactly the original
    depth: DepthWeights
    original: SublayerProfile | None = None
    converted: SublayerProfile | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "summary": asdict(self.summary),
            "queries_zero": self.queries_zero,
            "depth_weights": self.depth.to_dict(),
            "original": asdict(self.original) if self.original else None,
            "converted": asdict(self.converted) if self.converted else None,
            "notes": self.notes,
        }


# --- structure -------------------------------------------------------------------------------------


def _layers(model: AttnResForCausalLM):
    plan = model._attnres_plan
    return module_at(module_at(model, plan.base_model), plan.layers)


def sublayer_kinds(model: AttnResForCausalLM) -> list[str]:
    """attention / mlp / attention+mlp for sublayers 1..L in execution order."""
    plan = model._attnres_plan
    return [
        "attention+mlp" if len(s.branches) > 1 else ("mlp" if s.name.startswith("mlp") else "attention")
        for index in range(plan.num_layers)
        for s in plan.sublayers(index)
    ]


def queries_are_zero(model: AttnResForCausalLM) -> bool:
    return all(bool((t == 0).all()) for t in _query_tensors(model))


def _query_tensors(model: AttnResForCausalLM) -> list[torch.Tensor]:
    """Every tensor that is zero at conversion and makes the model the original again when zeroed: w, with
    query_rank the projections' B, with `additive` the gates (zero gates alone would do)."""
    tensors = []
    for module in model.modules():
        if isinstance(module, AttnResQuery):
            tensors += [module.weight] + ([module.up] if module.rank else [])
            tensors += [module.gate] if "gate" in module._parameters else []
    return tensors


@contextlib.contextmanager
def original_behaviour(model: AttnResForCausalLM) -> Iterator[None]:
    """Temporarily zero the pseudo-queries: with count scaling the model then computes the base model
    exactly (the conversion's guarantee), whatever it has learned."""
    queries = _query_tensors(model)
    saved = [q.detach().clone() for q in queries]
    try:
        with torch.no_grad():
            for q in queries:
                q.zero_()
        yield
    finally:
        with torch.no_grad():
            for q, value in zip(queries, saved):
                q.copy_(value)


# --- depth weights ---------------------------------------------------------------------------------


@torch.no_grad()
def depth_weights(model: AttnResForCausalLM, input_ids: torch.Tensor) -> DepthWeights:
    """Mean softmax weight of every (reader, source) pair over the tokens of `input_ids` [B, T]."""
    summary = summarize(model)
    total, size = summary.num_sublayers, summary.block_size
    with record_depth_weights(model) as recorded:
        model(input_ids=input_ids.to(model.device))
    if len(recorded) != total + 1:
        raise RuntimeError(f"expected {total + 1} depth mixes in one forward pass, recorded {len(recorded)}")
    ranges = source_ranges(total, size)
    matrix = np.full((total + 1, summary.num_blocks + 1), np.nan)
    for row, (weights, sources) in enumerate(zip(recorded, ranges)):
        mean = weights.float().mean(dim=(1, 2)).cpu().numpy()  # [n]: averaged over batch and tokens
        for value, (first, _last) in zip(mean, sources):
            matrix[row, 0 if first == 0 else (first - 1) // size + 1] = value
    kinds = sublayer_kinds(model)
    per_layer = total // len(_layers(model))
    layers = [index // per_layer for index in range(total)] + [-1]
    readers = [f"layer {layer} {kind}" for layer, kind in zip(layers, kinds)] + ["output"]
    label = "sublayer" if size == 1 else "block"
    columns = ["embedding"] + [f"{label} {k}" for k in range(1, summary.num_blocks + 1)]
    return DepthWeights(readers, kinds + ["output"], layers, columns, matrix, int(input_ids.numel()))


# --- magnitudes and gradients ----------------------------------------------------------------------


def _rms(x: torch.Tensor) -> float:
    return x.detach().float().pow(2).mean(-1).sqrt().mean().item()


def sublayer_profile(model: AttnResForCausalLM, input_ids: torch.Tensor) -> SublayerProfile:
    """Stream and output RMS per sublayer (forward hooks on each branch's norm and last module) and the
    gradient norm of each sublayer's parameters, from one forward/backward pass of the LM loss."""
    plan = model._attnres_plan
    layers = _layers(model)
    total = plan.num_sublayers
    stream: list[float | None] = [None] * total
    outputs: list[float] = [0.0] * total
    output_sums: list[torch.Tensor | None] = [None] * total
    current = [0]
    hooks = []

    def reading(index):
        def hook(module, args, kwargs=None):
            current[0] = index
            if stream[index] is None:  # a shared norm (Phi) reads the same input twice
                stream[index] = _rms(args[0])

        return hook

    def adding(module, args, output):
        y = output[0] if isinstance(output, tuple) else output
        index = current[0]
        output_sums[index] = y.detach() if output_sums[index] is None else output_sums[index] + y.detach()

    param_groups: list[list[torch.nn.Parameter]] = []
    index = -1
    for layer_index, layer in enumerate(layers):
        seen_norms, seen_last = set(), set()
        for sublayer in plan.sublayers(layer_index):
            index += 1
            params: dict[int, torch.nn.Parameter] = {}
            for branch in sublayer.branches:
                # What reads the stream: the norm, or the module itself where it reads the raw stream.
                norm = module_at(layer, branch.norm or branch.module)
                if id(norm) not in seen_norms:
                    seen_norms.add(id(norm))
                    hooks.append(norm.register_forward_pre_hook(reading(index)))
                steps = [name for name in branch.post if times_argument(name) is None]  # modules, not products
                # What the sublayer adds: its last module, or the last applied to the sum of its branches.
                last = module_at(layer, sublayer.post[-1] if sublayer.post else steps[-1] if steps else branch.module)
                if id(last) not in seen_last:  # Phi's branches share one dropout: it fires once per branch
                    seen_last.add(id(last))
                    hooks.append(last.register_forward_hook(adding))
                for name in (branch.norm, branch.module, *steps, *sublayer.post, *(side for side, _ in sublayer.side)):
                    for p in module_at(layer, name).parameters() if name else ():
                        params[id(p)] = p
            param_groups.append(list(params.values()))
    was_training = model.training
    model.eval()
    model.zero_grad(set_to_none=True)
    try:
        with torch.enable_grad():
            ids = input_ids.to(model.device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        grads = [
            sum(float(p.grad.float().pow(2).sum()) for p in group if p.grad is not None) ** 0.5
            for group in param_groups
        ]
    finally:
        for hook in hooks:
            hook.remove()
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    outputs = [_rms(y) if y is not None else float("nan") for y in output_sums]
    return SublayerProfile([s if s is not None else float("nan") for s in stream], outputs, grads, float(loss.detach()))


# --- all of it -------------------------------------------------------------------------------------


def inspect_model(
    model: AttnResForCausalLM, input_ids: torch.Tensor, name: str = "model", profiles: bool = True
) -> Inspection:
    """Summary, depth weights and (when `profiles`) original-vs-converted magnitude and gradient profiles."""
    zero = queries_are_zero(model)
    inspection = Inspection(name, summarize(model), sublayer_kinds(model), zero, depth_weights(model, input_ids))
    if zero:
        inspection.notes.append(
            "the pseudo-queries are all zero (as converted): every reader weighs its sources uniformly and the "
            "model computes exactly the original; fine-tune it to see learned routing"
        )
    if profiles:
        inspection.converted = sublayer_profile(model, input_ids)
        if zero:
            inspection.original = inspection.converted  # identical by construction: no second pass
        else:
            with original_behaviour(model):
                inspection.original = sublayer_profile(model, input_ids)
    return inspection


@dataclass
class InspectResult:
    inspection: Inspection
    converted_here: bool  # MODEL was a plain model, converted in memory for the inspection
    plots: list = field(default_factory=list)


def inspect_source(
    model: str | None,
    *,
    text: str | None = None,
    max_tokens: int = 256,
    plot: str | None = None,
    profiles: bool | None = None,
    dtype: str = "float32",
    trust_remote_code: bool = False,
) -> InspectResult:
    """Load MODEL (a converted folder, or a plain model which is converted in memory with the default S),
    measure it on TEXT (default: the built-in sample) and, with PLOT=OUT.png, write OUT.png (depth
    weights), OUT-relative.png (the same against uniform) and OUT-magnitudes.png (residual sum against
    AttnRes). Profiles need a backward pass: they
    run when plotting unless `profiles` says otherwise."""
    if plot:  # said before the model is loaded, not after the measurement
        from ..optional import require

        require("matplotlib", "--plot (drawing the depth-attention weights)")
    from ..architectures import UnsupportedModelError, vocab_size_of
    from ..conversion.convert import refusal
    from ..conversion.surgery import convert_model
    from ..conversion.verify import fit_to_context, sample_input_ids
    from ..io.loading import load_any
    from ..io.samples import SAMPLE_TEXT

    try:
        loaded = load_any(model, dtype, trust_remote_code)
        network = loaded.model
        if not loaded.converted:
            network = convert_model(network).eval()
    except UnsupportedModelError as error:
        raise UnsupportedModelError(refusal(model or "the embedded model", error, "inspect")) from error
    if max_tokens < 2:
        raise SourceError(f"--max-tokens must be at least 2, got {max_tokens}")
    tokens, _ = fit_to_context(network.config.text_config, max_tokens, 0)
    ids = sample_input_ids(loaded.tokenizer, text or SAMPLE_TEXT, tokens, vocab_size_of(network))
    inspection = inspect_model(network, ids, loaded.name, profiles=bool(plot) if profiles is None else profiles)
    if loaded.tokenizer is None:
        inspection.notes.append("the model has no tokenizer: measured on fixed pseudo-random token ids")
    if not loaded.converted:
        inspection.notes.append(f"{loaded.name} is a plain model: converted in memory (default S) for this inspection")
    result = InspectResult(inspection, not loaded.converted)
    if plot:
        from .plots import depth_heatmaps, magnitude_profiles

        out = Path(plot).expanduser()
        summary = inspection.summary
        state = "as converted: uniform" if inspection.queries_zero else "learned"
        title = (
            f"{loaded.name}: depth-attention weights ({state}), S = {summary.block_size}, {summary.num_blocks} blocks, "
            f"mean over {inspection.depth.tokens} tokens"
        )
        result.plots.append(depth_heatmaps(inspection.depth, out, title))
        relative_path = out.with_name(f"{out.stem}-relative{out.suffix or '.png'}")
        title = f"{loaded.name}: depth-attention weights against uniform (n x alpha; 1 = as converted)"
        result.plots.append(depth_heatmaps(inspection.depth, relative_path, title, relative=True))
        if inspection.converted is not None:
            profile_path = out.with_name(f"{out.stem}-magnitudes{out.suffix or '.png'}")
            title = f"{loaded.name}: per-sublayer magnitudes and gradients, original vs Block AttnRes"
            result.plots.append(
                magnitude_profiles(
                    inspection.original,
                    inspection.converted,
                    inspection.kinds,
                    profile_path,
                    title,
                    identical=inspection.queries_zero,
                )
            )
    return result
