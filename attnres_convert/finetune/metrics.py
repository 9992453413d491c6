"""metrics.jsonl: one JSON object per line, `kind` "train" (what a training step measured) or "eval" (a held-out evaluation)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

METRICS = "metrics.jsonl"


class MetricsLog:
    """Appends records to OUT/metrics.jsonl (main process only), flushed line by line so a killed run
    keeps everything up to its last step."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def truncate_after(self, step: int) -> None:
        """On resume: drop records of steps the checkpoint does not include (they will be redone)."""
        if not self.enabled or not self.path.is_file():
            return
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def reset(self) -> None:
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")


@dataclass
class StepStats:
    """What one optimizer step measured (global over processes)."""

    loss: float
    grad_norm: float  # the base (or LoRA) parameters', before clipping
    attnres_grad_norm: float | None  # the AttnRes parameters', before clipping; None when none train
    lrs: dict[str, float]  # this step's learning rate per parameter group
    tokens: int
    seconds: float
    stopping: bool  # a signal or stop_at_step asked every process to stop after this step
    kl: float | None = None  # mean KL(starting model || model) per prediction, with train.kl_weight

    @property
    def lr(self) -> float:
        """The learning rate shown and logged: the base parameters', else the AttnRes ones'."""
        return self.lrs.get("base", self.lrs.get("attnres"))

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def train_record(stats: StepStats, step: int, tokens: int, epoch: float, depth_gate: float | None) -> dict:
    """The metrics.jsonl record of training step STEP (TOKENS: seen so far; DEPTH_GATE: None when off)."""
    return {
        "kind": "train",
        "step": step,
        "loss": stats.loss,
        "lr": stats.lr,
        "attnres_lr": stats.lrs.get("attnres"),
        "grad_norm": stats.grad_norm,
        "attnres_grad_norm": stats.attnres_grad_norm,
        **({"kl": stats.kl} if stats.kl is not None else {}),
        **({"depth_gate": depth_gate} if depth_gate is not None else {}),
        "tokens": tokens,
        "tokens_per_s": stats.tokens_per_s,
        "epoch": epoch,
    }


def read_metrics(path: Path) -> list[dict]:
    records = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line:
            try:
                records.append(json.loads(line))
            except ValueError:
                break  # a line cut short by a crash ends the log
    return records


def loss_history(records: list[dict]) -> list[dict]:
    """[{"step", "loss", "eval_loss"}], the shape plots.loss_curve_plot and card.finetune_card read."""
    by_step: dict[int, dict] = {}
    for record in records:
        point = by_step.setdefault(record["step"], {"step": record["step"]})
        point["loss" if record.get("kind") == "train" else "eval_loss"] = record["loss"]
    return [by_step[step] for step in sorted(by_step)]
