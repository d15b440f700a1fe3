"""Goldens of users' models: what they hold, writing them, reading and validating them.

Computed in float64 on the CPU with every SDPA call on ``manual``, in
``<golden dir>/<entry name>/``:

============  ==========  ============================================================= output
kind        tensors ============  ==========
============================================================= ``outputs``   forward     every
tensor of the model's output by path, but its cache's ``loss``      loss        ``loss_fn(output,
inputs)``, or the default loss ``grads``     grad        the gradient of every parameter that
requires one
``decode``    forward     ``DECODE_STEPS`` teacher-forced steps through the model's step:
                          the float64 run's greedy ``tokens`` (a beam search's, with
                          ``parents``, for a factory's ``search``) and each step's logits
                          (``cached.logits.<step>``, and ``recomputed.logits.<step>`` where
                          a built-in step recomputes); or what a factory's own
                          ``decode(model, inputs, use_cache)`` returns (``cached.*``,
                          ``recomputed.*``)
============  ==========  =============================================================

Every cell decodes along the golden's tokens, so a near tie broken the other way changes no later
step; the reference cell's own tokens must be the golden's, and its ``decode-cache`` row judges
the cached decoding against the recompute, catching a KV-cache bug in the very run that made the
goldens. The default loss is a fixed pseudo-random projection of the floating outputs. Padded
positions (see :mod:`torchparity.subject.padding`) are left out of the judged outputs and of the
default loss; every row says how many.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from torchparity.distributed import sharding
from torchparity.errors import UsageError
from torchparity.golden.cells import REFERENCE, CellRun
from torchparity.golden.changed_weights import row_blocks
from torchparity.golden.model_runs import OUTPUT_KINDS, Status, run_in_cell
from torchparity.golden.renamed import Layout, Renaming, state_layout
from torchparity.golden.store import GOLDEN_DIR_ENV, Golden, GoldenStale, GoldenStore, checksum
from torchparity.subject import Subject
from torchparity.subject.islands import narrowest, summary
from torchparity.subject.running import default_loss_paths
from torchparity.subject.trees import flatten_tensors
from torchparity.subject.weights import NormalDraws


def user_golden_dir(explicit: str | os.PathLike | None = None) -> Path:
    """Where users' goldens live: ``explicit``, ``$TORCHPARITY_GOLDEN_DIR``, else ``./golden``."""
    return Path(explicit or os.environ.get(GOLDEN_DIR_ENV) or "golden")


def model_store(subject: Subject, root: str | os.PathLike) -> GoldenStore:
    """The golden store under ``root`` whose messages name this model's update command."""
    command = f"torchparity golden update --model {subject.entry}"
    # --golden-dir joins the command where root is not the default
    if Path(root).resolve() != user_golden_dir().resolve():
        command += f" --golden-dir {root}"
    return GoldenStore(root, update_command=command)


def model_checksums(subject: Subject, renamed: Renaming | None = None, *,
                    by_tensor: bool = True) -> dict[str, Any]:
    """``weights`` and ``inputs`` checksums of the float64 state dict and the factory's inputs.

    ``renamed``: the state dict under the goldens' names; ``by_tensor``: each weight tensor's
    rows in blocks too (``weight_blocks``, which goldens record). The weights' is None for a
    model sharded by hand some of whose slices were found nowhere: no whole state to weigh.
    """
    inputs = checksum(flatten_tensors(subject.inputs, "inputs"))
    weights = weight_state(subject, renamed)
    if weights is None:
        return {"weights": None, "inputs": inputs}
    sums: dict[str, Any] = {"weights": checksum(weights, dtype=torch.float64), "inputs": inputs}
    if by_tensor:
        tied = set(renamed.ties) if renamed is not None else {
            name for name, shape in state_layout(subject.model).items() if isinstance(shape, str)}
        sums["weight_blocks"] = row_blocks(weights, [n for n in weights if n not in tied])
    return sums


def weight_state(subject: Subject, renamed: Renaming | None = None
                 ) -> Mapping[str, torch.Tensor] | None:
    """The state dict goldens checksum, by their names, gathered as read; None: slices missing."""
    if subject.slices is not None and subject.slices.unmapped:
        return None
    weights = (subject.model.state_dict() if subject.shards is None
               else sharding.WholeState(subject.shards.state_dict(), subject.slices))
    if renamed is not None:
        weights = renamed.golden_state(weights, state_layout(subject.model))
    return weights


def write_goldens(subject: Subject, store: GoldenStore, status: Status | None = None,
                  run: CellRun | None = None, checksums: dict[str, Any] | None = None,
                  layout: Layout | None = None) -> dict[str, str]:
    """Compute and write the goldens of ``subject``: each output's ``created``, ``updated``...

    Args:
        subject: the user's model.
        store: where its goldens go.
        status: hears where the float64 run is (which block of how many).
        run: that run, when it was made elsewhere (by the ranks of a sharded model).
        checksums: the model's (:func:`model_checksums`), when taken before its plan sharded it.
        layout: its state dict's (:func:`~torchparity.golden.renamed.state_layout`), likewise.
    """
    with store.replacing(subject.name):  # all of its files, or none if interrupted
        return _write_goldens(subject, store, status, run, checksums, layout)


def _write_goldens(subject: Subject, store: GoldenStore, status: Status | None,
                   run: CellRun | None, checksums: dict[str, Any] | None,
                   layout: Layout | None) -> dict[str, str]:
    """:func:`write_goldens` inside the update of the model's folder."""
    run = run or run_in_cell(subject, REFERENCE, None, status=status)
    if run.missing:
        output, reason = next(iter(run.missing.items()))
        raise UsageError(f"{subject.entry}: the float64 golden run cannot compute {output}: "
                         f"{reason}")
    loss_paths = None if subject.loss_fn else default_loss_paths(run.outputs["outputs"])
    if status is not None:
        status("checksums of the weights and inputs")
    meta = {"entry": subject.entry, "model": type(subject.model).__name__,
            "loss": "loss_fn" if loss_paths is None else _default_loss(subject, loss_paths),
            "checksums": checksums or model_checksums(subject)}
    if subject.generates:
        meta["decoding"] = _decoding(subject)
    if run.islands:
        meta["islands"] = {dtype: summary(modules) for dtype, modules in run.islands.items()}
    # The gradients' names as the model laid them out: a check of renamed ones pairs them.
    grads_meta = {"layout": layout or state_layout(subject.model)}
    return {output: store.update(subject.name, output, tensors,
                                 {"kind": OUTPUT_KINDS[output], **meta,
                                  **(grads_meta if output == "grads" else {})})
            for output, tensors in run.outputs.items()}


def load_goldens(subject: Subject, store: GoldenStore) -> dict[str, Golden]:
    """Read and validate the goldens of ``subject``, by output.

    Goldens made without decoding are read as they are (see :func:`no_decode_golden`); changed
    weights or inputs are verdicts of ``check_subject``, not errors.

    Raises:
        GoldenError: a missing or damaged golden.
        GoldenStale: made with another kind of loss, or with decoding the factory no longer does.
    """
    goldens = {output: store.read(subject.name, output) for output in ("outputs", "loss",
                                                                       "grads")}
    fix = f"if the change is intended, run `{store.update_command}`"
    if store.exists(subject.name, "decode"):
        goldens["decode"] = store.read(subject.name, "decode")
    decodes = "decode" in goldens
    if decodes and not subject.generates:
        raise GoldenStale(f"the goldens of {subject.name} in {store.root} were made with "
                          f"decoding, the factory now does not; {fix}")
    padding = subject.padding.summary()
    made = goldens["decode"].summary.get("decoding") if decodes else None
    if decodes and made != _decoding(subject):
        raise GoldenStale(f"the decode golden of {subject.name} in {store.root} was made "
                          f"{f'by {made}' if made else 'by greedy generate'}, the factory now "
                          f"decodes {_decoding(subject)}; {fix}")
    for golden in goldens.values():
        loss = golden.summary.get("loss")
        uses_fn = loss == "loss_fn"
        if uses_fn != (subject.loss_fn is not None):
            raise GoldenStale(f"golden {golden.path.with_suffix('.json')} was made "
                              f"{'with' if uses_fn else 'without'} a loss_fn, the factory now "
                              f"returns {'none' if uses_fn else 'one'}; {fix}")
        if not uses_fn and isinstance(loss, dict) and loss.get("padding") != padding:
            made = loss.get("padding") or "no padding left out"
            raise GoldenStale(f"golden {golden.path.with_suffix('.json')} was made with a "
                              f"default loss over other positions ({made}; now "
                              f"{padding or 'no padding left out'}); {fix}")
    store.check_set(subject.name, goldens)
    return goldens


def no_decode_golden(subject: Subject, store: GoldenStore) -> str:
    """Why a decoding factory gets no decode verdict from goldens made without; how to remake."""
    return (f"the goldens of {subject.name} in {store.root} have no decoding (made when the "
            f"factory did not decode); run `{store.update_command}` to add it")


def _default_loss(subject: Subject, loss_paths: list[str]) -> dict[str, object]:
    """What a golden records of its default loss: the outputs projected and padding left out."""
    padding = subject.padding.summary()
    return {"default projection of": loss_paths, **({"padding": padding} if padding else {})}


def _decoding(subject: Subject) -> str:
    """How the subject decodes, as its goldens record it."""
    if not subject.steps:
        return "its decode"
    search = subject.search
    return "step by step" if search is None else (
        f"step by step, a beam search of {search.beams} beams (length penalty "
        f"{search.length_penalty:g}, end of sequence "
        f"{'none' if search.eos is None else search.eos})")


def loss_paths(goldens: dict[str, Golden]) -> list[str] | None:
    """The outputs the goldens' default loss projected (every cell's too); None: a ``loss_fn``."""
    loss = goldens["loss"].summary.get("loss")
    return loss["default projection of"] if isinstance(loss, dict) else None


def golden_islands(goldens: dict[str, Golden]) -> str | None:
    """The narrowest dtype the float64 golden run computed in, or None: float64 throughout."""
    return narrowest(goldens["outputs"].summary.get("islands"))


def islands_sentence(goldens: dict[str, Golden]) -> str | None:
    """Where the float64 golden computed in a narrower dtype, as a sentence, or None: nowhere."""
    islands = goldens["outputs"].summary.get("islands")
    if not islands:
        return None
    where = "; ".join(f"{dtype} at {', '.join(modules)}" for dtype, modules in islands.items())
    return (f"the float64 golden computes in {where} (the model's own casts): it is as "
            f"precise as {narrowest(islands)} there, and every budget allows for it")


def load_noting_draws(entry: str, noting_draws: bool) -> tuple[Subject, str | None]:
    """The subject of ``entry``, warning where its goldens would not travel (``noting_draws``)."""
    if not noting_draws:
        return Subject.load(entry), None
    with NormalDraws() as draws:
        subject = Subject.load(entry)
    drawn = [*draws.drawn(dict(subject.model.state_dict(keep_vars=True))),
             *draws.drawn(flatten_tensors(subject.inputs, "inputs"))]
    if not drawn:
        return subject, None
    named = drawn[0] + (f" and {len(drawn) - 1} more" if len(drawn) > 1 else "")
    return subject, (f"{subject.name}: warning: {named} come from torch's normal draws on the "
                     "CPU, whose last bits differ by instruction set, so these goldens may "
                     "read 'init changed' on another machine; draw them with "
                     "tp.init_weights(model, seed) and tp.random_tensor(shape, seed)")
