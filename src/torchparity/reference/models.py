"""The reference models: a decoder-only LM and an encoder-decoder, written for clarity."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from torchparity.reference import rng
from torchparity.reference.attention import AttentionContext
from torchparity.reference.cache import KVCache
from torchparity.reference.config import TransformerConfig
from torchparity.reference.layers import TransformerLayer
from torchparity.reference.norms import LayerNorm, RMSNorm, build_norm
from torchparity.reference.positions import LearnedPositions, RelativePositions, sinusoidal


def token_positions(mask: torch.Tensor | None, batch: int, length: int,
                    device: torch.device) -> torch.Tensor:
    """(batch, length) int64 positions: each token's index among its row's real tokens."""
    # padding takes the position of the real token before it (0 at the left): padded rows see
    # unpadded positions
    if mask is None:
        return torch.arange(length, device=device).expand(batch, length)
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def self_attention_mask(key_mask: torch.Tensor | None, new: int, past: int, *, causal: bool,
                        window: int | None) -> tuple[torch.Tensor | None, bool]:
    """The boolean (batch|1, 1, new, past + new) mask of ``new`` queries over all keys."""
    total = past + new
    # (None, True): a plain causal mask kernels apply themselves
    if causal and key_mask is None and window is None and past == 0:
        return None, True
    device = key_mask.device if key_mask is not None else None
    q_idx = torch.arange(past, total, device=device)[:, None]
    k_idx = torch.arange(total, device=device)[None, :]
    allowed = torch.ones(new, total, dtype=torch.bool, device=device)
    if causal:
        allowed &= k_idx <= q_idx
    if window is not None:
        allowed &= (q_idx - k_idx).abs() < window
    allowed = allowed[None, None]
    if key_mask is not None:
        allowed = allowed & key_mask.bool()[:, None, None, :]
    return allowed, False


class Embeddings(nn.Module):
    """Token embeddings plus absolute positions (sinusoidal or learned) when configured."""

    def __init__(self, config: TransformerConfig, vocab_size: int) -> None:
        super().__init__()
        self.config = config
        self.tokens = nn.Embedding(vocab_size, config.d_model)
        self.positions = (LearnedPositions(config.max_positions, config.d_model)
                          if config.positions == "learned" else None)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Checked in eager mode only: reading a tensor's value would break a compiled graph.
        """(batch, len, d_model) embeddings of ``ids``; a ``ValueError`` past the vocabulary."""
        if not torch.compiler.is_compiling() and (
                int(ids.max()) >= self.tokens.num_embeddings or int(ids.min()) < 0):
            raise ValueError(f"token ids must lie in [0, {self.tokens.num_embeddings}); "
                             f"got {int(ids.min())}..{int(ids.max())}")
        x = self.tokens(ids)
        if self.config.scale_embeddings:
            x = x * math.sqrt(self.config.d_model)
        if self.config.positions == "sinusoidal":
            x = x + sinusoidal(positions, self.config.d_model, self.config.sinusoidal_layout,
                               x.dtype)
        elif self.positions is not None:
            x = x + self.positions(positions)
        return self.dropout(x)


class Stack(nn.Module):
    """Embeddings, a sequence of layers and an optional final norm: an encoder or a decoder."""

    def __init__(self, config: TransformerConfig, n_layers: int, vocab_size: int, *,
                 causal: bool, cross: bool) -> None:
        super().__init__()
        self.config, self.causal = config, causal
        self.embed = Embeddings(config, vocab_size)
        self.layers = nn.ModuleList(
            TransformerLayer(config, i, cross=cross) for i in range(n_layers)
        )
        self.norm = build_norm(config) if config.final_norm else None

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None, *,
                cache: KVCache | None = None, memory: torch.Tensor | None = None,
                memory_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The (batch, new, d_model) hidden states of ``ids``, only the new ones with a ``cache``.

        Raises:
            ValueError: ``mask`` does not cover the cached and new tokens, (batch, cached + new).
        """
        batch, new = ids.shape
        past = len(cache) if cache is not None else 0
        if mask is not None and tuple(mask.shape) != (batch, past + new):
            raise ValueError(f"attention mask has shape {tuple(mask.shape)}; expected "
                             f"{(batch, past + new)} (batch, cached + new tokens)")
        positions = token_positions(mask, batch, past + new, ids.device)
        attn_mask, kernel_causal = self_attention_mask(
            mask, new, past, causal=self.causal, window=self.config.sliding_window)
        ctx = AttentionContext(positions[:, past:], positions, attn_mask, kernel_causal, cache)
        memory_ctx = None
        if memory is not None:
            cross_mask = None if memory_mask is None else memory_mask.bool()[:, None, None, :]
            memory_ctx = AttentionContext(None, None, cross_mask, False, cache)

        x = self.embed(ids, positions[:, past:])
        for layer in self.layers:
            x = layer(x, ctx, memory, memory_ctx)
        return x if self.norm is None else self.norm(x)


class DecoderLM(nn.Module):
    """Decoder-only language model returning (batch, seq, vocab) logits.

    Masks use 1 for tokens and 0 for padding, on either side. With a :class:`KVCache`, pass only
    the new tokens and the mask of all tokens so far.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if config.is_encoder_decoder:
            raise ValueError("DecoderLM needs architecture='decoder'; use EncoderDecoder")
        self.config = config
        self.decoder = Stack(config, config.n_layers, config.vocab_size, causal=True, cross=False)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.decoder.embed.tokens.weight

    def new_cache(self) -> KVCache:
        """An empty cache for incremental decoding."""
        return KVCache()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """Next-token logits (batch, new, vocab); with a cache, the new ids and the whole mask."""
        return self.lm_head(self.decoder(input_ids, attention_mask, cache=cache))


class EncoderDecoder(nn.Module):
    """Encoder-decoder (translation) model returning target logits (batch, tgt_len, vocab).

    With a :class:`KVCache` the encoder runs once (its output is kept in the cache) and
    cross-attention keys/values are computed once; pass only the new target tokens.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if not config.is_encoder_decoder:
            raise ValueError("EncoderDecoder needs architecture='encoder-decoder'; use DecoderLM")
        self.config = config
        self.encoder = Stack(config, config.n_encoder_layers, config.source_vocab_size,
                             causal=False, cross=False)
        self.decoder = Stack(config, config.n_layers, config.vocab_size, causal=True, cross=True)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.decoder.embed.tokens.weight

    def new_cache(self) -> KVCache:
        """An empty cache for incremental decoding; it keeps the encoder's output too."""
        return KVCache()

    def encode(self, src_ids: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder's output (batch, src_len, d_model), what cross-attention reads."""
        return self.encoder(src_ids, src_mask)

    def forward(self, src_ids: torch.Tensor, tgt_ids: torch.Tensor,
                src_mask: torch.Tensor | None = None, tgt_mask: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """Next-token logits (batch, new, vocab) of every target position."""
        # src_ids is not read when the cache holds the encoder's output
        if cache is not None and cache.memory is not None:
            memory = cache.memory
        else:
            memory = self.encode(src_ids, src_mask)
            if cache is not None:
                cache.memory = memory
        hidden = self.decoder(tgt_ids, tgt_mask, cache=cache, memory=memory, memory_mask=src_mask)
        return self.lm_head(hidden)


Model = DecoderLM | EncoderDecoder


def build_model(config: TransformerConfig, seed: int = 0, *, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> Model:
    """Build the model ``config`` describes, in training mode, with deterministic weights.

    The weights are drawn in float64 from :mod:`torchparity.reference.rng` and cast to ``dtype``:
    the same ``(config, seed)`` gives bit-identical weights on every machine and torch version.
    """
    model = (EncoderDecoder if config.is_encoder_decoder else DecoderLM)(config)
    init_reference_weights(model, seed)
    return model.to(device=device, dtype=dtype)


def init_reference_weights(model: nn.Module, seed: int) -> None:
    """Overwrite every parameter with its deterministic value (see :func:`build_model`)."""
    seen: set[int] = set()  # tied parameters are initialised once, by their first owner
    with torch.no_grad():
        for module_name, module in model.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                name = f"{module_name}.{param_name}" if module_name else param_name
                std, mean = _init_scale(module, param_name, param)
                param.copy_(rng.symmetric(seed, name, param.shape, std) + mean)


def _init_scale(module: nn.Module, param_name: str, param: torch.Tensor) -> tuple[float, float]:
    """(std, mean) of a parameter's uniform init; norms start near 1, biases near 0."""
    if isinstance(module, (LayerNorm, RMSNorm)):
        return (0.05, 1.0) if param_name == "weight" else (0.05, 0.0)
    if isinstance(module, nn.Linear):
        return (1.0 / math.sqrt(module.in_features), 0.0) if param_name == "weight" else (0.05, 0.0)
    if isinstance(module, (LearnedPositions, RelativePositions)):
        return 0.5, 0.0
    if isinstance(module, nn.Embedding):
        return 1.0, 0.0
    return 1.0 / math.sqrt(param.shape[-1]), 0.0


def sequence_loss(logits: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over real target tokens, computed in at least fp32."""
    # targets: input_ids (decoder) or tgt_ids shifted by one; padding on either side ignored; 0 with
    # no target
    ids_key, mask_key = ("tgt_ids", "tgt_mask") if "tgt_ids" in batch else ("input_ids",
                                                                            "attention_mask")
    targets = batch[ids_key][:, 1:]
    mask = batch.get(mask_key)
    valid = torch.ones_like(targets, dtype=torch.bool) if mask is None else (
        mask[:, 1:].bool() & mask[:, :-1].bool())
    logits = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32))
    losses = nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return (losses * valid).sum() / valid.sum().clamp(min=1)
