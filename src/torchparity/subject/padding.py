"""Which positions of a model's batch are padding, and which tensors they apply to.

A query at a padded position may attend to nothing, so what two implementations write there is
arbitrary (eager attention spreads it over masked keys, SDPA returns zeros): such positions are
left out of every comparison and of the default loss. A padded *key* reaching a real query still
fails. The padding is the factory's ``padding`` key (a bool (batch, sequence) tensor, True at
padding; a dict of them by output path; or ``False``), else the inputs' 1/0 :data:`MASK_KEYS`.
Anything in doubt is judged whole: a doubt judges more, never less.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchparity.comparison.selection import LeftOut
from torchparity.errors import UsageError
from torchparity.subject.trees import PyTree
from torchparity.text import with_article

#: Input keys read as 1/0 padding masks, and the part of an encoder-decoder they belong to
#: (``attention_mask`` is the encoder's in an encoder-decoder, else the model's one sequence).
MASK_KEYS = {"attention_mask": "encoder", "decoder_attention_mask": "decoder",
             "src_mask": "encoder", "tgt_mask": "decoder"}
#: Target tokens of an encoder-decoder given without a mask: a decoder sequence without padding.
DECODER_IDS = ("decoder_input_ids", "tgt_ids")
_PART = re.compile(r"(en|de)coder", re.IGNORECASE)


@dataclass(frozen=True, eq=False)
class Sequence:
    """One sequence of a batch, where it was read, and its encoder-decoder part (None: any)."""

    pad: torch.Tensor  # bool (batch, length), True at padding
    source: str
    part: str | None = None


@dataclass(frozen=True, eq=False)
class Padding:
    """The padding of one batch, callable as :func:`torchparity.compare`'s ``padding``."""

    sequences: tuple[Sequence, ...] = ()
    outputs: tuple[tuple[str, Sequence], ...] = ()  # the factory's masks, by output path
    encoder_decoder: bool = False
    scope: str = ""  # the module whose tensors are matched ("": the model's outputs)

    def __bool__(self) -> bool:
        """Whether any position is padding."""
        return any(bool(s.pad.any()) for s in self._all())

    # the LeftOut of the tensor at path (comparison or flat), or None: judged whole
    def __call__(self, path: str, tensor: torch.Tensor) -> LeftOut | None:
        return self.positions(path, tuple(tensor.shape))

    def within(self, module: str) -> Padding:
        """The same padding, matched to the tensors of ``module`` (its name says the part)."""
        return dataclasses.replace(self, scope=module)

    def positions(self, path: str, shape: tuple[int, ...]) -> LeftOut | None:
        """The padded positions of a tensor of ``shape`` at ``path``, or None: it is judged whole.

        Raises:
            UsageError: a mask the factory gave for ``path`` does not fit the tensor's shape.
        """
        flat = flat_path(path)
        own = self._own(flat) if not self.scope else None
        if own is not None:
            if tuple(shape[:2]) != tuple(own.pad.shape):
                raise UsageError(f"the padding for {flat} has shape "
                                 f"{tuple(own.pad.shape)}; the tensor there has shape "
                                 f"{tuple(shape)}: give a (batch, sequence) mask of its "
                                 "leading dimensions")
            return _left_out({own: own.pad})
        fits = {s: mask for s in self.sequences
                if (mask := _over_positions(s.pad, shape)) is not None}
        # source and target may have one length: the first of encoder/decoder the path names
        # (model.decoder.layers.0.encoder_attn is the decoder's) says whose it is
        named = _PART.search(f"{self.scope} {flat}")
        if named is not None:
            part = named.group(0).lower()
            return _left_out({s: m for s, m in fits.items() if s.part in (part, None)})
        # a path naming neither is matched only when both parts' sequences are known
        tagged = {s.part for s in self.sequences if s.part is not None}
        if self.encoder_decoder and tagged != {"encoder", "decoder"} and \
                any(s.part is not None for s in fits):
            return None  # the other part's length is unknown: it may be either's
        return _left_out(fits)

    def summary(self) -> str | None:
        """One line for a report: how many positions are padding, read where; None if none."""
        padded = [s for s in self._all() if bool(s.pad.any())]
        if not padded:
            return None
        return "; ".join(f"{int(s.pad.sum())} of {s.pad.numel()} positions are padding "
                         f"({s.source.removeprefix('padding ')})" for s in padded)

    def to_json(self) -> dict[str, object]:
        """A JSON form that :meth:`from_json` reads back, so a trace keeps its batch's padding."""
        def sequence(s: Sequence) -> dict[str, object]:
            return {"pad": s.pad.int().tolist(), "source": s.source, "part": s.part}

        return {"sequences": [sequence(s) for s in self.sequences],
                "outputs": [[path, sequence(s)] for path, s in self.outputs],
                "encoder_decoder": self.encoder_decoder}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Padding:
        """The padding :meth:`to_json` wrote."""
        def sequence(d: Mapping[str, Any]) -> Sequence:
            return Sequence(torch.tensor(d["pad"], dtype=torch.bool), d["source"], d["part"])

        return cls(tuple(sequence(d) for d in data["sequences"]),
                   tuple((path, sequence(d)) for path, d in data["outputs"]),
                   bool(data["encoder_decoder"]))

    def _own(self, flat: str) -> Sequence | None:
        path = flat.removeprefix("output.")
        for key, sequence in self.outputs:
            key = key.removeprefix("output.")
            if path == key or path.startswith(f"{key}."):
                return sequence
        return None

    def _all(self) -> list[Sequence]:
        return [*self.sequences, *(s for _, s in self.outputs)]


def _over_positions(pad: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """``pad`` spread over a tensor's dimensions up to the one holding its positions, or None."""
    # the first dimension is the batch, the last (of 3+) features, and the one between of the
    # sequence's length the positions: (batch, heads, sequence, head_dim) keys, (batch, heads,
    # queries, keys) weights by their queries. Two such dimensions, or none (a sliding-window
    # cache), judge it whole; time-major tensors need their masks by output path
    batch, length = pad.shape
    if len(shape) < 2 or shape[0] != batch:
        return None
    # The last dimension holds features, but for (batch, sequence) per-token values.
    between = range(1, 2) if len(shape) == 2 else range(1, len(shape) - 1)
    dims = [d for d in between if shape[d] == length]
    if len(dims) != 1:
        return None
    dim = dims[0]
    return pad.reshape(batch, *(1,) * (dim - 1), length).expand(*shape[:dim + 1])


def _left_out(masks: Mapping[Sequence, torch.Tensor]) -> LeftOut | None:
    """Positions padded in every one of the sequences of ``masks``; None when none, or ambiguous."""
    # on different dimensions: it could be either's
    if not masks or len({m.shape for m in masks.values()}) > 1:
        return None
    sequences, (pad, *others) = list(masks), list(masks.values())
    for other in others:
        pad = pad & other
    if not bool(pad.any()):
        return None
    if len(sequences) == 1:
        return LeftOut(pad, sequences[0].source)
    sources = " and ".join(s.source.removeprefix("padding per ") for s in sequences)
    return LeftOut(pad, f"padding in both {sources} (the tensor may be either's)")


def from_inputs(inputs: PyTree, *, encoder_decoder: bool = False) -> Padding:
    """The padding that keyword ``inputs`` carry in their 1/0 masks (:data:`MASK_KEYS`)."""
    if not isinstance(inputs, Mapping):
        return Padding()
    # a target given as tokens without a mask is a sequence without padding; other forms say nothing
    encoder_decoder = encoder_decoder or any(
        key in inputs for key in (*DECODER_IDS, "decoder_attention_mask", "src_mask"))
    sequences = []
    for key, part in MASK_KEYS.items():
        pad = _padding_of(inputs.get(key))
        if pad is not None:
            sequences.append(Sequence(pad, f"padding per the inputs' {key}",
                                      part if encoder_decoder else None))
    for key in DECODER_IDS:
        ids = inputs.get(key)
        if encoder_decoder and isinstance(ids, torch.Tensor) and ids.dim() == 2 and \
                not any(s.part == "decoder" for s in sequences):
            sequences.append(Sequence(torch.zeros(ids.shape, dtype=torch.bool),
                                      f"the inputs' {key} (no padding)", "decoder"))
    return Padding(tuple(sequences), encoder_decoder=encoder_decoder)


def _padding_of(mask: object) -> torch.Tensor | None:
    """``mask == 0`` of a 1/0 (batch, sequence) mask on the CPU; None for anything else."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.is_complex():
        return None
    mask = mask.detach().cpu()
    if not bool(((mask == 0) | (mask == 1)).all()):
        return None
    return mask == 0


#: What a factory's ``padding`` key and the diagnosis's ``padding`` argument take: None (read
#: the inputs), False (no padding), a bool (batch, sequence) tensor, a dict of them by output
#: path, or a :class:`Padding`.
PaddingLike = Padding | torch.Tensor | Mapping[str, torch.Tensor] | bool | None


def padding_of(spec: PaddingLike, inputs: PyTree, model: nn.Module | None = None,
               label: str = "padding", given_by: str = "the padding given") -> Padding:
    """The :class:`Padding` of a batch from what a factory or caller gave (:data:`PaddingLike`).

    Raises:
        UsageError: ``spec`` has another form, or a mask is not a bool (batch, sequence) tensor.
    """
    if isinstance(spec, Padding):
        return spec
    encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    if spec is False:
        return Padding()
    derived = from_inputs(inputs, encoder_decoder=encoder_decoder)
    if spec is None:
        return derived
    if isinstance(spec, torch.Tensor):
        return Padding((Sequence(_checked(spec, label), f"padding per {given_by}"),),
                       encoder_decoder=derived.encoder_decoder)
    if isinstance(spec, Mapping):
        outputs = tuple((str(path), Sequence(_checked(mask, f"{label}[{path!r}]"),
                                             f"padding per {given_by} for {path}"))
                        for path, mask in spec.items())
        return dataclasses.replace(derived, outputs=outputs)
    raise UsageError(f"{label} must be a bool tensor (batch, sequence), True at padding, a dict "
                     f"of them by output path, or False; got {type(spec).__name__}")


def _checked(mask: object, label: str) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        what = (f"a {mask.dtype} tensor of shape {tuple(mask.shape)}"
                if isinstance(mask, torch.Tensor) else with_article(type(mask).__name__))
        hint = " (from a 1/0 attention_mask: attention_mask == 0)" if \
            isinstance(mask, torch.Tensor) and mask.dim() == 2 else ""
        raise UsageError(f"{label} must be a bool tensor (batch, sequence), True at padding; "
                         f"got {what}{hint}")
    return mask.detach().cpu()


def flat_path(path: str) -> str:
    """A comparison path in flat form: ``outputs["hidden"][0]`` is ``hidden.0``; flat stays."""
    if not path.startswith("outputs") or path[len("outputs"):len("outputs") + 1] not in "[.":
        return path
    keys = re.findall(r'\["((?:[^"\\]|\\.)*)"\]|\[([^\]]*)\]|\.(\w+)', path[len("outputs"):])
    return ".".join(next(part for part in key if part) for key in keys)
