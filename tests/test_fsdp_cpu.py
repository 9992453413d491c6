"""FSDP on CPU: two gloo processes train a converted tiny Llama with non-zero queries, and the loss and the
query gradients match one process. Accelerate runs FSDP only on GPUs, so the model is sharded as its FSDP
plugin would shard it: FSDP2's fully_shard on every decoder layer and on the root, FSDP1 wrapping each
decoder layer, and activation-checkpoint wrappers around the decoder layers (with and without FSDP2); the additive
mix (its gates read by attribute, which FSDP1 swaps for plain tensors) under both FSDPs.
Wrappers replace the layers in the model's ModuleList, where depth attention looks its parameters up."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.extended  # end to end, tens of seconds: `make test-extended`

sys.path.insert(0, str(Path(__file__).parent))

VARIANTS = ("fsdp2", "fsdp1", "checkpoint", "fsdp2+checkpoint", "fsdp2+additive", "fsdp1+additive")
BATCH, LENGTH = 4, 16


def _model(additive: bool = False):
    from tiny_models import randomize_queries, tiny_model

    from attnres_convert import convert_model

    model = convert_model(tiny_model("llama", seed=1), block_size=3, additive=additive)
    return randomize_queries(model, 0.5, seed=2, parts=("weight", "gate") if additive else ("weight",)).train()


def _batch() -> torch.Tensor:
    return torch.randint(3, 128, (BATCH, LENGTH), generator=torch.Generator().manual_seed(3))


def _query_grads(named) -> dict[str, list[float]]:
    wanted = ("_res_proj.weight", "_res_proj.gate")
    return {name: grad.reshape(-1).tolist() for name, grad in named if name.endswith(wanted)}


def _wrap(model, variant: str):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    layer_cls = type(model.model.layers[0])
    if "checkpoint" in variant:
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, preserve_rng_state=False),
            check_fn=lambda m: isinstance(m, layer_cls),
        )
    if variant.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif variant.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({layer_cls}), device_id=torch.device("cpu"), use_orig_params=True
        )
    return model


def _full_grads(model, variant: str) -> dict[str, list[float]]:
    def clean(name: str) -> str:
        for part in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
            name = name.replace(part, "")
        return name

    if variant.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, with_grads=True):
            return _query_grads((clean(n), p.grad.clone()) for n, p in model.named_parameters())
    named = []
    for name, param in model.named_parameters():
        grad = param.grad
        if hasattr(grad, "full_tensor"):  # FSDP2: a sharded DTensor
            grad = grad.full_tensor()
        named.append((clean(name), grad))
    return _query_grads(named)


def _worker(rank: int, world: int, init_file: str, out: str, variants: tuple[str, ...] = VARIANTS) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        ids = _batch().chunk(world)[rank]
        results = {}
        for variant in variants:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                results[variant] = _train_step(_model("additive" in variant), variant, ids, world)
            results[variant]["warnings"] = [str(w.message) for w in caught]
        if rank == 0:
            Path(out).write_text(json.dumps(results))
        # Both processes reach the end before either tears its gloo connections down: a peer that closes
        # them while the other still uses them aborts it ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _train_step(model, variant: str, ids: torch.Tensor, world: int) -> dict:
    """One forward and backward of MODEL wrapped as VARIANT: the loss averaged over the processes and the
    queries' full gradients."""
    model = _wrap(model, variant)
    loss = model(ids, labels=ids).loss
    loss.backward()
    if variant == "checkpoint":  # no FSDP: average the gradients as DDP would
        for param in model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad /= world
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return {"loss": mean.item() / world, "grads": _full_grads(model, variant)}


@pytest.mark.slow
@pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available"
)
def test_fsdp_and_checkpoint_wrappers_match_one_process(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "out.json")), nprocs=2, join=True)
    results = json.loads((tmp_path / "out.json").read_text())

    references = {}
    for additive in (False, True):
        model = _model(additive)
        ids = _batch()
        loss = model(ids, labels=ids).loss  # both halves have the same number of tokens: the mean of the two means
        loss.backward()
        expected = _query_grads((name, param.grad) for name, param in model.named_parameters())
        assert any(max(abs(v) for v in grad) > 1e-4 for grad in expected.values())
        references[additive] = loss, expected
    assert any(name.endswith(".gate") for name in references[True][1])
    for variant in VARIANTS:
        loss, expected = references["additive" in variant]
        got = results[variant]
        # FSDP2 warns when a wrapped layer returns a view ("... can cause backward to fail or produce wrong
        # gradients"); no wrapper may warn that gradients can be wrong.
        doubts = [message for message in got["warnings"] if "view" in message or "gradients" in message]
        assert not doubts, (variant, doubts)
        assert abs(got["loss"] - loss.item()) < 1e-6, (variant, got["loss"], loss.item())
        assert got["grads"].keys() == expected.keys(), variant
        for name, grad in expected.items():
            # 1e-5 of the gradient's size: the sharded reduction adds in another order than one process (fp32).
            error = (torch.tensor(got["grads"][name]) - torch.tensor(grad)).abs().max().item()
            assert error <= 1e-5 * max(1.0, torch.tensor(grad).norm().item()), (variant, name, error)
