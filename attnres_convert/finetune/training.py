"""`attnres finetune`: continued pretraining of a converted (or, for a baseline, original) model.

Accelerate owns devices, mixed precision and distribution, so the same code runs on one CPU, under
`accelerate launch` with several processes (DDP) and with FSDP. Only the main process writes the run
folder (run_folder.py lists what it holds); every process writes its own RNG state into checkpoints (that
is what resuming needs).

A run that replaces an earlier one (output.overwrite) is written into a hidden folder beside it and swapped
in only once finished: until then, and for good if the run fails or is interrupted, the earlier run stays
as it was.

The loss of a step is the mean over every next-token prediction of the global batch (all micro-batches
and processes), so N processes x grad_accum G give the same update as 1 process x grad_accum N*G.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import shutil
import signal
import time
from pathlib import Path

import torch

from ..depth_controls import set_depth_gate
from ..io.text import perplexity, token_loss, token_loss_and_kl
from ..io.threads import cpu_threads
from .accelerator import make_accelerator
from .checkpoints import (
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    remove_partial_checkpoints,
    save_checkpoint,
    trainable_only_hook,
)
from .data import Corpus, SequenceOrder, build_corpus, local_micro_batches
from .evaluation import heldout_loss_across_processes
from .metrics import METRICS, MetricsLog, StepStats, read_metrics, train_record
from .optim import (
    apply_lora,
    attnres_parameters,
    clip_gradient_norm,
    count_parameters,
    enable_checkpointing,
    lr_schedules,
    make_optimizer,
    make_scheduler,
    select_trainable,
)
from .preflight import check_recipe, nothing_to_resume
from .recipe import Recipe, RecipeError
from .reporting import Reporter
from .result import FinetuneResult, final_metrics, save_result
from .run_folder import (
    MODEL_DIR,
    check_resume,
    extension_checkpoint,
    prepare_output,
    publish_run,
    replaces_run,
    stage_run,
)
from .starting_model import load_starting_model
from .stopping import GracefulStop, NonFiniteLossError, TrainingError, TrainingInterrupted

__all__ = ["FinetuneRecipe", "FinetuneResult", "NonFiniteLossError", "TrainingError", "TrainingInterrupted", "finetune"]


class FinetuneRecipe:
    """One fine-tuning run, shaped like a torchtune recipe:

        run = FinetuneRecipe(recipe); run.setup(); run.train(); result = run.save()    # or run.run()

    `setup` refuses what it can before anything is loaded or written, then builds the model, data,
    optimizer and run folder (resuming from the last checkpoint if asked); `train` repeats `train_step`,
    with `evaluate` and `checkpoint` on the recipe's schedule; `save` writes the result. Every process
    runs every method; only the main process writes.

    A run replacing an earlier one writes into `folder`, a staging folder beside `out`, which `save` swaps
    in at the end; `run` removes it if anything fails (after `setup` alone: call `discard`)."""

    def __init__(
        self,
        recipe: Recipe,
        *,
        resume: bool = False,
        extend: bool = False,
        console=None,
        stop_at_step: int | None = None,
        token: str | None = None,
        verbose: bool = False,
        threads: int | str | None = None,
    ):
        self.recipe, self.resume, self.stop_at_step, self.token = recipe, resume, stop_at_step, token
        # Continue the shorter run in output.dir for more steps (from a checkpoint the schedules share); written
        # beside it and swapped in once finished, like a run that replaces an earlier one.
        self.extend = extend
        # On the CPU: torch threads to train with ("auto": io.threads.cpu_threads; None: as the process has them).
        self.threads, self.threads_before = threads, None
        self.out = Path(recipe.output.dir).expanduser()
        self.folder = self.out  # where the run is written: a staging folder while it replaces an earlier run
        self.accelerator = make_accelerator(recipe)
        self.main = self.accelerator.is_main_process
        self.report = Reporter(console, self.main, verbose)
        self.state = TrainerState()

    def run(self) -> FinetuneResult:
        """Raises RecipeError (bad recipe, nothing written), NonFiniteLossError (stopped, last good checkpoint
        kept, no model saved) or TrainingInterrupted (signal or `stop_at_step`: a checkpoint was saved,
        `resume=True` continues exactly where it stopped). A run replacing an earlier one keeps no checkpoint
        on any failure: it is discarded and the earlier run stays as it was."""
        try:
            self.setup()
            self.train()
            return self.save()
        except BaseException:
            self.discard()
            raise
        finally:
            if self.threads_before is not None:
                torch.set_num_threads(self.threads_before)

    @property
    def staged(self) -> bool:
        return self.folder != self.out

    def discard(self) -> None:
        """Remove an unfinished run that was to replace an earlier one: the earlier run stays as it was."""
        if self.staged and self.main:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _kept(self) -> str:
        return f"the earlier run in {self.out} is unchanged (output.overwrite replaces it only with a finished run)"

    # --- setup ------------------------------------------------------------------------------------

    def setup(self) -> None:
        self._refuse()
        self._build()
        self._open_run_folder()

    def _refuse(self) -> None:
        """Everything that can be refused is refused before anything is loaded or written."""
        recipe, out = self.recipe, self.out
        if self.resume and self.extend:
            raise RecipeError("--resume and --extend: choose one (--extend continues a run for more train.steps)")
        check_recipe(recipe, resume=self.resume, token=self.token, extend=self.extend)
        self.checkpoint_path = latest_checkpoint(out) if self.resume else None
        if self.resume:
            check_resume(recipe, out, self.checkpoint_path)
        if self.extend:
            self.checkpoint_path = extension_checkpoint(recipe, out)
        self.distributed = self.accelerator.distributed_type.value
        if recipe.train.trainable == "lora" and self.distributed == "FSDP":
            raise RecipeError(
                "train.trainable: lora under FSDP is not supported (merging needs the whole model); use DDP or trainable full/attnres"
            )
        from rich.markup import escape

        report = self.report
        if report.verbose:
            report.say(f"[bold]Resolved recipe[/]\n{escape(recipe.to_yaml())}")
        else:
            report.say(escape(recipe.headline()) + " [dim](--verbose: the whole recipe)[/]")
        report.say(
            where_it_trains(
                self.accelerator.device,
                self.accelerator.num_processes,
                self.distributed,
                self.accelerator.mixed_precision,
            )
            + self._set_threads()
        )
        if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" and self.distributed != "FSDP":
            report.say(
                f"[yellow]note:[/] FSDP was asked for but Accelerate runs {self.distributed} here (FSDP needs GPUs)"
            )
        if self.resume and self.checkpoint_path is None:
            report.say(f"--resume: no checkpoint in {out / 'checkpoints'}; starting from step 0")
        elif not self.resume and not recipe.output.overwrite and nothing_to_resume(out):
            report.say(f"{out} holds a run stopped before its first checkpoint (nothing to resume): starting it over")

    def _set_threads(self) -> str:
        """Set the torch threads of a CPU run (self.threads) and say how many and why (', N torch threads (...)')."""
        if self.threads is None or self.accelerator.device.type != "cpu":
            return ""
        threads, why = (
            (self.threads, "as asked") if self.threads != "auto" else cpu_threads(self.accelerator.num_processes)
        )
        self.threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)
        return f", {threads} torch thread{'s' if threads != 1 else ''} ({why})"

    def _build(self) -> None:
        """Model, data, optimizer, scheduler; prepared by Accelerate."""
        from accelerate.utils import set_seed

        recipe, accelerator = self.recipe, self.accelerator
        set_seed(recipe.train.seed)
        self.report.say(
            f"Loading {'the embedded SmolLM2-135M-Instruct' if recipe.model.is_default else recipe.model.source} ..."
        )
        self.start = start = load_starting_model(recipe)
        model = start.model
        self.reference = None
        if recipe.train.kl_weight:
            # The starting model, frozen (for a fresh conversion: the original model, exactly).
            self.reference = copy.deepcopy(model).requires_grad_(False).eval().to(accelerator.device)
        if recipe.train.gradient_checkpointing:
            enable_checkpointing(model)
        if recipe.train.trainable == "lora":
            model = apply_lora(model, recipe.lora, recipe.train.seed)
        select_trainable(model, recipe.train.trainable)
        self.counts = count_parameters(model)
        self.report.say(
            f"{'AttnRes' if start.converted else 'original (baseline, not converted)'} model: {self.counts.describe()}"
            + (f"; block size {start.summary.block_size}, {start.summary.num_blocks} blocks" if start.summary else "")
            + (
                f", input-dependent queries of rank {start.summary.query_rank}"
                if start.summary and start.summary.query_rank
                else ""
            )
        )
        self.world = accelerator.num_processes
        self.global_batch = self.world * recipe.train.grad_accum * recipe.train.micro_batch
        with accelerator.main_process_first():
            # A streamed dataset is read only as far as the run needs (+1%: packing drops each source's tail).
            needed = (recipe.data.start_step + recipe.train.steps) * self.global_batch * recipe.data.seq_len
            self.corpus: Corpus = build_corpus(recipe, start.tokenizer, needed + needed // 100 + recipe.data.seq_len)
        self.report.say(self.corpus.describe)
        self.order = SequenceOrder(
            len(self.corpus.train), recipe.train.seed, recipe.data.start_step * self.global_batch
        )
        self.state.train_sequences = len(self.corpus.train)
        optimizer = make_optimizer(model, recipe)
        self.scheduler = make_scheduler(optimizer, recipe)
        new = {id(p) for _, p in attnres_parameters(model)}
        model.train()
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        accelerator.register_for_checkpointing(self.scheduler, self.state)
        accelerator.register_save_state_pre_hook(trainable_only_hook)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        # Clipped apart (see `clip_gradients`). DDP keeps the parameter objects; FSDP replaces them.
        self.base_params = [p for p in trainable if id(p) not in new]
        self.attnres_params = [p for p in trainable if id(p) in new]
        self.eval_batch = recipe.eval.batch_size or recipe.train.micro_batch

    def _open_run_folder(self) -> None:
        """The run folder (main process only), and the checkpoint's state when resuming."""
        accelerator, out = self.accelerator, self.out
        staging = None
        if self.main and self.extend:
            staging = str(stage_run(out))
            self.report.say(f"--extend: the longer run is written to {staging} and replaces {out} once finished")
        elif self.main and replaces_run(self.recipe, out, resuming=self.checkpoint_path is not None):
            staging = str(stage_run(out))
            self.report.say(f"output.overwrite: the new run is written to {staging} and replaces {out} once finished")
        if accelerator.num_processes > 1:  # every process saves its part of each checkpoint there
            from accelerate.utils import broadcast_object_list

            staging = broadcast_object_list([staging])[0]
        self.folder = folder = Path(staging) if staging else out
        self.metrics = MetricsLog(folder / METRICS, self.main)
        if self.main:
            prepare_output(self.recipe, folder)
            remove_partial_checkpoints(folder)  # left by a run killed while saving; never resumed from
            if self.extend:  # the shorter run's records up to its checkpoint (truncated below) are the longer run's
                shutil.copyfile(out / METRICS, folder / METRICS)
            elif self.checkpoint_path is None:
                self.metrics.reset()
        accelerator.wait_for_everyone()
        if self.checkpoint_path is not None:
            sequences = self.state.train_sequences
            load_checkpoint(accelerator, self.checkpoint_path, self.model)
            if self.state.train_sequences != sequences:
                raise RecipeError(
                    f"{'--extend' if self.extend else '--resume'}: the checkpoint {self.checkpoint_path} was trained on "
                    f"{self.state.train_sequences:,} training sequences, this run reads {sequences:,} (a streamed "
                    "dataset is read as far as train.steps needs): set data.max_tokens so that both read the same "
                    "text, or start a new run"
                )
            if self.main:
                self.metrics.truncate_after(self.state.step)
            if self.extend:
                self._extend_schedule()
            self.report.say(
                f"{'Extended' if self.extend else 'Resumed'} from {self.checkpoint_path} (step {self.state.step}, "
                f"{self.state.tokens:,} tokens seen)"
            )

    def _extend_schedule(self) -> None:
        """The checkpoint's scheduler carries the shorter run's schedule (its settings are in its state): the
        longer one takes over from here, the next step's learning rates set from it. Both gave every step so far
        the same rates (`extension_checkpoint`)."""
        scheduler = self.scheduler
        names = [group["name"] for group in scheduler.optimizer.param_groups]
        scheduler.lr_lambdas = lr_schedules(self.recipe.train, names)
        for group, base, schedule in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * schedule(scheduler.last_epoch)

    # --- training ---------------------------------------------------------------------------------

    def train(self) -> None:
        recipe, state = self.recipe, self.state
        if self.checkpoint_path is None and recipe.eval.at_start:
            self.evaluate()
        with GracefulStop() as self._stop, self.report.bar(recipe.train.steps, state.step):
            while state.step < recipe.train.steps:
                stats = self.train_step()
                self._log(stats)
                if recipe.eval.every and state.step % recipe.eval.every == 0 and state.step < recipe.train.steps:
                    self.evaluate()
                if stats.stopping:
                    raise self._interrupted()
                if (
                    recipe.checkpoint.every
                    and state.step % recipe.checkpoint.every == 0
                    and state.step < recipe.train.steps
                ):
                    self.checkpoint()
        self._set_gate()  # past depth_gate_steps: the whole mix, as saved

    def _interrupted(self) -> TrainingInterrupted:
        why, step = self._stop.requested or "stop_at_step", self.state.step
        signum = getattr(signal, self._stop.requested or "SIGINT")
        if self.staged:  # no checkpoint: the unfinished run is discarded, nothing could resume it
            return TrainingInterrupted(
                f"stopped by {why} after step {step}; {self._kept()}, and this unfinished run was removed. "
                "Run the same command again to start it over.",
                None,
                signum,
            )
        path = self.checkpoint()
        return TrainingInterrupted(
            f"stopped by {why} after step {step}; checkpoint saved to {path}. Run the same command with --resume to continue.",
            path,
            signum,
        )

    def train_step(self) -> StepStats:
        """One optimizer step over the global batch. The loss is the mean over every next-token prediction of
        all micro-batches and processes."""
        accelerator, recipe, state, model = self.accelerator, self.recipe, self.state, self.model
        began = time.perf_counter()
        self._set_gate()
        micro = local_micro_batches(
            self.order,
            state.step,
            recipe.train.micro_batch,
            recipe.train.grad_accum,
            accelerator.process_index,
            self.world,
        )
        batches = [self.corpus.train.batch(indices) for indices in micro]
        local = torch.tensor(
            [sum(b["predictions"] for b in batches), sum(int(b["lengths"].sum()) for b in batches)],
            dtype=torch.float64,
            device=accelerator.device,
        )
        predictions, tokens = (float(x) for x in accelerator.reduce(local, "sum"))
        loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
        kl_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
        for index, batch in enumerate(batches):
            # Gradients are all-reduced once per step, on the last micro-batch.
            sync = contextlib.nullcontext() if index == len(batches) - 1 else accelerator.no_sync(model)
            with sync:
                if self.reference is None:
                    batch_loss, _ = token_loss(model, batch, accelerator.device)
                    objective = batch_loss
                else:
                    batch_loss, batch_kl = token_loss_and_kl(model, self.reference, batch, accelerator.device)
                    objective = batch_loss + recipe.train.kl_weight * batch_kl
                    kl_sum += batch_kl.detach().double()
                # x world: DDP averages gradients over processes; this makes it the global token mean.
                accelerator.backward(objective * self.world / predictions)
            loss_sum += batch_loss.detach().double()
        grad_norm, attnres_grad_norm = self.clip_gradients()
        stopping = self._stop.requested is not None or (
            self.stop_at_step is not None and state.step + 1 >= self.stop_at_step
        )
        flag = torch.tensor(float(stopping), dtype=torch.float64, device=accelerator.device)
        shared = accelerator.reduce(torch.stack([loss_sum, kl_sum, flag]), "sum")
        loss = float(shared[0]) / predictions
        kl = float(shared[1]) / predictions if self.reference is not None else None
        self._refuse_non_finite(loss, grad_norm, attnres_grad_norm)
        lrs = {
            group.get("name", str(i)): group["lr"] for i, group in enumerate(self.optimizer.param_groups)
        }  # this step's
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.position += self.global_batch
        state.tokens += int(tokens)
        seconds = time.perf_counter() - began
        state.train_seconds += seconds
        return StepStats(loss, grad_norm, attnres_grad_norm, lrs, int(tokens), seconds, float(shared[2]) > 0, kl)

    def clip_gradients(self) -> tuple[float, float | None]:
        """Clip the base (or LoRA) and the AttnRes gradients each on their own; return both norms before
        clipping. One global clip would let the AttnRes queries' gradients (10x the base's early on) shrink
        every base update. Under FSDP the parameters are sharded: one norm over all of them, clipped at
        train.max_grad_norm (reported as grad_norm)."""
        train, accelerator = self.recipe.train, self.accelerator
        if self.distributed == "FSDP":
            norm = accelerator.clip_grad_norm_(
                self.base_params + self.attnres_params, train.max_grad_norm or float("inf")
            )
            return float(norm) if norm is not None else float("nan"), None
        accelerator.unscale_gradients()  # fp16: once, before both norms
        base = clip_gradient_norm(self.base_params, train.max_grad_norm)
        attnres = clip_gradient_norm(self.attnres_params, train.attnres_max_grad_norm) if self.attnres_params else None
        return base, attnres

    def _refuse_non_finite(self, loss: float, grad_norm: float, attnres_grad_norm: float | None) -> None:
        norms = [grad_norm] + ([attnres_grad_norm] if attnres_grad_norm is not None else [])
        bad_norm = (
            not all(math.isfinite(n) for n in norms) and self.recipe.train.mixed_precision != "fp16"
        )  # fp16 skips inf steps itself
        if math.isfinite(loss) and not bad_norm:
            return
        self.optimizer.zero_grad(set_to_none=True)
        what = (
            f"the loss is {loss}"
            if not math.isfinite(loss)
            else f"the gradient norm is {grad_norm} (AttnRes: {attnres_grad_norm})"
        )
        fix = (
            "Lower train.lr / train.attnres_lr, set train.max_grad_norm, or use train.mixed_precision=bf16 "
            "instead of fp16, and run again (output.overwrite=true or a new output.dir)"
        )
        if self.staged:  # its checkpoints go with it
            raise NonFiniteLossError(
                f"training stopped at step {self.state.step + 1}: {what} (non-finite). No model was saved; {self._kept()}. {fix}."
            )
        last = latest_checkpoint(self.folder)
        raise NonFiniteLossError(
            f"training stopped at step {self.state.step + 1}: {what} (non-finite). No model was saved; "
            + (
                f"the last good checkpoint is {last} (step {int(last.name.split('-')[1])}). "
                if last
                else "no checkpoint was written before it. "
            )
            + f"{fix}: resuming the same recipe would meet the same step again."
        )

    def _log(self, stats: StepStats) -> None:
        state, steps = self.state, self.recipe.train.steps
        if state.step % self.recipe.train.log_every == 0 or state.step == steps:
            epoch = self.order.epoch_of(state.position)
            self.metrics.write(
                train_record(stats, state.step, state.tokens, epoch, depth_gate=self._gate_at(state.step - 1))
            )
        # The run's training throughput so far (tokens over the time spent in steps): what the summary prints at the end.
        self.report.step(
            state.step, stats.loss, stats.lr, state.tokens / state.train_seconds if state.train_seconds else 0.0
        )

    def _gate_at(self, step: int) -> float | None:
        """train.depth_gate_steps: the depth gate of the step after `step` steps (0 first, 1 from depth_gate_steps
        on); None when off."""
        ramp = self.recipe.train.depth_gate_steps
        return min(1.0, step / ramp) if ramp else None

    def _set_gate(self) -> None:
        gate = self._gate_at(self.state.step)
        if gate is not None:
            set_depth_gate(self.model, gate)

    def evaluate(self) -> float:
        """Held-out loss now, written to metrics.jsonl."""
        self._set_gate()  # the model as it is at this step
        heldout = heldout_loss_across_processes(self.model, self.corpus.eval, self.accelerator, self.eval_batch)
        loss, step = heldout.loss, self.state.step
        self.metrics.write(
            {
                "kind": "eval",
                "step": step,
                "loss": loss,
                "perplexity": perplexity(loss),
                "predictions": heldout.predictions,
                "loss_se": heldout.se,
                # per sequence, for a paired comparison of two runs on the same held-out text (`attnres ab`)
                "sequence_losses": [round(x, 4) for x in heldout.sequence_sums],
                "sequence_predictions": heldout.sequence_counts,
            }
        )
        self.report.print(f"step {step}: held-out loss {loss:.4f}, perplexity {perplexity(loss):.2f}")
        return loss

    def checkpoint(self) -> Path:
        path = save_checkpoint(self.accelerator, self.folder, self.state, self.recipe.checkpoint.keep_last)
        self.report.print(f"step {self.state.step}: checkpoint {path}")
        return path

    # --- the result -------------------------------------------------------------------------------

    def save(self) -> FinetuneResult:
        """Final evaluation, metrics, loss curve, the model folder, and the push if the recipe asks."""
        final_loss = self.evaluate()
        records = read_metrics(self.folder / METRICS) if self.main else []
        final = final_metrics(records, self.state, self.counts, self.start, self.recipe, final_loss, self.world)
        model_dir = save_result(
            self.accelerator, self.model, self.start, self.recipe, self.folder, final, records, self.corpus
        )
        self.accelerator.wait_for_everyone()
        if self.staged:  # finished and complete: it replaces the earlier run now
            if self.main:
                publish_run(self.folder, self.out)
            self.accelerator.wait_for_everyone()
            self.folder = self.out
            model_dir = self.out / MODEL_DIR if model_dir is not None else None
        pushed = None
        if model_dir is not None and self.recipe.output.push_to_hub:
            from ..hub.push import push_folder

            self.report.say(f"Pushing {model_dir} to {self.recipe.output.push_to_hub} ...")
            pushed = push_folder(
                model_dir, self.recipe.output.push_to_hub, token=self.token, private=self.recipe.output.private
            )
        return FinetuneResult(self.out, model_dir, final, records, pushed)


def where_it_trains(device, processes: int, distributed: str, mixed_precision: str) -> str:
    """Accelerate's settings in words: 'Training on cpu in 1 process, float32', 'on cuda in 4 processes (FSDP), bf16
    mixed precision' (Accelerate's own names, NO and MULTI_CPU, say little to a reader)."""
    how = "" if processes == 1 else f" ({'FSDP' if distributed == 'FSDP' else 'DDP'})"
    count = "1 process" if processes == 1 else f"{processes} processes"
    precision = "no mixed precision" if mixed_precision == "no" else f"{mixed_precision} mixed precision"
    return f"Training on {device} in {count}{how}, {precision}"


def finetune(
    recipe: Recipe,
    *,
    resume: bool = False,
    extend: bool = False,
    console=None,
    stop_at_step: int | None = None,
    token: str | None = None,
    verbose: bool = False,
    threads: int | str | None = None,
) -> FinetuneResult:
    """Run RECIPE (see FinetuneRecipe.run); VERBOSE prints the whole resolved recipe, not only its headline; THREADS:
    the torch threads of a CPU run ("auto": one per idle core, or OMP_NUM_THREADS; None: as the process has them)."""
    return FinetuneRecipe(
        recipe,
        resume=resume,
        extend=extend,
        console=console,
        stop_at_step=stop_at_step,
        token=token,
        verbose=verbose,
        threads=threads,
    ).run()
