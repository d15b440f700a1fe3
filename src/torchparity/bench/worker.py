"""The measuring side of ``torchparity bench``: one process per attention backend.

Each backend of a benchmark group runs in its own fresh process (forked from a server that has
imported torch and nothing else), so its first step pays for exactly its own lazy start-up and
kernel loading, and with ``torch.compile`` its compile and recompile counts are its own. The
parent (:mod:`torchparity.bench.runner`) drives the processes in turn over a pipe, one step at
a time, so the backends' steps interleave and slow drift of a shared machine hits all of them alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.profiler
from torch import nn

from torchparity.errors import BackendUnavailable


@dataclasses.dataclass(frozen=True)
class Job:
    """What one worker process measures: a model, its batch, a dtype and a backend."""

    config: dict[str, Any]  # TransformerConfig.to_dict() of the model to build
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
        from torchparity.reference import TransformerConfig, sequence_loss, zoo

        if job.threads:
            torch.set_num_threads(job.threads)
        self.job = job
        self.device = torch.device(job.device)
        dtype = getattr(torch, job.dtype)
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
        self.model.zero_grad(set_to_none=True)
        if self.mode == "forward":
            with torch.no_grad():
                self.forward(**self.batch)
            return
        self.loss(self.forward(**self.batch), self.batch).backward()

    def first_step(self) -> dict[str, Any]:
        """Wall time of the first step; a backend without a backward falls back to forward only."""
        try:
            seconds = wall_time(self.step, self.device)
        except BackendUnavailable as exc:
            self.mode, self.note = "forward", f"forward only: {exc}"
            self.model.requires_grad_(False)  # kernels may refuse inputs that want gradients
            if self.job.compile:  # start the counts afresh: the failed attempt compiled too
                torch._dynamo.reset()
                self.forward = _compiled(self.model)
            seconds = wall_time(self.step, self.device)
        return {"seconds": seconds, "mode": self.mode, "note": self.note}

    def peak_bytes(self) -> int:
        """Peak memory of one step above the weights and batch (gradients are counted)."""
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


def _compiled(model: torch.nn.Module) -> Callable[..., Any]:
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


def wall_time(fn: Callable[[], Any], device: torch.device) -> float:
    """Wall-clock seconds of ``fn()``, with the device synchronised on both sides."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def step_time(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of ``fn()``: CUDA events on a GPU (device time), else the wall clock."""
    if device.type != "cuda":
        return wall_time(fn, device)
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    torch.cuda.synchronize(device)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def peak_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes allocated while ``fn()`` runs, above what was allocated before it.

    On CUDA the caching allocator's own peak. On the CPU the allocation events of the PyTorch
    profiler (``profile_memory``): every allocation through PyTorch's CPU allocator counts,
    kernel scratch included; memory a library allocates on its own (BLAS workspaces) does not.
    """
    # Garbage of earlier work freed by a collection inside ``fn`` would lower the CPU count.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with _quiet_stderr(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocations = sorted(_allocations(prof.profiler.kineto_results.experimental_event_tree()),
                         key=lambda event: event.start_time_ns)
    if not allocations:
        return 0
    # total_allocated is the running total of what was allocated since profiling began (frees
    # of older blocks are not reported), so its maximum over the start is the step's peak.
    first = allocations[0].extra_fields
    start = first.total_allocated - first.alloc_size
    return max(event.extra_fields.total_allocated for event in allocations) - start


def _allocations(events: list[Any]) -> Iterator[Any]:
    for event in events:
        if event.tag == torch._C._profiler._EventType.Allocation:
            yield event
        yield from _allocations(event.children)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    # The profiler's C++ side announces itself and warns about blocks allocated before it
    # started (expected here) on file descriptor 2, across a progress bar.
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class AttentionOnly(torch.nn.Module):
    """The attention call of one layer of ``config`` alone, causal, with trainable q, k, v of
    the layer's shapes (GQA included): the kernels' own speed, without the rest of the model."""

    def __init__(self, config, batch_size: int, seq_len: int, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)

        def heads(count: int) -> torch.nn.Parameter:
            shape = (batch_size, count, seq_len, config.dim_head)
            return torch.nn.Parameter(torch.randn(shape, generator=gen))

        self.q, self.k, self.v = heads(config.n_heads), heads(config.kv_heads), heads(
            config.kv_heads)
        self.backend = config.attention_backend

    def forward(self) -> torch.Tensor:
        from torchparity import backends

        return backends.attention(self.q, self.k, self.v, causal=True, backend=self.backend)

    @staticmethod
    def loss(output: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return output.float().square().mean()


def timing_model(config, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """The reference model of ``config`` with seeded weights meant for timing only.

    Every matrix is uniform with std ``1/sqrt(fan_in)`` from a seeded generator, and so is
    every linear bias (its constructor draws from the global RNG), so all workers, and the two
    models of a diagnosis, hold identical weights; norms keep their constant constructor
    values. The deterministic float64 init of ``build_model`` would cost more than the
    measurement at GPU sizes, and speed does not depend on the values.
    """
    from torchparity.reference import DecoderLM, EncoderDecoder

    model = (EncoderDecoder if config.is_encoder_decoder else DecoderLM)(config)
    gen = torch.Generator().manual_seed(seed)

    def draw(param: torch.Tensor, fan_in: int) -> None:
        bound = (3.0 / fan_in) ** 0.5
        param.copy_(torch.rand(param.shape, generator=gen) * (2 * bound) - bound)

    with torch.no_grad():
        for module in model.modules():
            for param in module.parameters(recurse=False):
                if param.dim() >= 2:
                    draw(param, param.shape[-1])
                elif isinstance(module, nn.Linear):
                    draw(param, module.in_features)
    return model.to(device=device, dtype=dtype)


def serve(conn: Connection, job: Job) -> None:
    """Worker process entry: build the runner, then answer command names sent over ``conn``
    until ``close``. Every answer is ``("ok", value)`` or ``("error", one line)``; after an
    error the worker exits."""
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
