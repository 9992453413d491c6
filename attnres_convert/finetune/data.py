"""A recipe's training and held-out text, and the deterministic, resumable order it is trained in.

The text pipeline itself (files into documents, tokenising, packing) is io.text, shared with `attnres eval`;
this module applies a recipe's data section to it:

* Documents also come from a `datasets` dataset (one document per record, its `text_field`).
* Held-out data never overlaps training data: held-out files are removed from the training files,
  and a held-out fraction takes whole documents (evenly spaced, so it also works when streaming).
* Packing (default) or, with data.packing=false, every document cut on its own.
* Order: the position in the stream of sequences is one integer. Epoch e visits the sequences in a
  permutation seeded by (seed, e), so the batch of any step can be recomputed from the position alone:
  that is what a checkpoint stores, and why a resumed run sees exactly the data it would have seen.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DataError, first_line
from ..io.text import (
    TOKENIZE_BATCH,
    Sequences,
    TokenBudget,
    chunk,
    expand_files,
    file_documents,
    pack,
    pad_token_id,
    tokenize,
)
from ..optional import require
from .recipe import Recipe, RecipeError, TextSource


@dataclass
class Corpus:
    train: Sequences
    eval: Sequences
    train_documents: int
    eval_documents: int
    describe: str  # one line for the log: where the text came from


# --- reading documents ----------------------------------------------------------------------------


def recipe_file_documents(paths: list[Path], field: str, where: str) -> Iterator[str]:
    """io.text's file documents; a file that cannot be read is a problem of the recipe (RecipeError,
    the same message), like every other problem found while its data is read."""
    try:
        yield from file_documents(paths, field, where)
    except DataError as error:
        raise RecipeError(str(error)) from error


def dataset_documents(source: TextSource, where: str) -> Iterator[str]:
    """One document per record of a `datasets` dataset (streamed if the recipe says so)."""
    datasets = require("datasets", f"reading the dataset {source.dataset!r} ({where}.dataset)")
    try:
        dataset = datasets.load_dataset(
            source.dataset, source.name, split=source.split, streaming=source.streaming, data_files=source.data_files
        )
    except Exception as error:  # noqa: BLE001 - every failure names the field and the fix
        raise RecipeError(
            f"{where}.dataset: could not load {source.dataset!r} (name={source.name!r}, split={source.split!r}): {first_line(error)}. "
            "Is the hub reachable? Offline, export the text to .jsonl/.parquet files and use data files instead."
        ) from error
    for number, row in enumerate(dataset, start=1):
        if source.text_field not in row:
            raise RecipeError(
                f"{where}.text_field: record {number} of {source.dataset} has no field {source.text_field!r} (fields: {', '.join(row)})"
            )
        if row[source.text_field]:
            yield str(row[source.text_field])


def _limit(documents: Iterator[str], count: int | None) -> Iterator[str]:
    for index, document in enumerate(documents):
        if count is not None and index >= count:
            return
        yield document


def held_out(index: int, fraction: float) -> bool:
    """Document `index` belongs to the held-out fraction: evenly spaced, decidable while streaming."""
    return math.floor((index + 1) * fraction) > math.floor(index * fraction)


def split_lines(text: str, fraction: float) -> tuple[str, str]:
    """A single document is cut at a line boundary: the last `fraction` of its lines are held out."""
    lines = text.splitlines(keepends=True)
    cut = max(1, min(len(lines) - 1, round(len(lines) * (1 - fraction))))
    return "".join(lines[:cut]), "".join(lines[cut:])


# --- the corpus of a recipe -----------------------------------------------------------------------


def build_corpus(recipe: Recipe, tokenizer, train_tokens_needed: int) -> Corpus:
    """Tokenised training and held-out sequences. `train_tokens_needed` bounds what is read from a
    dataset (a run never needs more than steps x global batch x seq_len tokens)."""
    data = recipe.data
    seq_len, pad = data.seq_len, pad_token_id(tokenizer)
    cut = pack if data.packing else chunk
    eval_cap = (recipe.eval.max_sequences or 1024) * seq_len * 2
    train_budget = TokenBudget(data.max_tokens or (train_tokens_needed if data.train.dataset else None))
    eval_budget = TokenBudget(eval_cap if (data.eval.dataset or data.train.dataset) else None)

    train_files: list[Path] = []
    if data.train.files is not None:
        train_files, problems = expand_files(data.train.files, "data.train.files")
        if problems:
            raise RecipeError("\n".join(problems))
    eval_files: list[Path] = []
    if data.eval.files is not None:
        eval_files, problems = expand_files(data.eval.files, "data.eval.files")
        if problems:
            raise RecipeError("\n".join(problems))
        train_files = [p for p in train_files if p not in set(eval_files)]

    def train_documents() -> Iterator[str]:
        if data.train.dataset:
            return _limit(dataset_documents(data.train, "data.train"), data.train.max_documents)
        return _limit(recipe_file_documents(train_files, data.train.text_field, "data.train"), data.train.max_documents)

    if data.eval.fraction is not None:
        train_docs: list[np.ndarray] = []
        eval_texts: list[str] = []
        train_texts: list[str] = []
        for index, document in enumerate(train_documents()):
            (eval_texts if held_out(index, data.eval.fraction) else train_texts).append(document)
            if len(train_texts) >= TOKENIZE_BATCH:
                train_docs += tokenize(tokenizer, train_texts, data.add_eos, train_budget)
                train_texts.clear()
            if train_budget.full:
                break
        if not eval_texts and len(train_texts) + len(train_docs) == 1 and train_texts:
            train_texts[0], held = split_lines(train_texts[0], data.eval.fraction)
            eval_texts.append(held)
        train_docs += tokenize(tokenizer, train_texts, data.add_eos, train_budget)
        eval_docs = tokenize(tokenizer, eval_texts, data.add_eos, eval_budget)
        source = "data.train"
    else:
        train_docs = tokenize(tokenizer, train_documents(), data.add_eos, train_budget)
        if data.eval.dataset:
            documents = _limit(dataset_documents(data.eval, "data.eval"), data.eval.max_documents)
        else:
            documents = _limit(
                recipe_file_documents(eval_files, data.eval.text_field, "data.eval"), data.eval.max_documents
            )
        eval_docs = tokenize(tokenizer, documents, data.add_eos, eval_budget)
        source = "data.eval"

    train, evaluation = cut(train_docs, seq_len, pad), cut(eval_docs, seq_len, pad)
    if len(train) == 0:
        raise RecipeError(
            f"data.train: the training text has {sum(map(len, train_docs))} tokens, not enough for one sequence of "
            f"data.seq_len={seq_len}; add text or lower data.seq_len"
        )
    if len(evaluation) == 0:
        raise RecipeError(
            f"{source}: the held-out text has {sum(map(len, eval_docs))} tokens, not enough for one sequence of "
            f"data.seq_len={seq_len}; hold out more text or lower data.seq_len"
        )
    if recipe.eval.max_sequences and len(evaluation) > recipe.eval.max_sequences:
        # Evenly spaced over the held-out text, the same sequences at every evaluation.
        keep = np.unique(np.linspace(0, len(evaluation) - 1, recipe.eval.max_sequences).round().astype(np.int64))
        evaluation = evaluation.subset(keep)
    where = data.train.dataset or f"{len(train_files)} files"
    describe = (
        f"train: {len(train):,} sequences x {seq_len} ({train.num_tokens:,} tokens, {len(train_docs):,} documents from {where}); "
        f"held out: {len(evaluation):,} sequences ({evaluation.num_tokens:,} tokens, {len(eval_docs):,} documents)"
    )
    return Corpus(train, evaluation, len(train_docs), len(eval_docs), describe)


class SequenceOrder:
    """Position p of the training stream -> sequence index. Epoch e = p // N is a permutation seeded by
    (seed, e); nothing else is state, so resuming needs only p. OFFSET (data.start_step x the global batch)
    shifts every position: a continued run reads on where an earlier run of the same seed stopped."""

    def __init__(self, count: int, seed: int, offset: int = 0):
        self.count, self.seed, self.offset = count, seed, offset
        self._epoch, self._permutation = -1, np.arange(count)

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch = epoch
            self._permutation = np.random.default_rng([self.seed, epoch]).permutation(self.count)
        return self._permutation

    def take(self, start: int, count: int) -> np.ndarray:
        positions = np.arange(self.offset + start, self.offset + start + count)
        return np.asarray([self._perm(int(p) // self.count)[int(p) % self.count] for p in positions], dtype=np.int64)

    def epoch_of(self, position: int) -> float:
        return (self.offset + position) / self.count


def local_micro_batches(
    order: SequenceOrder, step: int, micro_batch: int, grad_accum: int, rank: int, world: int
) -> list[np.ndarray]:
    """The sequences this process runs at optimizer step `step` (0-based). The global batch is
    world x grad_accum x micro_batch consecutive positions; micro-batch k of rank r is chunk k*world + r,
    so N processes compute exactly the chunks one process would with grad_accum x N."""
    global_batch = world * grad_accum * micro_batch
    indices = order.take(step * global_batch, global_batch)
    return [indices[(k * world + rank) * micro_batch : (k * world + rank + 1) * micro_batch] for k in range(grad_accum)]
