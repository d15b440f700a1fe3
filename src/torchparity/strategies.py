"""Hypothesis strategies for property tests of transformer code, and reproducers for failures.

Everything draws *valid* inputs only (nothing is thrown away by ``assume``) and shrinks toward
the smallest problem: one head, one layer, no positions, no padding, short rows. ::

    from hypothesis import given, note
    from torchparity import strategies as tps

    @given(config=tps.configs(positions="rotary"), data=st.data())
    def test_my_property(config, data):
        batch = data.draw(tps.batches(config))
        ...

Needs ``hypothesis`` (``pip install 'torchparity[strategies]'``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

try:
    from hypothesis import note
    from hypothesis import strategies as st
    from hypothesis.strategies import SearchStrategy
except ImportError as exc:  # an optional dependency: say how to get it
    raise ImportError("torchparity.strategies needs hypothesis: "
                      "pip install 'torchparity[strategies]'") from exc

from torchparity import backends
from torchparity.reference import config as config_module
from torchparity.reference.config import TransformerConfig

PADDINGS = ("none", "right", "left")  # simplest first: hypothesis shrinks toward "none"
#: Rotary bases drawn by :func:`configs`: Llama 2's, Llama 3's and a long-context one.
ROPE_THETAS = (10000.0, 500000.0, 1000000.0)
_FIELDS = {f.name for f in dataclasses.fields(TransformerConfig)}
_Result = TypeVar("_Result")


# --- configs ----------------------------------------------------------------------------------


def configs(*, architectures: Sequence[str] = config_module.ARCHITECTURES,
            max_d_model: int = 32, max_layers: int = 2,
            **fixed: object) -> SearchStrategy[TransformerConfig]:
    """Valid tiny configs, every field the reference supports, shrinking toward the simplest.

    Dropout is 0 (properties need determinism); pinned fields keep those depending on them
    consistent.

    Args:
        architectures: the architectures drawn from.
        max_d_model: the largest ``d_model`` drawn (at least 8).
        max_layers: the most layers per stack (at least 1).
        **fixed: fields pinned to a value (``positions="rotary"``) or to a strategy
            (``activation=st.sampled_from(["gated-silu", "gated-gelu"])``).

    Raises:
        ValueError: an unknown field name, an unknown architecture, or bounds too small.
    """
    unknown = sorted(set(fixed) - _FIELDS)
    if unknown:
        raise ValueError(f"configs() got unknown TransformerConfig field(s) {', '.join(unknown)}")
    bad = [a for a in architectures if a not in config_module.ARCHITECTURES]
    if bad or not architectures:
        raise ValueError(f"architectures must be a non-empty subset of "
                         f"{config_module.ARCHITECTURES}; got {tuple(architectures)}")
    if max_d_model < 8 or max_layers < 1:
        raise ValueError(f"configs() needs max_d_model >= 8 and max_layers >= 1; "
                         f"got {max_d_model}, {max_layers}")
    return _configs(tuple(architectures), max_d_model, max_layers, fixed)


@st.composite
def _configs(draw: st.DrawFn, architectures: tuple[str, ...], max_d_model: int,
             max_layers: int, fixed: dict[str, object]) -> TransformerConfig:
    fields: dict[str, Any] = {}

    def pick(field: str, strategy: SearchStrategy) -> Any:
        value = fixed.get(field, strategy)
        fields[field] = draw(value) if isinstance(value, SearchStrategy) else value
        return fields[field]

    def flag(field: str) -> bool:
        return pick(field, st.booleans())

    # Fields every config has come first and dependent ones last, so that shrinking a choice
    # (encoder-decoder to decoder, rotary to none) only drops draws from the end.
    architecture = pick("architecture", st.sampled_from(architectures))
    pick("vocab_size", st.integers(8, 64))
    pick("n_layers", st.integers(1, max_layers))
    d_model = pick("d_model", st.sampled_from([d for d in (8, 16, 32) if d <= max_d_model]))
    n_heads = pick("n_heads", st.sampled_from([h for h in (1, 2, 4) if d_model % h == 0]))
    pick("n_kv_heads", st.sampled_from([None, *_divisors(n_heads)]))
    # Head dims up to Llama's 128, where rotary's slowest frequencies are theta^(-126/128).
    head_dim = pick("head_dim", st.none() | st.sampled_from([2, 4, 8, 128]))
    pick("d_ff", st.sampled_from([f for f in (8, 16, 32, 64) if f <= 2 * max_d_model]))
    positions = pick("positions", st.sampled_from(
        ["none", "learned", "sinusoidal", "rotary", "alibi", "relative"]))
    pick("max_positions", st.just(64))  # learned tables: enough for every input drawn here
    norm = pick("norm", st.sampled_from(config_module.NORMS))
    pick("norm_eps", st.sampled_from([1e-5, 1e-6]))
    placement = pick("norm_placement", st.sampled_from(config_module.NORM_PLACEMENTS))
    pick("activation", st.sampled_from(config_module.ACTIVATIONS))
    for field in ("final_norm", "qkv_bias", "out_bias", "ffn_bias", "tie_embeddings",
                  "scale_embeddings"):
        flag(field)
    pick("sliding_window", st.none() | st.integers(1, 8))

    if positions == "rotary":
        pick("rotary_layout", st.sampled_from(config_module.ROTARY_LAYOUTS))
        partial = list(range(2, head_dim or d_model // n_heads, 2))  # partial rotary widths
        pick("rotary_dim", st.none() | st.sampled_from(partial) if partial else st.none())
        # At 5e5 and 1e6 the frequencies lose visible precision when computed below fp32
        # (theta does not even fit in fp16), which the classic 1e4 hides.
        pick("rope_theta", st.sampled_from(ROPE_THETAS))
    elif positions == "sinusoidal":
        pick("sinusoidal_layout", st.sampled_from(config_module.SINUSOIDAL_LAYOUTS))
    elif positions == "relative":
        pick("max_relative_positions", st.integers(1, 8))
    if norm == "layernorm":
        flag("norm_bias")
    if architecture == "encoder-decoder":
        pick("n_encoder_layers", st.integers(1, max_layers))
        pick("src_vocab_size", st.none() | st.integers(8, 64))
    elif placement == "pre" and flag("parallel_residual"):
        flag("shared_layernorm")
    fields.update({k: v for k, v in fixed.items() if k not in fields and
                   not isinstance(v, SearchStrategy)})
    fields.update({k: draw(v) for k, v in fixed.items() if k not in fields})
    try:
        return TransformerConfig(**fields)
    except ValueError as exc:
        raise ValueError(f"configs(): the pinned fields {sorted(fixed)} conflict with the "
                         f"drawn ones: {exc}") from None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# --- token inputs -----------------------------------------------------------------------------


def token_rows(vocab_size: int, *, batch_size: SearchStrategy[int] | int | None = None,
               lengths: SearchStrategy[int] | int | None = None
               ) -> SearchStrategy[list[list[int]]]:
    """Rows of real token ids in ``[1, vocab_size)`` (0 is padding), one length per row.

    Args:
        vocab_size: the vocabulary size (at least 2).
        batch_size: the rows, a number or a strategy (default 1 to 3).
        lengths: each row's tokens, a number or a strategy (default 1 to 12).
    """
    if vocab_size < 2:
        raise ValueError(f"token_rows needs vocab_size >= 2 (0 is padding); got {vocab_size}")
    sizes = _as_strategy(batch_size, st.integers(1, 3))
    lengths = _as_strategy(lengths, st.integers(1, 12))
    row = lengths.flatmap(lambda n: st.lists(st.integers(1, vocab_size - 1),
                                             min_size=n, max_size=n))
    return sizes.flatmap(lambda b: st.lists(row, min_size=b, max_size=b))


def pad_rows(rows: Sequence[Sequence[int]], side: str, length: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(ids, mask)``: ``rows`` padded with 0 on ``side`` ("left", "right", "none": no mask).

    Raises:
        ValueError: an unknown side, a row longer than ``length``, or unequal rows with "none".
    """
    if side not in PADDINGS:
        raise ValueError(f"side={side!r} is invalid; expected one of {', '.join(PADDINGS)}")
    longest = max((len(r) for r in rows), default=0)
    length = longest if length is None else length
    if length < longest:
        raise ValueError(f"length={length} is shorter than the longest row ({longest})")
    if side == "none":
        if any(len(r) != length for r in rows):
            raise ValueError("side='none' needs rows of equal length; pad on 'left' or 'right'")
        return torch.tensor([list(r) for r in rows], dtype=torch.long), None
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        cols = slice(length - len(row), length) if side == "left" else slice(0, len(row))
        ids[i, cols] = torch.tensor(list(row), dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


def _as_strategy(value: SearchStrategy | object, default: SearchStrategy) -> SearchStrategy:
    if value is None:
        return default
    return value if isinstance(value, SearchStrategy) else st.just(value)


@st.composite
def _padded(draw: st.DrawFn, vocab_size: int, batch_size: int, seq_len: int, side: str,
            allow_empty_rows: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    shortest = seq_len if side == "none" else 0 if allow_empty_rows else 1
    rows = draw(token_rows(vocab_size, batch_size=batch_size,
                           lengths=st.integers(shortest, seq_len)))
    return pad_rows(rows, side, seq_len)


@st.composite
def batches(draw: st.DrawFn, config: TransformerConfig, *,
            batch_size: SearchStrategy[int] | int | None = None,
            seq_len: SearchStrategy[int] | int | None = None,
            padding: SearchStrategy[str] | str | None = None,
            allow_empty_rows: bool = True) -> dict[str, torch.Tensor]:
    """Model keyword arguments like ``zoo.make_batch``'s, each row with its own real tokens.

    Encoder-decoder batches draw source and target lengths independently, padded on one side.

    Args:
        draw: hypothesis's draw (given by ``@st.composite``, not by the caller).
        config: the model's config: its vocabulary and architecture.
        batch_size: the rows, a number or a strategy (default 1 to 3).
        seq_len: the columns, a number or a strategy (default 2 to 12).
        padding: "none" (full rows, no mask), "right" or "left"; drawn unless given.
        allow_empty_rows: a row may be entirely padding.
    """
    side = draw(_as_strategy(padding, st.sampled_from(PADDINGS)))
    rows = draw(_as_strategy(batch_size, st.integers(1, 3)))
    columns = _as_strategy(seq_len, st.integers(2, 12))
    keys = ([("src_ids", "src_mask", config.source_vocab_size)] if config.is_encoder_decoder
            else [])
    keys.append(("tgt_ids", "tgt_mask", config.vocab_size) if config.is_encoder_decoder
                else ("input_ids", "attention_mask", config.vocab_size))
    batch: dict[str, torch.Tensor] = {}
    for ids_key, mask_key, vocab in keys:
        ids, mask = draw(_padded(vocab, rows, draw(columns), side, allow_empty_rows))
        batch[ids_key] = ids
        if mask is not None:
            batch[mask_key] = mask
    return batch


def lengths(batch: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """Real tokens per row (its mask's row sums) by ids key of ``batch``."""
    out = {}
    for ids_key, mask_key in (("input_ids", "attention_mask"), ("src_ids", "src_mask"),
                              ("tgt_ids", "tgt_mask")):
        if ids_key in batch:
            ids = batch[ids_key]
            mask = batch.get(mask_key)
            out[ids_key] = ([ids.shape[1]] * ids.shape[0] if mask is None
                            else mask.sum(-1).tolist())
    return out


# --- dtypes and backends ----------------------------------------------------------------------

_LOW_AND_SINGLE = (torch.float32, torch.bfloat16, torch.float16)


def dtypes(device: str | torch.device = "cpu",
           candidates: Sequence[torch.dtype] = _LOW_AND_SINGLE) -> SearchStrategy[torch.dtype]:
    """The ``candidates`` in which the reference attention runs on ``device`` (float32 first).

    Raises:
        ValueError: none of them runs on ``device``.
    """
    usable = [d for d in candidates if _manual_attention_runs(str(torch.device(device)), d)]
    if not usable:
        raise ValueError(f"none of {[str(d) for d in candidates]} runs on {device}")
    return st.sampled_from(usable)


@functools.cache
def _manual_attention_runs(device: str, dtype: torch.dtype) -> bool:
    # Only the plain backend: probing them all (backends.available) would compile flex.
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        return False
    x = torch.ones(1, 1, 2, 2, device=device).to(dtype)
    try:
        with torch.no_grad():
            backends.attention(x, x, x, backend="manual", causal=True)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def attention_backends(device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32) -> SearchStrategy[str]:
    """Names of the attention backends that run on ``device`` in ``dtype`` ("manual" first)."""
    return st.sampled_from([n for n, why in backends.available(device, dtype).items()
                            if why is None])


# --- what the suite compares in which dtype ---------------------------------------------------

# The CPU flash kernel (which "sdpa" also picks below fp32) derives the softmax backward's row
# term from the rounded output, FlashAttention-style. With near-uniform attention the query
# gradient cancels and carries rounding at the value gradient's scale, which the module-scale
# floor budgets; but that error flows on into every gradient upstream (the norm in front of a
# cross-attention whose queries cancel was 25% off in fp16, --hypothesis-seed=3). That is the
# kernel's real precision, reported rather than budgeted: its low-precision gradients are not
# compared.
_FLASH_BACKWARD = ("sdpa", "sdpa-flash")


def compares_gradients(backend: str, dtype: torch.dtype) -> bool:
    """Whether the property suite compares ``backend``'s gradients in ``dtype``."""
    # the CPU flash kernel's low-precision gradients carry its real rounding upstream: reported, not
    # budgeted
    return backend not in _FLASH_BACKWARD or dtype in (torch.float32, torch.float64)


def differentiable_in(dtype: torch.dtype) -> dict[str, SearchStrategy[str]]:
    """:func:`configs` pins for properties comparing gradients in ``dtype``: no ReLU below fp32."""
    # a pre-activation within rounding of 0 flips whether a ReLU passes gradient, changing whole
    # rows by O(1): the tolerance model budgets rounding, not kinks
    if dtype in (torch.float32, torch.float64):
        return {}
    return dict(activation=st.sampled_from(["gelu", "silu", "gated-gelu", "gated-silu"]))


# --- reproducers ------------------------------------------------------------------------------

#: What a reproducer imports; check functions passed to :func:`reproducer` may use these names.
REPRODUCER_HEADER = """\
import torch
import torchparity as tp
from torchparity.errors import BackendUnavailable
from torchparity.reference import TransformerConfig, build_model, sequence_loss, variants
from torchparity.reference.attention import AttentionContext
from torchparity.strategies import pad_rows
from torchparity.subject.rounding import perturb_weights
"""


def python_source(value: object) -> str:
    """A Python expression rebuilding ``value`` (tensors written in full: keep them small)."""
    if isinstance(value, TransformerConfig):
        return config_source(value)
    if isinstance(value, torch.Tensor):
        dtype = "" if value.dtype == torch.long else f", dtype={value.dtype}"
        return f"torch.tensor({value.tolist()!r}{dtype})"
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {python_source(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        items = [python_source(v) for v in value]
        if isinstance(value, tuple):
            return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
        return "[" + ", ".join(items) + "]"
    return repr(value)


def config_source(config: TransformerConfig) -> str:
    """``TransformerConfig(...)`` with only the fields that differ from the defaults."""
    default = TransformerConfig()
    changed = [f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config)
               if getattr(config, f.name) != getattr(default, f.name)]
    return f"TransformerConfig({', '.join(changed)})"


def reproducer(check: Callable[..., object], arguments: dict[str, object],
               helpers: Sequence[Callable[..., object]] = ()) -> str:
    """A self-contained script rerunning ``check(**arguments)`` on the header's names only."""
    # the source of every helper and of check shows the exact computation that failed
    parts = [REPRODUCER_HEADER]
    parts += [textwrap.dedent(inspect.getsource(f)) for f in (*helpers, check)]
    assignments = "\n".join(f"{name} = {python_source(v)}" for name, v in arguments.items())
    call = f"{check.__name__}({', '.join(f'{n}={n}' for n in arguments)})"
    return "\n\n".join(parts) + "\n\n" + assignments + "\n" + call + "\n"


def note_reproducer(check: Callable[..., _Result], arguments: dict[str, object],
                    helpers: Sequence[Callable[..., object]] = ()) -> _Result:
    """Run ``check(**arguments)`` in a hypothesis test, noting its ``reproducer`` if it fails."""
    note("# Reproducer: paste into a Python shell where torchparity is importable\n"
         + reproducer(check, arguments, helpers))
    return check(**arguments)
