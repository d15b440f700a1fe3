"""Distributed parity: 2-process DDP (torchrun, gloo on loopback) equals one process."""

from __future__ import annotations

import pytest
import torch

from torchparity.errors import TorchParityError
from torchparity.train.distributed import run_ddp
from torchparity.train.trainer import Execution, TrainConfig, train
from torchparity.train.trajectory import check_against_golden, compare_trajectories, reduction_twin

# Few steps of a tiny case: the cost is the two workers' start-up, not the training.
CONFIG = TrainConfig(case="encdec-prenorm", steps=3, batch_size=4)


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def ddp_run():
    return run_ddp(CONFIG, nproc=2, timeout=240)


def test_two_process_ddp_matches_one_process_on_the_whole_batch(ddp_run):
    assert ddp_run.world_size == 2 and len(ddp_run.records) == CONFIG.steps
    single = train(CONFIG)
    # Three-way: float64 golden (one process), baseline the one-process fp32 run.
    result = check_against_golden(ddp_run, baseline=single)
    assert result.ok, result.explain()
    # Two-run calibration: DDP against one process, noise from the single run and its twin,
    # which splits the batch into micro-batches the way the two ranks split it.
    twin = train(reduction_twin(CONFIG))
    result = compare_trajectories(ddp_run, single, (single, twin))
    assert result.ok, result.explain()
    # Same batch seen: the target tokens and correct predictions are counted over all ranks.
    assert [r.tokens for r in ddp_run.records] == [r.tokens for r in single.records]


def test_a_batch_that_does_not_split_over_the_processes_is_refused_before_launch():
    with pytest.raises(TorchParityError, match="multiple of processes x accum_steps = 4"):
        run_ddp(TrainConfig(case="llama-tiny", steps=1, batch_size=6, accum_steps=2), nproc=2)


@pytest.mark.gpu
def test_nccl_needs_one_gpu_per_process(device):
    if torch.device(device).type != "cuda":
        pytest.skip("nccl is CUDA-only; the CPU path (gloo) is tested above")
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has a GPU per process; nothing to refuse")
    with pytest.raises(TorchParityError, match="one GPU per process"):
        run_ddp(CONFIG, Execution(device=device), nproc=2)
