"""The base's side of ``train --model --diagnose --base REV``, in the base's worktree."""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from torchparity.diagnosis.core.trace import inputs_digest
from torchparity.diagnosis.pipelines.forward import record
from torchparity.errors import TorchParityError
from torchparity.golden.renamed import renaming, state_layout
from torchparity.subject.model import Subject
from torchparity.train.step_diagnosis.step_call import (
    a_execution,
    capture_call,
    cpu_thread,
    trained_before,
)
from torchparity.train.trainer import OWN_ATTENTION, Execution
from torchparity.train.user_model import training_subject

WEIGHTS_FILE, LAYOUT_FILE, TRACE_FOLDER = "weights.safetensors", "layout.json", "trace"


def record_step(subject: Subject, step: int, execution: Execution, folder: Path, *,
                ops: str | None = None, ops_only: bool = False) -> Path:
    """Write A's side of step ``step`` into ``folder``: its starting weights and its trace.

    Args:
        subject: A, the base's model and recipe.
        step: the first divergent step.
        execution: how the judged run was trained (its dtype and attention backend).
        folder: where to write (created).
        ops: A's ops of these modules kept, as in :func:`~.forward.record`.
        ops_only: the trace holds only those ops.

    Returns:
        ``folder``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    trainer = trained_before(subject, step, execution.device)
    weights = copy.deepcopy(trainer.model)
    with cpu_thread(execution):
        call = capture_call(trainer, step)
    layout = state_layout(weights)
    state = {name: t.detach().cpu().contiguous() for name, t in weights.state_dict().items()
             if not isinstance(layout[name], str)}  # a tied tensor once
    save_file(state, str(folder / WEIGHTS_FILE))
    (folder / LAYOUT_FILE).write_text(json.dumps({"layout": layout,
                                              "inputs": inputs_digest(call.inputs)}))
    backend = a_execution(execution).backend
    record(weights, call.inputs, folder / TRACE_FOLDER, loss_fn=call.loss_fn(),
           backend=None if backend == OWN_ATTENTION else backend, progress=False,
           dtype=execution.mode.param_dtype, ops=ops, ops_only=ops_only)
    return folder


def load_base_weights(model: nn.Module, folder: Path) -> str | None:
    """Copy the base's weights into ``model``; None, or why some found no counterpart."""
    layout = json.loads((folder / LAYOUT_FILE).read_text())["layout"]
    state = load_file(str(folder / WEIGHTS_FILE))
    own = state_layout(model)
    paired = renaming(layout, own)
    if not paired.complete:
        return "no module table: " + paired.unmatched_sentence("this code")
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if isinstance(own[name], str):
                continue
            tensor.copy_(paired.model_tensor(name, state))
    return None


def main(argv: list[str] | None = None) -> int:
    """The base side in its own process: ``ENTRY STEP BACKEND DTYPE DEVICE FOLDER [--ops M]``."""
    parser = argparse.ArgumentParser(prog="torchparity train --diagnose (base side)")
    for name in ("entry", "step", "backend", "dtype", "device", "folder"):
        parser.add_argument(name)
    parser.add_argument("--ops")
    parser.add_argument("--ops-only", action="store_true")
    args = parser.parse_args(argv)
    try:
        record_step(training_subject(args.entry), int(args.step),
                    Execution(args.backend, args.dtype, args.device), Path(args.folder),
                    ops=args.ops, ops_only=args.ops_only)
    except TorchParityError as exc:
        print(f"torchparity train: error: {exc}", file=sys.stderr)
        return 2
    return 0



if __name__ == "__main__":
    sys.exit(main())
