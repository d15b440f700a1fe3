"""Distributed parity: a zoo case trained by N processes under ``torchrun``.

:func:`run_parallel` launches the ranks (see :mod:`torchparity.distributed.launch`) with one of the
parallelisms of :mod:`torchparity.train.parallel` (DDP, FSDP2, tensor parallel, FSDP2 x TP) and
returns rank 0's trajectory, to be judged with
:func:`torchparity.train.trajectory.compare_trajectories` against one process training the same
recipe. gloo is used on the CPU, nccl on CUDA (one GPU per rank). Only rank 0 prints its log
lines; a rank that raises ends the run with its message.

Run by hand::

    torchrun --nproc-per-node 2 -m torchparity.train.distributed \\
        --job '{"parallelism": "fsdp", "config": {...TrainConfig...}, "out": "run.json"}'
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from torchparity.distributed import group, launch
from torchparity.errors import TorchParityError
from torchparity.train.parallel import Layout, tensor_parallel_problem
from torchparity.train.step_capture import (
    Location,
    StepCapture,
    capture_step,
    golden_of,
    load_weights,
    locate,
)
from torchparity.train.trainer import Execution, TrainConfig, Trainer, Trajectory


def run_parallel(config: TrainConfig, execution: Execution | None = None, *,
                 parallelism: str = "ddp", nproc: int = 2, timeout: float = 300.0,
                 log: Callable[[str], None] | None = None, log_every: int = 0,
                 setup: str | None = None) -> Trajectory:
    """Train ``config`` with ``nproc`` processes spread by ``parallelism``; return rank 0's run.

    Layouts and models that cannot be split are refused before anything starts, with
    :class:`~torchparity.errors.TorchParityError`; so is a launch that fails or exceeds
    ``timeout`` seconds. ``log`` receives rank 0's log lines every ``log_every`` steps.
    ``setup`` (``module:function`` or ``file.py:function``) is called in every rank before the
    model is built: a hook to register or patch code in the ranks' fresh interpreters.
    """
    return run_parallel_jobs([(parallelism, config)], execution, nproc=nproc, timeout=timeout,
                             log=log, log_every=log_every, setup=setup)[0]


def run_parallel_jobs(jobs: list[tuple[str, TrainConfig]], execution: Execution | None = None,
                      *, nproc: int = 2, timeout: float = 300.0,
                      log: Callable[[str], None] | None = None, log_every: int = 0,
                      setup: str | None = None) -> list[Trajectory]:
    """:func:`run_parallel` for several ``(parallelism, config)`` jobs, one after the other in
    one launch: the ranks start (interpreters, imports, rendezvous) once."""
    execution = execution or Execution()
    with tempfile.TemporaryDirectory(prefix="torchparity-train-") as tmp:
        specs = [{"parallelism": parallelism, "config": config,
                  "out": str(Path(tmp) / f"trajectory{i}.json")}
                 for i, (parallelism, config) in enumerate(jobs)]
        _launch(specs, execution, nproc, timeout, log, log_every, setup)
        return [Trajectory.from_dict(json.loads(Path(spec["out"]).read_text()))
                for spec in specs]


def diagnose_parallel_step(config: TrainConfig, execution: Execution | None = None, *,
                           parallelism: str, nproc: int, step: int, timeout: float = 300.0,
                           setup: str | None = None) -> Location:
    """Where step ``step`` of a distributed run first differs from one process: the ranks
    train the steps before it and capture it module by module (see
    :mod:`torchparity.train.step_capture`); one process runs the step from the ranks' weights
    and captures it too, and a float64 copy of that model is the golden."""
    execution = execution or Execution()
    with tempfile.TemporaryDirectory(prefix="torchparity-diagnose-") as tmp:
        capture = Path(tmp) / "capture.pt"
        _launch([{"parallelism": parallelism, "config": config, "capture_step": step,
                  "out": str(capture)}], execution, nproc, timeout, None, 0, setup)
        candidate = StepCapture(**torch.load(capture, weights_only=True))
    single = Trainer(config, execution)
    load_weights(single.model, candidate.weights)
    golden = golden_of(single, step)
    baseline = capture_step(single, step)
    rows = config.batch_size // (Layout(parallelism, nproc).dp * config.accum_steps)
    return locate(step, candidate, baseline, golden, rows)


def _launch(specs: list[dict], execution: Execution, nproc: int, timeout: float,
            log: Callable[[str], None] | None, log_every: int, setup: str | None) -> None:
    for spec in specs:
        check_layout(spec["config"], execution, spec["parallelism"], nproc)
    args = ["--execution", json.dumps(execution.to_dict()), "--log-every", str(log_every),
            *(["--setup", setup] if setup else [])]
    for spec in specs:
        args += ["--job", json.dumps({**spec, "config": spec["config"].to_dict()})]
    launch.launch("torchparity.train.distributed", args, nproc=nproc, timeout=timeout, log=log)


def check_layout(config: TrainConfig, execution: Execution, parallelism: str,
                 nproc: int) -> None:
    """Raise :class:`~torchparity.errors.TorchParityError` with one line when ``nproc`` ranks
    cannot train ``config`` with ``parallelism`` on ``execution``'s device."""
    layout = Layout(parallelism, nproc)
    problem = layout.problem() or tensor_parallel_problem(config.model_config, layout.tp)
    if problem:
        raise TorchParityError(problem)
    if config.batch_size % (layout.dp * config.accum_steps):
        raise TorchParityError(f"batch_size={config.batch_size} must be a multiple of "
                               f"data-parallel processes x accum_steps = "
                               f"{layout.dp * config.accum_steps}")
    if torch.device(execution.device).type == "cuda" and torch.cuda.device_count() < nproc:
        raise TorchParityError(f"nccl needs one GPU per process: {nproc} processes, "
                               f"{torch.cuda.device_count()} GPU(s) here")


def main(argv: list[str] | None = None) -> int:
    """The worker that ``torchrun`` starts: one rank of the run."""
    launch.die_with_parent()
    args = _parser().parse_args(argv)
    rank = group.rank()
    try:
        execution = Execution(**json.loads(args.execution))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = torch.device(execution.device).type == "cuda"
        if cuda:
            torch.cuda.set_device(local_rank)
            execution = Execution(execution.backend, execution.dtype, f"cuda:{local_rank}",
                                  execution.compile)
        if args.setup:
            from torchparity.subject.factory import resolve_entry

            resolve_entry(args.setup)()
        group.join()
        for job in map(json.loads, args.job):
            trainer = Trainer(TrainConfig.from_dict(job["config"]), execution,
                              parallelism=job["parallelism"],
                              log=lambda line: print(line, flush=True), log_every=args.log_every)
            if "capture_step" in job:
                trainer.run(job["capture_step"] - 1)
                capture = capture_step(trainer, job["capture_step"])
                if rank == 0:
                    torch.save(vars(capture), job["out"])
                continue
            trajectory = trainer.run()
            if rank == 0:
                Path(job["out"]).write_text(json.dumps(trajectory.to_dict()))
    except BaseException as exc:
        launch.record_failure(rank, exc)
        raise
    group.leave()  # once every rank is done: none closes what another still uses
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m torchparity.train.distributed",
                                     description="one rank of a distributed training run")
    parser.add_argument("--job", action="append", required=True,
                        help='{"parallelism": ..., "config": TrainConfig, "out": where rank 0 '
                             'writes the trajectory JSON, optionally "capture_step": N to '
                             'capture step N instead}; repeated jobs run one after another')
    parser.add_argument("--execution", default="{}", help="Execution as JSON")
    parser.add_argument("--log-every", type=int, default=0, help="rank 0 logs every N steps")
    parser.add_argument("--setup", help="module:function called in every rank first")
    return parser


if __name__ == "__main__":
    sys.exit(main())
