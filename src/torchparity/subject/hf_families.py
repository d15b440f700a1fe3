"""Tiny random ``transformers`` models of any causal-LM family, and local checkpoints, as
subjects: the entries ``hf:FAMILY`` and ``hf:FOLDER``.

An entry is ``hf:WHAT[,attn=IMPLEMENTATION][,dtype=DTYPE]``. ``WHAT`` is a ``model_type`` of
the installed release (``llama``, ``qwen3_moe``, ``mamba``: one of :func:`families`), built
from its config class with every size small (two layers, hidden 64, four heads) and weights
from :func:`~torchparity.subject.weights.init_weights`, the same on every machine; or a folder
holding ``config.json`` and its weights, loaded as they are. ``attn`` is the attention
implementation the model is built with (default: the one ``transformers`` picks), ``dtype``
the dtype of its weights (default float32). The model is judged as built: its golden runs its
own implementation, and the others are alternatives checked against it.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchparity.dtypes import CASTABLE, DTYPES, dtype_name
from torchparity.errors import UsageError
from torchparity.subject.weights import init_weights

PREFIX = "hf:"
SEED = 0
#: Tokens per prompt and prompts per batch: the second prompt is left-padded, as batched
#: generation has it.
SEQUENCE, BATCH, PADDED = 12, 2, 3
VOCAB = 128

#: Small values for every size field the releases' configs use, by field name.
_SIZES: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "embedding_size",
                     "word_embed_proj_dim", "attention_hidden_size"), 64),
    **dict.fromkeys(("intermediate_size", "n_inner", "ffn_dim", "d_ff", "encoder_ffn_dim",
                     "decoder_ffn_dim", "ffn_hidden_size", "feed_forward_size",
                     "ffn_inner_hidden_dim"), 128),
    **dict.fromkeys(("moe_intermediate_size", "expert_intermediate_size",
                     "shared_expert_intermediate_size", "moe_ffn_hidden_size",
                     "expert_dim"), 32),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers",
                     "decoder_layers", "encoder_layers", "num_decoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "n_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads",
                     "multi_query_group_num", "num_kv"), 2),
    **dict.fromkeys(("head_dim", "attention_head_dim", "kv_channels", "attention_head_size"),
                    16),
    **dict.fromkeys(("vocab_size", "n_vocab"), VOCAB),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len",
                     "context_length", "max_target_positions", "max_source_positions",
                     "seq_length"), 64),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts",
                     "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_top_k"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    **dict.fromkeys(("n_group", "topk_group"), 1),
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "qk_head_dim": 16,
    **dict.fromkeys(("state_size", "d_state", "mamba_d_state", "ssm_state_size"), 8),
    **dict.fromkeys(("time_step_rank", "mamba_dt_rank"), 8),
    **dict.fromkeys(("linear_key_head_dim", "linear_value_head_dim", "mamba_d_head"), 16),
    **dict.fromkeys(("linear_num_key_heads", "linear_num_value_heads", "mamba_n_heads"), 4),
    # A window shorter than the prompt, so that it changes what attention sees.
    **dict.fromkeys(("sliding_window", "attention_window_size", "window_size"), 8),
}
#: The fields that count layers.
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers",
                 "encoder_layers", "num_decoder_layers")
#: Special tokens inside the small vocabulary.
_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
           "decoder_start_token_id": 1}
#: A tiny model has at most this many parameters: more means a size field was not found.
_MOST_PARAMETERS = 20_000_000


@dataclass(frozen=True)
class HfEntry:
    """What an ``hf:`` entry names: a family or a checkpoint folder, and how it is built."""

    what: str
    attention: str | None = None
    dtype: torch.dtype = torch.float32

    @property
    def name(self) -> str:
        """The entry's name in reports and golden folders: ``hf.llama.eager``."""
        stem = Path(self.what).name if self.is_folder else self.what
        parts = ["hf", stem.replace("-", "_")]
        if self.attention:
            parts.append(self.attention)
        if self.dtype != torch.float32:
            parts.append(dtype_name(self.dtype))
        return ".".join(parts)

    @property
    def is_folder(self) -> bool:
        """Whether it names a checkpoint folder rather than a family."""
        # a folder named like a family, in the working directory, is one only with its config
        return ("/" in self.what or self.what.startswith(".")
                or (Path(self.what) / "config.json").is_file())


def is_hf_entry(spec: object) -> bool:
    """Whether ``spec`` is an ``hf:`` entry."""
    return isinstance(spec, str) and spec.startswith(PREFIX)


def parse(spec: str) -> HfEntry:
    """The family or folder, attention and dtype of ``hf:WHAT[,attn=...][,dtype=...]``.

    Raises:
        UsageError: an unknown option, dtype, or an empty ``WHAT``.
    """
    what, *options = spec[len(PREFIX):].split(",")
    if not what:
        raise UsageError(f"entry {spec!r} names no family; write hf:FAMILY (such as hf:llama) "
                         "or hf:path/to/checkpoint")
    settings: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if key not in ("attn", "dtype") or not sep or not value:
            raise UsageError(f"entry {spec!r}: unknown option {option!r}; options are "
                             "attn=eager|sdpa|flex_attention and dtype=fp32|bf16|fp16|fp64")
        settings[key] = value
    dtype = dtype_name(settings.get("dtype", "fp32"))
    if dtype not in CASTABLE:
        raise UsageError(f"entry {spec!r}: unknown dtype {settings['dtype']!r}; choose from "
                         f"{', '.join(CASTABLE)}")
    return HfEntry(what, settings.get("attn"), DTYPES[dtype])


def factory(spec: str) -> Callable[[], dict[str, Any]]:
    """The factory of an ``hf:`` entry: it builds the model and its inputs when called.

    Raises:
        UsageError: the entry is malformed, names no family of the installed release, or no
            folder with a ``config.json``.
    """
    entry = parse(spec)
    _transformers(spec)
    if entry.is_folder:
        folder = Path(entry.what)
        if not (folder / "config.json").is_file():
            raise UsageError(f"entry {spec}: {folder} has no config.json; give a checkpoint "
                             "folder as save_pretrained writes it")
    elif entry.what not in _causal_lm_classes():
        close = difflib.get_close_matches(entry.what, families(), n=3)
        hint = f"did you mean {' or '.join(close)}?" if close else (
            "a family is a config's model_type, such as llama, gpt2 or qwen3_moe")
        raise UsageError(f"entry {spec}: {entry.what!r} is not a causal-LM family of "
                         f"transformers {_transformers(spec).__version__}; {hint}")
    return functools.partial(_built, entry)


def _built(entry: HfEntry) -> dict[str, Any]:
    model = (checkpoint(entry) if entry.is_folder
             else tiny_model(entry.what, entry.attention, entry.dtype))
    return {"model": model, "inputs": prompts(model.config), "parallelize": fully_sharded,
            "mesh": {"dp": -1}}


def fully_sharded(model: nn.Module, mesh: Any) -> None:
    """FSDP2 as transformers models are trained with it: one unit per decoder layer, the
    embeddings, final norm and head in the root's (the plan of ``--nproc N``)."""
    from torch.distributed.fsdp import fully_shard

    layers = model.base_model.get_submodule("layers") if hasattr(model.base_model, "layers") \
        else next((m for m in model.modules() if isinstance(m, nn.ModuleList)), [])
    for layer in layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def tiny_model(family: str, attention: str | None = None,
          dtype: torch.dtype = torch.float32) -> nn.Module:
    """A tiny model of ``family``, in eval mode, its weights the same on every machine.

    Args:
        family: a causal-LM ``model_type`` of the installed release.
        attention: its attention implementation (default: what ``transformers`` picks).
        dtype: the dtype of its weights.

    Raises:
        UsageError: the family has no tiny form here (one line saying why).
    """
    transformers = _transformers(f"hf:{family}")
    config = tiny_config(family)
    model_class = getattr(transformers, _causal_lm_classes()[family], None)
    if model_class is None:
        raise UsageError(f"hf:{family}: transformers has no class for it")
    wanted = getattr(model_class, "config_class", None)
    text = getattr(config, "text_config", None)
    if wanted and text is not None and not isinstance(config, wanted):
        config = text  # a multimodal family's language model
    try:
        model = model_class._from_config(config, attn_implementation=attention)
    except ValueError as exc:  # the release refuses the implementation asked for
        raise UsageError(f"hf:{family}: {_first(exc)}") from None
    count = sum(p.numel() for p in model.parameters())
    if count > _MOST_PARAMETERS:
        raise UsageError(f"hf:{family}: its smallest form here has {count:,} parameters; "
                         "give a checkpoint folder instead")
    init_weights(model, SEED)
    return _without_cache(model.to(dtype).eval())


def checkpoint(entry: HfEntry) -> nn.Module:
    """The checkpoint in ``entry``'s folder, on its attention implementation and dtype."""
    transformers = _transformers(f"hf:{entry.what}")
    return _without_cache(transformers.AutoModelForCausalLM.from_pretrained(
        entry.what, attn_implementation=entry.attention, dtype=entry.dtype).eval())


def _without_cache(model: nn.Module) -> nn.Module:
    """``model``, its forward making no cache unless asked (decoding asks)."""
    # As in training: RWKV's cached forward writes in place a state its backward needs.
    model.config.use_cache = False
    return model


def tiny_config(family: str) -> Any:
    """The config of ``family`` with every size made small (see :data:`_SIZES`)."""
    transformers = _transformers(f"hf:{family}")
    config_class = transformers.CONFIG_MAPPING[family]
    return config_class(**_shrunk(config_class().to_dict()))


def _shrunk(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The small values of ``fields``, sub-configs (``text_config``) shrunk alike."""
    small: dict[str, Any] = {}
    for key, value in fields.items():
        if key in _SIZES and isinstance(value, int) and not isinstance(value, bool):
            small[key] = _SIZES[key]
        elif key in _TOKENS and isinstance(value, int) and not isinstance(value, bool):
            small[key] = _TOKENS[key]
        elif isinstance(value, Mapping) and "model_type" in value:
            small[key] = _shrunk(value)
    if "is_decoder" in fields and "model_type" in fields:
        small["is_decoder"] = True  # BERT-style families as the causal LMs they are used as
    layers = small.get("num_hidden_layers", small.get("num_layers"))
    for key in ("layer_types", "layers_block_type", "block_types"):
        if isinstance(fields.get(key), list) and layers:
            # Every kind of layer the family has, in turn: each path of a hybrid is run.
            kinds = list(dict.fromkeys(fields[key]))
            layers = max(layers, len(kinds))
            small.update({k: layers for k in _LAYER_COUNTS if k in small})
            small[key] = [kinds[i % len(kinds)] for i in range(layers)]
    # Hybrids placing attention (or experts) every so many layers: the second layer has it.
    small.update({k: 2 for k in fields if k.endswith("_layer_period")})
    small.update({k: 1 for k in fields if k.endswith("_layer_offset")})
    if "attn_layer_indices" in fields:
        small["attn_layer_indices"] = [1]
    if isinstance(fields.get("attention_types"), list) and layers:  # GPT-Neo's pattern
        kinds = fields["attention_types"][0][0]
        small["attention_types"] = [[kinds, max(layers // len(kinds), 1)]]
    if isinstance(fields.get("mlp_only_layers"), list):
        small["mlp_only_layers"] = [i for i in fields["mlp_only_layers"]
                                    if layers is None or i < layers]
    for expand, heads, head in (("expand", "num_heads", "head_dim"),
                                ("mamba_expand", "mamba_n_heads", "mamba_d_head")):
        if {expand, heads, head} <= set(fields) and "hidden_size" in small:
            # state-space heads tile the expanded hidden size (Mamba-2)
            small[heads] = fields[expand] * small["hidden_size"] // small[head]
            if "mamba_d_ssm" in fields:
                small["mamba_d_ssm"] = small[heads] * small[head]
    if "kv_lora_rank" in fields:  # latent attention: every head has its keys
        small["num_key_value_heads"] = small.get("num_attention_heads", 4)
        if "head_dim" in fields:
            small["head_dim"] = small["qk_rope_head_dim"]  # the rotated part
    if isinstance(fields.get("rotary_dim"), int):
        small["rotary_dim"] = _SIZES["head_dim"] // 2
    return small


def prompts(config: Any) -> dict[str, torch.Tensor]:
    """Two prompts of token ids, the second left-padded, the same on every machine."""
    vocab = getattr(config, "vocab_size", None) or getattr(
        getattr(config, "text_config", None), "vocab_size", VOCAB)
    generator = torch.Generator().manual_seed(SEED)
    input_ids = torch.randint(3, min(vocab, VOCAB), (BATCH, SEQUENCE), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :PADDED] = 0
    input_ids[1, :PADDED] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def families() -> list[str]:
    """Every causal-LM ``model_type`` of the installed ``transformers``, sorted."""
    return sorted(_causal_lm_classes())


@functools.cache
def _causal_lm_classes() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _transformers(spec: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise UsageError(f"entry {spec} needs transformers: pip install 'torchparity[hf]'"
                         ) from None
    return transformers


def _first(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
