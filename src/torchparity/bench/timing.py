"""Timing one call and its peak memory: the measurements every part's rounds take."""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.profiler


def wall_time(fn: Callable[[], object], device: torch.device) -> float:
    """Wall-clock seconds of ``fn()``, with the device synchronised on both sides."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def step_time(fn: Callable[[], object], device: torch.device) -> float:
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


def timed_command(args: Sequence[str], cwd: str | Path | None = None,
                  ) -> tuple[subprocess.CompletedProcess[str], float, float]:
    """Run ``python -m torchparity.cli *args`` in its own process: it, its wall and CPU seconds."""
    # CPU time beside wall time: on a shared machine the wall clock counts other jobs too
    src = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    start, cpu_start = time.perf_counter(), _children_cpu_s()
    done = subprocess.run([sys.executable, "-m", "torchparity.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True)
    return done, time.perf_counter() - start, _children_cpu_s() - cpu_start


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated while ``fn()`` runs, above what was allocated before it."""
    # Garbage of earlier work freed by a collection inside ``fn`` would lower the CPU count.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    # the profiler's allocation events: PyTorch's CPU allocator, kernel scratch included; a
    # library's own memory (BLAS workspaces) is not counted
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
