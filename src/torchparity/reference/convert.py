"""Weight import from Hugging Face Llama-family models and export back (needs ``transformers``)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from torchparity.reference.config import TransformerConfig
from torchparity.reference.models import DecoderLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Our parameter names <-> Hugging Face Llama names; "{i}" is the layer index.
_NAME_MAP = {
    "decoder.embed.tokens.weight": "model.embed_tokens.weight",
    "decoder.norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    **{f"decoder.layers.{{i}}.attn.{p}_proj.{t}": f"model.layers.{{i}}.self_attn.{p}_proj.{t}"
       for p in "qkvo" for t in ("weight", "bias")},
    **{f"decoder.layers.{{i}}.mlp.{p}_proj.{t}": f"model.layers.{{i}}.mlp.{p}_proj.{t}"
       for p in ("gate", "up", "down") for t in ("weight", "bias")},
    "decoder.layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "decoder.layers.{i}.mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
}


def _rename(name: str, mapping: dict[str, str]) -> str:
    for source, target in mapping.items():
        pattern = "^" + re.escape(source).replace(r"\{i\}", r"(?P<i>\d+)") + "$"
        match = re.match(pattern, name)
        if match:
            return target.replace("{i}", match.groupdict().get("i") or "")
    raise ValueError(f"parameter {name!r} has no Llama counterpart")


def _rope_theta(hf_config: PretrainedConfig) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        raise ValueError(f"rope scaling {rope_type!r} is not supported; only default rotary")
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def config_from_hf_llama(hf_config: PretrainedConfig) -> TransformerConfig:
    """The :class:`TransformerConfig` of a :class:`DecoderLM` matching an HF ``LlamaConfig``.

    Raises:
        ValueError: an activation other than silu, or a rope scaling other than the default.
    """
    if hf_config.hidden_act != "silu":
        raise ValueError(f"hidden_act={hf_config.hidden_act!r} is not supported; Llama uses silu")
    return TransformerConfig(
        architecture="decoder",
        vocab_size=hf_config.vocab_size,
        d_model=hf_config.hidden_size,
        n_heads=hf_config.num_attention_heads,
        n_kv_heads=hf_config.num_key_value_heads,
        head_dim=getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads,
        n_layers=hf_config.num_hidden_layers,
        d_ff=hf_config.intermediate_size,
        norm="rmsnorm",
        norm_eps=hf_config.rms_norm_eps,
        activation="gated-silu",
        positions="rotary",
        rotary_layout="half",
        rope_theta=_rope_theta(hf_config),
        max_positions=hf_config.max_position_embeddings,
        qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
        out_bias=bool(getattr(hf_config, "attention_bias", False)),
        ffn_bias=bool(getattr(hf_config, "mlp_bias", False)),
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )


def from_hf_llama(hf_model: torch.nn.Module) -> DecoderLM:
    """A :class:`DecoderLM` with a copy of an HF ``LlamaForCausalLM``'s weights, in its dtype.

    HF Llama checkpoints store rotary half-split, so q/k weights copy without permutation.
    Positions follow the mask (see ``token_positions``): pass HF the same ``position_ids`` for
    padded batches.

    Raises:
        ValueError: its config is one the reference cannot express.
    """
    config = config_from_hf_llama(hf_model.config)
    dtype = next(hf_model.parameters()).dtype
    model = DecoderLM(config).to(dtype)
    hf_state = hf_model.state_dict()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(hf_state[_rename(name, _NAME_MAP)])
    return model


def to_hf_llama(model: DecoderLM) -> torch.nn.Module:
    """An HF ``LlamaForCausalLM`` in eval mode with ``model``'s weights: from_hf_llama undone.

    Raises:
        ValueError: the config is one Llama cannot express (LayerNorm, ALiBi), naming the fields.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.config
    expected = _llama_constrained(c)
    if c != expected:
        diff = [f for f in c.to_dict() if getattr(c, f) != getattr(expected, f)]
        raise ValueError(f"config is not Llama-compatible in field(s) {', '.join(diff)}")
    if c.qkv_bias != c.out_bias:
        raise ValueError("Llama has one attention_bias flag: qkv_bias and out_bias must match")
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff,
        num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
        num_key_value_heads=c.kv_heads, head_dim=c.dim_head, rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta, max_position_embeddings=c.max_positions,
        attention_bias=c.qkv_bias, mlp_bias=c.ffn_bias, tie_word_embeddings=c.tie_embeddings,
    )
    dtype = next(model.parameters()).dtype
    hf_model = LlamaForCausalLM(hf_config).to(dtype)
    ours = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in ours.items():
            hf_model.get_parameter(_rename(name, _NAME_MAP)).copy_(param)
    return hf_model.eval()


def _llama_constrained(config: TransformerConfig) -> TransformerConfig:
    """``config`` with every field Llama fixes set to Llama's value (used to spot conflicts)."""
    return config.replace(
        architecture="decoder", norm="rmsnorm", activation="gated-silu", positions="rotary",
        rotary_layout="half", rotary_dim=None, norm_placement="pre", final_norm=True,
        parallel_residual=False, shared_layernorm=False, sliding_window=None,
        scale_embeddings=False, dropout=0.0,
    )
