"""Triton kernels for the depth mix (the math is modeling_attnres.py's).

One reader of the eager path is a chain of small operations (norm, scores, softmax, the count-scaled
mix, then the partial-sum and stream updates after its sublayer): on a GPU each is a kernel launch, and
a decoding step is bound by launches. Here:

* `mix_kernel`: one program per token of a reader. It first applies the previous sublayer's output (partial sum += y,
  stream = stream + y, rounded to the model dtype exactly as the base model's own residual add), then
  scores the completed sources (from the score table, or against their cached 1 / rms) and the partial
  sum (its statistic computed here), takes the softmax and writes h = H + sum_i (n alpha_i - 1) k_i.
  At zero queries every coefficient is exactly 0, so h is the stream bit for bit, in any dtype.
* `close_kernel`: one launch per block boundary (phase 1 of the two-phase computation): the last output joins
  the partial sum, which becomes a completed source with its 1 / rms, scored against every sublayer's
  query into the score table.
* `mix_backward_kernel`: the reader's backward in one launch: gradients of the partial sum, of the completed
  blocks (added in place to the training cache's buffers) and per-token rows of the query's gradient.

One program per token: a token's sources are a few rows of D values; nothing crosses tokens, so the results are
deterministic. A program walks its row in chunks of BLOCK_D, twice where a result needs the whole row first (the
scores and the partial sum's statistic, then the mix), so one compiled program serves any hidden size. The flags
(has_part, has_new, ...) are runtime arguments, not constexprs: each kernel compiles to one program per block sizes
and dtypes, and tests/test_kernels_aot.py compiles every one of them ahead of time for sm_80 and sm_90. Every launch
states enable_fp_fusion=False (triton.FP_POLICY): no product and sum are contracted into an FMA, so each
rounds as written, as in the PyTorch reference (triton_reference.py) and in Triton's interpreter.

The launchers, which size the programs and hand them tensors, are triton.py's. This file ships next to
converted weights and is imported only when `triton` is importable and selected (ATTNRES_KERNEL, see
kernels.triton_kernels_for). On CPU tensors it runs under Triton's interpreter (TRITON_INTERPRET=1), which is
how the test suite checks it without a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _select(vector, offsets, i):
    """Element i of a small register vector."""
    return tl.sum(tl.where(offsets == i, vector, 0.0), axis=0)


@triton.jit
def _rounded(x, ptr):
    """float32 x in the element type of ptr, rounded to nearest even as PyTorch rounds, so a residual add
    here gives the base model's bits. bfloat16 is rounded by hand: Triton's interpreter truncates."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(ptr.dtype.element_ty)


# Sizes, the strides of tables (which can be 1 or not for the same call site) and the flags (Triton 3.2 specialises a
# False as an integer divisible by 16) are not specialised on their value: one compiled program per block sizes and
# dtypes, whatever the number of sources or tokens and whichever flags are set.
@triton.jit(
    do_not_specialize=[
        "s_inv",
        "t_inv",
        "s_table",
        "t_table",
        "m",
        "has_part",
        "has_new",
        "init_part",
        "use_table",
        "count",
        "save",
    ]
)
def mix_kernel(
    keys,
    s_keys,
    t_keys,  # completed source i of token t at keys + i * s_keys + t * t_keys
    inv,
    s_inv,
    t_inv,  # their 1 / rms (without a table)
    table,
    s_table,
    t_table,  # their scores for this reader (with a table)
    part,
    t_part,  # the partial sum, float32 (inference: the buffer slot) or model dtype (training)
    new,
    t_new,  # the previous sublayer's output, applied first (has_new)
    stream,
    t_stream,  # the residual stream before that output
    stream_out,
    t_stream_out,  # the stream after it (has_new)
    q,  # the folded query [D], float32
    out,
    t_out,  # the mix, in the stream's dtype
    w_out,
    l_out,
    ip_out,  # weights [BT, n], scores [BT, n], the partial's 1 / rms [BT] (save)
    m,
    D,
    eps,
    has_part,
    has_new,
    init_part,
    use_table,
    count,
    save,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK_N)
    completed = slots < m
    # Pass 1, D in chunks: the dot products of the scores, and the partial sum (the previous output joins it and
    # it is written back).
    dots = tl.zeros([BLOCK_N], tl.float32)
    squares = tl.zeros([BLOCK_D], tl.float32)
    part_dots = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, D, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        dmask = offs < D
        qv = tl.load(q + offs, mask=dmask, other=0.0)
        if not use_table:
            for i in range(0, m):
                k = tl.load(keys + i * s_keys + t * t_keys + offs, mask=dmask, other=0.0)
                dots = tl.where(slots == i, dots + tl.sum(k * qv, axis=0), dots)
        if has_part:
            if has_new:
                y = tl.load(new + t * t_new + offs, mask=dmask, other=0.0).to(tl.float32)
                if init_part:
                    p = y
                else:
                    p = tl.load(part + t * t_part + offs, mask=dmask, other=0.0).to(tl.float32) + y
                tl.store(part + t * t_part + offs, p, mask=dmask)
            else:
                p = tl.load(part + t * t_part + offs, mask=dmask, other=0.0).to(tl.float32)
            squares += p * p
            part_dots += p * qv
    if use_table:
        logits = tl.load(table + slots * s_table + t * t_table, mask=completed, other=float("-inf"))
    else:
        logits = tl.where(
            completed, dots * tl.load(inv + slots * s_inv + t * t_inv, mask=completed, other=0.0), float("-inf")
        )
    n = m
    inv_p = tl.full([], 0.0, tl.float32)
    if has_part:
        inv_p = tl.rsqrt(tl.sum(squares, axis=0) / D + eps)
        logits = tl.where(slots == m, tl.sum(part_dots, axis=0) * inv_p, logits)
        n = m + 1
    e = tl.exp(logits - tl.max(logits, axis=0))
    total = tl.sum(e, axis=0)
    if count:
        # n alpha_i - 1 = (n e_i - sum e) / sum e: exactly 0 for equal scores, whatever the rounding.
        coef = (e * n - total) / total
    else:
        coef = e / total
    if save:
        nmask = slots < n
        tl.store(w_out + t * n + slots, e / total, mask=nmask)
        tl.store(l_out + t * n + slots, logits, mask=nmask)
        if has_part:
            tl.store(ip_out + t, inv_p)
    tl.debug_barrier()  # pass 2 reads the partial sum that pass 1 wrote
    # Pass 2, D in chunks: the stream update and h = H + sum_i coef_i k_i (count) or sum_i alpha_i k_i.
    for start in range(0, D, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        dmask = offs < D
        h = tl.load(stream + t * t_stream + offs, mask=dmask, other=0.0).to(tl.float32)
        if has_new:
            y = tl.load(new + t * t_new + offs, mask=dmask, other=0.0).to(tl.float32)
            # The base model's residual add, rounded to its dtype: the stream stays its own bit for bit.
            rounded = _rounded(h + y, stream_out)
            tl.store(stream_out + t * t_stream_out + offs, rounded, mask=dmask)
            h = rounded.to(tl.float32)
        if count:
            acc = h
        else:
            acc = tl.zeros([BLOCK_D], tl.float32)
        for i in range(0, m):
            k = tl.load(keys + i * s_keys + t * t_keys + offs, mask=dmask, other=0.0)
            acc += _select(coef, slots, i) * k
        if has_part:
            p = tl.load(part + t * t_part + offs, mask=dmask, other=0.0).to(tl.float32)
            acc += _select(coef, slots, m) * p
        tl.store(out + t * t_out + offs, _rounded(acc, out), mask=dmask)


@triton.jit(do_not_specialize=["t_inv", "R", "t_table", "has_new", "init_part", "has_table"])
def close_kernel(
    part,
    t_part,  # the partial sum (or the embedding)
    new,
    t_new,  # the last output of the block, joined first (has_new)
    stream,
    t_stream,
    stream_out,
    t_stream_out,  # the stream update that output makes (has_new)
    dst,
    t_dst,  # the completed source's float32 slot (may be `part` itself)
    inv_out,
    t_inv,  # its 1 / rms
    queries,
    R,  # every sublayer's folded query [R, D], float32, contiguous (has_table)
    table,
    t_table,  # the score table's rows for this source, [BT, R] with unit column stride
    D,
    eps,
    has_new,
    init_part,
    has_table,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_R)
    rmask = rows < R
    scores = tl.zeros([BLOCK_R], tl.float32)
    squares = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, D, BLOCK_D):  # D in chunks: the scores against all R queries accumulate per chunk
        offs = start + tl.arange(0, BLOCK_D)
        dmask = offs < D
        if has_new:
            y = tl.load(new + t * t_new + offs, mask=dmask, other=0.0).to(tl.float32)
            h = tl.load(stream + t * t_stream + offs, mask=dmask, other=0.0).to(tl.float32)
            tl.store(stream_out + t * t_stream_out + offs, _rounded(h + y, stream_out), mask=dmask)
            if init_part:
                k = y
            else:
                k = tl.load(part + t * t_part + offs, mask=dmask, other=0.0).to(tl.float32) + y
        else:
            k = tl.load(part + t * t_part + offs, mask=dmask, other=0.0).to(tl.float32)
        tl.store(dst + t * t_dst + offs, k, mask=dmask)
        squares += k * k
        if has_table:
            qs = tl.load(queries + rows[:, None] * D + offs[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
            scores += tl.sum(qs * k[None, :], axis=1)
    inv = tl.rsqrt(tl.sum(squares, axis=0) / D + eps)
    tl.store(inv_out + t * t_inv, inv)
    if has_table:
        tl.store(table + t * t_table + rows, scores * inv, mask=rmask)


@triton.jit(
    do_not_specialize=["s_inv", "t_inv", "s_rms", "t_rms", "s_sg", "t_sg", "m", "has_part", "use_table", "count"]
)
def mix_backward_kernel(
    g,
    t_g,  # the mix's gradient
    keys,
    s_keys,
    t_keys,
    inv,
    s_inv,
    t_inv,
    part,
    t_part,
    q,  # as in mix_kernel
    w,
    l,
    ip,  # saved weights and scores [BT, n], the partial's 1 / rms [BT]
    grad,
    s_grad,
    t_grad,  # the completed blocks' gradient buffer, float32, added to in place
    rms_grad,
    s_rms,
    t_rms,  # their per-token coefficient of k_i (without a table)
    score_grad,
    s_sg,
    t_sg,  # this reader's column of the score table's gradient (with a table)
    dpart,
    t_dpart,  # the partial sum's gradient, in its dtype
    dq,
    t_dq,  # per-token rows of the query's gradient, float32
    m,
    D,
    has_part,
    use_table,
    count,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK_N)
    completed = slots < m
    n = m
    if has_part:
        n = m + 1
    nmask = slots < n
    # Pass 1, D in chunks: d(mix)/d(alpha_i) = g . k_i (times n with count scaling).
    dw = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, D, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        dmask = offs < D
        gv = tl.load(g + t * t_g + offs, mask=dmask, other=0.0).to(tl.float32)
        for i in range(0, m):
            k = tl.load(keys + i * s_keys + t * t_keys + offs, mask=dmask, other=0.0)
            dw = tl.where(slots == i, dw + tl.sum(gv * k, axis=0), dw)
        if has_part:
            p = tl.load(part + t * t_part + offs, mask=dmask, other=0.0).to(tl.float32)
            dw = tl.where(slots == m, dw + tl.sum(gv * p, axis=0), dw)
    if count:
        dw = dw * n
    # The softmax's backward.
    wv = tl.load(w + t * n + slots, mask=nmask, other=0.0)
    lv = tl.load(l + t * n + slots, mask=nmask, other=0.0)
    dl = wv * (dw - tl.sum(wv * dw, axis=0))
    if count:
        coef = wv * n - 1.0
    else:
        coef = wv
    # A score s_i = (q . k_i) inv_i has d s_i / d k_i = inv_i q - s_i inv_i^2 k_i / D.
    via = tl.zeros([BLOCK_N], tl.float32)
    if use_table:
        cells = score_grad + slots * s_sg + t * t_sg
        tl.store(cells, tl.load(cells, mask=completed, other=0.0) + dl, mask=completed)
    else:
        inv_v = tl.load(inv + slots * s_inv + t * t_inv, mask=completed, other=0.0)
        via = dl * inv_v
        cells = rms_grad + slots * s_rms + t * t_rms
        tl.store(cells, tl.load(cells, mask=completed, other=0.0) - via * lv * inv_v / D, mask=completed)
    via_p = tl.full([], 0.0, tl.float32)
    coef_p = tl.full([], 0.0, tl.float32)
    l_p = tl.full([], 0.0, tl.float32)
    inv_p = tl.full([], 0.0, tl.float32)
    if has_part:
        inv_p = tl.load(ip + t)
        via_p = _select(dl, slots, m) * inv_p
        coef_p = _select(coef, slots, m)
        l_p = _select(lv, slots, m)
    # Pass 2, D in chunks: the blocks' gradients, the partial sum's and the query's.
    for start in range(0, D, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        dmask = offs < D
        gv = tl.load(g + t * t_g + offs, mask=dmask, other=0.0).to(tl.float32)
        qv = tl.load(q + offs, mask=dmask, other=0.0)
        dqv = tl.zeros([BLOCK_D], tl.float32)
        for i in range(0, m):
            update = _select(coef, slots, i) * gv
            if not use_table:
                via_i = _select(via, slots, i)
                update += via_i * qv
                k = tl.load(keys + i * s_keys + t * t_keys + offs, mask=dmask, other=0.0)
                dqv += via_i * k
            row = grad + i * s_grad + t * t_grad + offs
            tl.store(row, tl.load(row, mask=dmask, other=0.0) + update, mask=dmask)
        if has_part:
            p = tl.load(part + t * t_part + offs, mask=dmask, other=0.0).to(tl.float32)
            dqv += via_p * p
            dp = coef_p * gv + via_p * qv - (via_p * l_p * inv_p / D) * p
            tl.store(dpart + t * t_dpart + offs, _rounded(dp, dpart), mask=dmask)
        tl.store(dq + t * t_dq + offs, dqv, mask=dmask)
