"""What a ``torchparity bench`` run measures: its parts, sizes, dtypes, cases and rounds."""

from __future__ import annotations

import dataclasses

import torch

from torchparity import backends
from torchparity.dtypes import CASTABLE, dtype_name, torch_dtype
from torchparity.errors import UsageError
from torchparity.reference import zoo

PARTS = ("throughput", "diagnose", "decode", "check", "twins")
#: The reference models: a Llama-style decoder and a classic pre-norm encoder-decoder.
REFERENCE_CASES = ("llama-tiny", "encdec-prenorm")
#: ``diagnose`` and ``decode`` are timed on the most common question: manual attention against
#: plain SDPA.
DIAGNOSE_BACKENDS = ("manual", "sdpa")
#: The dtypes ``--dtype`` takes (short names): float64 is a golden's dtype, not one anyone
#: runs for speed.
DTYPE_CHOICES = tuple(name for name in CASTABLE if name != "fp64")


def torch_name(dtype: str) -> str:
    """torch's name of a dtype (``fp32`` -> ``float32``): what the settings and rows record."""
    return str(torch_dtype(dtype)).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class Size:
    """Model dimensions and batch shape of one benchmark size (layers per stack)."""

    name: str
    d_model: int
    n_heads: int
    n_layers: int
    d_ff: int
    vocab_size: int
    seq_len: int
    batch_size: int


QUICK_SIZES = (Size("tiny", 32, 4, 1, 64, 64, 32, 2),)
CPU_SIZES = (
    Size("s", 128, 4, 2, 512, 1024, 512, 2),
    Size("m", 256, 4, 2, 1024, 1024, 1024, 1),
)
GPU_SIZES = (
    Size("m", 512, 8, 4, 2048, 8192, 512, 8),
    Size("l", 1024, 16, 4, 4096, 32000, 2048, 4),
)


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    """Everything a benchmark run depends on; recorded in the result as given."""

    device: str
    dtypes: tuple[str, ...]  # torch's names: "float32", "bfloat16", ...
    sizes: tuple[Size, ...]  # diagnose runs at the first
    cases: tuple[str, ...] = REFERENCE_CASES
    backends: tuple[str, ...] = tuple(backends.names())
    rounds: int = 5
    warmup: int = 1
    compile: bool = False
    parts: tuple[str, ...] = PARTS
    quick: bool = False
    threads: int | None = None  # torch intra-op threads of the measured processes
    beams: int | None = None  # the decode part also times a beam search of this many beams


def default_settings(device: str = "cpu", quick: bool = False, size_names: tuple[str, ...] = (),
                     **changes: object) -> BenchSettings:
    """BenchSettings sized for ``device``, ``changes`` overriding fields (dtypes by any name).

    On the CPU the default run takes minutes on 2 cores (fp32 only: bf16 without native support
    is many times slower). ``quick``: seconds for every part but ``check``.

    Raises:
        UsageError: an invalid value, naming the field.
    """
    if quick:
        base = BenchSettings(device, ("float32",), QUICK_SIZES, rounds=3, warmup=1, quick=True)
    elif torch.device(device).type == "cuda":
        base = BenchSettings(device, ("bfloat16", "float32"), GPU_SIZES)
    else:
        base = BenchSettings(device, ("float32",), CPU_SIZES)
    known = {size.name: size for size in base.sizes}
    unknown = [name for name in size_names if name not in known]
    if unknown:
        raise UsageError(f"--size {unknown[0]}: sizes on {device}"
                         f"{' with --quick' if quick else ''} are {', '.join(known)}")
    if size_names:
        changes["sizes"] = tuple(known[name] for name in size_names)
    given = {key: value for key, value in changes.items() if value not in (None, ())}
    settings = dataclasses.replace(base, **given)
    _validate(settings)
    return dataclasses.replace(settings, dtypes=tuple(torch_name(d) for d in settings.dtypes))


def _validate(s: BenchSettings) -> None:
    if torch.device(s.device).type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {s.device}: CUDA is not available here; use --device cpu")
    for dtype in s.dtypes:
        if dtype_name(dtype) not in DTYPE_CHOICES:
            raise UsageError(f"--dtype {dtype}: choose from {', '.join(DTYPE_CHOICES)}")
    for case in s.cases:
        if case not in zoo.names():
            raise UsageError(f"--case {case}: unknown zoo case; choose from "
                             f"{', '.join(zoo.names())}")
    for name in s.backends:
        if name not in backends.names():
            raise UsageError(f"--backend {name}: choose from {', '.join(backends.names())}")
    for part in s.parts:
        if part not in PARTS:
            raise UsageError(f"unknown part {part!r}: choose from {', '.join(PARTS)}")
    if s.threads is not None and s.threads < 1:
        raise UsageError(f"--threads {s.threads}: needs at least 1")
    if s.beams is not None and s.beams < 1:
        raise UsageError(f"--beams {s.beams}: search with one beam or more")
    if s.rounds < 1 or s.warmup < 0:
        raise UsageError(f"--rounds must be >= 1 and --warmup >= 0 (got {s.rounds}, {s.warmup})")
