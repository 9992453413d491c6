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
