"""Numerical check of a conversion against the original model: logits and cached greedy generation.

Conversion adopts the base model's modules, so the reference is captured first (`capture_reference`)
and compared after surgery (`compare`): only one copy of the weights is ever in memory.

An original that cannot `generate` (a model with its own code whose forward takes no mask or cache, or whose
class has no generate) is verified on its logits: the greedy tokens then come from whole forwards, one per
new token, on both models, and the report says so (`greedy_by`, `generate_failure`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..architectures import text_config_of
from ..errors import first_line
from .trace import call_model, logits_of


@dataclass(frozen=True)
class Tolerances:
    max_abs_logit_diff: float | None
    kl: float
    top1_agreement: float
    greedy_identical: bool

    @staticmethod
    def for_dtype(dtype: torch.dtype) -> Tolerances:
        if dtype == torch.float32:
            return Tolerances(max_abs_logit_diff=1e-3, kl=1e-5, top1_agreement=1.0, greedy_identical=True)
        # Half precision rounds the residual sum differently from the converted mix: judge the distribution.
        return Tolerances(max_abs_logit_diff=None, kl=1e-3, top1_agreement=0.99, greedy_identical=False)


@dataclass
class Reference:
    input_ids: torch.Tensor  # [1, T]
    logits: torch.Tensor  # [T, V] float32
    generated: torch.Tensor  # [new_tokens]
    generate_failure: str | None = None  # why the original could not `generate`: greedy tokens by whole forwards


@dataclass
class VerificationReport:
    dtype: str
    tokens: int
    new_tokens: int
    max_abs_logit_diff: float
    kl: float  # mean over positions of KL(original || converted), nats
    top1_agreement: float
    greedy_identical: bool
    first_divergence: int | None
    tolerances: Tolerances
    greedy_by: str = "generate"  # "generate" (with the KV cache), or "forward": one whole forward per new token
    generate_failure: str | None = None  # why the original could not generate, where greedy_by is "forward"

    def failures(self) -> list[str]:
        t = self.tolerances
        out = []
        if t.max_abs_logit_diff is not None and self.max_abs_logit_diff > t.max_abs_logit_diff:
            out.append(f"max |delta logit| {self.max_abs_logit_diff:.2e} > {t.max_abs_logit_diff:.0e}")
        if self.kl > t.kl:
            out.append(f"KL {self.kl:.2e} > {t.kl:.0e}")
        if self.top1_agreement < t.top1_agreement:
            out.append(f"top-1 agreement {self.top1_agreement:.2%} < {t.top1_agreement:.0%}")
        if t.greedy_identical and not self.greedy_identical:
            out.append(f"greedy generation diverges at new token {self.first_divergence}")
        return out

    @property
    def passed(self) -> bool:
        return not self.failures()

    def to_dict(self) -> dict:
        data = asdict(self)
        data["passed"] = self.passed
        return data


def _greedy(model, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        num_beams=1,
        use_cache=True,
        pad_token_id=model.generation_config.pad_token_id or model.generation_config.eos_token_id or 0,
    )
    return out[0, input_ids.shape[1] :]


def _greedy_by_forward(model, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy tokens from whole forwards, one per new token: generation without `generate` or a cache."""
    ids = input_ids
    for _ in range(new_tokens):
        step = logits_of(call_model(model, ids))[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, step.to(ids.device)], dim=1)
    return ids[0, input_ids.shape[1] :]


@torch.no_grad()
def capture_reference(model, input_ids: torch.Tensor, new_tokens: int = 32) -> Reference:
    logits = logits_of(call_model(model, input_ids))[0].float()
    if not new_tokens:
        return Reference(input_ids, logits, input_ids[0, :0])
    try:
        return Reference(input_ids, logits, _greedy(model, input_ids, new_tokens))
    except Exception as error:  # noqa: BLE001 - the model's own code, in generate: any failure means "cannot generate"
        failure = first_line(error, with_type=True)
    return Reference(input_ids, logits, _greedy_by_forward(model, input_ids, new_tokens), failure)


@torch.no_grad()
def compare(reference: Reference, model) -> VerificationReport:
    logits = logits_of(call_model(model, reference.input_ids))[0].float()
    ref = reference.logits
    kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(ref, -1), log_target=True, reduction="none").sum(-1)
    new_tokens = reference.generated.shape[0]
    greedy = _greedy if reference.generate_failure is None else _greedy_by_forward
    generated = greedy(model, reference.input_ids, new_tokens) if new_tokens else reference.generated
    mismatch = (generated != reference.generated).nonzero()
    dtype = next(model.parameters()).dtype
    return VerificationReport(
        dtype=str(dtype).removeprefix("torch."),
        tokens=int(reference.input_ids.shape[1]),
        new_tokens=new_tokens,
        max_abs_logit_diff=(logits - ref).abs().max().item(),
        kl=kl.mean().item(),
        top1_agreement=(logits.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        greedy_identical=mismatch.numel() == 0,
        first_divergence=int(mismatch[0, 0]) if mismatch.numel() else None,
        tolerances=Tolerances.for_dtype(dtype),
        greedy_by="generate" if reference.generate_failure is None else "forward",
        generate_failure=reference.generate_failure,
    )


# Where configs keep the longest sequence a model can run (learned position tables end there).
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def _context_limit(config) -> int | None:
    config = text_config_of(config)
    return next((v for key in _CONTEXT_KEYS if isinstance(v := getattr(config, key, None), int) and v > 0), None)


def _fit(limit: int | None, tokens: int, new_tokens: int) -> tuple[int, int]:
    if limit is None or tokens + new_tokens <= limit:
        return tokens, new_tokens
    new_tokens = min(new_tokens, limit // 4)
    return min(tokens, limit - new_tokens), new_tokens


def fit_to_context(config, tokens: int, new_tokens: int) -> tuple[int, int]:
    """Shorten the verification (prompt, then generated tokens) to the model's context window: a model with a
    learned position table cannot run past it, and the check must not fail for that reason."""
    return _fit(_context_limit(config), tokens, new_tokens)


SHORTEST_PROBE = 8


@torch.no_grad()
def fit_to_model(model, tokens: int, new_tokens: int) -> tuple[int, int]:
    """`fit_to_context`, and, for a model with its own code whose config names its context window its own way
    (`context`, `block_size`...), the longest sequence it runs: the whole length, else halved until it runs (a
    learned position table or a causal-mask buffer ends at the window)."""
    from ..io.base_code import is_own_code

    if _context_limit(model.config) is not None or not is_own_code(type(model)):
        return fit_to_context(model.config, tokens, new_tokens)
    device = next(model.parameters()).device

    def runs(length: int) -> bool:
        try:
            call_model(model, torch.zeros(1, length, dtype=torch.long, device=device))
        except (IndexError, RuntimeError, ValueError, AssertionError):
            return False
        return True

    total = tokens + new_tokens
    if runs(total):
        return tokens, new_tokens
    good, bad = total // 2, total
    while good > SHORTEST_PROBE and not runs(good):
        good, bad = good // 2, good
    while bad - good > max(1, good // 16):  # then closer to the window: within 1/16 of it
        middle = (good + bad) // 2
        good, bad = (middle, bad) if runs(middle) else (good, middle)
    return _fit(good, tokens, new_tokens)


def sample_input_ids(tokenizer, text: str, max_tokens: int = 256, vocab_size: int | None = None) -> torch.Tensor:
    """Token ids of `text` (the built-in sample by default), or a fixed pseudo-random sequence when
    the model has no tokenizer."""
    if tokenizer is not None:
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :max_tokens]
        if ids.shape[1] > 0:
            return ids
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size or 1000, (1, max_tokens), generator=generator)
