"""Faults planted in the ranks of a distributed run, through ``run_parallel(setup=...)``.

Each function runs in every rank's fresh interpreter before the model is built and patches the
code there, as ``monkeypatch`` does in one process. The parallel bugs are the classic ones; the
failures exercise the launcher.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.parallel import RowwiseParallel

from torchparity.train import parallel, tensor_parallel, trainer

# --- parallel bugs --------------------------------------------------------------------------


class _BiasOnEveryRank(RowwiseParallel):
    """A row-parallel linear that adds its bias to every rank's partial sum, before the
    all-reduce: the sum carries the bias once per rank."""

    def _apply(self, module, device_mesh):
        module = super()._apply(module, device_mesh)

        def forward(x):
            partial = F.linear(x, module.weight)  # a Partial DTensor: summed after the hooks
            return partial + DTensor.from_local(module.bias.to_local(), device_mesh,
                                                [Partial()], run_check=False)

        module.forward = forward
        return module


def row_parallel_bias_on_every_rank() -> None:
    plan = tensor_parallel.attention_plan

    def buggy(attention, degree):
        return {**plan(attention, degree), "o_proj": _BiasOnEveryRank()}

    tensor_parallel.attention_plan = buggy


def loss_divided_by_world_size_twice() -> None:
    scale = trainer.loss_scale
    trainer.loss_scale = lambda denominator, data_parallel: (
        scale(denominator, data_parallel) / data_parallel)


def replicated_norm_gradient_not_reduced() -> None:
    """FSDP2 shards everything but the norms, kept replicated; nobody reduces their gradients."""
    from torch.distributed.fsdp import fully_shard

    def buggy(model, mesh):
        norms = {p for name, p in model.named_parameters() if "norm" in name}
        for module in model.modules():
            if isinstance(module, parallel.TransformerLayer):
                fully_shard(module, mesh=mesh, ignored_params=norms)
        fully_shard(model, mesh=mesh, ignored_params=norms)

    parallel.apply_fsdp = buggy


def gqa_heads_split_across_groups() -> None:
    """KV projections replicated but query heads sharded: with GQA a rank's query heads get
    paired with KV heads of other groups."""
    plan = tensor_parallel.attention_plan

    def buggy(attention, degree):
        kv = tensor_parallel.ReplicatedParallel()
        return {**plan(attention, degree), "k_proj": kv, "v_proj": kv}

    tensor_parallel.attention_plan = buggy


# --- launcher failures ----------------------------------------------------------------------

PID_DIR = "TORCHPARITY_TEST_PID_DIR"


def _note_pid() -> int:
    rank = int(os.environ["RANK"])
    if os.environ.get(PID_DIR):
        Path(os.environ[PID_DIR], f"rank{rank}.pid").write_text(str(os.getpid()))
    return rank


def rank_one_raises() -> None:
    if _note_pid() == 1:
        raise RuntimeError("planted failure in rank 1")


def rank_one_hangs() -> None:
    if _note_pid() == 1:
        time.sleep(3600)


def rank_one_fails_in_a_step() -> None:
    """Rank 1 raises inside its first step, while rank 0 waits in a collective."""
    _note_pid()
    step = trainer.Trainer._step

    def failing(self, step_number, mode):
        if self.rank == 1:
            raise FloatingPointError("planted failure in step 1 of rank 1")
        return step(self, step_number, mode)

    trainer.Trainer._step = failing


def _rank_one_signalled_in_a_step(sent: signal.Signals) -> None:
    """Rank 1 sends itself ``sent`` inside its first step, while rank 0 waits in a
    collective."""
    _note_pid()
    step = trainer.Trainer._step

    def signalled(self, step_number, mode):
        if self.rank == 1:
            os.kill(os.getpid(), sent)
        return step(self, step_number, mode)

    trainer.Trainer._step = signalled


def rank_one_stops_in_a_step() -> None:
    _rank_one_signalled_in_a_step(signal.SIGSTOP)


def rank_one_dies_in_a_step() -> None:
    _rank_one_signalled_in_a_step(signal.SIGKILL)
