"""Planted parallel bugs: each is caught at the first step it shows, by the quantity it shows in.

A bug in the forward pass (a bias counted once per rank, query heads paired with the wrong KV
heads) changes the loss of step 1, which is measured before any update. A bug in the gradient
(a loss scaled down twice, a replicated norm's gradient left unreduced) leaves the step-1 loss
alone and changes the step-1 gradient norm. The bugs are planted in the ranks only, so the
one-process run and its noise band are those of the correct code. ``diagnose_parallel_step`` then
names the module: the first whose output, else whose gradient, leaves its budget.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from torchparity.train.distributed import diagnose_parallel_step, run_parallel
from torchparity.train.golden_trajectories import judge_against_run
from torchparity.train.trainer import Execution, TrainConfig

FAULTS = str(Path(__file__).with_name("parallel_faults.py"))

pytestmark = pytest.mark.usefixtures("single_thread")


def _config(case: str) -> TrainConfig:
    return TrainConfig(case=case, steps=3, batch_size=4)


def _assert_first(bug, parallelism, case, quantity):
    config = _config(case)
    run = run_parallel(config, parallelism=parallelism, nproc=2, setup=f"{FAULTS}:{bug}")
    result = judge_against_run(run, config, Execution())
    first, explanation = result.first_divergence, result.explain()
    assert first is not None, f"{bug} went unnoticed: {explanation}"
    assert (first.step, first.quantity) == (1, quantity), explanation
    assert "part at step 1" in explanation


_BUGS = [
    # parallel-residual has an output-projection bias: added by both ranks, counted twice.
    ("row_parallel_bias_on_every_rank", "tp", "parallel-residual", "loss",
     ("decoder.layers.0.attn", "output")),
    # FSDP2 averages over the ranks already; a second division halves every gradient: the
    # first parameter (the token embedding) shows it.
    ("loss_divided_by_world_size_twice", "fsdp", "llama-tiny", "grad_norm",
     ("decoder.embed.tokens", "gradient")),
    # Norms kept out of FSDP2: each rank steps with the gradient of its own rows only.
    ("replicated_norm_gradient_not_reduced", "fsdp", "llama-tiny", "grad_norm",
     ("decoder.layers.0.attn_norm", "gradient")),
    # llama-tiny: 4 query heads in 2 GQA groups. KV replicated while the query heads are
    # split: rank 0's heads 0 and 1 (group 0) meet KV heads 0 and 1.
    ("gqa_heads_split_across_groups", "tp", "llama-tiny", "loss",
     ("decoder.layers.0.attn", "output")),
]


@pytest.mark.slow
@pytest.mark.parametrize("bug, parallelism, case, quantity, where", _BUGS)
def test_planted_parallel_bugs_are_caught_at_step_1_and_located(bug, parallelism, case,
                                                                 quantity, where):
    _assert_first(bug, parallelism, case, quantity)
    location = diagnose_parallel_step(_config(case), parallelism=parallelism, nproc=2, step=1,
                                      setup=f"{FAULTS}:{bug}")
    assert (location.module, location.quantity) == where, location.render()


@pytest.mark.slow
def test_a_correct_parallel_step_is_located_nowhere():
    location = diagnose_parallel_step(_config("mqa"), parallelism="fsdp+tp", nproc=2, step=2)
    assert location.module is None, location.render()
