"""Block Attention Residuals: softmax attention over depth.

A PreNorm decoder feeds sublayer l the plain sum of every earlier output. AttnRes replaces that sum
with a per-token softmax over *sources* (the embedding, completed blocks, the running partial sum of
the current block), scored by a static pseudo-query against RMS-normalised keys:

    alpha_i = softmax_i( (w * g) . k_i / rms(k_i) )        h = n * sum_i alpha_i k_i

With w = 0 every source weighs 1/n, and the factor n (the number of sources) turns the mix back into
the exact residual sum, so a converted model reproduces its base model. Scores and softmax run in
float32 whatever the model dtype.

This file ships next to converted weights: it imports torch only.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

# Imports torch only; compiles nothing until `build` is called (ATTNRES_KERNEL=cpu).
from .depth_kernels_cpu import NO_NORM, NONE, buffer_mix, build

class BlockState(NamedTuple):
    """What the residual stream carries between sublayers, instead of one tensor: the plain-tensor form,
    traced under torch.compile (eager forwards use SourceBuffer without autograd, TrainState with it).

    blocks:  [B, T, m, D] the embedding and every completed block, float32 (scores are float32, and a
             completed block is read by every later sublayer, so it is converted once, when it completes).
             Sources sit next to each other per token, so a reader's mix is one batched matrix product.
    inv_rms: [B, T, m]    1 / rms of each completed block, float32. A completed block never changes, so
             its key statistics are computed once, not once per reader.
    partial: [B, T, D]    running sum of the current block's outputs (model dtype), or None right after
             a block boundary.
    stream:  [B, T, D]    the plain residual stream: the sum of all sources, accumulated output by output
             exactly as the base model adds them (see `depth_mix` for why it is carried).

    It is an immutable value threaded through the layers' arguments and return values (never stored
    on a module), so gradient checkpointing replays see exactly the state of the forward pass. Nothing
    is stacked per sublayer: `blocks` grows once per block, and the partial sum is read where it is.
    """

    blocks: torch.Tensor
    inv_rms: torch.Tensor
    partial: torch.Tensor | None
    stream: torch.Tensor


class SourceBuffer(NamedTuple):
    """The state without autograd (inference, generation): every source in one preallocated float32
    buffer, written in place. A block boundary is a counter increment, a reader's sources are a view
    and the partial sum accumulates in its slot, so nothing is concatenated or copied per sublayer
    (Full AttnRes with BlockState would copy the growing block tensor at every sublayer). In-place
    updates are safe only without autograd; training uses TrainState (BlockState under torch.compile).

    sources:     float32; completed sources in slots [0, count), the partial sum in slot count; K slots,
                 the most sources any reader has. Two layouts, after what a forward pays for:
                 many tokens (prefill): [K, B, T, D], source-major. Such a forward is bound by memory
                 traffic; every source is one contiguous tensor, so the partial sum's update and score,
                 and the mix as a chain of elementwise multiply-adds, run at memory speed (measured per
                 512-token reader: a strided slot's norm 85 us against 47, its add 96 against 66, and the
                 mix of 3 sources 145 us against 242 for one batched product over a token-major buffer).
                 few tokens (a decoding step, `step` set): [B, T, K, D], token-major (a view of a
                 [B, T, K, D + 1] buffer, see StepViews). Such a forward pays per operation, and a
                 token's n sources are one [n, D] matrix: one product scores them and one mixes them.
    inv_rms:     1 / rms of the completed sources ([K, B, T]), written once when a source completes
                 (unused for few tokens, where readers recompute statistics: fewer operations).
    count:       the number of completed sources (embedding + completed blocks).
    has_partial: whether slot `count` holds a partial sum (False right after a block boundary).
    stream:      [B, T, D] the plain residual stream, as in BlockState.
    queries:     [R, D] the folded pseudo-queries of all R sublayers, or None (then each reader folds its own).
    scores:      [K, B, T, R] with queries and many tokens: the scores (q_r . k_i * inv_rms_i) of each completed source
                 for every sublayer r, written when the source completes (phase 1 of the two-phase
                 computation: a completed block is read once by one product with all queries, not
                 once per reader); a reader adds only its partial sum's score (phase 2).
    step:        for a forward of few tokens (a decoding step), the constants and views its readers
                 use, made once per forward (see StepViews); None otherwise.
    native:      the compiled C++ kernels for CPU (see `cpu_kernels_for`), or None: readers then run
                 `step_mix` / `buffer_mix` of depth_kernels_cpu.py instead of their eager operations, and an
                 output joins the partial sum and the stream inside the next reader's call (see `update`).
    kernels:     the Triton kernels (see `kernels_for`), or None for the eager path. With kernels the
                 buffer is source-major for any number of tokens, [K, BT, D] (inv_rms [K, BT], scores
                 [K, BT, R]), and an output is applied by the next kernel (see `_Update`).
    update:      with kernels (Triton or C++), the last output, until a kernel (or `current_stream`) applies it.
    shared_stream: the stream is the buffer's last slot (a float32 model: the buffer's dtype is the
                 stream's), so an output joins the partial sum and the stream in one in-place add over a
                 view of both slots (the partial slots start at zero; with the C++ kernels a prefill's are
                 written by a block's first output instead, inside a kernel). One operation less per sublayer, which
                 a decoding step pays for; `current_stream` hands out copies.
    """

    sources: torch.Tensor
    inv_rms: torch.Tensor
    count: int
    has_partial: bool
    stream: torch.Tensor
    queries: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    step: StepViews | None = None
    kernels: Kernels | None = None
    update: _Update | None = None
    shared_stream: bool = False
    native: object | None = None


class StepViews(NamedTuple):
    """What the readers of a few-token forward use, made once per forward instead of once per reader.
    Such a forward pays per operation (1-3 us each on CPU alone, 5-7 inside the model, whose weights
    evict the caches between readers), and making a view, or wrapping a Python number into a tensor, is
    an operation. Measured on a SmolLM2 decoding step (61 readers, AttnRes work alone): 2.5 -> 1.9 ms.

    The buffer behind it is [B, T, K, D + 1]: each source's row ends in a constant sqrt(D * eps), so one
    norm of the padded row is sqrt(|k|^2 + D eps) = sqrt(D) rms(k), the key statistic in one operation.

    inverse:   inverse[n] = 1/n, 0-dim float32 tensors.
    padded:    padded[n] = the n sources a reader reads with their constant, [B, T, n, D + 1].
    rows:      with one token, rows[n] = padded[n] as [n, D + 1], for one matrix-vector product with the
               query (a batched product is slower; with more tokens the scores are a product and a sum).
    flat:      flat[n], the n sources without the constant as [B*T, n, D], for the batched product of the mix.
    slots:     slots[j] = source j without the constant, [B, T, D], where outputs accumulate.
    queries:   every sublayer's folded query times sqrt(D), with a 0 for the constant (see
               `_few_token_logits`), one view each; or None.
    root_d:    sqrt(D), a 0-dim float32 tensor.
    pairs:     with the stream in the buffer's last row (see SourceBuffer.shared_stream), pairs[j] = slot j
               and the stream as one [2, B, T, D] view, so an output joins both in one operation.
    """

    inverse: tuple[torch.Tensor, ...]
    padded: tuple[torch.Tensor, ...]
    rows: tuple[torch.Tensor, ...] | None
    flat: tuple[torch.Tensor, ...]
    slots: tuple[torch.Tensor, ...]
    queries: tuple[torch.Tensor, ...] | None
    root_d: torch.Tensor
    pairs: tuple[torch.Tensor, ...] | None = None

    @classmethod
    def of(
        cls, padded: torch.Tensor, eps: float, queries: torch.Tensor | None = None, shared_stream: bool = False
    ) -> StepViews:
        """Views of a token-major buffer [B, T, K, D + 1], whose constant column this fills."""
        capacity, d, tokens = padded.shape[-2], padded.shape[-1] - 1, padded.shape[:-2].numel()
        padded[..., d] = (d * eps) ** 0.5
        constants = torch.tensor([d**0.5] + [1.0 / n for n in range(1, capacity + 1)], device=padded.device).unbind()
        prefixes = tuple(padded.narrow(-2, 0, n) for n in range(1, capacity + 1))
        rows = (None,) + tuple(p.view(n, d + 1) for n, p in enumerate(prefixes, 1)) if tokens == 1 else None
        flat = tuple(p.view(tokens, n, d + 1)[..., :d] for n, p in enumerate(prefixes, 1))
        slots = padded[..., :d].unbind(-2)
        scaled = None if queries is None else pad_query(queries * constants[0]).unbind()
        pairs = None
        if shared_stream:
            last = capacity - 1
            pairs = tuple(padded[..., j::last - j, :d].movedim(-2, 0) for j in range(last))
        # Index n for n sources (no reader has none).
        return cls((None,) + constants[1:], (None,) + prefixes, rows, (None,) + flat, slots, scaled, constants[0], pairs)


def pad_query(q: torch.Tensor) -> torch.Tensor:
    """A query [..., D] with a 0 for the constant column of a decoding step's buffer."""
    return torch.nn.functional.pad(q, (0, 1))


class BlockCache:
    """The completed blocks of one training forward, kept outside autograd (see `TrainState`).

    values:   [BT, M, D] float32, slot j holds completed source j (0 is the embedding), written once
              by `_CloseBlock` when the block completes and only read afterwards.
    inv_rms:  [BT, M] float32, their 1 / rms.
    grad:     [M, BT, D] float32, the gradient every reader's backward adds for each completed block;
              allocated by the first backward (after the forward's peak), handed to the block's producer
              by `_CloseBlock.backward` once all its readers are done. Source-major, so a reader's
              slots [:m] are one contiguous tensor, updated in place by plain elementwise kernels (a
              strided token-major [BT, :m, D] view made the in-place batched product fall back to one
              small matrix product per token).
    rms_grad: [M, BT] the per-token coefficient of k_j in that gradient (from the key statistics):
              every reader's term is a multiple of the same k_j, so it is summed as one scalar per token
              and applied once instead of once per reader.
    scores:   [BT, M, R] or None: the score table, as in SourceBuffer: each completed block scored by
              all R sublayers' queries in one product when it completes, so a reader reads its column
              instead of every completed block (the two-phase computation).
    score_grad: [BT, M, R], each reader's gradient for its column, turned into the block's and the
              queries' gradients by the block's `_CloseBlock.backward` in two products.
    """

    __slots__ = ("values", "inv_rms", "grad", "rms_grad", "scores", "score_grad")

    def __init__(self, values: torch.Tensor, inv_rms: torch.Tensor, scores: torch.Tensor | None = None):
        self.values, self.inv_rms, self.scores = values, inv_rms, scores
        self.grad: torch.Tensor | None = None
        self.rms_grad: torch.Tensor | None = None
        self.score_grad: torch.Tensor | None = None

    def gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.grad is None:
            self.grad = self.values.new_zeros(self.values.shape[1], *self.values.shape[::2])
            self.rms_grad = self.inv_rms.new_zeros(self.inv_rms.shape[::-1])
            if self.scores is not None:
                self.score_grad = torch.zeros_like(self.scores)
        return self.grad, self.rms_grad


class TrainState(NamedTuple):
    """The state of an eager training forward. Completed blocks live in one preallocated BlockCache
    instead of a BlockState's growing tensor (which copies all blocks at every boundary: 36 block
    copies for 8 blocks, ~1,900 for Full AttnRes), and the readers' gradients for them are
    accumulated in place in one buffer instead of one [BT, m, D] tensor per reader summed by autograd.
    Autograd still orders everything: each completed block is represented by a `handle` (an empty
    tensor returned by `_CloseBlock`) that its readers take as input, so a block's gradient is handed
    on only after every reader has added to it.

    The cache is written only when a block completes and never changed afterwards, so gradient
    checkpointing replays (which rewrite the slots they close with identical values) see the forward's
    state: the immutability that BlockState gives, for the blocks, by construction.
    """

    cache: BlockCache
    handles: tuple[torch.Tensor, ...]  # one per completed block, in order
    partial: torch.Tensor | None
    stream: torch.Tensor
    queries: torch.Tensor | None = None  # [R, D] all sublayers' folded queries, for the cache's score table
    kernels: Kernels | None = None  # the Triton kernels, or None for the eager path


STATE_TYPES = (BlockState, SourceBuffer, TrainState)


# ---------------------------------------------------------------------------------------------
# Kernel selection. ATTNRES_KERNEL=auto (default): the Triton kernels (depth_kernels.py) for CUDA
# tensors when triton is importable, the eager path otherwise; triton: the kernels or an error, never
# a silent fallback (CPU tensors run under Triton's interpreter, TRITON_INTERPRET=1); cpu: the C++
# kernels (depth_kernels_cpu.py, compiled on first use) for float32 inference on CPU, or an error;
# eager: never. Neither auto nor eager compiles anything.
# ---------------------------------------------------------------------------------------------

KERNEL_ENV = "ATTNRES_KERNEL"


class Kernels(NamedTuple):
    mix: Callable
    close: Callable
    mix_backward: Callable


_KERNELS: list[Kernels | ImportError] = []  # the import's outcome, once per process


def _import_kernels() -> Kernels | ImportError:
    if not _KERNELS:
        try:
            from .depth_kernels import close, mix, mix_backward
        except ImportError as error:  # triton not installed (or not importable here)
            _KERNELS.append(error)
        else:
            _KERNELS.append(Kernels(mix, close, mix_backward))
    return _KERNELS[0]


def kernel_mode() -> str:
    """ATTNRES_KERNEL: auto, triton, cpu or eager."""
    mode = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "triton", "cpu", "eager"):
        raise ValueError(
            f"{KERNEL_ENV}={mode!r} is not a kernel choice: use auto (the default), triton, cpu or eager"
        )
    return mode


def kernels_for(like: torch.Tensor, mode: str | None = None) -> Kernels | None:
    """The Triton kernels if selected (by `mode`, ATTNRES_KERNEL by default) for tensors like `like`, else None
    (the eager path)."""
    mode = mode or kernel_mode()
    if mode in ("eager", "cpu"):
        return None
    forced = mode == "triton"
    if torch.compiler.is_compiling():
        if forced:
            raise RuntimeError(
                f"{KERNEL_ENV}=triton: the Triton depth-mix kernels do not run under torch.compile, which "
                f"fuses the eager depth mix itself; unset {KERNEL_ENV} (auto) or set it to eager."
            )
        return None
    on_gpu = like.device.type == "cuda"
    if not forced and not on_gpu:
        return None
    kernels = _import_kernels()
    if isinstance(kernels, ImportError):
        if forced:
            raise RuntimeError(
                f"{KERNEL_ENV}=triton but Triton cannot be imported ({kernels}). Install it (pip install triton) "
                f"or set {KERNEL_ENV}=auto to use the eager path where Triton is missing."
            ) from kernels
        return None
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"{KERNEL_ENV}=triton needs CUDA tensors (these are on {like.device.type}); to run the kernels on "
            f"CPU in Triton's interpreter (slow, for tests) set TRITON_INTERPRET=1 before Python starts."
        )
    return kernels


def cpu_kernels_for(like: torch.Tensor, mode: str | None = None):
    """The compiled C++ kernels where ATTNRES_KERNEL=cpu (or `mode`) selects them, for a forward without
    autograd of tensors like `like` (CPU, float32); None where it does not. Raises where it selects them and they
    cannot run: never a silent fallback."""
    if (mode or kernel_mode()) != "cpu":
        return None
    if torch.compiler.is_compiling():
        raise RuntimeError(
            f"{KERNEL_ENV}=cpu: the C++ depth-mix kernels do not run under torch.compile, which fuses the eager "
            f"depth mix itself; unset {KERNEL_ENV} (auto) or set it to eager."
        )
    if like.device.type != "cpu" or like.dtype != torch.float32:
        raise RuntimeError(
            f"{KERNEL_ENV}=cpu runs float32 models on CPU; this forward is {like.dtype} on {like.device.type}. "
            f"Load the model with dtype=torch.float32 on CPU, or unset {KERNEL_ENV} (auto: Triton on CUDA)."
        )
    return build()


class _Update:
    """With kernels, an output joins the partial sum and the stream inside the next kernel (the next
    reader's mix, or the block's close), not in operations of its own. This holds it until then:
    exactly one of them applies it (`take`); `apply` does it eagerly for anyone who reads the stream
    before (the output_hidden_states hooks).

    Triton writes the new stream out of place (`previous` + new into `stream`); the C++ kernels add in place
    (`previous` None: `stream` is the buffer's stream row, `index` the partial sum's slot)."""

    __slots__ = ("new", "init", "previous", "stream", "slot", "index", "done")

    def __init__(self, new, init: bool, previous, stream, slot, index: int = 0):
        self.new, self.init, self.previous, self.stream, self.slot = new, init, previous, stream, slot
        self.index = index
        self.done = False

    def take(self) -> _Update | None:
        if self.done:
            return None
        self.done = True
        return self

    def apply(self) -> None:
        if self.take() is not None:
            new = self.new.reshape(self.slot.shape)
            self.slot.copy_(new) if self.init else self.slot.add_(new)
            if self.previous is None:
                self.stream.add_(new)
            else:
                torch.add(self.previous, self.new, out=self.stream)


def current_stream(state) -> torch.Tensor:
    """The plain residual stream a state stands for (with kernels, once its last output is applied)."""
    update = getattr(state, "update", None)
    if update is not None:
        update.apply()
    if getattr(state, "shared_stream", False):
        return state.stream.clone()  # the buffer's slot is updated in place by later outputs
    return state.stream
# Up to this many tokens per forward (a decoding step), operation count dominates: a reader then
# recomputes every source's statistics in a few large operations instead of reusing cached ones.
SMALL_STEP_TOKENS = 64


def inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    # One reduction pass (no squared copy of x to write, keep for backward and read back).
    x = x.float()
    return torch.rsqrt(torch.linalg.vector_norm(x, dim=-1).square() / x.shape[-1] + eps)


def _few_tokens(x: torch.Tensor) -> bool:
    return x.shape[:2].numel() <= SMALL_STEP_TOKENS


def wants_queries() -> bool:
    """Whether start_state would use all sublayers' folded queries (for a score table, or for a decoding
    step's readers), so whether the caller should gather them."""
    return not (torch.is_grad_enabled() and torch.compiler.is_compiling())


def start_state(
    embeddings: torch.Tensor,
    eps: float,
    capacity: int | None = None,
    queries: torch.Tensor | None = None,
    token_queries: bool = False,
    reuse: dict | None = None,
) -> BlockState | SourceBuffer | TrainState:
    """The embedding b_0 is always its own source. With a capacity (the most sources any reader has)
    the state is a SourceBuffer without autograd and a TrainState with it; a BlockState under
    torch.compile or without a capacity. `queries`, all the sublayers' folded pseudo-queries [R, D],
    where given, make the score table (or, for few tokens, the readers' query views).

    token_queries: the readers' queries depend on their input (a model with query_rank > 0), which the
    static-query fast paths (score tables, folded query views, the TrainState's hand-written backward, the
    Triton kernels) do not cover: the state is then the plain-tensor BlockState, differentiated by autograd.

    reuse: a dict owned by the model, where a few-token forward keeps its buffer and views for the next one of the
    same shape and queries (a decoding loop), per thread; see `_step_buffer`."""
    mode = kernel_mode()  # read once: a decoding step pays for every lookup
    if token_queries:
        if mode in ("triton", "cpu"):
            raise RuntimeError(
                f"{KERNEL_ENV}={mode}: the depth-mix kernels score one static query per reader, and this "
                f"model's queries depend on each token's input (query_rank > 0), which runs on the eager path. "
                f"Unset {KERNEL_ENV} (auto) or set it to eager."
            )
        capacity = None
    kernels = kernels_for(embeddings, mode) if capacity is not None else None
    if capacity is not None and not torch.is_grad_enabled():
        if kernels is not None:
            return _kernel_buffer(embeddings, eps, capacity, queries, kernels)
        native = None if _RECORDERS else cpu_kernels_for(embeddings, mode)  # a recorder needs the eager path's weights
        shared = embeddings.dtype == torch.float32
        rows, stream = capacity + int(shared), embeddings
        # Zeros where partial sums start by adding (an eager shared stream); the C++ kernels write a block's first output.
        new = embeddings.new_zeros if shared and native is None else embeddings.new_empty
        if _few_tokens(embeddings):
            d = embeddings.shape[-1]
            padded, step = _step_buffer(embeddings, rows, eps, queries, shared, reuse)
            step.slots[0].copy_(embeddings)
            if shared:
                stream = step.slots[capacity]
                stream.copy_(embeddings)
            return SourceBuffer(
                padded[..., :d], padded.new_empty(0), 1, False, stream, queries=queries, step=step,
                shared_stream=shared, native=native,
            )
        sources = new(rows, *embeddings.shape, dtype=torch.float32)
        sources[0] = embeddings
        if shared:
            stream = sources[capacity]
            stream.copy_(embeddings)
        inv_rms = sources.new_empty(sources.shape[:-1])
        inv_rms[0] = inverse_rms(sources[0], eps)
        state = SourceBuffer(sources, inv_rms, 1, False, stream, shared_stream=shared, native=native)
        if queries is not None:
            state = state._replace(queries=queries, scores=sources.new_empty(*sources.shape[:-1], queries.shape[0]))
            _score_source(state, 0)
        return state
    if capacity is not None and not torch.compiler.is_compiling():
        # Eager training. Under torch.compile the BlockState below is traced instead: plain tensor
        # operations, which the compiler fuses, where the custom autograd functions would break the graph.
        tokens, d = embeddings.shape[:-1].numel(), embeddings.shape[-1]
        values = embeddings.new_empty(tokens, capacity, d, dtype=torch.float32)
        scores = None if queries is None else values.new_empty(tokens, capacity, queries.shape[0])
        cache = BlockCache(values, values.new_empty(tokens, capacity), scores)
        return close_block(TrainState(cache, (), embeddings, embeddings, queries, kernels), eps)
    first = embeddings.float().unsqueeze(-2)
    return BlockState(first, inverse_rms(first, eps), None, embeddings)


def _step_buffer(embeddings: torch.Tensor, rows: int, eps: float, queries, shared: bool, reuse: dict | None):
    """The token-major buffer [B, T, rows, D + 1] of a few-token forward and its StepViews: the previous
    forward's where it had the same shape and queries (making them is ~70 operations and views, which a
    decoding step pays for: 0.4 ms of a SmolLM2 decoding step under cProfile). Kept per thread, so concurrent
    forwards never share one; a forward hands out no view of it (`current_stream` copies), so reusing it
    in the next is safe. The partial-sum slots are zeroed again (outputs are added to them)."""
    d = embeddings.shape[-1]
    keep = reuse is not None and not torch.compiler.is_compiling()  # a traced forward allocates its own
    if keep:
        # Under inference_mode the buffer is an inference tensor, which a later forward outside it may not write.
        inference = torch.is_inference_mode_enabled()
        key, thread = (tuple(embeddings.shape), embeddings.device, rows, shared, eps, inference), threading.get_ident()
        kept = reuse.get(thread)
        if kept is not None and kept[0] == key and kept[1] is queries:
            padded, step = kept[2], kept[3]
            if shared:
                padded[..., :d].zero_()
            return padded, step
    new = embeddings.new_zeros if shared else embeddings.new_empty
    padded = new(*embeddings.shape[:-1], rows, d + 1, dtype=torch.float32)
    step = StepViews.of(padded, eps, queries, shared)
    if keep:
        reuse[thread] = (key, queries, padded, step)
    return padded, step


def _kernel_buffer(embeddings: torch.Tensor, eps: float, capacity: int, queries, kernels: Kernels) -> SourceBuffer:
    """The SourceBuffer of a forward without autograd on the Triton kernels: source-major for any number of
    tokens, the embedding closed into slot 0 (with its scores, phase 1) by the close kernel."""
    tokens, d = embeddings.shape[:-1].numel(), embeddings.shape[-1]
    sources = embeddings.new_empty(capacity, tokens, d, dtype=torch.float32)
    inv_rms = sources.new_empty(capacity, tokens)
    scores = None if queries is None else sources.new_empty(capacity, tokens, queries.shape[0])
    kernels.close(embeddings, sources[0], inv_rms[0], eps, queries=queries, table=None if scores is None else scores[0])
    return SourceBuffer(sources, inv_rms, 1, False, embeddings, queries, scores, kernels=kernels)


def close_block(state, eps: float, first: int = 0):
    """At a block boundary the partial sum becomes a completed block (the only copy of the blocks). `first`: the
    first reader after the boundary; a score table gets the new source's scores for it and the readers after."""
    if isinstance(state, SourceBuffer) and state.kernels is not None:
        if not state.has_partial:
            return state
        slot, update = state.sources[state.count], state.update.take() if state.update is not None else None
        state.kernels.close(
            slot, slot, state.inv_rms[state.count], eps,
            new=None if update is None else update.new, init_partial=update is not None and update.init,
            stream=None if update is None else update.previous, stream_out=state.stream,
            queries=state.queries, table=None if state.scores is None else state.scores[state.count],
        )
        return state._replace(count=state.count + 1, has_partial=False, update=None)
    if isinstance(state, SourceBuffer):
        if not state.has_partial:
            return state
        if state.step is None:
            count = state.count
            if state.native is not None:  # the pending output's adds and the new source's 1 / rms, in one pass
                update = state.update.take() if state.update is not None else None
                d = state.sources.shape[-1]
                state.native.close_source(
                    state.sources[count].view(-1, d), state.stream.view(-1, d),
                    NONE if update is None else update.new.reshape(-1, d), update is not None and update.init,
                    state.inv_rms[count].view(-1), eps,
                )
            else:
                state.inv_rms[count] = inverse_rms(state.sources[count], eps)
            if state.scores is not None:
                _score_source(state, count, first)
        return state._replace(count=state.count + 1, has_partial=False)
    if state.partial is None:
        return state
    if isinstance(state, TrainState):
        handle = _CloseBlock.apply(state.partial, state.queries, state.cache, len(state.handles), eps, state.kernels)
        return state._replace(handles=state.handles + (handle,), partial=None)
    new = state.partial.float().unsqueeze(-2)
    blocks = torch.cat([state.blocks, new], dim=-2)
    inv_rms = torch.cat([state.inv_rms, inverse_rms(new, eps)], dim=-1)
    return BlockState(blocks, inv_rms, None, state.stream)


def add_output(state, output: torch.Tensor):
    if isinstance(state, SourceBuffer) and state.kernels is not None:
        if state.update is not None:
            state.update.apply()  # not taken by a kernel (a caller read no mix in between): applied here
        dtype = torch.promote_types(state.stream.dtype, output.dtype)
        stream = torch.empty(state.stream.shape, dtype=dtype, device=state.stream.device)
        update = _Update(output, not state.has_partial, state.stream, stream, state.sources[state.count])
        return state._replace(has_partial=True, stream=stream, update=update)
    if isinstance(state, SourceBuffer) and state.native is not None:
        return state._replace(has_partial=True, update=native_update(state, output))
    if isinstance(state, SourceBuffer) and state.shared_stream:
        count = state.count
        if state.step is not None:
            state.step.pairs[count].add_(output)
        else:
            last = state.sources.shape[0] - 1
            state.sources[count::last - count].add_(output)
        return state if state.has_partial else state._replace(has_partial=True)
    if isinstance(state, SourceBuffer):
        slot = state.sources[state.count] if state.step is None else state.step.slots[state.count]
        if state.has_partial:
            slot.add_(output)
        else:  # the first output of a block initialises its slot (the buffer is allocated uninitialised)
            slot.copy_(output)
        return state._replace(has_partial=True, stream=state.stream + output)
    partial = output if state.partial is None else state.partial + output
    return state._replace(partial=partial, stream=state.stream + output)


def native_update(state: SourceBuffer, output: torch.Tensor, slot: int | None = None) -> _Update:
    """An output for the C++ kernels to add to the partial sum in `slot` (the current one by default) and the
    stream inside the next reader's call. Its output is float32 (under autocast the eager add upcasts it the same)."""
    if state.update is not None:
        state.update.apply()  # not taken by a reader (nothing read the mix in between): applied here
    slot = state.count if slot is None else slot
    view = state.sources[slot] if state.step is None else state.step.slots[slot]
    init = state.step is None and not state.has_partial  # a decoding step's buffer starts at zero
    new = output if output.dtype == torch.float32 else output.float()
    return _Update(new, init, None, state.stream, view, slot)


def pseudo_query(query: torch.Tensor, key_norm_weight: torch.Tensor) -> torch.Tensor:
    """(w * g): the key norm's weight folds into the query, since (w * g) . (k / rms(k)) is
    ((w * g) . k) * inv_rms(k). float32, shape [D] (or [R, D] for R stacked queries [R, 1, D] and key
    norms [R, D])."""
    return query.reshape(key_norm_weight.shape).float() * key_norm_weight.float()


def table_scores(keys: torch.Tensor, queries: torch.Tensor, inv_rms: torch.Tensor) -> torch.Tensor:
    """Phase 1: a completed source [BT, D] scored by every sublayer's query [R, D] in one product, with
    its 1 / rms [BT]: the [BT, R] rows of a score table."""
    return torch.mm(keys, queries.t()).mul_(inv_rms[:, None])


def _score_source(state: SourceBuffer, slot: int, first: int = 0) -> None:
    """Phase 1 for a completed source: its scores by readers `first`.. (the ones after it; earlier columns stay
    unwritten and unread), written into the table's strided rows by the scaling product itself."""
    key, table = state.sources[slot], state.scores[slot]
    d, readers = key.shape[-1], table.shape[-1]
    scores = torch.mm(key.reshape(-1, d), state.queries[first:].t())
    torch.mul(scores, state.inv_rms[slot].reshape(-1, 1), out=table.view(-1, readers)[:, first:])


def source_scores(keys: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """q . k for every source of every token, on token-major keys: [B, T, c, D] (BlockState's blocks, or a
    strided view of the training cache) -> [B, T, c]. As one batched product [1, D] @ [D, c] per token,
    which reads the keys in place at memory speed; measured on CPU over a token-major buffer, a plain
    [B*T*c, D] @ [D] product (or the [D, k] product that scores a layer's k readers at once) ran two to
    three times slower. (The source-major inference buffer has each source contiguous: one mv there.)"""
    d = keys.shape[-1]
    flat = keys.reshape(-1, keys.shape[-2], d)
    q = q.view(1, 1, d).expand(flat.shape[0], 1, d) if q.dim() == 1 else q.view(-1, 1, d)  # [D], or one per token
    return torch.bmm(q, flat.transpose(1, 2)).view(keys.shape[:-1])


def _no_autocast(like: torch.Tensor):
    device = like.device.type
    return torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext()


class _CloseBlock(torch.autograd.Function):
    """A completed block enters the TrainState's cache (and, with queries [R, D], is scored by every
    sublayer into the cache's score table); returns its handle (an empty tensor).

    What a backward reads of the cache is saved with save_for_backward (views, no copies), so saved-tensor
    hooks see it: activation offloading (save_on_cpu) moves it and hands back what the backward reads.
    The cache is written through `.data` aliases (kernels write through pointers): a later block's write
    goes to other slots than the ones saved, and must not count as a change of the saved views."""

    @staticmethod
    def forward(ctx, block, queries, cache: BlockCache, slot: int, eps: float, kernels: Kernels | None = None):
        values, inv_rms, scores = cache.values[:, slot], cache.inv_rms[:, slot], None
        if queries is not None:
            scores = cache.scores[:, slot]
        if kernels is not None:
            kernels.close(block, values, inv_rms, eps, queries=queries, table=scores)
        else:
            with _no_autocast(block):
                flat = block.reshape(-1, block.shape[-1]).float()
                values.data.copy_(flat)
                inv_rms.data.copy_(inverse_rms(flat, eps))
                if queries is not None:
                    scores.data.copy_(table_scores(flat, queries, inv_rms))
        ctx.save_for_backward(queries, values, inv_rms, scores)
        ctx.cache, ctx.slot, ctx.shape, ctx.dtype = cache, slot, block.shape, block.dtype
        return values.new_empty(0)

    @staticmethod
    @once_differentiable
    def backward(ctx, _):
        cache, slot = ctx.cache, ctx.slot
        queries, values, inv_rms, scores = ctx.saved_tensors
        if cache.grad is None:  # no reader contributed (the loss does not depend on this block)
            return torch.zeros(ctx.shape, dtype=ctx.dtype, device=values.device), None, None, None, None, None
        with _no_autocast(cache.grad):
            rms_grad = cache.rms_grad[slot]
            dqueries = None
            if queries is not None:
                # The score table's gradient: s_r = (q_r . k) inv_rms, so ds_r/dk = inv_rms q_r - s_r inv_rms^2 k / D.
                dscores = cache.score_grad[:, slot]  # [BT, R]
                via_query = dscores * inv_rms[:, None]
                rms_grad.sub_((via_query * scores).sum(-1).mul_(inv_rms / values.shape[-1]))
                cache.grad[slot].addmm_(via_query, queries)
                dqueries = torch.mm(via_query.t(), values)
                dscores.zero_()
            grad = cache.grad[slot].addcmul(values, rms_grad[:, None])
            # Consumed: cleared, so that a second backward through the same graph (retain_graph) adds up anew.
            cache.grad[slot].zero_()
            rms_grad.zero_()
        return grad.view(ctx.shape).to(ctx.dtype), dqueries, None, None, None, None


class _DepthMix(torch.autograd.Function):
    """depth_mix on a TrainState, with a hand-written backward. Autograd through the plain formulation
    writes two [BT, m, D] gradients per reader (one from the scores, one from the mix), sums them and
    the readers' results block by block; here each reader adds its mix term to the cache's gradient
    buffer in place, and its scores' gradient to its column of the score table's gradient (turned into
    the blocks' and queries' gradients once per block, by `_CloseBlock.backward`). Saves only the
    partial sum, the [BT, n] weights and scores, and views of the cache's completed blocks.
    Measured on the default SmolLM2 training step: step peak memory 1.118x -> 1.076x of the base
    model's, and the AttnRes operations of a forward + backward (61 readers, 4 x 256 tokens, alone)
    in 244 ms against 525 ms through autograd on BlockState (306 ms without the table).
    Without a score table (reader None: the output aggregation, or queries that are not whole tensors
    on this device) a reader scores the completed blocks itself and adds that gradient too.
    Runs with autocast off: the design keeps depth-attention statistics in float32 whatever the
    model dtype, and under mixed precision autocast would run the score and mix products in bfloat16.
    With kernels, the forward and the backward are one Triton launch each.

    Returns (mix, weights [BT, n]); the weights are for recorders only (not differentiable)."""

    @staticmethod
    def forward(ctx, q, stream, partial, cache: BlockCache, eps: float, scaling: str, reader, kernels, *handles):
        m = len(handles)
        keys, inv_rms = cache.values[:, :m], cache.inv_rms[:, :m]
        table = None if reader is None else cache.scores[:, :m, reader]
        if kernels is not None:
            mixed, weights, logits, inv_partial = kernels.mix(
                keys.transpose(0, 1), m, q, stream, eps, scaling == "count",
                inv_rms=None if table is not None else inv_rms.t(), table=None if table is None else table.t(),
                partial=partial, save=True,
            )
        else:
            with _no_autocast(stream):
                mixed, weights, logits, inv_partial = _mix_blocks(keys, inv_rms, partial, stream, q, eps, scaling, table)
            if table is not None and partial is None:
                logits = None  # a view of the table, which later blocks write to; unused by the backward
        ctx.save_for_backward(q, partial, weights, logits, inv_partial, keys, inv_rms)
        ctx.cache, ctx.scaling, ctx.m, ctx.reader, ctx.kernels = cache, scaling, m, reader, kernels
        ctx.mark_non_differentiable(weights)
        return mixed, weights

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, _):
        if ctx.kernels is not None:
            return _DepthMix._kernel_backward(ctx, grad)
        with _no_autocast(grad):
            return _DepthMix._backward(ctx, grad)

    @staticmethod
    def _kernel_backward(ctx, grad):
        q, partial, weights, logits, inv_partial, keys, inv_rms = ctx.saved_tensors
        cache, m, count, reader = ctx.cache, ctx.m, ctx.scaling == "count", ctx.reader
        grads, rms_grads = cache.gradients()
        dpartial, dq = ctx.kernels.mix_backward(
            grad, keys.transpose(0, 1), m, q, weights, logits, count, grads,
            inv_rms=inv_rms.t(), rms_grad=rms_grads,
            score_grad=None if reader is None else cache.score_grad[:, :m, reader].t(),
            partial=partial, inv_partial=inv_partial,
        )
        return (dq, grad if count else None, dpartial, None, None, None, None, None) + (None,) * m

    @staticmethod
    def _backward(ctx, grad):
        q, partial, weights, logits, inv_partial, keys, inv = ctx.saved_tensors
        cache, m, count, reader = ctx.cache, ctx.m, ctx.scaling == "count", ctx.reader
        tokens, n, d = keys.shape[0], weights.shape[-1], keys.shape[-1]
        g = grad.reshape(tokens, 1, d).float()
        # d(mix)/d(alpha_i) = (n) k_i, then the softmax's backward.
        dweights = torch.bmm(g, keys.transpose(1, 2)).view(tokens, m)
        if partial is not None:
            p = partial.reshape(tokens, d).float()
            # (A batched product of 1 x D by D x 1 runs six times slower than this, measured.)
            dweights = torch.cat([dweights, torch.linalg.vecdot(g.view(tokens, d), p).unsqueeze(-1)], dim=-1)
        if count:
            dweights = dweights * n
        dlogits = weights * (dweights - (weights * dweights).sum(-1, keepdim=True))
        coef = weights * n - 1.0 if count else weights
        grads, rms_grads = cache.gradients()
        grads[:m].addcmul_(coef[:, :m].t().unsqueeze(-1), g.view(1, tokens, d))
        # A score s_i = (q . k_i) inv_i has d s_i / d k_i = inv_i q - s_i inv_i^2 k_i / D, so the
        # gradient of k_i is coef_i g + (dlogit_i inv_i) q - (dlogit_i s_i inv_i^2 / D) k_i.
        dq = None
        if reader is not None:
            cache.score_grad[:, :m, reader] += dlogits[:, :m]
        else:
            via_query = dlogits[:, :m] * inv
            grads[:m].addcmul_(via_query.t().unsqueeze(-1), q.view(1, 1, d))
            rms_grads[:m] -= (via_query * logits[:, :m] * inv).t() / d
            dq = torch.bmm(via_query[:, None, :], keys).view(tokens, d).sum(0)
        dpartial = None
        if partial is not None:
            via_query = dlogits[:, m] * inv_partial
            dq = via_query @ p if dq is None else dq + via_query @ p
            via_rms = -(via_query * logits[:, m] * inv_partial) / d
            dpartial = (via_rms[:, None] * p).addcmul_(coef[:, m, None], g.view(tokens, d))
            dpartial = dpartial.addcmul_(via_query[:, None], q).view(partial.shape).to(partial.dtype)
        dstream = grad if count else None
        return (dq, dstream, dpartial, None, None, None, None, None) + (None,) * m


def depth_mix(
    state: BlockState | SourceBuffer | TrainState,
    query: torch.Tensor,
    key_norm_weight: torch.Tensor | None,
    eps: float,
    scaling: str = "count",
    reader: int | None = None,
    projection: tuple[torch.Tensor, torch.Tensor] | None = None,
    norm: tuple = (),
) -> torch.Tensor:
    """The input of one sublayer (or of the final norm): attention over the state's sources.

    query: the pseudo-query w ([1, D] or [D]) and key_norm_weight g ([D]); or, with key_norm_weight None,
    the folded `pseudo_query` already. reader: the sublayer's 0-based index, to read its column of the
    state's score table and its row of the queries stacked for it (folded once per forward, not again here).
    projection: (A [r, D], B [D, r]) of a reader whose query depends on its input (see `token_queries`);
    the state is then a BlockState (start_state with token_queries).
    norm: the sublayer's norm as `fused_norm` gives it, for a state with the C++ kernels (`state.native`): the
    result is then that norm of the mix, made in the same pass.

    With "count" scaling h = n * sum_i alpha_i k_i. Since the sources sum to the stream H, this equals
    H + sum_i (n alpha_i - 1) k_i, which is how it is computed: at zero queries n alpha_i - 1 is 0, so h
    is the base model's own residual stream bit for bit, with its own rounding (in bfloat16 a freshly
    summed mix would round differently from the base model's running sum and drift from it).
    """
    if projection is not None:
        return _mix_token_queries(state, query, key_norm_weight, projection, eps, scaling)
    step = getattr(state, "step", None)
    if reader is not None and getattr(state, "queries", None) is not None:  # folded once per forward
        q = state.queries[reader] if step is None else step.queries[reader]
    else:
        q = query if key_norm_weight is None else pseudo_query(query, key_norm_weight)
        if step is not None:
            q = pad_query(q * step.root_d)  # see _few_token_logits
    if isinstance(state, SourceBuffer):
        return _mix_buffer(state, q, eps, scaling, reader, norm)
    if isinstance(state, TrainState):
        column = None if state.queries is None else reader
        mixed, weights = _DepthMix.apply(
            q, state.stream, state.partial, state.cache, eps, scaling, column, state.kernels, *state.handles
        )
    else:
        blocks, inv_rms, partial, stream = state
        m, d = blocks.shape[-2], blocks.shape[-1]
        mixed, weights, _, _ = _mix_blocks(blocks.reshape(-1, m, d), inv_rms.reshape(-1, m), partial, stream, q, eps, scaling)
    if _RECORDERS:
        _RECORDERS[-1].append(weights.detach().movedim(-1, 0).reshape(-1, *state.stream.shape[:-1]))
    return mixed


def token_queries(
    stream: torch.Tensor, query: torch.Tensor, key_norm_weight: torch.Tensor, down: torch.Tensor, up: torch.Tensor, eps: float
) -> torch.Tensor:
    """Input-dependent queries, folded with the key norm: per token t,

        q_t = (w + B A x_t / rms(x_t)) * g                                  [B*T, D], float32

    x_t is the reader's input in the base model, the plain residual stream (sum of all sources so far);
    dividing by its rms makes the query independent of the stream's magnitude, which grows with depth.
    B (`up`) starts at zero, so q_t = w exactly and the converted model stays the base model bit for bit;
    A (`down`) starts random, so B's gradient is not zero (as in LoRA)."""
    x = stream.reshape(-1, stream.shape[-1]).float()
    x = x * inverse_rms(x, eps)[:, None]
    q = torch.addmm(query.reshape(1, -1).float(), x @ down.float().t(), up.float().t())
    return q * key_norm_weight.float()


def _mix_token_queries(state: BlockState, query, key_norm_weight, projection, eps: float, scaling: str) -> torch.Tensor:
    """depth_mix with one query per token: plain tensor operations on a BlockState, differentiated by
    autograd, in float32 whatever the model dtype (autocast off)."""
    if not isinstance(state, BlockState):
        raise TypeError("input-dependent queries need the BlockState (start_state with token_queries=True)")
    blocks, inv_rms, partial, stream = state
    m, d = blocks.shape[-2], blocks.shape[-1]
    with _no_autocast(stream):
        q = token_queries(stream, query, key_norm_weight, *projection, eps)
        mixed, weights, _, _ = _mix_blocks(blocks.reshape(-1, m, d), inv_rms.reshape(-1, m), partial, stream, q, eps, scaling)
    if _RECORDERS:
        _RECORDERS[-1].append(weights.detach().movedim(-1, 0).reshape(-1, *stream.shape[:-1]))
    return mixed


def _mix_blocks(keys, inv_rms, partial, stream, q, eps: float, scaling: str, table=None):
    """depth_mix over completed blocks keys [BT, m, D] with their cached 1 / rms [BT, m], and the partial
    sum: the traced BlockState path, and the forward of the TrainState's `_DepthMix`. q: the folded query
    [D], or one per token [BT, D] (`token_queries`). table: the completed blocks' scores [BT, m] where a
    score table has them. Returns the mix in the stream's shape and dtype, the weights and scores [BT, n],
    and the partial's 1 / rms ([BT] or None)."""
    m, d = keys.shape[-2], keys.shape[-1]
    # Completed blocks: cached statistics, one product. The partial sum is the only source that changed
    # since the last block boundary; its score joins before one softmax over the few sources of a token.
    logits = source_scores(keys, q) * inv_rms if table is None else table
    inv_partial = None
    if partial is not None:
        p = partial.reshape(-1, d).float()
        inv_partial = inverse_rms(p, eps)
        partial_score = p @ q if q.dim() == 1 else torch.linalg.vecdot(p, q)
        logits = torch.cat([logits, (partial_score * inv_partial).unsqueeze(-1)], dim=-1)
    weights = torch.softmax(logits, dim=-1)  # float32
    n = weights.shape[-1]
    if scaling == "count":
        # One batched product over the completed blocks, [BT, 1, m] @ [BT, m, D], added to the stream.
        coef = weights * n - 1.0
        mixed = torch.baddbmm(stream.float().reshape(-1, 1, d), coef[:, None, :m], keys)
    else:
        coef = weights
        mixed = torch.bmm(coef[:, None, :m], keys)
    if partial is not None:
        # In place: the product's backward does not need its output.
        mixed.addcmul_(coef[:, m:, None], p.unsqueeze(1))
    return mixed.view(stream.shape).to(stream.dtype), weights, logits, inv_partial


def _mix_buffer(state: SourceBuffer, q: torch.Tensor, eps: float, scaling: str, reader: int | None, norm: tuple = ()) -> torch.Tensor:
    """depth_mix on a SourceBuffer (`norm` with the C++ kernels only)."""
    if state.kernels is not None:
        return _mix_kernels(state, q, eps, scaling, reader)
    n = state.count + int(state.has_partial)
    step = state.step
    if step is not None:
        return step_mix(step, n, q, state.stream, scaling, state.native, state.update, norm)
    m, d = state.count, state.sources.shape[-1]
    if state.native is not None:
        table = state.scores[..., reader] if state.scores is not None and reader is not None else None
        update = state.update.take() if state.update is not None else None
        return buffer_mix(
            state.native, state.sources, m, state.has_partial, q, state.stream, eps, scaling == "count",
            table=table, inv_rms=state.inv_rms if table is None else None,
            added=None if update is None else update.new, init=update is not None and update.init, norm=norm,
        )
    # Source-major: scores [n, B, T], from the table where there is one (phase 2: only the partial sum
    # is scored here), else one product over the n contiguous sources.
    if state.scores is not None and reader is not None:
        logits = state.scores[:m, ..., reader]
        if state.has_partial:
            partial = state.sources[m]
            partial_logit = (partial @ q).mul_(inverse_rms(partial, eps))
            logits = torch.cat([logits, partial_logit.unsqueeze(0)])
    else:
        if state.has_partial:
            state.inv_rms[m] = inverse_rms(state.sources[m], eps)
        logits = torch.mv(state.sources[:n].view(-1, d), q).view(state.inv_rms[:n].shape).mul_(state.inv_rms[:n])
    weights = torch.softmax(logits, dim=0)
    if _RECORDERS:
        _RECORDERS[-1].append(weights.clone())
    return _chained_mix(state.stream, weights, state.sources, scaling)


def step_mix(
    step: StepViews,
    n: int,
    q: torch.Tensor,
    stream: torch.Tensor,
    scaling: str,
    native=None,
    update: _Update | None = None,
    norm: tuple = (),
) -> torch.Tensor:
    """depth_mix of a reader of n sources in a few-token forward (token-major: one product scores a token's
    n sources, one mixes them; with `native`, the C++ kernels, one call, which first adds the pending output
    `update`). The model's decoding loop calls it directly (see AttnResDecoderLayerMixin), since such a step pays
    for every Python call as well as every operation. `norm`: as depth_mix's."""
    if native is not None:
        update = update.take() if update is not None else None
        added, slot = (NONE, 0) if update is None else (update.new, update.index)
        return native.step_mix(step.padded[n], n, q, stream, scaling == "count", added, slot, *(norm or NO_NORM))
    weights = torch.softmax(_few_token_logits(step, n, q), dim=-1)
    if _RECORDERS:
        _RECORDERS[-1].append(weights.movedim(-1, 0).clone())
    return _fused_mix(stream, weights, step.flat[n], scaling, step.inverse[n])


def _mix_kernels(state: SourceBuffer, q: torch.Tensor, eps: float, scaling: str, reader: int | None) -> torch.Tensor:
    """depth_mix on a SourceBuffer with kernels: one launch, which first applies the last output."""
    m, update = state.count, state.update.take() if state.update is not None else None
    table = state.scores[:m, :, reader] if state.scores is not None and reader is not None else None
    mixed, weights, _, _ = state.kernels.mix(
        state.sources, m, q, state.stream if update is None else update.previous, eps, scaling == "count",
        inv_rms=state.inv_rms if table is None else None, table=table,
        partial=state.sources[m] if state.has_partial else None,
        new=None if update is None else update.new, init_partial=update is not None and update.init,
        stream_out=None if update is None else state.stream, save=bool(_RECORDERS),
    )
    if _RECORDERS:
        _RECORDERS[-1].append(weights.t().reshape(-1, *state.stream.shape[:-1]))
    return mixed


def _chained_mix(stream: torch.Tensor, weights: torch.Tensor, sources: torch.Tensor, scaling: str) -> torch.Tensor:
    """n * sum_i alpha_i k_i as H + sum_i n (alpha_i - 1/n) k_i (exactly H at zero queries), as one
    elementwise multiply-add per source over a source-major buffer: weights [n, B, T] (this function's
    own, changed in place), sources [K, B, T, D]. Measured per 512-token reader, cold caches: faster than
    one batched product ([B*T, 1, n] @ [B*T, n, D] runs as B*T tiny matrix products) up to n = 9."""
    n = weights.shape[0]
    if scaling == "count":
        coef = weights.sub_(1.0 / n).mul_(n).unsqueeze(-1)
        mixed = torch.addcmul(stream.float(), coef[0], sources[0])
    else:
        coef = weights.unsqueeze(-1)
        mixed = sources[0] * coef[0]
    for i in range(1, n):
        mixed.addcmul_(coef[i], sources[i])
    return mixed.to(stream.dtype)


def _few_token_logits(step: StepViews, n: int, q: torch.Tensor) -> torch.Tensor:
    """Scores of the first n sources in a decoding step, [B, T, n], for q = (w * g) sqrt(D) padded with a 0.
    Recomputing every source's statistics takes fewer operations than merging cached ones, and such a
    step pays per operation, so this is written for the fewest: q . k / rms(k) = (q sqrt(D)) . k / |k, c|
    with c = sqrt(D eps) the buffer's constant column. Measured per reader of 6 sources (alone): norm,
    addcmul, rsqrt_, mv, mul_ took 7.8 us; this 5.1."""
    keys = step.padded[n]
    norms = torch.linalg.vector_norm(keys, dim=-1)  # sqrt(D) rms(k)
    if step.rows is not None:
        return torch.mv(step.rows[n], q) / norms
    return (keys * q).sum(-1).div_(norms)


def _fused_mix(stream: torch.Tensor, weights: torch.Tensor, flat: torch.Tensor, scaling: str, inverse: torch.Tensor) -> torch.Tensor:
    """n * sum_i alpha_i k_i as H + n * sum_i (alpha_i - 1/n) k_i in one product (exactly H at zero
    queries), for few tokens. flat: the keys as [B*T, n, D], a view of the token-major buffer; inverse:
    1/n as a tensor. (Dtype conversions are skipped where there is none to do: each is an operation.)"""
    n, d = flat.shape[-2], flat.shape[-1]
    one_token = stream.shape[1] == 1  # decoding: [B, 1, *] already has bmm's shapes, no views needed
    same = stream.dtype == torch.float32
    base = stream if same else stream.float()
    base = base if one_token else base.reshape(-1, 1, d)
    weights = weights if one_token else weights.reshape(-1, 1, n)
    if scaling == "count":  # the weights are this function's own (recorders got a copy): in place
        mixed = torch.baddbmm(base, weights.sub_(inverse), flat, alpha=n)
    else:
        mixed = torch.bmm(weights, flat)
    mixed = mixed if one_token else mixed.view(stream.shape)
    return mixed if same else mixed.to(stream.dtype)


# Active recorders of depth-attention weights (a plain list, not a ContextVar: torch.compile traces it).
_RECORDERS: list[list[torch.Tensor]] = []


@contextlib.contextmanager
def record_depth_weights() -> Iterator[list[torch.Tensor]]:
    """Collect the softmax weights [n, B, T] of every depth_mix call (sublayers 1..L in order, then the
    output aggregation), for inspection and plots:

        with record_depth_weights() as weights:
            model(input_ids)
    """
    recorded: list[torch.Tensor] = []
    _RECORDERS.append(recorded)
    try:
        yield recorded
    finally:
        _RECORDERS.remove(recorded)


# ---------------------------------------------------------------------------------------------
# Block structure: which sources each sublayer reads. Sublayers are numbered 1..L in execution
# order and cut into consecutive blocks of S. Sublayer l at position i (1..S) of block n reads the
# embedding, completed blocks 1..n-1 and, if i >= 2, its own block's partial sum. The output
# aggregation reads the embedding, every completed block and the last partial sum.
# ---------------------------------------------------------------------------------------------


class SublayerPlan(NamedTuple):
    index: int  # 1-based position in execution order
    closes_block: bool  # the partial sum becomes a completed block just before this sublayer reads
    num_sources: int


def plan_sublayers(num_sublayers: int, block_size: int) -> list[SublayerPlan]:
    plans = []
    for l in range(1, num_sublayers + 1):
        position = (l - 1) % block_size + 1
        completed = (l - 1) // block_size
        plans.append(SublayerPlan(l, position == 1 and l > 1, 1 + completed + (1 if position >= 2 else 0)))
    return plans


def output_num_sources(num_sublayers: int, block_size: int) -> int:
    return 1 + -(-num_sublayers // block_size)


def source_ranges(num_sublayers: int, block_size: int) -> list[list[tuple[int, int]]]:
    """For each reader (sublayers 1..L, then the output aggregation), its sources as inclusive
    ranges (a, b) of sublayer outputs; (0, 0) is the embedding. Used by summaries and tests."""
    readers = []
    for l in list(range(1, num_sublayers + 1)) + [num_sublayers + 1]:
        sources = [(0, 0)]
        start = 1
        while start + block_size <= l:  # completed blocks strictly before l
            sources.append((start, start + block_size - 1))
            start += block_size
        if start <= l - 1:
            sources.append((start, l - 1))
        readers.append(sources)
    return readers


def default_block_size(num_sublayers: int, sublayers_per_layer: int, max_blocks: int = 8) -> int:
    """The smallest S that is a whole number of decoder layers and gives at most max_blocks blocks."""
    if max_blocks < 1:
        raise ValueError(f"the number of blocks must be >= 1, got {max_blocks}")
    layers = 1
    while -(-num_sublayers // (layers * sublayers_per_layer)) > max_blocks:
        layers += 1
    return layers * sublayers_per_layer
