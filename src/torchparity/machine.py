"""The machine a result is computed on, as far as its rounding is concerned.

torch picks CPU kernels by instruction set (DEFAULT, AVX2, AVX512 on x86) and rounds differently
under each; on CUDA the device and its TF32 and reduced-precision settings do the same. Goldens
record what made them. ``ATEN_CPU_CAPABILITY``, read once at start, picks a lower set per
process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping

import torch

#: The variable torch reads at start-up to dispatch another instruction set.
CAPABILITY_VARIABLE = "ATEN_CPU_CAPABILITY"
#: x86's instruction sets torch dispatches, lowest first; other CPUs offer DEFAULT and their own.
X86_CAPABILITIES = ("default", "avx2", "avx512")


def describe(device: str | torch.device = "cpu") -> dict[str, str | bool]:
    """What rounds on ``device`` besides torch's version: CPU capability, CUDA device, settings."""
    described: dict[str, str | bool] = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability().lower(),
    }
    if torch.device(device).type == "cuda":
        matmul = torch.backends.cuda.matmul
        described |= {
            "cuda_device": torch.cuda.get_device_name(device),
            "tf32_matmul": matmul.allow_tf32,
            "tf32_cudnn": torch.backends.cudnn.allow_tf32,
            "reduced_precision_fp16": matmul.allow_fp16_reduced_precision_reduction,
            "reduced_precision_bf16": matmul.allow_bf16_reduced_precision_reduction,
        }
    return described


def label(produced_by: Mapping[str, object] | None) -> str:
    """``cpu avx512, torch 2.13.0`` (with a CUDA device and its TF32): where a golden was made."""
    if not produced_by or "cpu_capability" not in produced_by:
        return "a machine they do not record (made before goldens recorded it)"
    parts = [f"cpu {produced_by['cpu_capability']}", f"torch {produced_by.get('torch')}"]
    if "cuda_device" in produced_by:
        tf32 = "on" if produced_by.get("tf32_matmul") else "off"
        parts.append(f"{produced_by['cuda_device']} (tf32 {tf32})")
    return ", ".join(parts)


def native_capability() -> str:
    """The highest instruction set torch dispatches on this CPU, whatever this process runs."""
    if CAPABILITY_VARIABLE not in os.environ:
        return torch.backends.cpu.get_cpu_capability().lower()
    # with ATEN_CPU_CAPABILITY set, ask a child started without it
    env = {k: v for k, v in os.environ.items() if k != CAPABILITY_VARIABLE}
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, check=True).stdout
    return out.strip().lower()


def capabilities() -> list[str]:
    """Every instruction set this CPU can dispatch, lowest first."""
    native = native_capability()
    if native in X86_CAPABILITIES:
        return list(X86_CAPABILITIES[: X86_CAPABILITIES.index(native) + 1])
    return ["default", native] if native != "default" else ["default"]


def second_capability() -> str | None:
    """The instruction set just below the native one (the next machine down, for CI), or None."""
    offered = capabilities()
    return offered[-2] if len(offered) > 1 else None


def environment(capability: str) -> dict[str, str]:
    """A copy of ``os.environ`` with ``ATEN_CPU_CAPABILITY`` set to ``capability`` for a child."""
    return {**os.environ, CAPABILITY_VARIABLE: capability}
