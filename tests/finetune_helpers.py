"""Tiny models, a character tokenizer and small text files for fine-tuning tests (seconds on a CPU)."""

from __future__ import annotations

import string
from pathlib import Path

import yaml
from tiny_models import tiny_model

from attnres_convert.io.samples import SAMPLE_TEXT

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def char_tokenizer():
    """A character-level tokenizer whose ids fit the tiny models' 128-token vocabulary."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {token: index for index, token in enumerate(SPECIALS + chars)}
    assert len(vocab) <= 128
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def tiny_model_folder(folder: Path, family: str = "llama", seed: int = 0) -> Path:
    """A tiny random base model saved as a plain HF folder with the character tokenizer."""
    model = tiny_model(family, seed=seed)
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


def write_corpus(folder: Path, documents: int = 6) -> dict[str, list[str]]:
    """Text files: `documents` training files and one held-out file, variations of the sample text."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [line for line in SAMPLE_TEXT.splitlines() if line.strip()]
    train = []
    for index in range(documents):
        shifted = lines[index:] + lines[:index]
        path = folder / f"doc{index}.txt"
        path.write_text("\n".join(shifted) + "\n")
        train.append(str(path))
    held = folder / "held_out.txt"
    held.write_text("\n".join(reversed(lines)) + "\n")
    return {"train": train, "eval": [str(held)]}


def tiny_recipe(model_dir: Path, corpus: dict, out: Path, **sections) -> dict:
    """A recipe (plain data) that trains in a second or two; `sections` update it per section."""
    recipe = {
        "model": {"source": str(model_dir), "convert": True, "num_blocks": 2},
        "data": {"train": {"files": corpus["train"]}, "eval": {"files": corpus["eval"]}, "seq_len": 32},
        "train": {
            "trainable": "attnres",
            "steps": 6,
            "micro_batch": 2,
            "grad_accum": 2,
            "lr": 1e-3,
            "attnres_lr": 3e-2,
            "warmup_steps": 1,
            "seed": 0,
        },
        "eval": {"every": 3, "max_sequences": 8},
        "checkpoint": {"every": 0, "keep_last": 2},
        "output": {"dir": str(out)},
    }
    for section, values in sections.items():
        recipe.setdefault(section, {}).update(values)
    return recipe


def write_recipe(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path
