"""What a finished run leaves: its final metrics, the loss curve, and the model folder with its card."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..io.base_code import ship_model_code
from ..io.text import perplexity
from .metrics import loss_history
from .recipe import Recipe
from .run_folder import FINAL_METRICS, LOSS_CURVE, MODEL_DIR, RECIPE_FILE
from .starting_model import StartingModel
from .stopping import TrainingError


@dataclass
class FinetuneResult:
    output: Path
    model_dir: Path | None
    metrics: dict
    records: list[dict] = field(repr=False, default_factory=list)
    pushed: object | None = None  # hub.PushResult when output.push_to_hub was set


def final_metrics(records, state, counts, start, recipe, final_loss, world) -> dict:
    """final_metrics.json: the held-out loss before and after, the budget trained, the speed."""
    evals = [r for r in records if r.get("kind") == "eval"]
    trains = [r for r in records if r.get("kind") == "train"]
    first = evals[0] if evals and evals[0]["step"] == 0 else None
    return {
        "steps": state.step,
        "tokens": state.tokens,
        "processes": world,
        "converted": start.converted,
        "trainable": recipe.train.trainable,
        "trainable_parameters": counts.trainable,
        "attnres_parameters": counts.attnres,
        "eval_loss_start": first["loss"] if first else None,
        "eval_perplexity_start": first["perplexity"] if first else None,
        "eval_loss": final_loss,
        "eval_perplexity": perplexity(final_loss),
        "train_loss_last": trains[-1]["loss"] if trains else None,
        "tokens_per_s": state.tokens / state.train_seconds if state.train_seconds else None,
        "train_seconds": state.train_seconds,
    }


def save_result(
    accelerator, model, start: StartingModel, recipe: Recipe, out: Path, final: dict, records, corpus
) -> Path | None:
    """Final metrics, loss curve and (unless output.save_model is false) the model folder."""
    state_dict = None
    if recipe.output.save_model and accelerator.distributed_type.value == "FSDP":
        state_dict = accelerator.get_state_dict(model)  # gathers the shards; every process takes part
    if not accelerator.is_main_process:
        return None
    from ..analysis.plots import loss_curve_plot, plot_unless_missing

    history = loss_history(records)
    title = f"{'AttnRes' if start.converted else 'Baseline (no AttnRes)'}: {start.source.short_name}"
    plotted = plot_unless_missing(
        lambda: loss_curve_plot(history, out / LOSS_CURVE, title=title), f"{LOSS_CURVE} (the loss curve)"
    )
    (out / FINAL_METRICS).write_text(json.dumps(final, indent=2))
    if not recipe.output.save_model:
        return None
    from ..io.saving import SHIPPED_CODE, atomic_folder

    unwrapped = accelerator.unwrap_model(model)
    adapter = None
    if recipe.train.trainable == "lora":
        if recipe.lora.merge:
            unwrapped = unwrapped.merge_and_unload()
        else:
            adapter = unwrapped
    model_dir = out / MODEL_DIR

    def write(folder: Path) -> None:
        base = unwrapped
        if adapter is not None:
            adapter.save_pretrained(folder / "adapter")  # LoRA weights only
            base = adapter.unload()  # the AttnRes model without LoRA layers (its AttnRes params are trained)
        base.save_pretrained(folder, state_dict=state_dict, max_shard_size=recipe.output.max_shard_size)
        ship_model_code(base, folder)
        if start.converted:
            missing = [name for name in SHIPPED_CODE if not (folder / name).is_file()]
            if missing:
                raise TrainingError(
                    f"internal error: save_pretrained did not copy {missing}; the model folder would not load"
                )
        start.tokenizer.save_pretrained(folder)
        if plotted:
            shutil.copy(out / LOSS_CURVE, folder / LOSS_CURVE)
        (folder / RECIPE_FILE).write_text(recipe.to_yaml())
        (folder / "finetune_metrics.json").write_text(json.dumps(final, indent=2))
        (folder / "README.md").write_text(model_card(base, start, recipe, final, history, corpus, plotted))

    # A model folder left by an earlier attempt of this run is swapped out only once the new one is complete.
    atomic_folder(model_dir, write, owned=True)
    return model_dir


def model_card(model, start: StartingModel, recipe: Recipe, final: dict, history, corpus, plotted: bool = True) -> str:
    """README.md of the model folder: where it started, the recipe, the held-out metrics, the loss curve."""
    from ..conversion.surgery import summarize
    from ..io.card import base_identity, baseline_card, card_identity, finetune_card

    name = start.source.short_name
    if start.source.kind == "folder":
        base_model, license_ = card_identity(start.source.location)
    else:
        base_model, license_ = base_identity(start.source)
    metrics = {}
    if final["eval_loss_start"] is not None:
        before = "before fine-tuning (= original)" if start.converted else "before fine-tuning"
        metrics[before] = {"loss": final["eval_loss_start"], "perplexity": final["eval_perplexity_start"]}
    metrics["fine-tuned"] = {"loss": final["eval_loss"], "perplexity": final["eval_perplexity"]}
    common = dict(
        name=name,
        base_model=base_model,
        license=license_,
        recipe=recipe.model_dump(mode="json"),
        metrics=metrics,
        finetuned_key="fine-tuned",
        eval_data=f"{corpus.eval_documents} held-out documents, {len(corpus.eval)} sequences x {recipe.data.seq_len} tokens",
        train_data=f"{final['tokens']:,} tokens",
        loss_curve=LOSS_CURVE if plotted else None,
        history=history,
    )
    if not start.converted:
        return baseline_card(**common)  # front matter and all: a baseline can be pushed like any model
    return finetune_card(summarize(model), **common)
