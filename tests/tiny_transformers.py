"""Tiny random Hugging Face models of four families, built in code (no downloads): the
real-world outputs the comparison and the diagnosis meet (ModelOutput, attention weights,
caches). Every test that needs one builds it here."""

from __future__ import annotations

import pytest
from torch import nn

transformers = pytest.importorskip("transformers")

VOCAB = 64
LAYERS = 2
#: A release before 5.0 (the oldest supported is 4.46): some tests assume what 5.x returns.
BEFORE_5 = int(transformers.__version__.split(".")[0]) < 5


def needs_5(why: str) -> pytest.MarkDecorator:
    """Skip a test whose premise is a 5.x behaviour under an older release, saying ``why``."""
    return pytest.mark.skipif(BEFORE_5, reason=f"transformers {transformers.__version__}: {why}")


#: Why tests that ask for attention weights assume 5.x.
ATTENTION_WEIGHTS = ("its sdpa attention falls back to eager when asked for attention weights, "
                     "and eager Llama is NaN in float64 on a left-padded row (its mask "
                     "overflows)")


def gpt2(**config: object) -> nn.Module:
    """``config``: more of the config's fields (``attn_implementation="eager"``)."""
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=LAYERS, n_head=4, n_positions=64, vocab_size=VOCAB, **config))


def llama(**config: object) -> nn.Module:
    """Grouped-query attention: 4 query heads over 2 key/value heads."""
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, vocab_size=VOCAB, **config))


def bert() -> nn.Module:
    return transformers.BertModel(transformers.BertConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        max_position_embeddings=64, vocab_size=VOCAB))


def bart() -> nn.Module:
    return transformers.BartModel(transformers.BartConfig(
        d_model=32, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=64, vocab_size=VOCAB))


def bart_generator() -> nn.Module:
    """A BART that generates: one layer each side, decoding starts at token 2, no end of
    sequence (every hypothesis runs every step)."""
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        vocab_size=VOCAB, max_position_embeddings=32, decoder_start_token_id=2,
        forced_eos_token_id=None, pad_token_id=0, eos_token_id=None))


def generator(family: str) -> nn.Module:
    """A tiny generating model of ``family`` (``llama``, ``gpt2`` or ``bart``), its weights
    drawn from seed 0, in eval mode."""
    import torch

    torch.manual_seed(0)
    return (bart_generator() if family == "bart" else globals()[family]()).eval()


#: family -> (builder, its first attention module, the output fields holding attention weights)
FAMILIES = {
    "gpt2": (gpt2, "transformer.h.0.attn", ["attentions"]),
    "llama": (llama, "model.layers.0.self_attn", ["attentions"]),
    "bert": (bert, "encoder.layer.0.attention.self", ["attentions"]),
    "bart": (bart, "encoder.layers.0.self_attn",
             ["decoder_attentions", "cross_attentions", "encoder_attentions"]),
}
