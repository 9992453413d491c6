"""torch.compile traces the AttnRes path without graph breaks (inference and training forward)."""

import torch
import torch._dynamo as dynamo
from tiny_models import tiny_model, token_ids

from attnres_convert.conversion.surgery import convert_model


def _breaks(model, ids, grad: bool):
    dynamo.reset()
    with torch.set_grad_enabled(grad):
        explanation = dynamo.explain(model)(ids)
    return explanation.graph_break_count, [str(r.reason)[:200] for r in explanation.break_reasons]


def test_no_graph_breaks_beyond_the_base_model():
    ids = token_ids()
    base = tiny_model("llama")
    base_breaks, _ = _breaks(base, ids, grad=False)
    model = convert_model(tiny_model("llama"), block_size=3).eval()
    for grad in (False, True):
        count, reasons = _breaks(model, ids, grad)
        assert count <= base_breaks, reasons


def test_compiled_depth_mix_matches_eager_and_stays_exact_at_zero_queries():
    """Under torch.compile the depth mix is sums of products (fused by the compiler) instead of batched matrix
    products: at the conversion's zero queries the compiled converted model gives the compiled base model's logits
    bit for bit, and with trained-looking queries it matches its own eager forward (to float32 reordering)."""
    from tiny_models import randomize_queries

    ids = token_ids()
    base = tiny_model("llama").eval()
    model = convert_model(tiny_model("llama"), block_size=3).eval()
    dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(model, dynamic=True)
        assert torch.equal(compiled(ids).logits, torch.compile(base, dynamic=True)(ids).logits)
        randomize_queries(model, 0.5, seed=0, key_norms=0.1)
        eager = model(ids).logits
        assert (eager - base(ids).logits).abs().max() > 1e-2  # the queries change the output
        torch.testing.assert_close(compiled(ids).logits, eager, rtol=1e-4, atol=1e-4)


def test_the_buffered_block_state_mixes_as_the_growing_one():
    """Without autograd a compiled forward keeps its blocks in one buffer of the forward's capacity, written in place
    at each close (BlockState with a capacity): every mix equals the one of the state whose blocks grow by a cat."""
    from attnres_convert.modeling.modeling_attnres import BlockState

    generator = torch.Generator().manual_seed(0)
    embeddings = torch.randn(2, 5, 16, generator=generator)
    growing, buffered = BlockState.start(embeddings, 1e-6), BlockState.start(embeddings, 1e-6, capacity=4)
    assert buffered.blocks.shape == (2, 5, 4, 16) and buffered.count == 1
    for step in range(7):
        if step in (2, 5):
            growing, buffered = growing.close(1e-6), buffered.close(1e-6)
        q = torch.randn(16, generator=generator)
        mixes = [state.mix(q, 1e-6, "count") for state in (growing, buffered)]
        assert torch.equal(*mixes)
        output = torch.randn(2, 5, 16, generator=generator)
        growing, buffered = growing.add(output), buffered.add(output)
    assert buffered.count == 3 and torch.equal(buffered.blocks[..., :3, :], growing.blocks)


def test_the_score_table_mixes_as_scoring_each_reader():
    """With every reader's folded query the compiled buffer scores each block once as it closes (the score table):
    every reader's mix equals the one that scores the blocks itself (to float32 reordering), and at zero queries it
    is the same stream bit for bit; columns of readers before a close are never read."""
    from attnres_convert.modeling.modeling_attnres import BlockState

    generator = torch.Generator().manual_seed(1)
    embeddings = torch.randn(2, 5, 16, generator=generator)
    queries = torch.randn(7, 16, generator=generator)
    for scale in (1.0, 0.0):
        q = queries * scale
        scored, tabled = BlockState.start(embeddings, 1e-6, 4), BlockState.start(embeddings, 1e-6, 4, q)
        assert tabled.table.shape == (2, 5, 4, 7) and torch.equal(tabled.query(3), q[3])
        tabled.table[..., 1:, :] = float("nan")  # unwritten: a read of any column before its close would show
        for reader in range(7):
            if reader in (2, 5):
                scored, tabled = scored.close(1e-6, reader), tabled.close(1e-6, reader)
                assert tabled.table[..., tabled.count - 1, :reader].isnan().all()
            mixes = [scored.mix(q[reader], 1e-6, "count"), tabled.mix(q[reader], 1e-6, "count", reader)]
            if scale:
                torch.testing.assert_close(*mixes, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(mixes[1], scored.stream)
            output = torch.randn(2, 5, 16, generator=generator)
            scored, tabled = scored.add(output), tabled.add(output)
        assert torch.equal(tabled.blocks[..., :3, :], scored.blocks[..., :3, :])
