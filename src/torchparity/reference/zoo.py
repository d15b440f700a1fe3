"""Named reference cases: configs exercising every variant of :class:`TransformerConfig`, tiny."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchparity.reference import rng
from torchparity.reference.config import TransformerConfig

PADDINGS = ("none", "left", "right")


@dataclass(frozen=True)
class ZooCase:
    """A named reference case: its config, what it exercises, and how its batch is padded."""
    name: str
    config: TransformerConfig
    description: str
    padding: str  # how the case's standard batch is padded ("left" suits generation)


_ENCDEC = dict(architecture="encoder-decoder", n_encoder_layers=2, src_vocab_size=48)
_BIASES = dict(qkv_bias=True, out_bias=True, ffn_bias=True)

_CASES = [
    ZooCase("encdec-prenorm", TransformerConfig(
        **_ENCDEC, **_BIASES, norm_placement="pre", activation="relu", positions="sinusoidal",
        sinusoidal_layout="concatenated"),
        "encoder-decoder, pre-norm LayerNorm, ReLU, sinusoidal (concatenated), biases",
        "right"),
    ZooCase("encdec-postnorm", TransformerConfig(
        **_ENCDEC, **_BIASES, norm_placement="post", activation="gelu", positions="sinusoidal",
        sinusoidal_layout="interleaved", scale_embeddings=True, tie_embeddings=True),
        "encoder-decoder, post-norm, GELU, sinusoidal (interleaved), scaled and tied embeddings",
        "right"),
    ZooCase("encdec-relative", TransformerConfig(
        **_ENCDEC, norm="rmsnorm", activation="silu", positions="relative",
        max_relative_positions=4),
        "encoder-decoder, RMSNorm, SiLU, Shaw relative positions (clipped at 4), no biases",
        "left"),
    ZooCase("llama-tiny", TransformerConfig(
        norm="rmsnorm", norm_eps=1e-6, activation="gated-silu", positions="rotary",
        rotary_layout="half", n_kv_heads=2),
        "Llama-style decoder: RMSNorm, SwiGLU, rotary (half-split), GQA 4:2, no biases",
        "left"),
    ZooCase("llama3-rope", TransformerConfig(
        d_model=64, n_heads=2, n_kv_heads=1, head_dim=128, d_ff=64, n_layers=1,
        norm="rmsnorm", activation="gated-silu", positions="rotary", rope_theta=500000.0),
        "Llama-3-style decoder: rotary base 500000 over 128-dim heads (frequencies down to"
        " 500000^(-126/128)), GQA 2:1, SwiGLU",
        "left"),
    ZooCase("rotary-interleaved", TransformerConfig(
        activation="gelu", positions="rotary", rotary_layout="interleaved", rotary_dim=4,
        qkv_bias=True, tie_embeddings=True),
        "decoder, rotary (interleaved pairs, partial: 4 of 8 dims), qkv bias, tied embeddings",
        "left"),
    ZooCase("alibi", TransformerConfig(
        d_model=48, n_heads=6, activation="gated-gelu", positions="alibi", ffn_bias=True),
        "decoder, ALiBi with 6 heads (non-power-of-2 slopes), GeGLU, MLP bias",
        "right"),
    ZooCase("sliding-window", TransformerConfig(
        norm="rmsnorm", activation="gated-silu", positions="rotary", n_kv_heads=2,
        sliding_window=4),
        "Mistral-style decoder: sliding window of 4, rotary, GQA 4:2, SwiGLU",
        "left"),
    ZooCase("parallel-residual", TransformerConfig(
        **_BIASES, activation="gelu", positions="rotary", rotary_dim=4, parallel_residual=True),
        "GPT-NeoX-style decoder: parallel residual with two norms, partial rotary, biases",
        "right"),
    ZooCase("parallel-shared-norm", TransformerConfig(
        activation="gelu", positions="rotary", rotary_layout="interleaved",
        parallel_residual=True, shared_layernorm=True, out_bias=True, norm_bias=False),
        "GPT-J-style decoder: parallel residual sharing one norm, interleaved rotary",
        "left"),
    ZooCase("mqa", TransformerConfig(
        n_kv_heads=1, activation="silu", positions="learned", out_bias=True),
        "decoder with multi-query attention (1 KV head), learned positions, SiLU",
        "right"),
    ZooCase("nope-postnorm", TransformerConfig(
        norm_placement="post", final_norm=False, activation="relu", positions="none",
        norm_eps=1e-6, **_BIASES),
        "decoder without position encoding (causal mask only), post-norm, ReLU, no final norm",
        "none"),
]
_BY_NAME = {case.name: case for case in _CASES}


def names() -> list[str]:
    """Names of all zoo cases, in a stable order."""
    return list(_BY_NAME)


def get(name: str) -> ZooCase:
    """The case called ``name``; a ``KeyError`` for an unknown name lists the known ones."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown zoo case {name!r}; known cases: {', '.join(names())}") from None


def padding_mask(batch_size: int, seq_len: int, padding: str) -> torch.Tensor | None:
    """A (batch_size, seq_len) 1/0 mask, rows shorter down to half, padded on ``padding``'s side."""
    if padding not in PADDINGS:
        raise ValueError(f"padding={padding!r} is invalid; expected one of {', '.join(PADDINGS)}")
    if padding == "none":  # no mask at all
        return None
    lengths = [seq_len - (b * seq_len) // (2 * max(batch_size, 1)) for b in range(batch_size)]
    index = torch.arange(seq_len)
    rows = [index >= seq_len - n if padding == "left" else index < n for n in lengths]
    return torch.stack(rows).long()


def _tokens(seed: int, stream: str, shape: tuple[int, int], vocab: int,
            mask: torch.Tensor | None) -> torch.Tensor:
    ids = rng.integers(seed, stream, shape, 1, vocab)  # 0 is reserved for padding
    return ids if mask is None else ids * mask


def make_batch(config: TransformerConfig, batch_size: int = 2, seq_len: int = 16,
               seed: int = 0, padding: str = "right") -> dict[str, torch.Tensor]:
    """Deterministic model inputs, the same on every machine: ``model(**make_batch(...))`` runs.

    Padding tokens are 0 and masked out; ``padding`` "none" passes no mask at all.

    Raises:
        ValueError: a batch too small (``seq_len`` < 2: the loss predicts the next token), or an
            unknown padding.
    """
    if batch_size < 1 or seq_len < 2:
        raise ValueError(f"make_batch needs batch_size >= 1 and seq_len >= 2; "
                         f"got {batch_size}, {seq_len}")
    mask = padding_mask(batch_size, seq_len, padding)
    shape = (batch_size, seq_len)
    if not config.is_encoder_decoder:
        batch = {"input_ids": _tokens(seed, "input_ids", shape, config.vocab_size, mask)}
        if mask is not None:
            batch["attention_mask"] = mask
        return batch
    batch = {
        "src_ids": _tokens(seed, "src_ids", shape, config.source_vocab_size, mask),
        "tgt_ids": _tokens(seed, "tgt_ids", shape, config.vocab_size, mask),
    }
    if mask is not None:
        batch["src_mask"], batch["tgt_mask"] = mask, mask
    return batch


def case_batch(case: ZooCase, batch_size: int = 2, seq_len: int = 12, seed: int = 0,
               ) -> dict[str, torch.Tensor]:
    """The standard batch of a case, padded as the case says (see :func:`make_batch`)."""
    return make_batch(case.config, batch_size, seq_len, seed, case.padding)
