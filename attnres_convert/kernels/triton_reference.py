"""The Triton launches of triton.py written once more in plain PyTorch, with the same arguments and the
same in-place writes: the readable reference beside the kernels. The first-use self-check
(triton_check.py) compares a kernel with it, and a kernel variant that fails the check runs it instead.

The arithmetic follows the kernels (float32 throughout, the residual add rounded once to the stream's dtype,
`n alpha_i - 1` as `(n e_i - sum e) / sum e`), so at zero queries the mix is the stream bit for bit here too.
"""

from __future__ import annotations

import torch


def _rows(x: torch.Tensor | None, d: int) -> torch.Tensor | None:
    return None if x is None else x.reshape(-1, d)


def mix(
    keys,
    m,
    q,
    stream,
    eps,
    count,
    *,
    inv_rms=None,
    table=None,
    partial=None,
    new=None,
    init_partial=False,
    stream_out=None,
    save=False,
):
    """triton.mix (same arguments, same writes: the partial sum and stream_out when `new` is given)."""
    d = stream.shape[-1]
    h = _rows(stream, d).float()
    keys = keys[:m].float()  # [m, BT, D]
    y = None
    if new is not None:
        y = _rows(new, d).float()
        rounded = (h + y).to(stream_out.dtype)
        _rows(stream_out, d).copy_(rounded)
        h = rounded.float()
    if table is not None:
        logits = table[:m].float().t()
    else:
        logits = ((keys * q).sum(-1) * inv_rms[:m]).t()  # [BT, m]
    inv_partial = p = None
    if partial is not None:
        p = y if y is not None and init_partial else _rows(partial, d).float()
        if y is not None and not init_partial:
            p = p + y
        if y is not None:
            _rows(partial, d).copy_(p)
        inv_partial = torch.rsqrt((p * p).sum(-1) / d + eps)
        logits = torch.cat([logits, ((p * q).sum(-1) * inv_partial)[:, None]], dim=-1)
    n = logits.shape[-1]
    e = torch.exp(logits - logits.max(-1, keepdim=True).values)
    total = e.sum(-1, keepdim=True)
    coef = (e * n - total) / total if count else e / total
    acc = h.clone() if count else torch.zeros_like(h)
    for i in range(m):
        acc += coef[:, i, None] * keys[i]
    if p is not None:
        acc += coef[:, m, None] * p
    out = acc.to(stream.dtype).view(stream.shape)
    if not save:
        return out, None, None, None
    return out, e / total, logits, inv_partial


def close(
    source, dst, inv_out, eps, *, new=None, init_partial=False, stream=None, stream_out=None, queries=None, table=None
):
    """triton.close (same arguments, same writes: dst, inv_out, the table and stream_out)."""
    d = dst.shape[-1]
    k = _rows(source, d).float()
    if new is not None:
        y = _rows(new, d).float()
        _rows(stream_out, d).copy_((_rows(stream, d).float() + y).to(stream_out.dtype))
        k = y if init_partial else k + y
    dst.copy_(k)
    inv = torch.rsqrt((dst * dst).sum(-1) / d + eps)
    inv_out.copy_(inv)
    if queries is not None:
        table.copy_((dst @ queries.float().t()) * inv[:, None])


def mix_backward(
    grad,
    keys,
    m,
    q,
    weights,
    logits,
    count,
    block_grad,
    *,
    inv_rms=None,
    rms_grad=None,
    score_grad=None,
    partial=None,
    inv_partial=None,
):
    """triton.mix_backward (same arguments, same in-place adds to block_grad and score_grad or rms_grad)."""
    d, tokens, n = keys.shape[-1], keys.shape[1], weights.shape[-1]
    g = grad.reshape(tokens, d).float()
    keys = keys[:m].float()
    dw = (keys * g).sum(-1).t()  # [BT, m]
    p = None
    if partial is not None:
        p = _rows(partial, d).float()
        dw = torch.cat([dw, (g * p).sum(-1, keepdim=True)], dim=-1)
    if count:
        dw = dw * n
    dl = weights * (dw - (weights * dw).sum(-1, keepdim=True))
    coef = weights * n - 1.0 if count else weights
    update = coef[:, :m].t()[..., None] * g  # [m, BT, D]
    dq = torch.zeros(tokens, d, device=keys.device, dtype=torch.float32)
    if score_grad is not None:
        score_grad[:m] += dl[:, :m].t()
    else:
        via = dl[:, :m].t() * inv_rms[:m]  # [m, BT]
        update = update + via[..., None] * q
        rms_grad[:m] -= via * logits[:, :m].t() * inv_rms[:m] / d
        dq = dq + (via[..., None] * keys).sum(0)
    block_grad[:m] += update
    dpartial = None
    if p is not None:
        via = dl[:, m] * inv_partial
        dq = dq + via[:, None] * p
        dp = coef[:, m, None] * g + via[:, None] * q - (via * logits[:, m] * inv_partial / d)[:, None] * p
        dpartial = dp.to(partial.dtype).view(partial.shape)
    return dpartial, dq.sum(0)
