"""The machine a result is computed on, as far as its rounding is concerned.

torch picks its CPU kernels by instruction set (``torch.backends.cpu.get_cpu_capability()``:
DEFAULT, AVX2, AVX512 on x86) and rounds differently under each; on CUDA the device and its
reduced-precision settings (TF32, reduced-precision reductions) do the same. Goldens record
what made them, so a check on another machine can say so. ``ATEN_CPU_CAPABILITY`` chooses a
lower instruction set, read once when torch starts: one capability per process.
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
    """What rounds on ``device`` here besides torch's version, for a golden to record.

    Args:
        device: the device a result is computed on.

    Returns:
        The CPU capability and, on CUDA, the device's name and whether TF32 or
        reduced-precision reductions are allowed.
    """
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
    """One short line for the machine a golden was made on.

    Args:
        produced_by: a golden's ``produced_by`` (:func:`describe` and the torch version), or
            None.

    Returns:
        ``cpu avx512, torch 2.13.0``, with the CUDA device and its TF32 setting where there was
        one; for goldens made before they recorded it, a line saying so.
    """
    if not produced_by or "cpu_capability" not in produced_by:
        return "a machine they do not record (made before goldens recorded it)"
    parts = [f"cpu {produced_by['cpu_capability']}", f"torch {produced_by.get('torch')}"]
    if "cuda_device" in produced_by:
        tf32 = "on" if produced_by.get("tf32_matmul") else "off"
        parts.append(f"{produced_by['cuda_device']} (tf32 {tf32})")
    return ", ".join(parts)


def native_capability() -> str:
    """The highest instruction set torch dispatches on this CPU, whatever this process started with.

    Returns:
        Its lower-case name; when ``ATEN_CPU_CAPABILITY`` is set, read by a child without it.
    """
    if CAPABILITY_VARIABLE not in os.environ:
        return torch.backends.cpu.get_cpu_capability().lower()
    env = {k: v for k, v in os.environ.items() if k != CAPABILITY_VARIABLE}
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, check=True).stdout
    return out.strip().lower()


def capabilities() -> list[str]:
    """Every instruction set this CPU can dispatch, lowest first.

    Returns:
        On x86 those of :data:`X86_CAPABILITIES` up to the native one, elsewhere ``default``
        and the native one.
    """
    native = native_capability()
    if native in X86_CAPABILITIES:
        return list(X86_CAPABILITIES[: X86_CAPABILITIES.index(native) + 1])
    return ["default", native] if native != "default" else ["default"]


def second_capability() -> str | None:
    """The instruction set just below the native one: the next machine down, for CI's rerun.

    Returns:
        Its name, or None on a CPU that offers one.
    """
    offered = capabilities()
    return offered[-2] if len(offered) > 1 else None


def environment(capability: str) -> dict[str, str]:
    """This process's environment with ``capability`` dispatched by the child it starts.

    Args:
        capability: an instruction set of :func:`capabilities`.

    Returns:
        A copy of ``os.environ`` with ``ATEN_CPU_CAPABILITY`` set.
    """
    return {**os.environ, CAPABILITY_VARIABLE: capability}
