"""`attnres finetune`: continued pretraining of a converted (or, for a baseline, original) model.

Accelerate owns devices, mixed precision and distribution, so the same code runs on one CPU, under
`accelerate launch` with several processes (DDP) and with FSDP. Only the main process writes the run
folder; every process writes its own RNG state into checkpoints (that is what resuming needs).

Run folder (output.dir):
    recipe.yaml          the resolved recipe (written at the start)
    metrics.jsonl        training steps and held-out evaluations
    checkpoints/         resumable state, the last checkpoint.keep_last of them
    loss_curve.png       at the end
    final_metrics.json   at the end
    model/               the trained model (converted format; LoRA merged unless lora.merge=false)

The loss of a step is the mean over every next-token prediction of the global batch (all micro-batches
and processes), so N processes x grad_accum G give the same update as 1 process x grad_accum N*G.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .checkpoints import (
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    remove_partial_checkpoints,
    save_checkpoint,
    trainable_only_hook,
)
from .data import Corpus, SequenceOrder, Sequences, build_corpus, local_micro_batches
from ..errors import AttnResError
from .metrics import METRICS, MetricsLog, loss_history, perplexity, read_metrics
from .optim import apply_lora, count_parameters, enable_checkpointing, make_optimizer, make_scheduler, select_trainable
from .recipe import Recipe, RecipeError, check_recipe, is_run_folder, parse_recipe, read_yaml
from .starting_model import StartingModel, load_starting_model

RECIPE_FILE = "recipe.yaml"
FINAL_METRICS = "final_metrics.json"
LOSS_CURVE = "loss_curve.png"
MODEL_DIR = "model"
# Sections a resumed run must share with the run it continues (eval/checkpoint/output may change).
RESUME_LOCKED = ("model", "data", "train", "lora")


class TrainingError(AttnResError):
    """The run could not go on (the CLI exits 1): the message says at which step, why, what was kept."""


class NonFiniteLossError(TrainingError):
    pass


class TrainingInterrupted(AttnResError):
    """SIGINT/SIGTERM (or `stop_at_step`): a checkpoint was saved; `--resume` continues."""

    def __init__(self, message: str, checkpoint: Path, signum: int = signal.SIGINT):
        super().__init__(message)
        self.checkpoint, self.signum = checkpoint, int(signum)


@dataclass
class FinetuneResult:
    output: Path
    model_dir: Path | None
    metrics: dict
    records: list[dict] = field(repr=False, default_factory=list)
    pushed: object | None = None  # hub.PushResult when output.push_to_hub was set


# --- small pieces ---------------------------------------------------------------------------------


def _accelerator(recipe: Recipe):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # A second run in the same Python process (the A/B, tests) starts from fresh Accelerate settings;
    # the distributed process group, if any, is kept.
    AcceleratorState._reset_state()
    # Several processes (torchrun / `accelerate launch --multi_gpu`) on a machine without an accelerator:
    # Accelerate only picks gloo DDP when told to use the CPU; otherwise each process would train alone.
    cpu = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.accelerator.is_available()
    try:
        return Accelerator(mixed_precision=recipe.train.mixed_precision, step_scheduler_with_optimizer=False, cpu=cpu)
    except (ValueError, RuntimeError) as error:
        raise RecipeError(f"train.mixed_precision: {error}") from error


def token_loss(model, batch: dict, device) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropies over the real (unpadded) positions, in float32."""
    ids = batch["input_ids"].to(device)
    mask = batch["attention_mask"].to(device) if batch["attention_mask"] is not None else None
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
    targets = ids[:, 1:]
    if mask is not None:
        targets = targets.masked_fill(mask[:, 1:] == 0, -100)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum")
    return loss, batch["predictions"]


def evaluate(model, sequences: Sequences, accelerator, batch_size: int) -> tuple[float, int]:
    """Held-out loss (mean nats per predicted token) and the number of predictions. Every process runs
    the same number of forward passes (a process short of data repeats one batch and discards it):
    DDP buffer syncs and FSDP all-gathers need every process in every forward."""
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = np.arange(len(sequences))[rank::world]
    passes = math.ceil(math.ceil(len(sequences) / world) / batch_size)
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for index in range(passes):
            chunk = mine[index * batch_size : (index + 1) * batch_size]
            real = len(chunk) > 0
            batch = sequences.batch(chunk if real else np.arange(1))
            loss, count = token_loss(model, batch, accelerator.device)
            if real:
                totals += torch.stack([loss.double(), torch.tensor(float(count), dtype=torch.float64, device=loss.device)])
    totals = accelerator.reduce(totals, "sum")
    model.train(was_training)
    return float(totals[0] / totals[1]), int(totals[1])


class GracefulStop:
    """SIGINT / SIGTERM ask the run to stop after the current step (a checkpoint is saved); a second
    signal stops at once."""

    def __init__(self):
        self.requested: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _resume_differences(saved: Recipe, current: Recipe) -> list[str]:
    def flat(data, prefix=""):
        if isinstance(data, dict):
            for key, value in data.items():
                yield from flat(value, f"{prefix}{key}.")
        else:
            yield prefix.rstrip("."), data

    old = dict(flat({k: saved.model_dump(mode="json")[k] for k in RESUME_LOCKED}))
    new = dict(flat({k: current.model_dump(mode="json")[k] for k in RESUME_LOCKED}))
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]


# --- the run --------------------------------------------------------------------------------------


class _Reporter:
    """Console output of the main process: stage lines, the Rich progress bar, evaluation lines."""

    def __init__(self, console, enabled: bool):
        self.console = console if enabled else None
        self.progress = None
        self.task = None

    def say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text, highlight=False)

    @contextlib.contextmanager
    def bar(self, total: int, start: int) -> Iterator[None]:
        if self.console is None:
            yield
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("lr {task.fields[lr]}"),
            TextColumn("{task.fields[speed]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
        )
        with self.progress:
            self.task = self.progress.add_task("train", total=total, completed=start, loss="-", lr="-", speed="-")
            yield
        self.progress = None

    def step(self, step: int, loss: float, lr: float, speed: float) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step, loss=f"{loss:.4f}", lr=f"{lr:.2e}", speed=f"{speed:,.0f}")

    def print(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(text, highlight=False)
        else:
            self.say(text)


def prepare_output(recipe: Recipe, out: Path, resuming: bool) -> None:
    if not resuming and recipe.output.overwrite and out.exists() and is_run_folder(out):
        shutil.rmtree(out)  # check_recipe made sure it is an earlier run, not some other folder
    out.mkdir(parents=True, exist_ok=True)
    (out / RECIPE_FILE).write_text(recipe.to_yaml())


def finetune(
    recipe: Recipe,
    *,
    resume: bool = False,
    console=None,
    stop_at_step: int | None = None,
    token: str | None = None,
) -> FinetuneResult:
    """Run RECIPE. Raises RecipeError (bad recipe, nothing written), NonFiniteLossError (stopped, last
    good checkpoint kept, no model saved) or TrainingInterrupted (signal or `stop_at_step`: a checkpoint
    was saved, `resume=True` continues exactly where it stopped)."""
    out = Path(recipe.output.dir).expanduser()
    accelerator = _accelerator(recipe)
    main = accelerator.is_main_process
    report = _Reporter(console, main)

    # 1. Everything that can be refused is refused before anything is loaded or written.
    check_recipe(recipe, resume=resume, token=token)
    checkpoint = latest_checkpoint(out) if resume else None
    if resume and (out / FINAL_METRICS).is_file():
        raise RecipeError(f"output.dir: the run in {out} is complete ({FINAL_METRICS} exists); nothing to resume")
    if checkpoint is not None and (out / RECIPE_FILE).is_file():
        differences = _resume_differences(parse_recipe(read_yaml(out / RECIPE_FILE)), recipe)
        if differences:
            raise RecipeError(
                f"--resume: the recipe differs from the one the run in {out} started with:\n  "
                + "\n  ".join(differences)
                + "\nResume with the same recipe, or start a new run in another output.dir"
            )
    distributed = accelerator.distributed_type.value
    if recipe.train.trainable == "lora" and distributed == "FSDP":
        raise RecipeError("train.trainable: lora under FSDP is not supported (merging needs the whole model); use DDP or trainable full/attnres")
    from rich.markup import escape

    report.say(f"[bold]Resolved recipe[/]\n{escape(recipe.to_yaml())}")
    report.say(
        f"Accelerate: {distributed}, {accelerator.num_processes} process(es) on {accelerator.device}, "
        f"mixed precision {accelerator.mixed_precision}"
    )
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" and distributed != "FSDP":
        report.say(f"[yellow]note:[/] FSDP was asked for but Accelerate runs {distributed} here (FSDP needs GPUs)")
    if resume and checkpoint is None:
        report.say(f"--resume: no checkpoint in {out / 'checkpoints'}; starting from step 0")

    # 2. Model, data, optimizer.
    from accelerate.utils import set_seed

    set_seed(recipe.train.seed)
    report.say(f"Loading {'the embedded SmolLM2-135M-Instruct' if recipe.model.is_default else recipe.model.source} ...")
    start = load_starting_model(recipe)
    model = start.model
    if recipe.train.gradient_checkpointing:
        enable_checkpointing(model)
    if recipe.train.trainable == "lora":
        model = apply_lora(model, recipe.lora, recipe.train.seed)
    select_trainable(model, recipe.train.trainable)
    counts = count_parameters(model)
    report.say(
        f"{'AttnRes' if start.converted else 'original (baseline, not converted)'} model: {counts.describe()}"
        + (f"; block size {start.summary.block_size}, {start.summary.num_blocks} blocks" if start.summary else "")
    )
    world = accelerator.num_processes
    global_batch = world * recipe.train.grad_accum * recipe.train.micro_batch
    with accelerator.main_process_first():
        # A streamed dataset is read only as far as the run needs (+1%: packing drops each source's tail).
        needed = recipe.train.steps * global_batch * recipe.data.seq_len
        corpus: Corpus = build_corpus(recipe, start.tokenizer, needed + needed // 100 + recipe.data.seq_len)
    report.say(corpus.describe)
    order = SequenceOrder(len(corpus.train), recipe.train.seed)
    optimizer = make_optimizer(model, recipe)
    scheduler = make_scheduler(optimizer, recipe)
    model.train()
    model, optimizer = accelerator.prepare(model, optimizer)
    state = TrainerState()
    accelerator.register_for_checkpointing(scheduler, state)
    accelerator.register_save_state_pre_hook(trainable_only_hook)
    trainable = [p for p in model.parameters() if p.requires_grad]

    # 3. The run folder (main process only).
    metrics = MetricsLog(out / METRICS, main)
    if main:
        prepare_output(recipe, out, resuming=checkpoint is not None)
        remove_partial_checkpoints(out)  # left by a run killed while saving; never resumed from
        if checkpoint is None:
            metrics.reset()
    accelerator.wait_for_everyone()
    if checkpoint is not None:
        load_checkpoint(accelerator, checkpoint)
        if main:
            metrics.truncate_after(state.step)
        report.say(f"Resumed from {checkpoint} (step {state.step}, {state.tokens:,} tokens seen)")

    eval_batch = recipe.eval.batch_size or recipe.train.micro_batch

    def run_eval() -> float:
        loss, count = evaluate(model, corpus.eval, accelerator, eval_batch)
        metrics.write({"kind": "eval", "step": state.step, "loss": loss, "perplexity": perplexity(loss), "predictions": count})
        report.print(f"step {state.step}: held-out loss {loss:.4f}, perplexity {perplexity(loss):.2f}")
        return loss

    def checkpoint_now() -> Path:
        path = save_checkpoint(accelerator, out, state, recipe.checkpoint.keep_last)
        report.print(f"step {state.step}: checkpoint {path}")
        return path

    if checkpoint is None and recipe.eval.at_start:
        run_eval()

    # 4. Training.
    rank = accelerator.process_index
    with GracefulStop() as stop, report.bar(recipe.train.steps, state.step):
        while state.step < recipe.train.steps:
            began = time.perf_counter()
            micro = local_micro_batches(order, state.step, recipe.train.micro_batch, recipe.train.grad_accum, rank, world)
            batches = [corpus.train.batch(indices) for indices in micro]
            local = torch.tensor(
                [sum(b["predictions"] for b in batches), sum(int(b["lengths"].sum()) for b in batches)],
                dtype=torch.float64,
                device=accelerator.device,
            )
            predictions, tokens = (float(x) for x in accelerator.reduce(local, "sum"))
            loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
            for index, batch in enumerate(batches):
                # Gradients are all-reduced once per step, on the last micro-batch.
                sync = contextlib.nullcontext() if index == len(batches) - 1 else accelerator.no_sync(model)
                with sync:
                    batch_loss, _ = token_loss(model, batch, accelerator.device)
                    # x world: DDP averages gradients over processes; this makes it the global token mean.
                    accelerator.backward(batch_loss * world / predictions)
                loss_sum += batch_loss.detach().double()
            grad_norm = accelerator.clip_grad_norm_(trainable, recipe.train.max_grad_norm or float("inf"))
            stopping = stop.requested is not None or (stop_at_step is not None and state.step + 1 >= stop_at_step)
            shared = accelerator.reduce(
                torch.stack([loss_sum, torch.tensor(float(stopping), dtype=torch.float64, device=accelerator.device)]), "sum"
            )
            loss = float(shared[0]) / predictions
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
            bad_norm = not math.isfinite(grad_norm) and recipe.train.mixed_precision != "fp16"  # fp16 skips inf steps itself
            if not math.isfinite(loss) or bad_norm:
                optimizer.zero_grad(set_to_none=True)
                last = latest_checkpoint(out)
                what = f"the loss is {loss}" if not math.isfinite(loss) else f"the gradient norm is {grad_norm}"
                raise NonFiniteLossError(
                    f"training stopped at step {state.step + 1}: {what} (non-finite). No model was saved; "
                    + (f"the last good checkpoint is {last} (step {int(last.name.split('-')[1])}). " if last else "no checkpoint was written before it. ")
                    + "Lower train.lr / train.attnres_lr, set train.max_grad_norm, or use train.mixed_precision=bf16 "
                    "instead of fp16, and run again (output.overwrite=true or a new output.dir): resuming the same "
                    "recipe would meet the same step again."
                )
            lrs = {group.get("name", str(i)): group["lr"] for i, group in enumerate(optimizer.param_groups)}  # this step's
            lr = lrs.get("base", lrs.get("attnres"))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            state.position += global_batch
            state.tokens += int(tokens)
            elapsed = time.perf_counter() - began
            state.train_seconds += elapsed
            if state.step % recipe.train.log_every == 0 or state.step == recipe.train.steps:
                metrics.write(
                    {
                        "kind": "train",
                        "step": state.step,
                        "loss": loss,
                        "lr": lr,
                        "attnres_lr": lrs.get("attnres"),
                        "grad_norm": grad_norm,
                        "tokens": state.tokens,
                        "tokens_per_s": tokens / elapsed,
                        "epoch": order.epoch_of(state.position),
                    }
                )
            report.step(state.step, loss, lr, tokens / elapsed)
            if recipe.eval.every and state.step % recipe.eval.every == 0 and state.step < recipe.train.steps:
                run_eval()
            if float(shared[1]) > 0:
                path = checkpoint_now()
                why = stop.requested or "stop_at_step"
                raise TrainingInterrupted(
                    f"stopped by {why} after step {state.step}; checkpoint saved to {path}. "
                    "Run the same command with --resume to continue.",
                    path,
                    getattr(signal, stop.requested or "SIGINT"),
                )
            if recipe.checkpoint.every and state.step % recipe.checkpoint.every == 0 and state.step < recipe.train.steps:
                checkpoint_now()

    # 5. The result.
    final_loss = run_eval()
    records = read_metrics(out / METRICS) if main else []
    final = _final_metrics(records, state, counts, start, recipe, final_loss, world)
    model_dir = _save_result(accelerator, model, start, recipe, out, final, records, corpus)
    accelerator.wait_for_everyone()
    pushed = None
    if model_dir is not None and recipe.output.push_to_hub:
        from ..hub.push import push_folder

        report.say(f"Pushing {model_dir} to {recipe.output.push_to_hub} ...")
        pushed = push_folder(model_dir, recipe.output.push_to_hub, token=token, private=recipe.output.private)
    return FinetuneResult(out, model_dir, final, records, pushed)


def _final_metrics(records, state, counts, start, recipe, final_loss, world) -> dict:
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


def _save_result(accelerator, model, start: StartingModel, recipe: Recipe, out: Path, final: dict, records, corpus) -> Path | None:
    """Final metrics, loss curve and (unless output.save_model is false) the model folder."""
    state_dict = None
    if recipe.output.save_model and accelerator.distributed_type.value == "FSDP":
        state_dict = accelerator.get_state_dict(model)  # gathers the shards; every process takes part
    if not accelerator.is_main_process:
        return None
    from ..analysis.plots import loss_curve_plot

    history = loss_history(records)
    title = f"{'AttnRes' if start.converted else 'Baseline (no AttnRes)'}: {start.source.short_name}"
    loss_curve_plot(history, out / LOSS_CURVE, title=title)
    (out / FINAL_METRICS).write_text(json.dumps(final, indent=2))
    if not recipe.output.save_model:
        return None
    from ..conversion.saving import SHIPPED_CODE, atomic_folder

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
        base.save_pretrained(folder, state_dict=state_dict)
        if start.converted:
            missing = [name for name in SHIPPED_CODE if not (folder / name).is_file()]
            if missing:
                raise TrainingError(f"internal error: save_pretrained did not copy {missing}; the model folder would not load")
        start.tokenizer.save_pretrained(folder)
        shutil.copy(out / LOSS_CURVE, folder / LOSS_CURVE)
        (folder / RECIPE_FILE).write_text(recipe.to_yaml())
        (folder / "finetune_metrics.json").write_text(json.dumps(final, indent=2))
        (folder / "README.md").write_text(_card(base, start, recipe, final, history, corpus))

    if model_dir.exists():  # left by an earlier attempt of this run (e.g. killed before final_metrics.json)
        shutil.rmtree(model_dir)
    atomic_folder(model_dir, write)
    return model_dir


def _card(model, start: StartingModel, recipe: Recipe, final: dict, history, corpus) -> str:
    from ..hub.card import base_identity, card_identity, finetune_card
    from ..conversion.surgery import summarize

    name = start.source.short_name
    if not start.converted:
        return (
            f"# {name}, fine-tuned (baseline, no AttnRes)\n\nThe original model trained with the same `attnres finetune` "
            f"recipe as its AttnRes counterpart, for comparison.\n\nHeld-out loss {final['eval_loss']:.4f} "
            f"(perplexity {final['eval_perplexity']:.2f}) after {final['steps']} steps.\n\n```yaml\n{recipe.to_yaml()}```\n"
        )
    if start.source.kind == "folder":
        base_model, license_ = card_identity(start.source.location)
    else:
        base_model, license_ = base_identity(start.source)
    metrics = {}
    if final["eval_loss_start"] is not None:
        metrics["before fine-tuning (= original)"] = {"loss": final["eval_loss_start"], "perplexity": final["eval_perplexity_start"]}
    metrics["fine-tuned"] = {"loss": final["eval_loss"], "perplexity": final["eval_perplexity"]}
    return finetune_card(
        summarize(model),
        name=name,
        base_model=base_model,
        license=license_,
        recipe=recipe.model_dump(mode="json"),
        metrics=metrics,
        finetuned_key="fine-tuned",
        eval_data=f"{corpus.eval_documents} held-out documents, {len(corpus.eval)} sequences x {recipe.data.seq_len} tokens",
        train_data=f"{final['tokens']:,} tokens",
        loss_curve=LOSS_CURVE,
        history=history,
    )
