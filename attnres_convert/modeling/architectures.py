"""Which modules form each residual sublayer: the plan the shipped forward executes.

A sublayer is what adds one output to the residual stream: one or more branches, each
`scale * post(module(norm(h)))`, summed. A parallel-residual layer (GPT-NeoX with use_parallel_residual,
Phi-1/2, GPT-J) has one sublayer with two branches read from the same input. Norms applied to a branch's
output (Gemma 2/3 and GLM-4 post-norms, residual dropouts) and residual multipliers (Granite) belong to
the branch.

A `ModelPlan` says where the decoder stack, final norm and head are and which sublayers every decoder
layer has (layers of one model may differ). Conversion finds it from the model itself and proves it
layer by layer (attnres_convert/conversion/discovery.py and proof.py), then records it in the converted config
(`structure`), so the shipped forward needs nothing else.

The `FAMILIES` table below holds only what the module tree does not say: which norm and which module form each
sublayer, by attribute name, and the config flag that makes a layer parallel. Where the decoder stack, final
norm and head are, and the norms' eps, come from the model itself (`locate`, `norm_eps`; the meta device
will do). The table gives the sublayer count from the config alone (block sizes are checked before weights
load), the first candidate for the model types it lists, and the plan of configs converted before plans
were recorded.

This file ships next to converted weights: it imports torch and the standard library only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import nn

# Where norm classes keep their eps.
EPS_ATTRIBUTES = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "rms_norm_eps", "norm_eps")


class UnsupportedModelError(ValueError):
    """The model cannot be converted exactly; the message says why and what is supported."""


@dataclass(frozen=True)
class Branch:
    # Attribute of the decoder layer: the PreNorm that reads the residual stream; "" (RAW_STREAM) where the module
    # reads the stream itself (Gemma 4's per-layer-input gate). With source_scaling "count" the depth mix at zero
    # queries is the stream itself, so such a reader still reads exactly what it read in the base model.
    norm: str
    module: str  # attention or MLP module
    # Modules applied to the branch output before it joins the stream; an entry `*name` multiplies the branch's
    # value by the layer's argument `name` (Gemma 4's gate times its `per_layer_input`).
    post: tuple[str, ...] = ()
    attention: bool = False  # receives the layer's call arguments (mask, positions, cache)
    scale: float | None = None  # residual multiplier applied to the branch output (Granite)
    # Where the module takes the layer's arguments under other names (Falcon-H1's Mamba mixer gets the layer's
    # `mamba_attention_mask` as `attention_mask`, its cache as `cache_params`): (module keyword, layer keyword)
    # pairs, and (module keyword, value) constants the layer passes; None: the layer's arguments as they are.
    arguments: tuple[tuple[str, str], ...] | None = None
    constants: tuple[tuple[str, object], ...] = ()
    # Post-modules that take the layer's arguments too (Inkling's short convolutions after attention and the MLP
    # keep their state in the cache): (post name, arguments as above, constants).
    post_arguments: tuple[tuple[str, tuple | None, tuple], ...] = ()
    # > 0: the module returns a bias at this index of its output tuple, which the layer adds to its output
    # (GPT-NeoX-Japanese's attention).
    output_bias: int = 0
    # Values of the module's output tuple that the decoder layer returns after the stream, for the base model to
    # keep (a recurrent state: RWKV's, xLSTM's): (position in the layer's output tuple, index in the module's).
    returns: tuple[tuple[int, int], ...] = ()
    # The norm reads the stream flattened to [tokens, width] (Gemma 4's experts take their tokens flat); the
    # branch's output is given the stream's shape again.
    flat: bool = False

    def to_dict(self) -> dict:
        data = {"norm": self.norm, "module": self.module}
        if self.post:
            data["post"] = list(self.post)
        if self.attention:
            data["attention"] = True
        if self.scale is not None:
            data["scale"] = self.scale
        if self.arguments is not None:
            data["arguments"] = dict(self.arguments)
        if self.constants:
            data["constants"] = dict(self.constants)
        if self.output_bias:
            data["output_bias"] = self.output_bias
        if self.returns:
            data["returns"] = [list(pair) for pair in self.returns]
        if self.flat:
            data["flat"] = True
        if self.post_arguments:
            data["post_arguments"] = {
                name: {"arguments": None if args is None else dict(args), "constants": dict(constants)}
                for name, args, constants in self.post_arguments
            }
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Branch:
        arguments = data.get("arguments")
        post_arguments = tuple(
            (name, None if spec["arguments"] is None else tuple(spec["arguments"].items()), tuple(spec["constants"].items()))
            for name, spec in data.get("post_arguments", {}).items()
        )
        return cls(data["norm"], data["module"], tuple(data.get("post", ())), bool(data.get("attention", False)),
                   data.get("scale"), None if arguments is None else tuple(arguments.items()),
                   tuple(data.get("constants", {}).items()), post_arguments, int(data.get("output_bias", 0)),
                   tuple((int(p), int(i)) for p, i in data.get("returns", ())), bool(data.get("flat", False)))

    def call_kwargs(self, layer_kwargs: dict, x) -> dict:
        """The keyword arguments the module takes, from those the decoder layer was called with (X: the module's
        input, for the markers below)."""
        return _kwargs(self.arguments, self.constants, layer_kwargs, x)

    def post_kwargs(self, post: str, layer_kwargs: dict, x) -> dict | None:
        """The keyword arguments post-module POST takes, or None where it takes only the branch's output."""
        for name, arguments, constants in self.post_arguments:
            if name == post:
                return _kwargs(arguments, constants, layer_kwargs, x)
        return None


def _kwargs(arguments, constants, layer_kwargs: dict, x) -> dict:
    if arguments is None:
        return layer_kwargs
    kwargs = {name: _argument(source, layer_kwargs, x) for name, source in arguments}
    return {**kwargs, **dict(constants)}


RAW_STREAM = ""  # Branch.norm of a module that reads the residual stream itself
OUTPUT = "<output:"  # a module argument that is a side module's output: `<output:NAME:INDEX>` (Sublayer.side)


def output_of(module: str, index: int) -> str:
    return f"{OUTPUT}{module}:{index}>"
TIMES = "*"  # prefix of a Branch.post entry that multiplies by a layer argument


def reads_raw_stream(branch: Branch) -> bool:
    return branch.norm == RAW_STREAM


def times_argument(post: str) -> str | None:
    """The layer argument a post entry `*name` multiplies by, or None for a module's name."""
    return post[len(TIMES):] if post.startswith(TIMES) else None


# Sources of a module argument that are not the layer's: the module's own input again (CTRL's attention takes
# v, k, q), or the residual stream that the module adds to its output itself (Bloom, MPT's MLP): zeros stand in
# for it, so the module returns its own output, which AttnRes adds as a source.
INPUT, RESIDUAL = "<input>", "<residual>"


def _argument(source: str, layer_kwargs: dict, x):
    if source == INPUT:
        return x
    if source == RESIDUAL:
        return x.new_zeros(x.shape)
    return layer_kwargs.get(source)


@dataclass(frozen=True)
class Sublayer:
    name: str  # prefix of its AttnRes parameters: "self_attention" or "mlp"
    branches: tuple[Branch, ...]
    # Modules applied to the sum of the branches before it joins the stream (Gemma 4's MoE block normalises the
    # sum of its dense MLP and its experts).
    post: tuple[str, ...] = ()
    # Side modules: (name, flat) for a module that reads the sublayer's input itself (flattened to [tokens, width]
    # where flat) and whose outputs a branch's module takes as arguments (`<output:NAME:INDEX>`): Gemma 4's router.
    side: tuple[tuple[str, bool], ...] = ()

    def to_dict(self) -> dict:
        data = {"name": self.name, "branches": [branch.to_dict() for branch in self.branches]}
        if self.post:
            data["post"] = list(self.post)
        if self.side:
            data["side"] = [[name, flat] for name, flat in self.side]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Sublayer:
        return cls(data["name"], tuple(Branch.from_dict(branch) for branch in data["branches"]),
                   tuple(data.get("post", ())), tuple((name, bool(flat)) for name, flat in data.get("side", ())))

    def describe(self) -> str:
        """e.g. `input_layernorm -> self_attn -> post_attention_layernorm`, branches joined by ` + ` (`stream ->`
        for a module that reads the raw stream, `* name` for a product with the layer's argument `name`)."""
        parts = []
        for branch in self.branches:
            module = branch.module
            sides = sorted({source.split(":")[1] for _, source in branch.arguments or () if source.startswith(OUTPUT)})
            if sides:  # the side modules whose outputs it takes
                module = f"{module}({', '.join(sides)})"
            text = " -> ".join((branch.norm or "stream", module, *(p.replace(TIMES, "* ", 1) for p in branch.post)))
            parts.append(text if branch.scale is None else f"{text} x {branch.scale:g}")
        if self.post:
            return f"({' + '.join(parts)}) -> {' -> '.join(self.post)}"
        return " + ".join(parts)


@dataclass(frozen=True)
class ModelPlan:
    """Where a causal LM keeps its decoder stack, final norm and head (attribute paths, dotted where nested),
    and every decoder layer's sublayers: `kinds` lists the distinct layer layouts, `layer_kinds` the layout
    of each layer. Serialised into the converted config as `structure`."""

    layer_kinds: tuple[int, ...]
    kinds: tuple[tuple[Sublayer, ...], ...]
    eps: float  # the base model's norm eps, for the key norms
    base_model: str = "model"
    layers: str = "layers"  # relative to the base model
    final_norm: str = "norm"  # relative to the base model
    lm_head: str = "lm_head"
    logit_scale: float | None = None  # logits * scale (Cohere)
    logit_divisor: float | None = None  # logits / divisor (Granite)
    logit_softcap: float | None = None  # tanh(logits / cap) * cap (Gemma 2)
    tuple_output: int = 0  # the layers return a tuple of this length (True: 1) and the base model unpacks it; 0: a tensor
    # A module of the first decoder layer whose output replaces the stream it receives (RWKV's `pre_ln`): applied
    # to the embeddings, it makes the first source, as it makes the first stream of the base model.
    stream_start: str | None = None
    # Per decoder layer, the factor it multiplies the whole stream by before returning it (Gemma 4's
    # `layer_scalar`); None: 1 everywhere. See `stream_scales`.
    layer_scalars: tuple[float, ...] | None = None

    def sublayers(self, layer_index: int) -> tuple[Sublayer, ...]:
        return self.kinds[self.layer_kinds[layer_index]]

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def num_sublayers(self) -> int:
        return sum(len(self.kinds[kind]) for kind in self.layer_kinds)

    def stream_scales(self) -> tuple[tuple[float, ...], float]:
        """(P_k for each decoder layer, P for the final norm): how much the base model's stream has been scaled by the
        layer scalars of the layers before (the product of their `layer_scalars`). Layer k's outputs join the
        sources divided by P_k and its readers read P_k times their mix, so every source stays in the units of the
        embedding and, at zero queries, a reader reads exactly the base model's (scaled) stream."""
        scales, product = [], 1.0
        for scalar in self.layer_scalars or (1.0,) * self.num_layers:
            scales.append(product)
            product *= scalar
        return tuple(scales), product

    def to_dict(self) -> dict:
        data = {
            "base_model": self.base_model,
            "layers": self.layers,
            "final_norm": self.final_norm,
            "lm_head": self.lm_head,
            "eps": self.eps,
            "kinds": [[sublayer.to_dict() for sublayer in kind] for kind in self.kinds],
            "layer_kinds": list(self.layer_kinds),
        }
        for key in ("logit_scale", "logit_divisor", "logit_softcap"):
            if getattr(self, key) is not None:
                data[key] = getattr(self, key)
        if self.tuple_output:
            data["tuple_output"] = True if self.tuple_output == 1 else int(self.tuple_output)
        if self.stream_start:
            data["stream_start"] = self.stream_start
        if self.layer_scalars is not None:
            data["layer_scalars"] = list(self.layer_scalars)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> ModelPlan:
        kinds = tuple(tuple(Sublayer.from_dict(s) for s in kind) for kind in data["kinds"])
        optional = {k: data[k] for k in ("logit_scale", "logit_divisor", "logit_softcap", "tuple_output", "stream_start") if data.get(k) is not None}
        if data.get("layer_scalars") is not None:
            optional["layer_scalars"] = tuple(float(v) for v in data["layer_scalars"])
        return cls(tuple(data["layer_kinds"]), kinds, float(data["eps"]), data["base_model"], data["layers"],
                   data["final_norm"], data["lm_head"], **optional)

    @classmethod
    def uniform(cls, num_layers: int, sublayers: tuple[Sublayer, ...], eps: float, **where) -> ModelPlan:
        return cls((0,) * num_layers, (tuple(sublayers),), eps, **where)


def module_at(root, path: str):
    """The submodule at a dotted attribute path ("model.decoder.layers"). A plain child name is read from the
    module's dict first: this runs for every branch of every sublayer in every forward."""
    if not path:
        return root
    if "." not in path:
        found = getattr(root, "_modules", {}).get(path)
        return found if found is not None else getattr(root, path)
    return functools.reduce(getattr, path.split("."), root)


@dataclass(frozen=True)
class Where:
    """Where a causal LM keeps its parts (attribute paths): found from the module tree itself (`locate`)."""

    base_model: str
    layers: str  # relative to the base model
    lm_head: str
    final_norm: str | None = None  # relative to the base model; None where the module tree alone does not tell


def _child_name(parent, child) -> str | None:
    return next((name for name, module in parent.named_children() if module is child), None)


def is_norm(module) -> bool:
    """A normalisation module: LayerNorm / RMSNorm by type, or a class named *Norm* whose own parameters are
    all per-channel vectors (weight, bias) and that holds at most one norm (AXK2's gated RMSNorm wraps one):
    DBRX's NormAttentionNorm, a block with an attention between two norms, is no norm."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return True
    name = type(module).__name__.lower()
    if "norm" not in name or not all(p.dim() == 1 for p in module.parameters(recurse=False)):
        return False
    return sum(1 for child in module.children() if is_norm(child)) < 2


def norm_eps(module) -> float | None:
    """A norm's own eps (whatever attribute its class keeps it in)."""
    for attr in EPS_ATTRIBUTES:
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def text_config_of(config):
    """The language model's config: a composite's (image-text) text config, else the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def vocab_size_of(model) -> int | None:
    """The vocabulary size: the config's `vocab_size`, else, for a config that names its sizes its own way
    (`n_vocab`, `padded_vocab_size`...), the rows of the model's input embedding."""
    vocab = getattr(text_config_of(model.config), "vocab_size", None)
    if isinstance(vocab, int) and not isinstance(vocab, bool):
        return vocab
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return getattr(embeddings, "num_embeddings", None)


def _head_by_shape(model) -> str | None:
    """The LM head of a model whose class names none (no `get_output_embeddings`, a head not called `lm_head`):
    its one direct child that is a Linear from the hidden size to the vocabulary (both read from the input
    embedding where the config does not name them)."""
    config = text_config_of(model.config)
    vocab = vocab_size_of(model)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    hidden = getattr(embeddings, "embedding_dim", None) or getattr(config, "hidden_size", None)
    found = [
        name for name, child in model.named_children()
        if isinstance(child, nn.Linear) and child.out_features == vocab and (hidden is None or child.in_features == hidden)
    ]
    return found[0] if len(found) == 1 else None


def _is_stack(module: nn.Module, layers: int | None) -> bool:
    """Whether MODULE is a list of LAYERS modules (of any length where LAYERS is None): a decoder stack."""
    return isinstance(module, nn.ModuleList) and len(module) > 0 and (layers is None or len(module) == layers)


def _decoder_of(model) -> nn.Module | None:
    """The language model of a composite model (`get_decoder`), or None."""
    try:
        decoder = model.get_decoder()
    except Exception:  # noqa: BLE001 - models without one, or whose get_decoder needs what they lack
        return None
    return decoder if isinstance(decoder, nn.Module) else None


def locate(model, lm_head: str | None = None) -> Where:
    """The base model, its decoder stack (the ModuleList of num_hidden_layers layers, or of any length where the
    config names no num_hidden_layers, with the most parameters),
    the LM head, and the final norm where the base model has exactly one norm outside its layers. From the
    module tree alone: works on the meta device, before any weights are loaded. LM_HEAD: the head's attribute
    path where the caller found it from the model's logits (discovery.head_from_logits)."""
    if lm_head is None:
        head = model.get_output_embeddings()
        lm_head = _child_name(model, head) if head is not None else _head_by_shape(model)
    if lm_head is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} names no LM head: get_output_embeddings returns none and not exactly one of its "
            "direct modules is a Linear from its hidden size to its vocabulary"
        )
    # A config that names its layer count its own way (`n_layer`, `n_blocks`): the stack is the shallowest list of
    # modules with the most parameters, and its length is the layer count.
    want = getattr(text_config_of(model.config), "num_hidden_layers", None)
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if not isinstance(base, nn.Module) or base is model:
        head_owner = lm_head.split(".")[0]
        others = [name for name, child in model.named_children() if name != head_owner and any(True for _ in child.parameters())]
        if len(others) > 1:  # a second head beside the base model (a draft head): the base model holds the stack
            others = [name for name in others if any(_is_stack(m, want) for m in getattr(model, name).modules())]
        if len(others) != 1:
            raise UnsupportedModelError(f"{type(model).__name__}: cannot tell which module is the base model ({others})")
        prefix, base = others[0], getattr(model, others[0])
    stacks = [(name, module) for name, module in base.named_modules() if _is_stack(module, want)]
    # An image-text model has a vision tower beside its language model: the stack is the language model's.
    decoder = _decoder_of(model)
    in_decoder = [(n, m) for n, m in stacks if decoder is not None and any(m is d for d in decoder.modules())]
    stacks = in_decoder or stacks
    if len(stacks) > 1:  # towers inside the language model's embeddings sit deeper than its stack (Phi-4-MM)
        depth = min(name.count(".") for name, _ in stacks)
        stacks = [(n, m) for n, m in stacks if n.count(".") == depth]
    if not stacks:
        raise UnsupportedModelError(f"{type(model).__name__}: found no list of {want} decoder layers in {type(base).__name__}")
    layers, stack = max(stacks, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    inside = {id(module) for module in stack.modules()}
    norms = [name for name, module in base.named_modules() if name and id(module) not in inside and is_norm(module)]
    return Where(prefix, layers, lm_head, norms[0] if len(norms) == 1 else None)


@dataclass(frozen=True)
class Family:
    """What the module tree does not say: which norm and module form each sublayer, by attribute name."""

    name: str
    model_types: tuple[str, ...]
    sequential: tuple[Sublayer, ...]
    parallel_flag: str | bool = False  # a config flag (or True: always) that runs the branches in parallel
    notes: str = ""

    def sublayers(self, config) -> tuple[Sublayer, ...]:
        """The sequential sublayers, or, parallel, one sublayer with all their branches read from one input."""
        flag = self.parallel_flag
        if flag is True or (isinstance(flag, str) and getattr(config, flag, False)):
            return (Sublayer("self_attention", tuple(b for sublayer in self.sequential for b in sublayer.branches)),)
        return self.sequential

    def plan(self, config, model) -> ModelPlan:
        """The plan for MODEL (a causal LM of this family, possibly on the meta device): the table's sublayers,
        the places and the norms' eps from the model itself."""
        where = locate(model)
        if where.final_norm is None:
            raise UnsupportedModelError(f"{self.name}: cannot tell the final norm of {type(model).__name__} from its modules")
        first = self.sublayers(config)[0].branches[0].norm
        eps = norm_eps(module_at(module_at(module_at(model, where.base_model), where.layers)[0], first))
        if eps is None:
            raise UnsupportedModelError(f"{self.name}: the norm `{first}` keeps no eps attribute")
        softcap = getattr(config, "final_logit_softcapping", None)
        return ModelPlan.uniform(
            int(config.num_hidden_layers), self.sublayers(config), eps, base_model=where.base_model,
            layers=where.layers, final_norm=where.final_norm, lm_head=where.lm_head,
            logit_softcap=float(softcap) if softcap else None,
        )


def _attn(norm, module="self_attn", post=()):
    return Branch(norm, module, tuple(post), attention=True)


def _mlp(norm, module="mlp", post=()):
    return Branch(norm, module, tuple(post))


def _sequential(attn: Branch, mlp: Branch) -> tuple[Sublayer, ...]:
    return (Sublayer("self_attention", (attn,)), Sublayer("mlp", (mlp,)))


_LLAMA_LIKE = _sequential(_attn("input_layernorm"), _mlp("post_attention_layernorm"))

FAMILIES: tuple[Family, ...] = (
    Family(
        "llama",
        ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma"),
        sequential=_LLAMA_LIKE,
        notes="Llama, SmolLM2, Mistral, Mixtral, Qwen2/3 (+MoE), Gemma (embedding scaling happens before layer 0)",
    ),
    Family(
        "phi3",
        ("phi3",),
        sequential=_sequential(
            _attn("input_layernorm", post=("resid_attn_dropout",)),
            _mlp("post_attention_layernorm", post=("resid_mlp_dropout",)),
        ),
        notes="Phi-3: residual dropouts belong to the branch",
    ),
    Family(
        "gemma2",
        ("gemma2", "gemma3_text"),
        sequential=_sequential(
            _attn("input_layernorm", post=("post_attention_layernorm",)),
            _mlp("pre_feedforward_layernorm", post=("post_feedforward_layernorm",)),
        ),
        notes="Gemma 2, Gemma 3 text: the norms after each sublayer belong to the sublayer",
    ),
    Family(
        "gpt2",
        ("gpt2",),
        sequential=_sequential(_attn("ln_1", "attn"), _mlp("ln_2")),
        notes="GPT-2: LayerNorm, learned positions (added before layer 0)",
    ),
    Family(
        "gpt_neox",
        ("gpt_neox",),
        sequential=_sequential(
            _attn("input_layernorm", "attention", post=("post_attention_dropout",)),
            _mlp("post_attention_layernorm", post=("post_mlp_dropout",)),
        ),
        parallel_flag="use_parallel_residual",
        notes="GPT-NeoX / Pythia: parallel residual is one sublayer with two branches",
    ),
    Family(
        "phi",
        ("phi",),
        sequential=_sequential(_attn("input_layernorm", post=("resid_dropout",)), _mlp("input_layernorm", post=("resid_dropout",))),
        parallel_flag=True,
        notes="Phi-1/1.5/2: parallel attention and MLP on one shared LayerNorm",
    ),
)

_ENCODER = "{} is an encoder (bidirectional attention, post-norm layers), not a decoder-only causal LM"
_HYPER = ("{} uses hyper-connections: several residual streams mixed by learned matrices, read at the end by "
          "`{}`; AttnRes replaces one residual stream")
_OWN_ATTNRES = "{} already mixes its blocks' outputs with attention over depth (its own attention residuals)"
_SCALED = ("{} scales the residual stream itself at every sublayer by {}: the stream is not a sum of sublayer "
           "outputs")

# Known model types that cannot be converted exactly, and why (what discovery would only see as a failure).
REFUSED: dict[str, str] = {
    "olmo2": "OLMo-2 is post-norm: it normalises sublayer outputs but feeds the raw residual stream into "
    "attention and the MLP, so the stream is read by something that is not a scale-invariant norm",
    "olmo3": "OLMo-3 is post-norm like OLMo-2: the residual stream is read without a PreNorm",
    "olmo_hybrid": "OLMo-Hybrid is post-norm like OLMo-2 and mixes in linear-attention layers",
    "openai-gpt": "the original GPT is post-norm: each sublayer's LayerNorm is applied after the residual add",
    "gemma4_assistant": "Gemma-4-Assistant is a drafter for speculative decoding: its layers read the KV states "
    "of its target model (shared_kv_states), so it is not a causal LM on its own",
    "gemma4_unified_assistant": "Gemma-4-Unified-Assistant is a drafter for speculative decoding: its layers read "
    "the KV states of its target model (shared_kv_states), so it is not a causal LM on its own",
    "xlnet": "XLNet is a permutation-LM encoder with post-norm layers, not a decoder-only causal LM",
    "t5": "T5 is an encoder-decoder; only decoder-only causal LMs are supported",
    "bart": "BART is an encoder-decoder; only decoder-only causal LMs are supported",
    **{t: _ENCODER.format(n) for t, n in (
        ("bert", "BERT"), ("roberta", "RoBERTa"), ("xlm-roberta", "XLM-RoBERTa"), ("camembert", "CamemBERT"),
        ("electra", "ELECTRA"), ("ernie", "ERNIE"), ("data2vec-text", "Data2Vec-Text"), ("rembert", "RemBERT"),
        ("roc_bert", "RoCBert"), ("roformer", "RoFormer"), ("xmod", "X-MOD"), ("megatron-bert", "Megatron-BERT"),
        ("big_bird", "BigBird"), ("bert-generation", "BertGeneration"), ("xlm", "XLM"),
        ("roberta-prelayernorm", "RoBERTa-PreLayerNorm"), ("xlm-roberta-xl", "XLM-RoBERTa-XL"),
        ("modernbert-decoder", "ModernBERT-decoder"),
    )},
    "zamba": "Zamba's shared attention block reads the residual stream concatenated with the input embeddings, "
    "and its output feeds the next Mamba layer's input instead of adding to the stream: not a PreNorm sublayer",
    "zamba2": "Zamba2's shared attention block reads the residual stream concatenated with the input embeddings, "
    "and its output feeds the next Mamba layer's input instead of adding to the stream: not a PreNorm sublayer",
    **{t: _HYPER.format(n, m) for t, n, m in (
        ("deepseek_v4", "DeepSeek-V4", "hc_head"), ("hy_v4", "HY-V4", "hc_head"),
        ("qwen4_exp", "Qwen4-Exp", "hyper_connection_mixer"), ("qwen4_exp_text", "Qwen4-Exp", "hyper_connection_mixer"),
    )},
    **{t: _OWN_ATTNRES.format(n) for t, n in (("inkling2_text", "Inkling-2"), ("inkling2_loop_text", "Inkling-2-Loop"))},
    **{t: _SCALED.format(n, how) for t, n, how in (
        ("doge", "Doge", "a learned per-channel vector (input_residual, post_attention_residual)"),
        ("zaya", "ZAYA", "a learned per-channel scale and bias (ZayaResidualScaling)"),
        ("beam", "Beam", "sqrt((k-1)/k) at the k-th add (depth_scaled_residual_add)"),
    )},
    "dory": "Dory moves the stream towards each sublayer's output (hidden + alpha * (output - hidden), nGPT style) "
    "and loops its middle layers: the stream is not a sum of sublayer outputs",
    **{t: "Gemma-3n keeps several residual streams (AltUp) that learned coefficients predict and correct around "
       "each layer: not one PreNorm residual stream" for t in ("gemma3n", "gemma3n_text")},
    "hrm_text": "HRM-Text runs its two layer stacks several times per token (H and L cycles): a layer is not one "
    "step of one residual stream",
    "blt": "BLT is a byte-level model of a local encoder, a global transformer over patches and a local decoder "
    "joined by cross-attention: not one decoder stack",
    "reformer": "Reformer's layers are reversible: two residual streams, each updated from the other",
    "git": "GIT's layers are post-norm (BERT-style LayerNorm(output + residual))",
    "trocr": "TrOCR's decoder layers are post-norm (LayerNorm after each residual add) with cross-attention to "
    "the image encoder",
    "longcat_flash": "LongCat-Flash's shortcut MoE reads the stream after a layer's first attention, but its output "
    "is added only at the end of the layer, after the second attention and MLP have read the stream without it: "
    "AttnRes mixes each sublayer's output into every later sublayer's input, so a delayed add has no equivalent",
    "minimax": "MiniMax adds each sublayer's output to the normalised stream (its residual is taken after "
    "input_layernorm), so the stream is re-normalised at every sublayer: post-norm, not PreNorm",
}

# Config settings that make an otherwise convertible model type post-norm or not a plain decoder:
# (model type, attribute, value, why).
CONFIG_REFUSALS: tuple[tuple[str, str, object, str], ...] = (
    ("opt", "do_layer_norm_before", False, "OPT with do_layer_norm_before=False (OPT-350m) is post-norm: the "
     "LayerNorms come after the residual adds, so attention and the MLP read the raw residual stream"),
    ("gpt2", "add_cross_attention", True, "cross-attention layers read an encoder, not the stream"),
)


def config_refusal(config) -> str | None:
    """Why this config cannot be converted, where the config alone says so; None otherwise."""
    model_type = getattr(config, "model_type", None)
    for refused_type, attr, bad, why in CONFIG_REFUSALS:
        if model_type != refused_type:
            continue
        value = getattr(config, attr, None)
        if value is None:  # the setting of a composite's (image-text) language model
            value = getattr(text_config_of(config), attr, None)
        if value == bad:
            return f"{model_type} with {attr}={bad!r} cannot be converted: {why}"
    if model_type in REFUSED:
        return REFUSED[model_type]
    if getattr(config, "is_encoder_decoder", False):
        return f"{model_type} is an encoder-decoder; only decoder-only PreNorm causal LMs are supported"
    return None


def supported_model_types() -> list[str]:
    return sorted(t for family in FAMILIES for t in family.model_types)


def family_for(config) -> Family:
    """The family of a base config, or UnsupportedModelError saying why and what is supported."""
    model_type = getattr(config, "model_type", None)
    refusal = config_refusal(config)
    if refusal:
        raise UnsupportedModelError(f"{refusal}.")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise UnsupportedModelError(f"model type {model_type!r} has no entry in the architecture table")


def plan_for(text_config, structure: dict | None, base_model) -> ModelPlan:
    """The plan recorded in a converted config, or for a config converted before plans were recorded, the
    table's, placed on BASE_MODEL (the base causal LM)."""
    if structure:
        return ModelPlan.from_dict(structure)
    return family_for(text_config).plan(text_config, base_model)
