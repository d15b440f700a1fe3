"""What ``torchparity check`` checks: the zoo cases and the cells (backend x dtype x device)."""

from __future__ import annotations

import torch

from torchparity import backends
from torchparity.errors import UsageError
from torchparity.golden.cells import REFERENCE, Cell
from torchparity.reference import zoo
from torchparity.subject.compiling import MODES

DEFAULT_DTYPES = {"cpu": ["fp32", "bf16"], "cuda": ["fp32", "tf32", "bf16", "fp16"]}
CHECK_DTYPES = ("fp32", "tf32", "bf16", "fp16")

def select_cases(names: list[str] | None) -> list[zoo.ZooCase]:
    """The zoo cases named (all when None), in the zoo's order; UsageError lists the known ones."""
    for name in names or []:
        if name not in zoo.names():
            raise UsageError(f"unknown zoo case {name!r}; choose from {', '.join(zoo.names())}")
    return [zoo.get(name) for name in zoo.names() if names is None or name in names]


def select_cells(backend_names: list[str] | None, dtypes: list[str] | None,
                 devices: list[str] | None, known: list[str] | None = None,
                 compile_forms: list[str] | None = None) -> list[Cell]:
    """The reference cell, then every (device, dtype, backend) selected, in a stable order.

    Backends that cannot run a cell are kept: they are reported as ``n/a`` with the reason.

    Args:
        backend_names: the backends (None: all of ``known``).
        dtypes: the dtype names (None: the default ones).
        devices: the devices (None: the CPU, and CUDA where there is one).
        known: the backends to choose from (default: the attention backends).
        compile_forms: ``dynamic``, ``static``: each dtype's eager cells are followed by the
            same cells compiled in each form.

    Raises:
        UsageError: an unknown backend, dtype or device, naming the choices.
    """
    known = known or backends.names()
    for name in backend_names or []:
        if name not in known:
            raise UsageError(f"unknown attention backend {name!r}; choose from "
                             f"{', '.join(known)}")
    for dtype in dtypes or []:
        if dtype not in CHECK_DTYPES:
            raise UsageError(f"unknown dtype {dtype!r} for --dtype; choose from "
                             f"{', '.join(CHECK_DTYPES)} (the fp64 reference always runs)")
    chosen_backends = [b for b in known if backend_names is None or b in backend_names]
    cells = [REFERENCE]
    for device in _devices(devices):
        kind = torch.device(device).type
        wanted = DEFAULT_DTYPES[kind] if dtypes is None else [
            d for d in CHECK_DTYPES if d in dtypes and (d != "tf32" or kind == "cuda")]
        if dtypes is not None and devices is not None and not wanted:
            raise UsageError(f"none of the dtypes {', '.join(dtypes)} runs on {device} "
                             f"(tf32 is CUDA only)")
        cells += [Cell(b, d, device, form) for d in wanted
                  for form in [None, *(compile_forms or [])] for b in chosen_backends]
    if dtypes is not None and len(cells) == 1:
        raise UsageError(f"none of the dtypes {', '.join(dtypes)} runs here (tf32 needs CUDA)")
    return cells


def _devices(devices: list[str] | None) -> list[str]:
    if devices is None:
        return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    for device in devices:
        try:
            kind = torch.device(device).type
        except RuntimeError:
            kind = None
        if kind not in DEFAULT_DTYPES:
            raise UsageError(f"unknown device {device!r} for --device; use cpu or cuda[:N]")
        if kind == "cuda" and not torch.cuda.is_available():
            raise UsageError(f"--device {device}: no CUDA device is available here")
    return list(dict.fromkeys(devices))


def compile_forms(choice: str | None) -> list[str]:
    """The compile forms ``check --compile FORM`` asks for: none without, all for ``both``."""
    if choice is None:
        return []
    return list(MODES) if choice == "both" else [choice]
