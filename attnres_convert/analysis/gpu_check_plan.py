"""What gpu-check builds and runs: the model shapes (SmolLM2-135M's and Llama-3.2-1B's, random weights) and the
sizes of each stage, on a GPU and in --quick mode on a CPU."""

from __future__ import annotations

from dataclasses import dataclass, field

# The two shapes (Llama architecture, random weights): SmolLM2-135M's config and Llama-3.2-1B's.
SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=128001,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
}
# --quick: the same two kinds of shape (GQA, tied embeddings, llama3 rope), small enough for two CPU cores.
QUICK_SHAPES = {
    "smollm2-135m": dict(
        SHAPES["smollm2-135m"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
    "llama-3.2-1b": dict(
        SHAPES["llama-3.2-1b"],
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1024,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


@dataclass
class Plan:
    """How much each stage does: the GPU sizes, or --quick's."""

    exact_tokens: int = 128
    exact_new_tokens: int = 32
    bench: dict = field(default_factory=lambda: dict(batch=1, seq_len=512, decode_tokens=32, rounds=3))
    ab_overrides: list[str] = field(
        default_factory=lambda: [
            "train.steps=150",
            "eval.every=50",
            "eval.max_sequences=64",
            "train.micro_batch=16",
            "data.seq_len=256",
            "train.mixed_precision=bf16",
        ]
    )


QUICK_PLAN = Plan(
    exact_tokens=24,
    exact_new_tokens=8,
    bench=dict(batch=1, seq_len=32, decode_tokens=4, rounds=1),
    ab_overrides=[
        "model.layers=4",
        "model.hidden=64",
        "model.heads=2",
        "model.kv_heads=2",
        "model.num_blocks=2",
        "train.steps=6",
        "eval.every=3",
        "eval.max_sequences=4",
        "train.micro_batch=2",
        "data.seq_len=32",
        "train.warmup_steps=1",
    ],
)
