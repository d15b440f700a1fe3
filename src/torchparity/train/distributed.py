"""Distributed parity: data-parallel (DDP) training of a zoo case under ``torchrun``.

Every process builds the same global batch and trains on its share of the rows; the loss is
normalised by the global token count, so DDP's gradient average equals the single-process
gradient of the whole batch up to summation order. :func:`run_ddp` launches
``python -m torch.distributed.run --nproc-per-node N`` on the loopback interface and returns
the trajectory of rank 0, to be judged with
:func:`torchparity.train.trajectory.compare_trajectories` against one process training the same
recipe. gloo is used on the CPU, nccl on CUDA.

Run by hand::

    torchrun --nproc-per-node 2 -m torchparity.train.distributed --case llama-tiny --steps 5 \\
        --out ddp.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from torchparity.errors import TorchParityError
from torchparity.train.trainer import Execution, TrainConfig, Trainer, Trajectory


def run_ddp(config: TrainConfig, execution: Execution | None = None, *, nproc: int = 2,
            timeout: float = 180.0) -> Trajectory:
    """Train ``config`` with ``nproc`` DDP processes on this machine; return rank 0's run.

    Rendezvous is on 127.0.0.1 at a free port, and gloo is bound to the loopback interface, so
    nothing leaves the machine. Raises :class:`~torchparity.errors.TorchParityError` with the
    tail of the workers' output when the launch fails or exceeds ``timeout`` seconds.
    """
    execution = execution or Execution()
    if config.batch_size % (nproc * config.accum_steps):
        raise TorchParityError(f"batch_size={config.batch_size} must be a multiple of processes "
                               f"x accum_steps = {nproc * config.accum_steps}")
    if torch.device(execution.device).type == "cuda" and torch.cuda.device_count() < nproc:
        raise TorchParityError(f"nccl data parallelism needs one GPU per process: {nproc} "
                               f"processes, {torch.cuda.device_count()} GPU(s) here")
    with tempfile.TemporaryDirectory(prefix="torchparity-ddp-") as tmp:
        out = Path(tmp) / "trajectory.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), "-m", "torchparity.train.distributed",
               "--config", json.dumps(config.to_dict()),
               "--execution", json.dumps(execution.to_dict()), "--out", str(out)]
        try:
            done = subprocess.run(cmd, env=_worker_env(), capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise TorchParityError(f"torchrun did not finish within {timeout:.0f}s: "
                                   f"{_tail(exc.stderr)}") from None
        if done.returncode != 0 or not out.exists():
            raise TorchParityError(f"torchrun failed with exit status {done.returncode}: "
                                   f"{_tail(done.stderr or done.stdout)}")
        return Trajectory.from_dict(json.loads(out.read_text()))


def main(argv: list[str] | None = None) -> int:
    """The worker that ``torchrun`` starts: one process of the data-parallel run."""
    import torch.distributed as dist

    args = _parser().parse_args(argv)
    config = TrainConfig.from_dict(json.loads(args.config))
    execution = Execution(**json.loads(args.execution))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.device(execution.device).type == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
        execution = Execution(execution.backend, execution.dtype, f"cuda:{local_rank}",
                              execution.compile)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        trajectory = Trainer(config, execution, distributed=True).run()
        if dist.get_rank() == 0:
            Path(args.out).write_text(json.dumps(trajectory.to_dict()))
    finally:
        dist.destroy_process_group()
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m torchparity.train.distributed",
                                     description="one process of a DDP training run")
    parser.add_argument("--config", required=True, help="TrainConfig as JSON")
    parser.add_argument("--execution", default="{}", help="Execution as JSON")
    parser.add_argument("--out", required=True, help="where rank 0 writes the trajectory JSON")
    return parser


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), None)


def _worker_env() -> dict[str, str]:
    """The workers' environment: this package importable, loopback only, one thread each."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    loopback = _loopback_interface()
    if loopback:
        env["GLOO_SOCKET_IFNAME"] = loopback
    return env


def _tail(text: str | bytes | None, lines: int = 8) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return " | ".join((text or "no output").strip().splitlines()[-lines:])


if __name__ == "__main__":
    sys.exit(main())
