"""The measuring side of ``torchparity bench``: one process per attention backend.

Each backend runs in a fresh process forked from a server that imported torch only, so its first
step pays exactly its own start-up, kernel loading and compiles. The parent steps the processes
in turn through :class:`Worker`, so drift of a shared machine hits all backends alike.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import multiprocessing
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection

import torch

from torchparity.bench.rounds import Row
from torchparity.bench.timing import peak_bytes, step_time, wall_time
from torchparity.dtypes import torch_dtype
from torchparity.errors import BackendUnavailable
from torchparity.reference.config import FieldValue


@dataclasses.dataclass(frozen=True)
class Job:
    """What one worker process measures: a model, its batch, a dtype and a backend."""

    config: dict[str, FieldValue]  # TransformerConfig.to_dict() of the model to build
    batch_size: int
    seq_len: int
    padding: str
    dtype: str  # "float32", "bfloat16", ...
    device: str
    backend: str
    compile: bool = False
    threads: int | None = None  # torch intra-op threads; None keeps torch's default
    workload: str = "model"  # or "attention": the attention call of one layer alone


class Runner:
    """One model on one backend, stepped forward+backward (or forward only, see ``mode``)."""

    def __init__(self, job: Job) -> None:
        from torchparity.bench.models import AttentionOnly, timing_model
        from torchparity.reference import TransformerConfig, sequence_loss, zoo

        if job.threads:
            torch.set_num_threads(job.threads)
        self.job = job
        self.device = torch.device(job.device)
        dtype = torch_dtype(job.dtype)
        config = TransformerConfig.from_dict(job.config).replace(attention_backend=job.backend)
        if job.workload == "attention":
            self.model = AttentionOnly(config, job.batch_size, job.seq_len).to(self.device, dtype)
            self.batch: dict[str, torch.Tensor] = {}
            self.loss = AttentionOnly.loss
        else:
            self.model = timing_model(config, self.device, dtype)
            batch = zoo.make_batch(config, job.batch_size, job.seq_len, seed=0,
                                   padding=job.padding)
            self.batch = {key: value.to(self.device) for key, value in batch.items()}
            self.loss = sequence_loss
        self.forward = _compiled(self.model) if job.compile else self.model
        self.mode = "forward+backward"
        self.note: str | None = None

    def step(self) -> None:
        """One step: forward and backward, or forward alone where the backend has no backward."""
        self.model.zero_grad(set_to_none=True)
        if self.mode == "forward":
            with torch.no_grad():
                self.forward(**self.batch)
            return
        self.loss(self.forward(**self.batch), self.batch).backward()

    def first_step(self) -> Row:
        """Time the first step, which pays start-up and compiling: seconds, mode and note."""
        try:
            seconds = wall_time(self.step, self.device)
        # a backend without a backward falls back to forward only, from then on
        except BackendUnavailable as exc:
            self.mode, self.note = "forward", f"forward only: {exc}"
            self.model.requires_grad_(False)  # kernels may refuse inputs that want gradients
            if self.job.compile:  # start the counts afresh: the failed attempt compiled too
                torch._dynamo.reset()
                self.forward = _compiled(self.model)
            seconds = wall_time(self.step, self.device)
        return {"seconds": seconds, "mode": self.mode, "note": self.note}

    def peak_bytes(self) -> int:
        """Peak memory of one step above the weights and batch (gradients are counted), in bytes."""
        self.model.zero_grad(set_to_none=True)
        return peak_bytes(self.step, self.device)

    def compile_stats(self) -> dict[str, int]:
        """Graphs, graph breaks and recompiles dynamo made in this process so far."""
        import torch._dynamo.utils

        counters = torch._dynamo.utils.counters
        metrics = torch._dynamo.utils.get_compilation_metrics()
        return {
            "graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "recompiles": sum(1 for m in metrics if m.recompile_reason is not None),
        }


def _compiled(model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    import torch._dynamo.utils
    import torch._inductor.config

    # Cold caches: the first step shows what a first run on a fresh machine pays.
    torch._inductor.config.force_disable_caches = True
    warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")  # as intended
    # Graph breaks are counted in the report; dynamo's warning for each would bury the bar.
    torch._logging.set_logs(dynamo=logging.ERROR)
    torch._dynamo.utils.clear_compilation_metrics()
    torch._dynamo.utils.counters.clear()
    return torch.compile(model)


def serve(conn: Connection, job: Job) -> None:
    """Worker process entry: build the runner, then answer command names until ``close``."""
    # every answer is ("ok", value) or ("error", one line); after an error the worker exits
    try:
        runner = Runner(job)
        conn.send(("ok", None))
        commands = {
            "first": runner.first_step,
            "step": lambda: step_time(runner.step, runner.device),
            "peak": runner.peak_bytes,
            "compile_stats": runner.compile_stats,
        }
        while (command := conn.recv()) != "close":
            conn.send(("ok", commands[command]()))
    except (EOFError, KeyboardInterrupt):
        return
    except Exception as exc:  # reported as the row's reason, never as a crash of the bench
        conn.send(("error", _one_line(exc)))


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


class Worker:
    """The parent's handle on one worker process (:func:`serve`); after an error it is done."""

    def __init__(self, job: Job) -> None:
        ctx = _context()
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child, job), name=f"bench-{job.backend}")
        self.process.start()
        child.close()
        self.error: str | None = None  # the reason; every later call returns None without asking

    def receive(self) -> object:
        """The worker's next answer, or None once it failed (``error`` says why, or it died)."""
        if self.error is not None:
            return None
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(timeout=5)
            status, value = "error", f"the worker process died (exit code {self.process.exitcode})"
        if status == "error":
            self.error = value
            return None
        return value

    def call(self, command: str) -> object:
        """Ask the worker to run ``command`` and wait for its answer (None once it failed)."""
        if self.error is None:
            try:
                self.conn.send(command)
            except OSError:
                pass  # it died; receive() reports how
        return self.receive()

    def close(self) -> None:
        """Stop the worker: asked first, terminated after 30 seconds."""
        try:
            self.conn.send("close")
        except OSError:
            pass
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()
        self.conn.close()


@contextmanager
def workers(jobs: dict[str, Job]) -> Iterator[dict[str, Worker]]:
    """A started :class:`Worker` per job, by the same names, all closed when the block ends."""
    started: dict[str, Worker] = {}
    try:
        for name, job in jobs.items():
            started[name] = Worker(job)
        yield started
    finally:
        for worker in started.values():
            worker.close()


@functools.cache
def _context() -> multiprocessing.context.BaseContext:
    # Workers fork from a server that imported torch and nothing ran yet: each starts fresh
    # (no CUDA context, no loaded kernels, empty dynamo caches) without paying the import.
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torchparity.bench.worker"])
    return ctx
