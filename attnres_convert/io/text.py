"""Text for language-model scoring: files into documents, documents into token ids, token ids into
fixed-length sequences, and the next-token loss of a model on them.

Fine-tuning (its training and held-out data) and `attnres eval` both read text through this module, so
their numbers are comparable.

* Documents: a plain-text file is one document; a .jsonl/.json/.parquet file gives one document per
  record (its text field).
* Packing: documents are concatenated with EOS between them and cut into full `seq_len` blocks.
  Chunking: every document is cut on its own and the last piece is padded.
* Loss: the sum of next-token cross-entropies over the real (unpadded) positions, in float32.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import DataError
from .files import JSON_SUFFIXES, PARQUET_SUFFIXES, SHAKESPEARE_PREFIX, TEXT_SUFFIXES, expand_files  # noqa: F401 - re-exported

TOKENIZE_BATCH = 64


# --- files and documents --------------------------------------------------------------------------


def _records(path: Path, field: str, where: str) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if field not in table.column_names:
            raise DataError(
                f"{where}: {path} has no column {field!r} (columns: {', '.join(table.column_names)}); set text_field"
            )
        yield from (text for text in table.column(field).to_pylist() if text)
        return
    text = path.read_text(errors="replace")
    if suffix == ".json" and text.lstrip().startswith("["):
        rows: Iterable = json.loads(text)
    else:
        rows = (json.loads(line) for line in text.splitlines() if line.strip())
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, dict) or field not in row:
            raise DataError(f"{where}: record {number} of {path} has no field {field!r}; set text_field")
        if row[field]:
            yield str(row[field])


def file_documents(paths: list[Path], field: str, where: str) -> Iterator[str]:
    """The documents of PATHS: a plain-text file whole, a record file one per record (its FIELD). A record
    without FIELD raises DataError naming WHERE (the setting that gave the files)."""
    for path in paths:
        if path.suffix.lower() in JSON_SUFFIXES | PARQUET_SUFFIXES:
            yield from _records(path, field, where)
        else:
            yield path.read_text(errors="replace")


# --- tokenising -----------------------------------------------------------------------------------


class TokenBudget:
    """Stop reading a (possibly endless, streamed) source once enough tokens are in."""

    def __init__(self, limit: int | None):
        self.limit, self.used = limit, 0

    @property
    def full(self) -> bool:
        return self.limit is not None and self.used >= self.limit


def tokenize(tokenizer, documents: Iterable[str], add_eos: bool, budget: TokenBudget | None = None) -> list[np.ndarray]:
    """Token ids of each document (EOS appended when `add_eos`), in batches, until BUDGET is full."""
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


def pad_token_id(tokenizer) -> int:
    """The id that fills padded positions: the tokenizer's pad token, else its EOS, else 0."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if candidate is not None:
            return int(candidate)
    return 0


# --- sequences ------------------------------------------------------------------------------------


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


# --- scoring --------------------------------------------------------------------------------------


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


def token_loss_by_sequence(model, batch: dict, device) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
    """`token_loss` (the same sum, bit for bit), and each sequence's loss sum and prediction count: what the
    standard error of a held-out loss is estimated from (sequences, not tokens, are the independent draws)."""
    logits, targets = _logits_and_targets(model, batch, device)
    rows = batch["input_ids"].shape[0]
    per_token = F.cross_entropy(logits, targets, ignore_index=-100, reduction="none").view(rows, -1)
    counts = (targets != -100).view(rows, -1).sum(1)
    return (
        F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum"),
        batch["predictions"],
        per_token.sum(1),
        counts,
    )


def token_loss_and_kl(model, reference, batch: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The cross-entropy sum of `token_loss` and the sum of KL(reference || model) over the same positions:
    how far the model's next-token distributions moved from the reference model's."""
    logits, targets = _logits_and_targets(model, batch, device)
    with torch.no_grad():
        reference_logits, _ = _logits_and_targets(reference, batch, device)
    real = targets != -100
    kl = F.kl_div(
        F.log_softmax(logits[real], -1), F.log_softmax(reference_logits[real], -1), log_target=True, reduction="sum"
    )
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum"), kl


def perplexity(loss: float) -> float:
    """exp(mean next-token loss in nats); infinite where the exponential would overflow."""
    return math.exp(loss) if loss < 50 else float("inf")
