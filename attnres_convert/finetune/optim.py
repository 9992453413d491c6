"""What trains, and how: trainable parameter selection, AdamW parameter groups, LR schedules and
gradient clipping.

The AttnRes parameters (pseudo-queries and key norms) are new and start at zero / one: they get their
own, higher learning rate (`train.attnres_lr`) and no weight decay (decay would pull the queries back
to uniform routing). Norm weights and biases are not decayed either, as usual.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ..modeling.modeling_attnres import AttnResKeyNorm, AttnResQuery
from .recipe import LoraSection, Recipe, RecipeError


def attnres_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The AttnRes queries and key norms, found by module type (names may carry PEFT prefixes)."""
    found = []
    for module_name, module in model.named_modules():
        if isinstance(module, (AttnResQuery, AttnResKeyNorm)):
            for name, param in module.named_parameters():
                found.append((f"{module_name}.{name}", param))
    return found


def enable_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing (the only kind AttnRes models accept), under transformers'
    current name where it has one (`gradient_checkpointing_enable` warns until it goes in v6)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def apply_lora(model: nn.Module, lora: LoraSection, seed: int) -> nn.Module:
    """Wrap with PEFT LoRA. The AttnRes parameters are then marked trainable in place, not through
    `modules_to_save`, which would train a wrapped copy of each module beside the original: one copy of
    each, saved with the model rather than the adapter."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(seed)  # the same LoRA init for the baseline and the AttnRes run of an A/B
    try:
        with warnings.catch_warnings():
            # PEFT asks transformers' deprecated `is_gradient_checkpointing`: noise for the user.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return get_peft_model(model, config)
    except ValueError as error:
        raise RecipeError(f"lora.target_modules: {error}") from error


def select_trainable(model: nn.Module, trainable: str) -> None:
    """Freeze everything but what the recipe trains (LoRA weights are already set by PEFT)."""
    new = {id(p) for _, p in attnres_parameters(model)}
    for param in model.parameters():
        if trainable == "full":
            param.requires_grad_(True)
        elif trainable == "attnres":
            param.requires_grad_(id(param) in new)
        elif id(param) in new:  # lora: PEFT froze the base; the AttnRes parameters train alongside
            param.requires_grad_(True)


@dataclass
class ParameterCounts:
    total: int
    trainable: int
    attnres: int

    def describe(self) -> str:
        return (
            f"{self.trainable:,} trainable of {self.total:,} parameters ({self.trainable / self.total:.3%}), "
            f"of which AttnRes {self.attnres:,}"
        )


def count_parameters(model: nn.Module) -> ParameterCounts:
    seen: dict[int, nn.Parameter] = {id(p): p for p in model.parameters()}
    new = {id(p) for _, p in attnres_parameters(model)}
    return ParameterCounts(
        total=sum(p.numel() for p in seen.values()),
        trainable=sum(p.numel() for p in seen.values() if p.requires_grad),
        attnres=sum(p.numel() for k, p in seen.items() if k in new and p.requires_grad),
    )


def parameter_groups(model: nn.Module, recipe: Recipe) -> list[dict]:
    train = recipe.train
    new = {id(p) for _, p in attnres_parameters(model)}
    decay, no_decay, attnres = [], [], []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if id(param) in new:
            attnres.append(param)
        elif param.dim() >= 2:
            decay.append(param)
        else:
            no_decay.append(param)
    groups = [
        {"name": "base", "params": decay, "lr": train.lr, "weight_decay": train.weight_decay},
        {"name": "base_no_decay", "params": no_decay, "lr": train.lr, "weight_decay": 0.0},
        {"name": "attnres", "params": attnres, "lr": train.peak_attnres_lr, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise RecipeError("train.trainable: no parameter would train with this recipe")
    return groups


def make_optimizer(model: nn.Module, recipe: Recipe) -> torch.optim.AdamW:
    train = recipe.train
    return torch.optim.AdamW(parameter_groups(model, recipe), betas=tuple(train.betas), eps=train.adam_eps)


class Schedule:
    """LR multiplier per step: linear warmup, then cosine to `min_ratio`, or warmup-stable-decay (flat,
    then a linear decay over the last `decay_fraction` of the steps), or constant. A plain object (not a
    lambda) so LambdaLR puts its settings in the scheduler's state_dict. With `delay`, held at 0 for that many
    steps and then run from its own step 0 (the base's rate in train.attnres_first_steps' routing-first phase)."""

    def __init__(self, kind: str, steps: int, warmup: int, min_ratio: float, decay_fraction: float, delay: int = 0):
        self.kind, self.steps, self.warmup = kind, steps, warmup
        self.min_ratio, self.decay_fraction, self.delay = min_ratio, decay_fraction, delay

    def __call__(self, step: int) -> float:
        if step < self.delay:
            return 0.0
        step -= self.delay
        if self.warmup and step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        if self.kind == "cosine":
            span = max(1, self.steps - self.warmup)
            progress = min(1.0, (step - self.warmup) / span)
            return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        decay_steps = max(1, round(self.steps * self.decay_fraction))
        decay_start = self.steps - decay_steps
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / decay_steps)
        return 1.0 - (1 - self.min_ratio) * progress


def lr_schedules(train, names: list[str]) -> list[Schedule]:
    """The schedule of each optimizer group, by its name (TRAIN: the recipe's train section)."""
    schedule = Schedule(train.schedule, train.steps, train.warmup_steps, train.min_lr_ratio, train.decay_fraction)
    first = train.attnres_first_steps
    if not first or "attnres" not in names:  # nothing to route: off
        return [schedule] * len(names)
    # Routing first: the base's groups wait, then warm up and decay over the steps left; AttnRes's run as usual.
    # Their gradients are still computed meanwhile (AdamW's moments see them; a zero rate moves and decays nothing).
    later = Schedule(
        train.schedule, train.steps - first, train.warmup_steps, train.min_lr_ratio, train.decay_fraction, delay=first
    )
    return [schedule if name == "attnres" else later for name in names]


def make_scheduler(optimizer: torch.optim.Optimizer, recipe: Recipe) -> torch.optim.lr_scheduler.LambdaLR:
    names = [group["name"] for group in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedules(recipe.train, names))


def shared_schedule_steps(first, second) -> int:
    """How many leading steps two train sections' schedules give every group the same learning rate at: a run of
    FIRST's checkpoint at or before that step continues as a run of SECOND would have (`--extend`). A cosine
    schedule depends on train.steps from its first step after warmup; wsd until the shorter run's decay starts;
    constant throughout."""
    names = ["base", "attnres"]
    ours, theirs = lr_schedules(first, names), lr_schedules(second, names)
    for step in range(min(first.steps, second.steps)):
        if any(a(step) != b(step) for a, b in zip(ours, theirs)):
            return step
    return min(first.steps, second.steps)


def clip_gradient_norm(params: list[torch.Tensor], max_norm: float | None) -> float:
    """The gradient norm of PARAMS (before clipping), clipped to MAX_NORM unless it is None."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads)
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)
