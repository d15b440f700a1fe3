"""Distributed parity: DDP, FSDP2, tensor parallel and FSDP2 x TP equal one process.

The ranks are real ``torchrun`` processes (gloo on loopback on the CPU, nccl under ``-m gpu``).
Every parallelism is judged against one process training the same recipe, within the noise
band that run's rounding-only ensemble spreads around it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from torchparity import cli
from torchparity.errors import TorchParityError
from torchparity.reference import zoo
from torchparity.train.distributed import run_parallel, run_parallel_jobs
from torchparity.train.golden_trajectories import judge_against_run
from torchparity.train.parallel import PARALLELISMS, Layout, tensor_parallel_problem
from torchparity.train.trainer import Execution, TrainConfig, train

FAULTS = str(Path(__file__).with_name("parallel_faults.py"))

# One case per parallelism, together covering GQA with sharded KV heads (llama-tiny), MQA with
# replicated KV (mqa), ALiBi's per-head slopes (alibi) and an encoder-decoder (ddp). Few steps
# of tiny models: the cost is the ranks' start-up, paid once for the four runs.
CASES = {"ddp": "encdec-prenorm", "fsdp": "llama-tiny", "tp": "mqa", "fsdp+tp": "alibi"}
STEPS = 2

pytestmark = pytest.mark.usefixtures("single_thread")


def _config(case: str, steps: int = STEPS) -> TrainConfig:
    return TrainConfig(case=case, steps=steps, batch_size=4)


def _device_execution(device: str) -> Execution:
    if torch.device(device).type == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip(f"nccl needs a GPU per rank; {torch.cuda.device_count()} GPU(s) here")
    return Execution(device=device)


@pytest.fixture(scope="module")
def parallel_runs():
    jobs = [(p, _config(CASES[p])) for p in PARALLELISMS]
    runs = run_parallel_jobs(jobs, nproc=2, timeout=300)
    return dict(zip(PARALLELISMS, runs, strict=True))


def _assert_parity(run, execution):
    config = run.config
    single = train(config, execution)
    result = judge_against_run(run, config, execution)
    assert result.ok, result.explain()
    # The same global batch was seen: target tokens and correct predictions over all ranks.
    assert [r.tokens for r in run.records] == [r.tokens for r in single.records]
    assert [r.correct for r in run.records] == [r.correct for r in single.records]


@pytest.mark.parametrize("parallelism", PARALLELISMS)
def test_two_ranks_train_like_one_process(parallelism, parallel_runs):
    run = parallel_runs[parallelism]
    assert run.world_size == 2 and run.parallelism == parallelism
    assert len(run.records) == STEPS
    _assert_parity(run, Execution())


@pytest.mark.gpu
@pytest.mark.parametrize("parallelism", PARALLELISMS)
def test_nccl_ranks_train_like_one_process(parallelism, device):
    execution = _device_execution(device)
    if torch.device(device).type != "cuda":
        pytest.skip("nccl is CUDA-only; the CPU path (gloo) is tested above")
    run = run_parallel(_config(CASES[parallelism]), execution, parallelism=parallelism, nproc=2)
    _assert_parity(run, execution)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama-tiny", "mqa"])
def test_four_ranks_on_a_two_dimensional_mesh_train_like_one_process(case):
    run = run_parallel(_config(case, steps=3), parallelism="fsdp+tp", nproc=4, timeout=600)
    assert run.world_size == 4
    _assert_parity(run, Execution())


# --- what cannot be split is refused before anything starts ---------------------------------


@pytest.mark.parametrize("case, degree, message", [
    ("llama-tiny", 4, "n_kv_heads divisible by 4 (or 1, replicated): with 2 KV heads"),
    ("alibi", 4, "needs n_heads divisible by 4; the model has 6"),
    ("encdec-relative", 2, "Shaw relative positions"),
])
def test_layouts_tensor_parallelism_would_get_wrong_are_refused(case, degree, message):
    assert message in tensor_parallel_problem(zoo.get(case).config, degree)
    with pytest.raises(TorchParityError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_parallel(_config(case), parallelism="tp", nproc=degree)


def test_mqa_and_whole_gqa_groups_split():
    assert tensor_parallel_problem(zoo.get("mqa").config, 4) is None  # one KV head, replicated
    assert tensor_parallel_problem(zoo.get("llama-tiny").config, 2) is None  # one group a rank


def test_layouts_split_ranks_into_data_and_tensor_parallel():
    assert (Layout("fsdp+tp", 4).dp, Layout("fsdp+tp", 4).tp) == (2, 2)
    assert (Layout("tp", 2).dp, Layout("fsdp", 2).dp) == (1, 2)
    assert "not a multiple" in Layout("fsdp+tp", 3).problem()
    assert "at least 2 processes" in Layout("fsdp", 1).problem()


def test_a_batch_that_does_not_split_over_the_data_parallel_ranks_is_refused():
    with pytest.raises(TorchParityError, match="data-parallel processes x accum_steps = 4"):
        run_parallel(TrainConfig(case="llama-tiny", steps=1, batch_size=6, accum_steps=2),
                     parallelism="fsdp", nproc=2)


@pytest.mark.gpu
def test_nccl_needs_one_gpu_per_process(device):
    if torch.device(device).type != "cuda":
        pytest.skip("nccl is CUDA-only; the CPU path (gloo) is tested above")
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has a GPU per process; nothing to refuse")
    with pytest.raises(TorchParityError, match="one GPU per process"):
        run_parallel(_config("llama-tiny"), Execution(device=device), nproc=2)


# --- nothing is left hanging ----------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(
        f"/proc/{pid}/status").read_text().lower()


def _ranks_pids(folder: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(folder.glob("rank*.pid"))]


def test_a_rank_that_raises_ends_the_run_with_its_message_and_exit_2(tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.setenv("TORCHPARITY_TEST_PID_DIR", str(tmp_path))
    started = time.monotonic()
    with pytest.raises(TorchParityError, match=r"rank 1: FloatingPointError: planted failure "
                                               r"in step 1 of rank 1"):
        run_parallel(_config("llama-tiny"), parallelism="fsdp", nproc=2, timeout=120,
                     setup=f"{FAULTS}:rank_one_fails_in_a_step")
    # Rank 0 was waiting in a collective: it was stopped, not left to its timeout.
    assert time.monotonic() - started < 60
    pids = _ranks_pids(tmp_path)
    assert len(pids) == 2 and not any(map(_alive, pids))


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "said"), [
    # named by rank 0's watch on its heartbeat, in 10 s rather than the collective timeout
    ("rank_one_stops_in_a_step",
     r"^rank 1 has not answered for \d+s \(stopped, or frozen\); every rank was stopped$"),
    # named from torchrun's report, not by the connection rank 0 then found broken
    ("rank_one_dies_in_a_step", r": rank 1 died \(Signal 9 \(SIGKILL\)")])
def test_a_rank_stopped_or_killed_in_a_step_is_named_and_every_rank_ends(tmp_path, monkeypatch,
                                                                          fault, said):
    monkeypatch.setenv("TORCHPARITY_TEST_PID_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHPARITY_COLLECTIVE_TIMEOUT", "30")
    with pytest.raises(TorchParityError, match=said):
        run_parallel(_config("llama-tiny"), parallelism="ddp", nproc=2, timeout=300,
                     setup=f"{FAULTS}:{fault}")
    pids = _ranks_pids(tmp_path)
    assert len(pids) == 2 and not any(map(_alive, pids))


def test_cli_refuses_a_layout_in_one_line_with_exit_2(capsys):
    code = cli.main(["train", "--case", "llama-tiny", "--parallel", "tp", "--nproc", "4",
                     "--steps", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "n_kv_heads divisible by 4" in err


@pytest.mark.slow
def test_cli_trains_in_parallel_logs_rank_0_and_prints_the_budget_share(tmp_path, capsys):
    out = tmp_path / "run.json"
    code = cli.main(["train", "--case", "mqa", "--parallel", "tp", "--steps", "3",
                     "--log-every", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    # Rank 0's lines only, each once, forwarded as they come.
    assert [printed.count(f"Step {n}/3; acc:") for n in (1, 2, 3)] == [1, 1, 1]
    # The console wraps at 80 columns.
    assert re.search(r"vs one process: within, [\d.]+% of the budget used \(loss "
                     r"[\d.]+%, grad_norm\s+[\d.]+%,\s+update_norm [\d.]+%\)", printed), printed
    data = json.loads(out.read_text())
    assert data["trajectory"]["parallelism"] == "tp" and data["trajectory"]["world_size"] == 2
    assert data["comparison"]["ok"]
    assert data["comparison"]["calibration"].startswith("noise band of")


@pytest.mark.slow
def test_a_run_past_its_timeout_stops_every_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHPARITY_TEST_PID_DIR", str(tmp_path))
    with pytest.raises(TorchParityError, match="did not finish within 30s.*every process was "
                                               "stopped"):
        run_parallel(_config("llama-tiny"), parallelism="ddp", nproc=2, timeout=30,
                     setup=f"{FAULTS}:rank_one_hangs")
    pids = _ranks_pids(tmp_path)
    assert len(pids) == 2 and not any(map(_alive, pids))


@pytest.mark.slow
def test_ctrl_c_stops_every_rank(tmp_path):
    script = (f"from torchparity.train.distributed import run_parallel\n"
              f"from torchparity.train.trainer import TrainConfig\n"
              f"run_parallel(TrainConfig(case='llama-tiny', steps=2, batch_size=4), nproc=2,\n"
              f"             timeout=600, setup={FAULTS + ':rank_one_hangs'!r})\n")
    env = {**os.environ, "TORCHPARITY_TEST_PID_DIR": str(tmp_path)}
    caller = subprocess.Popen([sys.executable, "-c", script], env=env,
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(_ranks_pids(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    pids = _ranks_pids(tmp_path)
    assert len(pids) == 2, "the ranks did not start"
    caller.send_signal(signal.SIGINT)
    _, stderr = caller.communicate(timeout=60)
    assert caller.returncode != 0 and "KeyboardInterrupt" in stderr
    assert not any(map(_alive, pids))


@pytest.mark.slow
def test_concurrent_runs_pick_their_own_ports():
    config = _config("llama-tiny")
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda p: run_parallel(config, parallelism=p, nproc=2, timeout=600),
                             ("ddp", "tp")))
    assert [run.parallelism for run in runs] == ["ddp", "tp"]
    _assert_parity(runs[1], Execution())

