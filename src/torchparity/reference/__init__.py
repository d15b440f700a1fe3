"""The reference transformer, written for clarity; attention runs through ``backends``."""

from torchparity.reference import zoo
from torchparity.reference.cache import KVCache
from torchparity.reference.config import TransformerConfig
from torchparity.reference.decoding import Decoded, greedy_decode
from torchparity.reference.models import (
    DecoderLM,
    EncoderDecoder,
    Model,
    build_model,
    sequence_loss,
)

__all__ = [
    "Decoded",
    "DecoderLM",
    "EncoderDecoder",
    "KVCache",
    "Model",
    "TransformerConfig",
    "build_model",
    "greedy_decode",
    "sequence_loss",
    "zoo",
]
