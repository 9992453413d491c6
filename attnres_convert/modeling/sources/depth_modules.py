"""The AttnRes parameters' modules (a reader's pseudo-query and key norm), and how a reader finds their weights
through the wrappers that training and big-model loading put around them.
"""

from __future__ import annotations

import torch
from torch import nn


class AttnResQuery(nn.Module):
    """The pseudo-query w of one reader, stored as [1, d] like a bias-free Linear(d, 1). With rank r > 0 also
    A = `down` [r, d] (kaiming-uniform from a generator seeded with the reader's index) and B = `up` [d, r] (zero):
    q = w + B A x / rms(x) (`token_queries`). Additive: also `gate` [1], zero (`additive_mix_and_weights`)."""

    def __init__(self, hidden_size: int, rank: int = 0, reader: int = 0, device=None, dtype=None, additive=False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, device=device, dtype=dtype))
        self.rank, self.reader = rank, reader
        if rank:
            self.down = nn.Parameter(torch.empty(rank, hidden_size, device=device, dtype=dtype))
            self.up = nn.Parameter(torch.zeros(hidden_size, rank, device=device, dtype=dtype))
        if additive:
            self.gate = nn.Parameter(torch.zeros(1, device=device, dtype=dtype))

    def forward(self) -> torch.Tensor:
        # Called (rather than read) only where a hook must run first: big-model offload loads the weight here.
        return self.weight

    def initial_values(self) -> dict[str, torch.Tensor]:
        """Each parameter's value at conversion (float32, CPU), by parameter name."""
        hidden = self.weight.shape[-1]
        values = {"weight": torch.zeros(1, hidden)}
        if self.rank:
            # nn.Linear's (and LoRA's A) default: kaiming_uniform_(a=sqrt(5)), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
            bound = 1.0 / hidden**0.5
            generator = torch.Generator().manual_seed(self.reader)
            values["down"] = torch.empty(self.rank, hidden).uniform_(-bound, bound, generator=generator)
            values["up"] = torch.zeros(hidden, self.rank)
        if "gate" in self._parameters:
            values["gate"] = torch.zeros(1)
        return values

    def plain_inputs(self, like: torch.Tensor | None = None) -> tuple:
        """((A, B) of an input-dependent query, the gate of an additive reader), each None where the reader has none,
        on the device of `like` where given."""
        if "_hf_hook" in self.__dict__ and self.weight.device.type == "meta":
            self()  # big-model offload loads the module's weights when it is called
        move = (lambda t: t) if like is None else (lambda t: t.to(like.device))  # noqa: E731
        gate = getattr(self, "gate", None)  # by attribute: FSDP1 swaps parameters for plain tensors in its forward
        return ((move(self.down), move(self.up)) if self.rank else None), (None if gate is None else move(gate))

    def extra_repr(self) -> str:
        extra = (f", rank={self.rank}" if self.rank else "") + (", additive" if "gate" in self._parameters else "")
        return f"{self.weight.shape[-1]}{extra}"


class AttnResKeyNorm(nn.Module):
    """The RMSNorm weight g applied to the keys of one reader (the eps is the base model's)."""

    def __init__(self, hidden_size: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self) -> torch.Tensor:
        return self.weight

    def initial_values(self) -> dict[str, torch.Tensor]:
        return {"weight": torch.ones(self.weight.shape)}

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def depth_params(layer: nn.Module, names: tuple[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
    """A sublayer's pseudo-query w and key-norm weight g, looked up at call time (PEFT or FSDP may have wrapped the
    modules); plain modules through their dicts, faster than nn.Module's attribute lookup."""
    query, key_norm = layer._modules[names[0]], layer._modules[names[1]]
    if type(query) is AttnResQuery and type(key_norm) is AttnResKeyNorm and "_hf_hook" not in query.__dict__:
        # FSDP1 swaps parameters for plain tensor attributes during its forward: then `.weight` below.
        weight, norm_weight = query._parameters.get("weight"), key_norm._parameters.get("weight")
        if weight is not None and norm_weight is not None:
            return weight, norm_weight
    # A wrapper (PEFT's modules_to_save) hands out its active weight; an offloaded module loads it.
    return loaded_weight(query), loaded_weight(key_norm)


def loaded_weight(module: nn.Module) -> torch.Tensor:
    """A depth-attention module's weight; offloaded (a meta tensor), it is loaded by calling the module."""
    weight = module.weight
    if weight.device.type == "meta" and hasattr(module, "_hf_hook"):
        weight = module()
    return weight


def placed(module: nn.Module, like: torch.Tensor) -> torch.Tensor:
    """An output-aggregation weight on the device of the stream (a device map may put it elsewhere)."""
    return loaded_weight(module).to(like.device)


def init_depth_module(module: AttnResQuery | AttnResKeyNorm, skip_loaded: bool = False) -> None:
    """Set a depth-attention module's parameters to their conversion values (skip_loaded: except loaded ones)."""
    for name, value in module.initial_values().items():
        param = module._parameters[name]
        if skip_loaded and (getattr(param, "_is_hf_initialized", False) or param.device.type == "meta"):
            continue
        param.copy_(value)
