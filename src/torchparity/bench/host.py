"""The machine a benchmark's numbers come from: CPU, cores, memory, versions, GPU and load."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from torchparity.bench.rounds import Document


def machine_info(device: str, threads: int | None = None) -> Document:
    """The machine the numbers come from: CPU, cores, memory, versions, GPU, load and threads."""
    info: Document = {
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "torch_threads": threads or torch.get_num_threads(),
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
        "load_average_start": load_average(),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def load_average() -> list[float] | None:
    """The 1, 5 and 15-minute load averages, or None where the system does not say."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def describe_machine(machine: Document) -> str:
    """One line for :func:`machine_info`'s result, with the load at the end when recorded."""
    parts = [f"{machine['cpu']}, {machine['logical_cores']} logical cores "
             f"({machine['torch_threads']} torch threads)"]
    if machine.get("memory_gib"):
        parts.append(f"{machine['memory_gib']} GiB RAM")
    if machine.get("gpu"):
        parts.append(f"{machine['gpu']} (CUDA {machine.get('cuda')})")
    parts.append(f"torch {machine['torch']}, Python {machine['python']}")
    loads = [machine.get("load_average_start"), machine.get("load_average_end")]
    if all(loads):
        parts.append(f"1-min load {loads[0][0]} at start, {loads[1][0]} at end")
    return "; ".join(parts)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None
