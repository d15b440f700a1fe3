"""EncoderDecoder equals torch.nn.Transformer, an independent implementation, given its weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchparity as tp
from torchparity.reference import build_model, zoo
from torchparity.reference.config import TransformerConfig

pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")


def _config(norm_first: bool, activation: str) -> TransformerConfig:
    return TransformerConfig(
        architecture="encoder-decoder", n_encoder_layers=2, n_layers=2, d_model=32, n_heads=4,
        d_ff=64, vocab_size=40, src_vocab_size=36, norm="layernorm", norm_eps=1e-5,
        norm_placement="pre" if norm_first else "post", activation=activation,
        positions="sinusoidal", qkv_bias=True, out_bias=True, ffn_bias=True,
    )


def _copy_attention(theirs: nn.MultiheadAttention, ours) -> None:
    theirs.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight,
                                           ours.v_proj.weight]))
    theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
    theirs.out_proj.weight.copy_(ours.o_proj.weight)
    theirs.out_proj.bias.copy_(ours.o_proj.bias)


def _copy_norm(theirs: nn.LayerNorm, ours) -> None:
    theirs.weight.copy_(ours.weight)
    theirs.bias.copy_(ours.bias)


def _torch_transformer(model, config: TransformerConfig) -> nn.Transformer:
    torch_model = nn.Transformer(
        d_model=config.d_model, nhead=config.n_heads, num_encoder_layers=config.n_encoder_layers,
        num_decoder_layers=config.n_layers, dim_feedforward=config.d_ff, dropout=0.0,
        activation=config.activation, layer_norm_eps=config.norm_eps, batch_first=True,
        norm_first=config.norm_placement == "pre",
    ).to(next(model.parameters()).dtype)
    with torch.no_grad():
        for theirs, ours in zip(torch_model.encoder.layers, model.encoder.layers, strict=True):
            _copy_attention(theirs.self_attn, ours.attn)
            _copy_norm(theirs.norm1, ours.attn_norm)
            _copy_norm(theirs.norm2, ours.mlp_norm)
            theirs.linear1.load_state_dict(ours.mlp.up_proj.state_dict())
            theirs.linear2.load_state_dict(ours.mlp.down_proj.state_dict())
        for theirs, ours in zip(torch_model.decoder.layers, model.decoder.layers, strict=True):
            _copy_attention(theirs.self_attn, ours.attn)
            _copy_attention(theirs.multihead_attn, ours.cross_attn)
            _copy_norm(theirs.norm1, ours.attn_norm)
            _copy_norm(theirs.norm2, ours.cross_attn_norm)
            _copy_norm(theirs.norm3, ours.mlp_norm)
            theirs.linear1.load_state_dict(ours.mlp.up_proj.state_dict())
            theirs.linear2.load_state_dict(ours.mlp.down_proj.state_dict())
        _copy_norm(torch_model.encoder.norm, model.encoder.norm)
        _copy_norm(torch_model.decoder.norm, model.decoder.norm)
    # Training mode with dropout 0 keeps nn.Transformer off its fused inference fast path,
    # whose nested tensors zero padded positions instead of computing them.
    return torch_model.train()


def _torch_logits(model, torch_model: nn.Transformer, batch) -> torch.Tensor:
    src_mask, tgt_mask = batch["src_mask"].bool(), batch["tgt_mask"].bool()
    src_positions = (batch["src_mask"].cumsum(-1) - 1).clamp(min=0)
    tgt_positions = (batch["tgt_mask"].cumsum(-1) - 1).clamp(min=0)
    src = model.encoder.embed(batch["src_ids"], src_positions)
    tgt = model.decoder.embed(batch["tgt_ids"], tgt_positions)
    future = torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool).triu(1)  # True = hidden
    hidden = torch_model(
        src, tgt, tgt_mask=future, src_key_padding_mask=~src_mask,
        tgt_key_padding_mask=~tgt_mask, memory_key_padding_mask=~src_mask,
    )
    return model.lm_head(hidden)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-norm", "post-norm"])
def test_encoder_decoder_matches_torch_transformer(norm_first: bool, activation: str) -> None:
    config = _config(norm_first, activation)
    batch = zoo.make_batch(config, batch_size=3, seq_len=10, seed=1, padding="right")
    outputs = {}
    for dtype in (torch.float64, torch.float32):
        model = build_model(config, seed=3, dtype=dtype)
        torch_model = _torch_transformer(model, config)
        with torch.no_grad():
            outputs[dtype] = (model(**batch), _torch_logits(model, torch_model, batch))
    ours32, theirs32 = outputs[torch.float32]
    ours64, theirs64 = outputs[torch.float64]
    # Golden: torch's model in float64; baseline: torch's model in fp32; candidate: ours in fp32.
    tp.assert_parity(ours32, theirs64, baseline=theirs32, kind="forward")
    tp.assert_parity(ours64, theirs64, kind="forward")
