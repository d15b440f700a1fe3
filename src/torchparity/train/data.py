"""A synthetic training corpus for zoo cases: copy, reverse and sort tasks generated from a seed.

Each example is a task marker and a random string of symbols; the target is the string copied,
reversed or sorted. The tasks are learnable by any of the zoo's models, so the loss really falls
in a few dozen steps, and the data is a pure function of ``(seed, step)`` drawn with
:mod:`torchparity.reference.rng`: identical on every machine and torch version, which lets a
float64 golden trajectory be replayed anywhere, and lets every process of a distributed run
build the same global batch and take its own rows.

Token layout (shared by source and target vocabularies): 0 padding, 1 begin, 2 end,
3 separator, 4-6 the task markers, from 7 the symbols.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torchparity.reference import rng
from torchparity.reference.config import TransformerConfig

PAD, BOS, EOS, SEP = 0, 1, 2, 3
TASKS = ("copy", "reverse", "sort")
FIRST_SYMBOL = 4 + len(TASKS)
IGNORE = -100  # label of positions that carry no loss


@dataclass
class TrainBatch:
    """Model inputs and aligned next-token labels (``IGNORE`` where no loss is taken).

    ``labels[b, t]`` is the token the model should predict from position ``t`` of the (target)
    input, so the loss needs no shifting: ``cross_entropy(logits[b, t], labels[b, t])``.
    """

    inputs: dict[str, torch.Tensor]
    labels: torch.Tensor

    @property
    def n_sentences(self) -> int:
        return self.labels.shape[0]

    @property
    def n_tokens(self) -> int:
        """Number of target tokens that carry loss."""
        return int((self.labels != IGNORE).sum())

    @property
    def n_input_tokens(self) -> int:
        """Real (unpadded) tokens fed to the model, source and target together."""
        return sum(int((v != PAD).sum()) for k, v in self.inputs.items() if k.endswith("ids"))

    def rows(self, index: slice) -> TrainBatch:
        """The sub-batch of rows ``index`` (a micro-batch or a distributed shard)."""
        return TrainBatch({k: v[index] for k, v in self.inputs.items()}, self.labels[index])

    def to(self, device: str | torch.device) -> TrainBatch:
        return TrainBatch({k: v.to(device) for k, v in self.inputs.items()},
                          self.labels.to(device))


@dataclass(frozen=True)
class Corpus:
    """The stream of global batches of a training run; ``batch(step)`` is deterministic.

    ``task`` is one of :data:`TASKS` or ``"mixed"`` (each example draws its task). Strings have
    ``min_len`` to ``max_len`` symbols, so rows are padded (right) and masks are exercised;
    every batch has the same padded shape, so compiled models never recompile. With
    ``min_len == max_len`` no row is padded and no mask is passed, so attention kernels that
    take no mask (flash, cuDNN) can train.
    """

    model: TransformerConfig
    batch_size: int
    seed: int = 0
    task: str = "mixed"
    min_len: int = 3
    max_len: int = 8

    def __post_init__(self) -> None:
        if self.task not in (*TASKS, "mixed"):
            raise ValueError(f"task={self.task!r} is invalid; choose one of "
                             f"{', '.join((*TASKS, 'mixed'))}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len; got {self.min_len}, {self.max_len}")
        if self.n_symbols < 2:
            raise ValueError(f"the vocabulary of {self.vocab} tokens leaves no room for symbols; "
                             f"it needs more than {FIRST_SYMBOL + 1}")

    @property
    def vocab(self) -> int:
        return min(self.model.vocab_size, self.model.source_vocab_size)

    @property
    def n_symbols(self) -> int:
        return self.vocab - FIRST_SYMBOL

    def batch(self, step: int) -> TrainBatch:
        """The global batch of optimizer step ``step`` (1-based), on the CPU."""
        tasks, strings, lengths = self._draw(step)
        targets = _solve(tasks, strings, lengths)
        if self.model.is_encoder_decoder:
            return self._encoder_decoder(tasks, strings, targets, lengths)
        return self._decoder(tasks, strings, targets, lengths)

    def _draw(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = (self.batch_size,)
        stream = f"train/{step}"
        if self.task == "mixed":
            tasks = rng.integers(self.seed, f"{stream}/task", shape, 0, len(TASKS))
        else:
            tasks = torch.full(shape, TASKS.index(self.task))
        lengths = rng.integers(self.seed, f"{stream}/length", shape, self.min_len,
                               self.max_len + 1)
        strings = rng.integers(self.seed, f"{stream}/symbols", (*shape, self.max_len),
                               FIRST_SYMBOL, self.vocab)
        strings = strings.masked_fill(_positions(self.max_len) >= lengths[:, None], PAD)
        return tasks, strings, lengths

    def _decoder(self, tasks, strings, targets, lengths) -> TrainBatch:
        # [task, x1..xn, SEP, y1..yn, EOS]: loss on y1..yn and EOS, predicted from SEP onwards.
        rows = []
        for task, x, y, n in zip(tasks.tolist(), strings, targets, lengths.tolist(),
                                 strict=True):
            rows.append(torch.cat([torch.tensor([4 + task]), x[:n], torch.tensor([SEP]), y[:n],
                                   torch.tensor([EOS])]))
        ids = _pad(rows, 2 * self.max_len + 3)
        labels = torch.full_like(ids, IGNORE)
        for b, n in enumerate(lengths.tolist()):
            labels[b, n + 1:2 * n + 2] = ids[b, n + 2:2 * n + 3]
        return TrainBatch(self._masked({"input_ids": ids}, "attention_mask"), labels)

    def _encoder_decoder(self, tasks, strings, targets, lengths) -> TrainBatch:
        # source [task, x1..xn, EOS]; target input [BOS, y1..yn], labels [y1..yn, EOS].
        src = _pad([torch.cat([torch.tensor([4 + t]), x[:n], torch.tensor([EOS])])
                    for t, x, n in zip(tasks.tolist(), strings, lengths.tolist(), strict=True)],
                   self.max_len + 2)
        tgt = _pad([torch.cat([torch.tensor([BOS]), y[:n]])
                    for y, n in zip(targets, lengths.tolist(), strict=True)], self.max_len + 1)
        labels = _pad([torch.cat([y[:n], torch.tensor([EOS])])
                       for y, n in zip(targets, lengths.tolist(), strict=True)],
                      self.max_len + 1, IGNORE)
        inputs = self._masked(self._masked({"src_ids": src}, "src_mask") | {"tgt_ids": tgt},
                              "tgt_mask")
        return TrainBatch(inputs, labels)

    def _masked(self, inputs: dict[str, torch.Tensor], mask: str) -> dict[str, torch.Tensor]:
        """Add the padding mask of the last ids in ``inputs``, unless nothing is padded."""
        if self.min_len == self.max_len:
            return inputs
        ids = list(inputs.values())[-1]
        return {**inputs, mask: (ids != PAD).long()}


def _positions(n: int) -> torch.Tensor:
    return torch.arange(n)[None, :]


def _solve(tasks: torch.Tensor, strings: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Targets of every example: its string copied, reversed or sorted (padding stays last)."""
    out = strings.clone()
    for b, (task, n) in enumerate(zip(tasks.tolist(), lengths.tolist(), strict=True)):
        x = strings[b, :n]
        out[b, :n] = {"copy": x, "reverse": x.flip(0), "sort": x.sort().values}[TASKS[task]]
    return out


def _pad(rows: list[torch.Tensor], length: int, value: int = PAD) -> torch.Tensor:
    return torch.stack([F.pad(r, (0, length - len(r)), value=value) for r in rows])


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-position cross-entropy (0 where the label is ``IGNORE``) in at least fp32.

    Flattened to (tokens, vocab) so CUDA uses the 1-d NLL kernel, which
    ``torch.use_deterministic_algorithms`` accepts.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none",
                             ignore_index=IGNORE)
    return losses.view(labels.shape)


def correct_tokens(logits: torch.Tensor, labels: torch.Tensor) -> int:
    """How many labelled positions the model's argmax gets right (for the accuracy column)."""
    return int(((logits.argmax(-1) == labels) & (labels != IGNORE)).sum())
