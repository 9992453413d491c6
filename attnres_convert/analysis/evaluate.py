"""Held-out loss and perplexity of a plain or converted model on text files (`attnres eval`).

Text is read, tokenised and packed exactly as fine-tuning packs its held-out data (io.text: documents
joined with EOS, cut into full seq_len sequences), so the numbers of `attnres eval` and of a fine-tune
run are comparable. The loss is the mean next-token cross-entropy over every predicted token, in
float32; perplexity is its exponential.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

from ..errors import AttnResError
from ..io.loading import LoadedModel, load_any
from ..io.text import Sequences, TokenBudget, expand_files, file_documents, pack, pad_token_id, token_loss, tokenize
from ..io.text import perplexity as perplexity_of  # `perplexity` is also a field of EvalResult

DEFAULT_SEQ_LEN = 256  # what the README examples pass


class EvalError(AttnResError):
    """The evaluation cannot run (no tokenizer, not enough text, a sequence longer than the model allows)."""


@dataclass
class EvalResult:
    model: str
    converted: bool
    data: list[str]
    seq_len: int
    sequences: int
    tokens: int  # next-token predictions scored
    loss: float
    perplexity: float
    dtype: str

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def heldout_loss(model, sequences: Sequences, batch_size: int = 1) -> tuple[float, int]:
    """(mean next-token loss in nats, number of predictions) of `model` over `sequences`, one process.
    The per-batch loss is fine-tuning's own (io.text.token_loss), so both tools score alike."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    try:
        for start in range(0, len(sequences), batch_size):
            loss, predictions = token_loss(
                model, sequences.batch(range(start, min(start + batch_size, len(sequences)))), device
            )
            total += loss.item()
            count += predictions
    finally:
        model.train(was_training)
    return total / max(count, 1), count


def _first_tokens(documents: list, limit: int) -> list:
    kept, used = [], 0
    for document in documents:
        if used >= limit:
            break
        kept.append(document[: limit - used])
        used += len(kept[-1])
    return kept


def data_files(data: list[str]) -> list:
    """The files DATA names (globs, `shakespeare:NAME`), checked before any model is loaded."""
    if not data:
        raise EvalError("no --data: give held-out text files (e.g. --data held_out.txt or --data shakespeare:hamlet)")
    files, problems = expand_files(list(data), "--data")
    if problems:
        raise EvalError("\n".join(problems))
    return files


def evaluation_sequences(tokenizer, data: list[str], seq_len: int, max_tokens: int | None = None) -> Sequences:
    """DATA tokenised and packed as fine-tuning packs held-out text: EOS between documents, full seq_len
    sequences (the incomplete tail is dropped), at most max_tokens tokens read."""
    documents = tokenize(
        tokenizer, file_documents(data_files(data), "text", "--data"), add_eos=True, budget=TokenBudget(max_tokens)
    )
    if max_tokens is not None:  # the budget stops between documents; one play alone can be 50k tokens
        documents = _first_tokens(documents, max_tokens)
    sequences = pack(documents, seq_len, pad_token_id(tokenizer))
    if len(sequences) == 0:
        found = sum(len(d) for d in documents)
        raise EvalError(
            f"the text has {found:,} tokens{' (within --max-tokens)' if max_tokens else ''}, not enough for one "
            f"sequence of --seq-len {seq_len}: give more text or a smaller --seq-len"
        )
    return sequences


def evaluate(
    model: str | os.PathLike | None | LoadedModel,
    data: list[str],
    *,
    seq_len: int = DEFAULT_SEQ_LEN,
    max_tokens: int | None = None,
    batch_size: int = 1,
    dtype: str = "auto",
    trust_remote_code: bool = False,
) -> EvalResult:
    """Held-out loss and perplexity of MODEL (a converted folder, hub id, HF folder, .gguf, None = the
    embedded SmolLM2, or an already loaded model) on DATA (text/.jsonl/.json/.parquet files, globs, or
    `shakespeare:NAME` plays of the embedded corpus)."""
    data_files(data)  # a wrong path fails before minutes of model loading
    if seq_len < 2:
        raise EvalError(f"--seq-len must be at least 2, got {seq_len}")
    if batch_size < 1:
        raise EvalError(f"--batch-size must be at least 1, got {batch_size}")
    loaded = model if isinstance(model, LoadedModel) else load_any(model, dtype, trust_remote_code)
    if loaded.tokenizer is None:
        raise EvalError(
            f"{loaded.name} has no tokenizer, so its text cannot be tokenised: save the tokenizer next to the weights "
            "(tokenizer.save_pretrained(folder))"
        )
    config = loaded.model.config.get_text_config()
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit and seq_len > limit:
        raise EvalError(f"--seq-len {seq_len} is longer than the model's {limit} positions; use at most {limit}")
    sequences = evaluation_sequences(loaded.tokenizer, data, seq_len, max_tokens)
    loss, count = heldout_loss(loaded.model, sequences, batch_size)
    return EvalResult(
        model=loaded.name,
        converted=loaded.converted,
        data=list(data),
        seq_len=seq_len,
        sequences=len(sequences),
        tokens=count,
        loss=loss,
        perplexity=perplexity_of(loss),
        dtype=str(next(loaded.model.parameters()).dtype).removeprefix("torch."),
    )
