"""EncoderDecoder equals torch.nn.Transformer, an independent implementation, given its weights;
its embeddings and sinusoidal positions equal the paper's formulas, written out here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchparity as tp
from torchparity.reference import build_model, zoo
from torchparity.reference.config import TransformerConfig

pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")


def _config(norm_first: bool, activation: str, layout: str) -> TransformerConfig:
    return TransformerConfig(
        architecture="encoder-decoder", n_encoder_layers=2, n_layers=2, d_model=32, n_heads=4,
        d_ff=64, vocab_size=40, src_vocab_size=36, norm="layernorm", norm_eps=1e-5,
        norm_placement="pre" if norm_first else "post", activation=activation,
        positions="sinusoidal", sinusoidal_layout=layout, scale_embeddings=True,
        qkv_bias=True, out_bias=True, ffn_bias=True,
    )


def _paper_positions(positions: torch.Tensor, d_model: int, layout: str) -> torch.Tensor:
    """Vaswani et al. (2017), section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i / d_model)) and
    PE(pos, 2i + 1) = cos(pos / 10000^(2i / d_model)), in float64. "concatenated" moves every
    sine before every cosine (tensor2tensor's layout)."""
    pos = positions.to(torch.float64)
    sines = [torch.sin(pos / 10000 ** (2 * i / d_model)) for i in range(d_model // 2)]
    cosines = [torch.cos(pos / 10000 ** (2 * i / d_model)) for i in range(d_model // 2)]
    if layout == "interleaved":
        channels = [c for pair in zip(sines, cosines, strict=True) for c in pair]
    else:
        channels = sines + cosines
    return torch.stack(channels, dim=-1)


def _paper_embedding(embed, ids: torch.Tensor, positions: torch.Tensor,
                     config: TransformerConfig) -> torch.Tensor:
    """Section 3.4: the token's embedding row times sqrt(d_model), plus its position's code."""
    weight = embed.tokens.weight
    table = _paper_positions(positions, config.d_model, config.sinusoidal_layout)
    return weight[ids] * config.d_model ** 0.5 + table.to(weight.dtype)


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
    src = _paper_embedding(model.encoder.embed, batch["src_ids"], src_positions, model.config)
    tgt = _paper_embedding(model.decoder.embed, batch["tgt_ids"], tgt_positions, model.config)
    future = torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool).triu(1)  # True = hidden
    hidden = torch_model(
        src, tgt, tgt_mask=future, src_key_padding_mask=~src_mask,
        tgt_key_padding_mask=~tgt_mask, memory_key_padding_mask=~src_mask,
    )
    return model.lm_head(hidden)


@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-norm", "post-norm"])
def test_encoder_decoder_matches_torch_transformer(norm_first: bool, activation: str,
                                                   layout: str) -> None:
    config = _config(norm_first, activation, layout)
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
