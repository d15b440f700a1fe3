"""TransformerConfig: every architectural variant of the reference transformer is a field."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass

from torchparity.backends import names as backend_names

ARCHITECTURES = ("decoder", "encoder-decoder")
NORMS = ("layernorm", "rmsnorm")
NORM_PLACEMENTS = ("pre", "post")
ACTIVATIONS = ("relu", "gelu", "silu", "gated-gelu", "gated-silu")
POSITIONS = ("sinusoidal", "learned", "rotary", "alibi", "relative", "none")
SINUSOIDAL_LAYOUTS = ("concatenated", "interleaved")
ROTARY_LAYOUTS = ("half", "interleaved")
#: The value of one field: every field is a number, a string, a flag or None.
FieldValue = int | float | str | bool | None


@dataclass(frozen=True)
class TransformerConfig:
    """A validated, immutable and hashable description of one reference transformer.

    A bad value raises ``ValueError`` naming the field and what is allowed;
    ``to_dict``/``from_dict`` round-trip through JSON.
    """

    architecture: str = "decoder"
    vocab_size: int = 64
    src_vocab_size: int | None = None  # encoder-decoder only; None means vocab_size
    d_model: int = 32
    n_heads: int = 4
    n_kv_heads: int | None = None  # None means n_heads (MHA); 1 is MQA; in between is GQA
    head_dim: int | None = None  # None means d_model // n_heads
    n_layers: int = 2  # decoder layers
    n_encoder_layers: int = 0  # encoder-decoder only
    d_ff: int = 64
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    norm_placement: str = "pre"
    final_norm: bool = True  # a norm after the last layer of each stack
    activation: str = "gelu"
    positions: str = "rotary"
    sinusoidal_layout: str = "concatenated"
    rotary_layout: str = "half"
    rotary_dim: int | None = None  # None means the full head_dim (partial rotary when smaller)
    rope_theta: float = 10000.0
    max_positions: int = 2048  # size of learned position tables
    max_relative_positions: int = 8  # Shaw relative positions: distances are clipped to this
    qkv_bias: bool = False
    out_bias: bool = False
    ffn_bias: bool = False
    norm_bias: bool = True  # LayerNorm only; RMSNorm has no bias
    parallel_residual: bool = False
    shared_layernorm: bool = False  # parallel residual with one norm for both branches (GPT-J)
    sliding_window: int | None = None  # a query sees at most this many keys, itself included
    tie_embeddings: bool = False
    scale_embeddings: bool = False  # multiply token embeddings by sqrt(d_model)
    dropout: float = 0.0
    attention_backend: str = "manual"

    def __post_init__(self) -> None:
        _validate(self)

    # Derived sizes, so no caller recomputes them differently.
    @property
    def kv_heads(self) -> int:
        """The key/value heads: ``n_kv_heads``, else ``n_heads`` (plain multi-head attention)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def dim_head(self) -> int:
        """The width of one head: ``head_dim``, else ``d_model // n_heads``."""
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def rotary_dims(self) -> int:
        """The rotated width of a head: ``rotary_dim``, else the whole head."""
        return self.dim_head if self.rotary_dim is None else self.rotary_dim

    @property
    def source_vocab_size(self) -> int:
        """The encoder's vocabulary: ``src_vocab_size``, else the shared ``vocab_size``."""
        return self.vocab_size if self.src_vocab_size is None else self.src_vocab_size

    @property
    def is_encoder_decoder(self) -> bool:
        """Whether the model has an encoder and cross-attention."""
        return self.architecture == "encoder-decoder"

    @property
    def gated(self) -> bool:
        """Whether the MLP is gated (``gated-silu``, ``gated-gelu``): two input projections."""
        return self.activation.startswith("gated-")

    def replace(self, **changes: FieldValue) -> TransformerConfig:
        """A copy with ``changes`` applied, validated like a new config."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, FieldValue]:
        """Every field by name, as :meth:`from_dict` takes them back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, FieldValue]) -> TransformerConfig:
        """Build from a dict of fields (:meth:`to_dict`'s, a golden's); unknown keys: ValueError."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"TransformerConfig has no field(s) {', '.join(unknown)}")
        return cls(**data)

    def to_json(self) -> str:
        """The fields as JSON with sorted keys: one text for one config, to hash or store."""
        return json.dumps(self.to_dict(), sort_keys=True)


def _fail(field: str, value: object, allowed: str) -> None:
    raise ValueError(f"TransformerConfig.{field}={value!r} is invalid: {allowed}")


def _validate(c: TransformerConfig) -> None:
    choices = {
        "architecture": ARCHITECTURES,
        "norm": NORMS,
        "norm_placement": NORM_PLACEMENTS,
        "activation": ACTIVATIONS,
        "positions": POSITIONS,
        "sinusoidal_layout": SINUSOIDAL_LAYOUTS,
        "rotary_layout": ROTARY_LAYOUTS,
    }
    for field, allowed in choices.items():
        value = getattr(c, field)
        if value not in allowed:
            _fail(field, value, "expected one of " + ", ".join(repr(a) for a in allowed))

    for field in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_positions"):
        value = getattr(c, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            _fail(field, value, "expected a positive integer")
    for field in ("src_vocab_size", "n_kv_heads", "head_dim", "rotary_dim", "sliding_window"):
        value = getattr(c, field)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            _fail(field, value, "expected a positive integer or None")
    if not isinstance(c.n_encoder_layers, int) or c.n_encoder_layers < 0:
        _fail("n_encoder_layers", c.n_encoder_layers, "expected an integer >= 0")
    if not isinstance(c.max_relative_positions, int) or c.max_relative_positions < 1:
        _fail("max_relative_positions", c.max_relative_positions, "expected a positive integer")

    if c.is_encoder_decoder and c.n_encoder_layers < 1:
        _fail("n_encoder_layers", c.n_encoder_layers, "an encoder-decoder needs at least 1")
    if not c.is_encoder_decoder and (c.n_encoder_layers or c.src_vocab_size is not None):
        _fail("architecture", c.architecture,
              "n_encoder_layers and src_vocab_size need architecture='encoder-decoder'")
    if c.head_dim is None and c.d_model % c.n_heads:
        _fail("n_heads", c.n_heads, f"must divide d_model={c.d_model}, or set head_dim")
    if c.n_heads % c.kv_heads:
        _fail("n_kv_heads", c.n_kv_heads, f"must divide n_heads={c.n_heads}")
    if not c.norm_eps > 0:
        _fail("norm_eps", c.norm_eps, "expected a positive float")
    if not c.rope_theta > 0:
        _fail("rope_theta", c.rope_theta, "expected a positive float")
    if not 0.0 <= c.dropout < 1.0:
        _fail("dropout", c.dropout, "expected 0 <= dropout < 1")
    if c.positions == "rotary":
        if c.rotary_dims > c.dim_head or c.rotary_dims % 2:
            _fail("rotary_dim", c.rotary_dim, f"must be even and at most head_dim={c.dim_head}")
    elif c.rotary_dim is not None:
        _fail("rotary_dim", c.rotary_dim, "only applies with positions='rotary'")
    if c.positions == "sinusoidal" and c.d_model % 2:
        _fail("d_model", c.d_model, "sinusoidal positions need an even d_model")
    if c.parallel_residual:
        if c.norm_placement != "pre":
            _fail("parallel_residual", True, "needs norm_placement='pre'")
        if c.is_encoder_decoder:
            _fail("parallel_residual", True, "is supported for architecture='decoder' only")
    if c.shared_layernorm and not c.parallel_residual:
        _fail("shared_layernorm", True, "needs parallel_residual=True")

    if c.attention_backend not in backend_names():
        _fail("attention_backend", c.attention_backend,
              "expected one of " + ", ".join(repr(n) for n in backend_names()))
