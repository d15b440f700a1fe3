"""The golden store: named groups of tensors on disk, each with a JSON summary for reviewers.

A golden is ``<root>/<case>/<output>.safetensors`` (the tensors) and ``<output>.json`` (what a
reviewer reads in a diff: schema, the producer's metadata, versions, and one line per tensor with
shape, dtype, mean, std, absmax and sha256). Floating tensors of
:func:`torchparity.sketching.threshold` elements or more are kept as sketches
(``<name>::sketch``, ``::slices``, ``::stats``; schema 2, exact goldens keep schema 1).

Reading checks everything a damaged or hand-edited golden could get wrong, raising a
:class:`GoldenError` whose one line says how to repair it. A case's folder changes as a set
(:mod:`torchparity.golden.golden_sets`): an interruption or a failed write leaves the old set
whole, and reads take the lock the folder is switched under. Files follow the umask.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import platform
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchparity import digests, machine, sketching
from torchparity.errors import TorchParityError, UsageError
from torchparity.golden.golden_sets import (
    FolderUpdate,
    settle,
    sigterm_interrupts,
    switch_lock,
)
from torchparity.sketching import Sketch

#: Version of the on-disk layout: the newest this code reads, written for goldens holding
#: sketches. Readers refuse newer versions instead of misreading them.
SCHEMA_VERSION = 2
#: The version of goldens without sketches (the layout before them, unchanged).
EXACT_SCHEMA_VERSION = 1
#: The stored tensors of one sketched tensor: ``<name><SEPARATOR><part>``.
SEPARATOR = "::"
#: Environment variable naming the golden folder (``--golden-dir`` wins over it).
GOLDEN_DIR_ENV = "TORCHPARITY_GOLDEN_DIR"
#: Where a wheel carries the zoo's goldens inside the package (see pyproject.toml).
SHIPPED_GOLDENS = "goldens"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
_OBTAINED = ".obtained"
# Summary statistics are rounded for a readable diff; re-derived values must agree this well.
_STAT_DIGITS = 6
_STAT_TOLERANCE = 1e-5
# What a golden records of itself alone; the rest of its metadata is its set's.
_OWN_KEYS = {"schema_version", "case", "output", "produced_by", "tensors", "kind", "layout"}
# The set updates under way in this process, by folder and thread (GoldenStore.replacing).
_updating: dict[tuple[Path, int], FolderUpdate] = {}


class GoldenError(TorchParityError):
    """A golden file is missing, damaged or does not fit this code; the message says the fix."""


class GoldenMissing(GoldenError):
    """The golden folder or a golden file does not exist."""


class GoldenCorrupt(GoldenError):
    """A golden file is truncated, unreadable, or its JSON no longer matches its tensors."""


class GoldenSchemaError(GoldenError):
    """A golden was written by a newer torchparity whose format this version cannot read."""


class GoldenStale(GoldenError):
    """A golden was produced from another configuration than the one the code has now."""


class GoldenMixed(GoldenCorrupt):
    """A case's goldens come from two updates (an older torchparity, interrupted, left them)."""


class GoldenWriteError(GoldenError):
    """A golden set could not be written (a read-only folder, a full disk); the old set is kept."""


@dataclass
class Golden:
    """One golden read from disk: its tensors (on the CPU) and its JSON summary."""

    case: str
    output: str
    tensors: dict[str, torch.Tensor | Sketch]  # a tensor, or the sketch kept of it
    summary: dict[str, Any]
    path: Path  # the .safetensors file


# --- checksums and summaries ----------------------------------------------------------------


def tensor_sha256(tensor: torch.Tensor) -> str:
    """The hex sha256 of a tensor's values alone: the same on every machine and torch version."""
    return digests.sha256(tensor)


def checksum(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> str:
    """One sha256 over named tensors (sorted by name; names, dtypes, shapes and values)."""
    # on float64 weights (dtype converts chunk by chunk) and int64 inputs it is version-independent:
    # a changed digest is a changed init or inputs, never a new torch
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name]
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        header = f"{name}|{str(target).removeprefix('torch.')}|{list(tensor.shape)}|"
        digest.update(header.encode())
        digests.update(digest, tensor, target)
    return "sha256:" + digest.hexdigest()


def _rounded(x: float) -> float | str:
    if not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return float(f"{x:.{_STAT_DIGITS}g}")


def tensor_summary(tensor: torch.Tensor | Sketch) -> dict[str, Any]:
    """A golden JSON's line for one tensor: shape, dtype, mean, std, absmax (6 digits), sha256."""
    if isinstance(tensor, Sketch):
        return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                "mean": _rounded(tensor.mean), "std": _rounded(tensor.std),
                "absmax": _rounded(tensor.absmax), "sha256": stored_sha256(tensor),
                "sketch": [sketching.METHOD, tensor.size, str(tensor.seed)]}  # one line
    # a sketch: its tensor's statistics, the stored sketch's sha256, method, size and seed
    values = tensor.detach().to("cpu", torch.float64)
    empty = values.numel() == 0
    stats = {
        "mean": None if empty else _rounded(values.mean().item()),
        "std": None if empty else _rounded(values.std(correction=0).item()),
        "absmax": None if empty else _rounded(values.abs().max().item()),
    }
    return {
        "shape": list(tensor.shape),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        **stats,
        "sha256": tensor_sha256(tensor),
    }


def stored_sha256(value: torch.Tensor | Sketch) -> str:
    """sha256 of what a golden stores of ``value``: its values, or its sketch's parts."""
    if isinstance(value, torch.Tensor):
        return tensor_sha256(value)
    digest = hashlib.sha256()
    for part in sketching.parts(value).values():
        digests.update(digest, part)
    return digest.hexdigest()


def as_stored(name: str, value: torch.Tensor | Sketch) -> torch.Tensor | Sketch:
    """``value`` as a golden keeps it: a sketch when big (seeded by ``name``), else on the CPU."""
    if isinstance(value, torch.Tensor) and sketching.wants_sketch(value):
        return sketching.sketch(value, name)
    return value


def produced_by(device: str | torch.device = "cpu") -> dict[str, str | bool]:
    """Versions producing a golden and the machine it ran on: informational, never compared."""
    import torchparity

    return {"torchparity": torchparity.__version__, "torch": torch.__version__.split("+")[0],
            "python": platform.python_version(), **machine.describe(device)}


def machine_recorded(summary: Mapping[str, object]) -> bool:
    """Whether a golden's summary names the machine that made it (its CPU capability)."""
    return "cpu_capability" in (summary.get("produced_by") or {})


def format_json(value: object, indent: int = 0) -> str:
    """JSON for reviewers: small flat objects and lists of scalars on one line, the rest nested."""
    # each tensor's summary on one line: a diff shows exactly which changed
    if isinstance(value, Mapping) and value and not _is_flat(value):
        pad = " " * (indent + 1)
        items = [f"{pad}{json.dumps(str(k))}: {format_json(v, indent + 1)}"
                 for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {format_json(v)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(format_json(v, indent) for v in value) + "]"
    return json.dumps(value, allow_nan=False)


def _is_flat(mapping: Mapping) -> bool:
    scalars = all(not isinstance(v, Mapping) and not (
        isinstance(v, list | tuple) and any(isinstance(x, Mapping | list | tuple) for x in v))
        for v in mapping.values())
    return scalars and len(mapping) <= 8


# --- the store ------------------------------------------------------------------------------


class GoldenStore:
    """Golden tensor groups under ``root``: ``root/<case>/<output>.{safetensors,json}``."""

    # update_command recreates a golden, quoted in every error with {case} and {output} filled in
    def __init__(self, root: str | os.PathLike,
                 update_command: str = "torchparity golden update {case}") -> None:
        self.root = Path(root)
        self.update_command = update_command

    def paths(self, case: str, output: str) -> tuple[Path, Path]:
        """The ``.safetensors`` and ``.json`` paths of one golden; UsageError for an unsafe name."""
        _check_name(case, "case")
        _check_name(output, "output")
        folder = self.root / case
        return folder / f"{output}.safetensors", folder / f"{output}.json"

    def obtained_path(self, case: str, output: str) -> Path:
        """Where :meth:`write_obtained` puts a mismatching run's values, beside the golden."""
        return self.paths(case, output)[0].with_name(f"{output}{_OBTAINED}.safetensors")

    def exists(self, case: str, output: str) -> bool:
        """Whether both files of the golden exist."""
        return all(p.is_file() for p in self.paths(case, output))

    def cases(self) -> list[str]:
        """Names of the case folders under ``root``, sorted."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and _NAME.match(p.name))

    def outputs(self, case: str) -> list[str]:
        """Names of the goldens of ``case``, sorted, obtained files excluded."""
        folder = self.root / case
        if not folder.is_dir():
            return []
        return sorted(p.stem for p in folder.glob("*.json")
                      if not p.stem.endswith(_OBTAINED) and _NAME.match(p.stem))

    def require_root(self) -> None:
        """Check that the golden folder exists before any run (GoldenMissing names the command)."""
        if not self.root.is_dir():
            raise GoldenMissing(
                f"golden directory {self.root} does not exist; create it with "
                f"`{self.update_command.format(case='', output='').strip()}` or point "
                f"--golden-dir / {GOLDEN_DIR_ENV} at an existing one")

    def write(self, case: str, output: str, tensors: Mapping[str, torch.Tensor],
              meta: Mapping[str, Any] | None = None) -> list[Path]:
        """Atomically write one golden (``meta`` in its JSON summary); the paths written."""
        tensor_path, json_path = self.paths(case, output)
        # each file replaced in one rename: a reader sees the old or the new, never half
        stored = _storable(tensors)
        version = _version(stored)
        summary = {"schema_version": version, "case": case, "output": output,
                   **dict(meta or {}), "produced_by": produced_by(_device(tensors)),
                   "tensors": {name: tensor_summary(t) for name, t in stored.items()}}
        from safetensors.torch import save

        payload = _canonical(save(_flat(stored), metadata={"format": "pt",
                                                           "schema_version": str(version)}))
        with self.replacing(case) as update:
            update.write_file(tensor_path.name, payload)
            update.write_file(json_path.name, (format_json(summary) + "\n").encode())
        return [tensor_path, json_path]

    @contextlib.contextmanager
    def replacing(self, case: str) -> Iterator[FolderUpdate]:
        """Replace the goldens of ``case`` as a set: those written in the block land together.

        An exception (an interruption, the model raising, a full disk) leaves the old set, its
        message saying which set the folder holds; nested blocks share the outer one; SIGTERM
        acts as Ctrl-C.

        Raises:
            GoldenBusy: another process is updating the folder.
            GoldenWriteError: the set cannot be written (the old one is kept).
        """
        _check_name(case, "case")
        key = ((self.root / case).resolve(), threading.get_ident())
        if key in _updating:
            yield _updating[key]
            return
        update = FolderUpdate(self.root / case)
        with update.locked(), sigterm_interrupts():
            _updating[key] = update
            try:
                update.recover()
                yield update
                update.commit()
            except OSError as exc:
                update.abort()
                raise GoldenWriteError(self._write_failure(case, exc, update.switched)) from None
            except BaseException as exc:
                update.abort()
                exc.add_note(_held(case, update.switched))
                raise
            finally:
                del _updating[key]

    def _write_failure(self, case: str, exc: OSError, switched: bool) -> str:
        reason = exc.strerror or str(exc)
        if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):  # a full disk or quota
            command = self.update_command.format(case=case, output="")
            fix = f"free space there, then run `{command}` again"
        else:
            fix = (f"make it writable, or point --golden-dir / {GOLDEN_DIR_ENV} at a writable "
                   f"folder")
        return f"cannot write the goldens of {case} in {self.root} ({reason}): {fix}; " \
               f"{_held(case, switched)}"

    def update(self, case: str, output: str, tensors: Mapping[str, torch.Tensor | Sketch],
               meta: Mapping[str, Any]) -> str:
        """Write one golden unless it holds these values and metadata already; what happened.

        Unchanged files are left untouched, so a rerun elsewhere does not churn them. Returns
        ``created``, ``replaced`` (unreadable before), ``updated``, ``machine recorded`` (same
        values, made before goldens recorded their machine) or ``unchanged``.
        """
        status = self._update_status(case, output, tensors, meta)
        if status != "unchanged":
            self.write(case, output, tensors, meta)
        return status

    def _update_status(self, case: str, output: str,
                       tensors: Mapping[str, torch.Tensor | Sketch], meta: Mapping[str, Any]
                       ) -> str:
        if not any(p.exists() for p in self.paths(case, output)):
            return "created"
        try:
            old = self.read(case, output)
        except GoldenError:
            return "replaced"
        same_tensors = ({n: s["sha256"] for n, s in old.summary["tensors"].items()}
                        == {n: stored_sha256(as_stored(n, t)) for n, t in tensors.items()})
        header = {"schema_version", "case", "output", "produced_by", "tensors"}
        same_meta = {k: v for k, v in old.summary.items() if k not in header} == dict(meta)
        if not (same_tensors and same_meta):
            return "updated"
        # Goldens made before they recorded their machine are rewritten once, values as they
        # are, so that a check elsewhere can name the machine that made them.
        return "unchanged" if machine_recorded(old.summary) else "machine recorded"

    def write_obtained(self, case: str, output: str,
                       tensors: Mapping[str, torch.Tensor | Sketch]) -> Path:
        """Write what a mismatching run produced beside the golden, for inspection; the path."""
        from safetensors.torch import save

        path = self.obtained_path(case, output)
        with switch_lock(path.parent):
            _atomic_write(path, save(_flat(_storable(tensors)), metadata={"format": "pt"}))
        return path

    def read(self, case: str, output: str) -> Golden:
        """Read and validate one golden: its tensors on the CPU and its summary.

        Raises:
            GoldenMissing: the files are not there.
            GoldenCorrupt: unreadable, truncated, or a JSON that no longer matches its tensors.
            GoldenSchemaError: a newer format. Each message names the file and the fix.
        """
        tensor_path, json_path = self.paths(case, output)
        fix = self._fix(case, output, tensor_path)
        with switch_lock(tensor_path.parent):
            return self._read(case, output, tensor_path, json_path, fix)

    def _read(self, case: str, output: str, tensor_path: Path, json_path: Path, fix: str
              ) -> Golden:
        with contextlib.suppress(OSError):  # a read-only folder is read as it is
            settle(tensor_path.parent)
        if not tensor_path.exists() and not json_path.exists():
            command = self.update_command.format(case=case, output=output)
            raise GoldenMissing(f"no golden {output!r} for case {case!r} in {self.root}; "
                                f"create it with `{command}`")
        for present, absent in ((tensor_path, json_path), (json_path, tensor_path)):
            if not absent.exists():
                raise GoldenCorrupt(f"{present} has no {absent.name} beside it; {fix}")
        summary = _read_summary(json_path, fix)
        tensors = _unflat(_read_tensors(tensor_path, fix), summary["tensors"])
        _check_consistent(json_path, summary, tensors, fix)
        # safetensors gives the tensors in no set order: the JSON's is the order they were
        # written in, so that a comparison meets them (and picks among ties) the same each run.
        listed = {name: tensors[name] for name in summary["tensors"] if name in tensors}
        return Golden(case, output, listed | tensors, summary, tensor_path)

    def check_set(self, case: str, goldens: Mapping[str, Golden]) -> None:
        """Refuse goldens of ``case`` that two updates made: their recorded set metadata must agree.

        Raises:
            GoldenMixed: they disagree, with the command that rewrites the set.
        """
        (first, golden), *others = goldens.items()
        for output, other in others:
            shared = (set(golden.summary) & set(other.summary)) - _OWN_KEYS
            differ = sorted(k for k in shared if golden.summary[k] != other.summary[k])
            if differ:
                command = self.update_command.format(case=case, output="").strip()
                raise GoldenMixed(
                    f"the goldens of {case} in {self.root} are a mixed set: {first}.json and "
                    f"{output}.json record different {', '.join(differ)} (an interrupted "
                    f"update of an older torchparity left them); rerun `{command}`")

    def _fix(self, case: str, output: str, path: Path) -> str:
        command = self.update_command.format(case=case, output=output)
        return (f"restore it from version control (git checkout -- {path.parent}) "
                f"or regenerate it with `{command}`")


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name) or name.endswith(_OBTAINED):
        raise UsageError(f"golden {what} name {name!r} is invalid: use letters, digits and "
                         f"'_.+-', starting with a letter or digit")


def _device(tensors: Mapping[str, torch.Tensor | Sketch]) -> torch.device:
    """The device a golden's tensors were computed on: CUDA when any of them is there."""
    devices = [t.device for t in tensors.values() if isinstance(t, torch.Tensor)]
    return next((d for d in devices if d.type == "cuda"), torch.device("cpu"))


def _storable(tensors: Mapping[str, torch.Tensor | Sketch]) -> dict[str, torch.Tensor | Sketch]:
    if not isinstance(tensors, Mapping) or not tensors:
        raise UsageError("a golden needs a non-empty mapping of names to tensors")
    stored: dict[str, torch.Tensor | Sketch] = {}
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor | Sketch):
            raise UsageError(f"golden entry {name!r} must map a string to a torch.Tensor, "
                             f"got {type(tensor).__name__}")
        if SEPARATOR in name:
            raise UsageError(f"golden entry {name!r}: names may not contain {SEPARATOR!r}")
        value = as_stored(name, tensor)
        stored[name] = value if isinstance(value, Sketch) else (
            value.detach().to("cpu").contiguous())
    return stored


def _version(stored: Mapping[str, torch.Tensor | Sketch]) -> int:
    sketched = any(isinstance(v, Sketch) for v in stored.values())
    return SCHEMA_VERSION if sketched else EXACT_SCHEMA_VERSION


def _flat(stored: Mapping[str, torch.Tensor | Sketch]) -> dict[str, torch.Tensor]:
    """The tensors of the ``.safetensors`` file: exact ones by name, a sketch's by part."""
    flat = {}
    for name, value in stored.items():
        if isinstance(value, Sketch):
            flat.update({f"{name}{SEPARATOR}{part}": tensor.contiguous()
                         for part, tensor in sketching.parts(value).items()})
        else:
            flat[name] = value
    return flat


def _unflat(flat: dict[str, torch.Tensor], listed: Mapping[str, Any]
            ) -> dict[str, torch.Tensor | Sketch]:
    """The golden's tensors and sketches from the file's tensors and the JSON's lines."""
    # parts a sketch lacks are left for _check_consistent to report
    tensors: dict[str, torch.Tensor | Sketch] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in flat.items():
        name, separator, part = key.partition(SEPARATOR)
        if separator and part in sketching.PARTS:
            parts.setdefault(name, {})[part] = tensor
        else:
            tensors[key] = tensor
    for name, found in parts.items():
        line = listed.get(name)
        try:
            method, size, seed = line["sketch"]
            if method != sketching.METHOD:
                raise GoldenSchemaError(f"{name} was sketched by {method!r}, this torchparity "
                                        f"sketches by {sketching.METHOD!r}; regenerate the "
                                        "golden or use the torchparity that made it")
            tensors[name] = sketching.from_parts(
                {"shape": line["shape"], "dtype": line["dtype"], "method": method,
                 "size": size, "seed": seed}, found)
        except (TypeError, ValueError, KeyError):
            # Left as stored: _check_consistent names what does not match.
            tensors.update({f"{name}{SEPARATOR}{part}": t for part, t in found.items()})
    return tensors


def _canonical(payload: bytes) -> bytes:
    """A safetensors file with its header's keys sorted: the same golden must be the same bytes."""
    size = int.from_bytes(payload[:8], "little")
    header = json.dumps(json.loads(payload[8:8 + size]), sort_keys=True, separators=(",", ":"))
    header += " " * (-len(header) % 8)  # the data stays aligned to 8 bytes
    return len(header).to_bytes(8, "little") + header.encode() + payload[8 + size:]


def _held(case: str, switched: bool) -> str:
    """What the folder of ``case`` holds after an update that did not finish."""
    return f"the goldens of {case} are the {'new set' if switched else 'old set, unchanged'}"


def _atomic_write(path: Path, data: bytes) -> None:
    """Replace one file in one rename, its mode following the umask."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _read_summary(path: Path, fix: str) -> dict[str, Any]:
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GoldenCorrupt(f"{path} is not valid JSON ({exc}); {fix}") from None
    if not isinstance(summary, dict):
        raise GoldenCorrupt(f"{path} does not hold a JSON object; {fix}")
    version = summary.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise GoldenCorrupt(f"{path} has no valid schema_version; {fix}")
    if version > SCHEMA_VERSION:
        raise GoldenSchemaError(
            f"{path} has schema version {version}, newer than the {SCHEMA_VERSION} this "
            f"torchparity reads; upgrade torchparity (pip install -U torchparity)")
    if not isinstance(summary.get("tensors"), dict):
        raise GoldenCorrupt(f"{path} has no 'tensors' section; {fix}")
    return summary


def _read_tensors(path: Path, fix: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    try:
        return load(path.read_bytes())
    except Exception as exc:  # safetensors raises several types for damaged files
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise GoldenCorrupt(f"{path} is truncated or corrupt ({detail}); {fix}") from None


def _check_consistent(path: Path, summary: dict[str, Any],
                      tensors: dict[str, torch.Tensor | Sketch], fix: str) -> None:
    """The JSON's tensor lines must describe exactly the stored tensors."""
    listed = summary["tensors"]
    problem = None
    if set(listed) != set(tensors):
        extra = sorted(set(listed) - set(tensors))
        missing = sorted(set(tensors) - set(listed))
        problem = (f"lists {', '.join(extra)} that the tensors lack" if extra
                   else f"does not list {', '.join(missing)}")
    else:
        for name, tensor in tensors.items():
            problem = _summary_mismatch(name, listed[name], tensor_summary(tensor))
            if problem:
                break
    if problem and ": sha256 " in problem:
        # Same names, shapes and dtypes, other bytes: the tensors' file changed after it was
        # written (a disk or a copy damaged it), not the readable JSON.
        raise GoldenCorrupt(f"{path.with_suffix('.safetensors')} is damaged: its bytes no "
                            f"longer match the checksum {path.name} records ({problem}). "
                            f"{fix[0].upper()}{fix[1:]}")
    if problem:
        raise GoldenCorrupt(f"{path} no longer matches its tensors ({problem}); was it edited "
                            f"by hand? {fix[0].upper()}{fix[1:]}")


def _summary_mismatch(name: str, listed: Any, actual: dict[str, Any]) -> str | None:
    if not isinstance(listed, dict):
        return f"{name}: not an object"
    for key in ("shape", "dtype", "sha256", "sketch"):
        if listed.get(key) != actual.get(key):
            return f"{name}: {key} {listed.get(key)!r} in the JSON, {actual[key]!r} stored"
    scale = actual["absmax"] if isinstance(actual["absmax"], float) else 0.0
    for key in ("mean", "std", "absmax"):
        if not _stat_close(listed.get(key), actual[key], scale):
            return f"{name}: {key} {listed.get(key)!r} in the JSON, {actual[key]!r} stored"
    return None


def _stat_close(listed: Any, actual: Any, scale: float) -> bool:
    if isinstance(actual, float) and isinstance(listed, int | float) and not isinstance(
            listed, bool):
        return math.isclose(listed, actual, rel_tol=_STAT_TOLERANCE,
                            abs_tol=_STAT_TOLERANCE * scale)
    return listed == actual


# --- where the goldens live -----------------------------------------------------------------


def default_golden_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The golden folder, found the way every command finds it (it need not exist yet).

    ``explicit`` (``--golden-dir``), else ``$TORCHPARITY_GOLDEN_DIR``, else ``golden/`` of the
    torchparity source tree holding the working directory, else of the one torchparity was
    imported from (editable), else the goldens shipped in the package (``torchparity/goldens``).

    Raises:
        UsageError: none applies.
    """
    if explicit:
        return Path(explicit)
    if os.environ.get(GOLDEN_DIR_ENV):
        return Path(os.environ[GOLDEN_DIR_ENV])
    cwd = Path.cwd().resolve()
    package = Path(__file__).resolve().parents[1]  # .../torchparity/golden/store.py
    for folder in (cwd, *cwd.parents, package.parents[1]):  # src/torchparity -> the tree
        if _is_source_tree(folder):
            return folder / "golden"
    if (package / SHIPPED_GOLDENS).is_dir():
        return package / SHIPPED_GOLDENS
    raise UsageError(f"cannot tell where the goldens are: run from the torchparity source tree, "
                     f"pass --golden-dir DIR or set {GOLDEN_DIR_ENV}")


def _is_source_tree(folder: Path) -> bool:
    pyproject = folder / "pyproject.toml"
    try:
        text = pyproject.read_text(encoding="utf-8")
    except OSError:
        return False
    return re.search(r'^name\s*=\s*"torchparity"\s*$', text, re.MULTILINE) is not None
