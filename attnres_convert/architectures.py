"""The architecture table and the module-tree readers conversion uses to find a model's plan.

A converted model runs the plan recorded in its config (`structure`, modeling_attnres.ModelPlan). Conversion
finds that plan from the model itself and proves it layer by layer (conversion/discovery.py and proof.py). The
`FAMILIES` table below holds only what the module tree does not say: which norm and which module form each
sublayer, by attribute name, and the config flag that makes a layer parallel. Where the decoder stack, final
norm and head are, and the norms' eps, come from the model itself (`locate`, `norm_eps`; the meta device
will do). The table gives the sublayer count from the config alone (block sizes are checked before weights
load), the first candidate for the model types it lists, and the plan of configs converted before plans
were recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .modeling.modeling_attnres import (  # noqa: F401 - the plan's records, used with the table
    OUTPUT,
    RAW_STREAM,
    TIMES,
    Branch,
    ModelPlan,
    Sublayer,
    module_at,
)

# Where norm classes keep their eps.
EPS_ATTRIBUTES = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "rms_norm_eps", "norm_eps")


class UnsupportedModelError(ValueError):
    """The model cannot be converted exactly; the message says why and what is supported."""


def reads_raw_stream(branch: Branch) -> bool:
    return branch.norm == RAW_STREAM


# The plan's records written into a converted config, and read by people (the forward reads them back with
# their from_dict).


def branch_to_dict(branch: Branch) -> dict:
    """A branch as the converted config's `structure` records it (Branch.from_dict reads it back)."""
    data = {"norm": branch.norm, "module": branch.module}
    if branch.post:
        data["post"] = list(branch.post)
    if branch.attention:
        data["attention"] = True
    if branch.scale is not None:
        data["scale"] = branch.scale
    if branch.arguments is not None:
        data["arguments"] = dict(branch.arguments)
    if branch.constants:
        data["constants"] = dict(branch.constants)
    if branch.output_bias:
        data["output_bias"] = branch.output_bias
    if branch.returns:
        data["returns"] = [list(pair) for pair in branch.returns]
    if branch.flat:
        data["flat"] = True
    if branch.post_arguments:
        data["post_arguments"] = {
            name: {"arguments": None if args is None else dict(args), "constants": dict(constants)}
            for name, args, constants in branch.post_arguments
        }
    return data


def sublayer_to_dict(sublayer: Sublayer) -> dict:
    data = {"name": sublayer.name, "branches": [branch_to_dict(branch) for branch in sublayer.branches]}
    if sublayer.post:
        data["post"] = list(sublayer.post)
    if sublayer.side:
        data["side"] = [[name, flat] for name, flat in sublayer.side]
    return data


def describe(sublayer: Sublayer) -> str:
    """e.g. `input_layernorm -> self_attn -> post_attention_layernorm`, branches joined by ` + ` (`stream ->`
    for a module that reads the raw stream, `* name` for a product with the layer's argument `name`)."""
    parts = []
    for branch in sublayer.branches:
        module = branch.module
        sides = sorted({source.split(":")[1] for _, source in branch.arguments or () if source.startswith(OUTPUT)})
        if sides:  # the side modules whose outputs it takes
            module = f"{module}({', '.join(sides)})"
        text = " -> ".join((branch.norm or "stream", module, *(p.replace(TIMES, "* ", 1) for p in branch.post)))
        parts.append(text if branch.scale is None else f"{text} x {branch.scale:g}")
    if sublayer.post:
        return f"({' + '.join(parts)}) -> {' -> '.join(sublayer.post)}"
    return " + ".join(parts)


def plan_to_dict(plan: ModelPlan) -> dict:
    """The plan as the converted config's `structure` (ModelPlan.from_dict reads it back)."""
    data = {
        "base_model": plan.base_model,
        "layers": plan.layers,
        "final_norm": plan.final_norm,
        "lm_head": plan.lm_head,
        "eps": plan.eps,
        "kinds": [[sublayer_to_dict(sublayer) for sublayer in kind] for kind in plan.kinds],
        "layer_kinds": list(plan.layer_kinds),
    }
    for key in ("logit_scale", "logit_divisor", "logit_softcap"):
        if getattr(plan, key) is not None:
            data[key] = getattr(plan, key)
    if plan.tuple_output:
        data["tuple_output"] = True if plan.tuple_output == 1 else int(plan.tuple_output)
    if plan.stream_start:
        data["stream_start"] = plan.stream_start
    if plan.layer_scalars is not None:
        data["layer_scalars"] = list(plan.layer_scalars)
    return data


def uniform_plan(num_layers: int, sublayers: tuple[Sublayer, ...], eps: float, **where) -> ModelPlan:
    return ModelPlan((0,) * num_layers, (tuple(sublayers),), eps, **where)


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
        name
        for name, child in model.named_children()
        if isinstance(child, nn.Linear)
        and child.out_features == vocab
        and (hidden is None or child.in_features == hidden)
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
        others = [
            name
            for name, child in model.named_children()
            if name != head_owner and any(True for _ in child.parameters())
        ]
        if len(others) > 1:  # a second head beside the base model (a draft head): the base model holds the stack
            others = [name for name in others if any(_is_stack(m, want) for m in getattr(model, name).modules())]
        if len(others) != 1:
            raise UnsupportedModelError(
                f"{type(model).__name__}: cannot tell which module is the base model ({others})"
            )
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
        raise UnsupportedModelError(
            f"{type(model).__name__}: found no list of {want} decoder layers in {type(base).__name__}"
        )
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
            raise UnsupportedModelError(
                f"{self.name}: cannot tell the final norm of {type(model).__name__} from its modules"
            )
        first = self.sublayers(config)[0].branches[0].norm
        eps = norm_eps(module_at(module_at(module_at(model, where.base_model), where.layers)[0], first))
        if eps is None:
            raise UnsupportedModelError(f"{self.name}: the norm `{first}` keeps no eps attribute")
        softcap = getattr(config, "final_logit_softcapping", None)
        return uniform_plan(
            int(config.num_hidden_layers),
            self.sublayers(config),
            eps,
            base_model=where.base_model,
            layers=where.layers,
            final_norm=where.final_norm,
            lm_head=where.lm_head,
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
        sequential=_sequential(
            _attn("input_layernorm", post=("resid_dropout",)), _mlp("input_layernorm", post=("resid_dropout",))
        ),
        parallel_flag=True,
        notes="Phi-1/1.5/2: parallel attention and MLP on one shared LayerNorm",
    ),
)

_ENCODER = "{} is an encoder (bidirectional attention, post-norm layers), not a decoder-only causal LM"
_HYPER = (
    "{} uses hyper-connections: several residual streams mixed by learned matrices, read at the end by "
    "`{}`; AttnRes replaces one residual stream"
)
_OWN_ATTNRES = "{} already mixes its blocks' outputs with attention over depth (its own attention residuals)"
_SCALED = "{} scales the residual stream itself at every sublayer by {}: the stream is not a sum of sublayer outputs"

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
    **{
        t: _ENCODER.format(n)
        for t, n in (
            ("bert", "BERT"),
            ("roberta", "RoBERTa"),
            ("xlm-roberta", "XLM-RoBERTa"),
            ("camembert", "CamemBERT"),
            ("electra", "ELECTRA"),
            ("ernie", "ERNIE"),
            ("data2vec-text", "Data2Vec-Text"),
            ("rembert", "RemBERT"),
            ("roc_bert", "RoCBert"),
            ("roformer", "RoFormer"),
            ("xmod", "X-MOD"),
            ("megatron-bert", "Megatron-BERT"),
            ("big_bird", "BigBird"),
            ("bert-generation", "BertGeneration"),
            ("xlm", "XLM"),
            ("roberta-prelayernorm", "RoBERTa-PreLayerNorm"),
            ("xlm-roberta-xl", "XLM-RoBERTa-XL"),
            ("modernbert-decoder", "ModernBERT-decoder"),
        )
    },
    "zamba": "Zamba's shared attention block reads the residual stream concatenated with the input embeddings, "
    "and its output feeds the next Mamba layer's input instead of adding to the stream: not a PreNorm sublayer",
    "zamba2": "Zamba2's shared attention block reads the residual stream concatenated with the input embeddings, "
    "and its output feeds the next Mamba layer's input instead of adding to the stream: not a PreNorm sublayer",
    **{
        t: _HYPER.format(n, m)
        for t, n, m in (
            ("deepseek_v4", "DeepSeek-V4", "hc_head"),
            ("hy_v4", "HY-V4", "hc_head"),
            ("qwen4_exp", "Qwen4-Exp", "hyper_connection_mixer"),
            ("qwen4_exp_text", "Qwen4-Exp", "hyper_connection_mixer"),
        )
    },
    **{
        t: _OWN_ATTNRES.format(n) for t, n in (("inkling2_text", "Inkling-2"), ("inkling2_loop_text", "Inkling-2-Loop"))
    },
    **{
        t: _SCALED.format(n, how)
        for t, n, how in (
            ("doge", "Doge", "a learned per-channel vector (input_residual, post_attention_residual)"),
            ("zaya", "ZAYA", "a learned per-channel scale and bias (ZayaResidualScaling)"),
            ("beam", "Beam", "sqrt((k-1)/k) at the k-th add (depth_scaled_residual_add)"),
        )
    },
    "dory": "Dory moves the stream towards each sublayer's output (hidden + alpha * (output - hidden), nGPT style) "
    "and loops its middle layers: the stream is not a sum of sublayer outputs",
    **{
        t: "Gemma-3n keeps several residual streams (AltUp) that learned coefficients predict and correct around "
        "each layer: not one PreNorm residual stream"
        for t in ("gemma3n", "gemma3n_text")
    },
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
    (
        "opt",
        "do_layer_norm_before",
        False,
        "OPT with do_layer_norm_before=False (OPT-350m) is post-norm: the "
        "LayerNorms come after the residual adds, so attention and the MLP read the raw residual stream",
    ),
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


def table_structure(config) -> dict:
    """The `structure` of an AttnRes CONFIG converted before plans were recorded in configs: the architecture table's
    plan for its base model, placed on that model built on the meta device (no weights)."""
    import torch

    from .modeling.modeling_attnres import causal_lm_class

    text_config = config.text_config
    with torch.device("meta"):
        base_model = causal_lm_class(text_config, config.base_model_type)(text_config)
    return plan_to_dict(family_for(text_config).plan(text_config, base_model))
