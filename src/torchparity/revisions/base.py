"""The base side: ``golden update``, ``record`` or ``train --update-golden`` run on a revision.

The revision is checked out in a worktree of its own and the command runs there in a process of
its own, the worktree's ``src/`` and the entries' folders (mapped into it) first on
``PYTHONPATH``, so the base's code is what runs; its result is cached.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from torchparity.golden.store import SCHEMA_VERSION
from torchparity.revisions import cache
from torchparity.revisions.worktree import Repository, RevisionError
from torchparity.text import wrapped

#: Distributions whose versions change the numbers a base side makes.
NUMERIC_DISTRIBUTIONS = ("torch", "transformers", "numpy", "safetensors", "torchparity")
_VERSIONS = ("import importlib.metadata as m, json\n"
             "def version(name):\n"
             "    try:\n"
             "        return m.version(name)\n"
             "    except m.PackageNotFoundError:\n"
             "        return None\n"
             f"print(json.dumps({{n: version(n) for n in {NUMERIC_DISTRIBUTIONS!r}}}))\n")


@dataclass
class BaseSide:
    """A ``revision`` of the repository around ``cwd``, run by ``python`` (default: this one)."""

    revision: str
    python: str | None = None
    use_cache: bool = True  # False recomputes a kept result (and keeps the new one)
    cwd: Path = field(default_factory=Path.cwd)

    def __post_init__(self) -> None:
        self.repository = Repository.around(self.cwd, "--base")
        self.commit = self.repository.resolve(self.revision, "--base")
        found = shutil.which(self.python or sys.executable)
        if found is None:
            raise RevisionError(f"--base-python {self.python}: no such interpreter")
        self.python = os.path.abspath(found)  # not resolved: a venv's python is a link

    @property
    def name(self) -> str:
        """``origin/main (1a2b3c4d5e6f)``: the revision and its commit."""
        return f"{self.revision} ({self.commit[:12]})"

    @property
    def label(self) -> str:
        return f"--base {self.name}"

    def run(self, entries: list[str], command: list[str], what: str,
            files: tuple[str, ...] = (), module: str = "torchparity") -> Path:
        """The cache folder holding what ``torchparity COMMAND`` wrote into ``{out}`` at the base.

        Every ``{out}`` becomes a folder of the cache entry, ``{entry:I}`` entry ``I`` as the
        worktree names it; ``files`` (inputs the command reads) are hashed into the key; ``what``
        names the result in progress lines; ``module`` is what ``python -m`` runs.
        """
        relative = [self._relative(entry) for entry in entries]
        program = [] if module == "torchparity" else [module]  # the keys made before it stay
        parts = {"commit": self.commit, "entries": [f"{path}:{attr}" for path, attr in relative],
                 "outside": self._outside_sources(entries),
                 "command": [*program, *command], "files": {f: _digest(Path(f)) for f in files},
                 "versions": self._versions(), "golden_schema": SCHEMA_VERSION,
                 "cpu_capability": _cpu_capability(), "python": self.python,
                 "cwd": self.repository.prefix.as_posix()}
        key = cache.cache_key(parts)
        kept = cache.lookup(key) if self.use_cache else None
        if kept is not None:
            _progress(f"base {self.name}: {what} from the cache, {kept} (--no-base-cache "
                      "recomputes the base side)")
            return kept
        started = time.perf_counter()
        staged = cache.staging()
        try:
            with self.repository.worktree(self.commit) as tree:
                _progress(f"base {self.name}: checked out in {tree}")
                mapped = [self._mapped(tree, path, attr) for path, attr in relative]
                argv = [_filled(arg, mapped, staged) for arg in command]
                shown = [_filled(arg, entries, Path("<cache>")) for arg in command]
                _progress(f"base {self.name}: "
                          f"{'python -m ' * bool(program)}{module} {' '.join(shown)}")
                self._call(tree, argv, entries, module)
            folder = cache.keep(key, parts, staged)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        _progress(f"base {self.name}: {what} made in {time.perf_counter() - started:.1f} s, "
                  f"kept in {folder}")
        return folder

    # -- where the entries are at the base --------------------------------------------------

    def _relative(self, entry: str) -> tuple[str, str]:
        """``(location, attribute)``, a file's location relative to the repository's top."""
        location, _, attribute = entry.rpartition(":")
        if not location.endswith(".py"):
            return location, attribute
        path = (self.cwd / location).resolve()
        try:
            relative = path.relative_to(self.repository.top.resolve()).as_posix()
        except ValueError:
            raise RevisionError(f"{self.label}: the factory file {location} lies outside the "
                                f"repository {self.repository.top}") from None
        if not self.repository.has_file(self.commit, relative):
            raise RevisionError(f"{self.label}: the factory file {location} does not exist "
                                "at the base (is it new since then?)")
        return relative, attribute

    @staticmethod
    def _mapped(tree: Path, location: str, attribute: str) -> str:
        return f"{tree / location}:{attribute}" if location.endswith(".py") else \
            f"{location}:{attribute}"

    def _outside_sources(self, entries: list[str]) -> dict[str, str]:
        """Digests of files entries import from outside the repository (the commit fixes none)."""
        digests = {}
        for entry in entries:
            origin = _origin(entry.rpartition(":")[0], self.cwd)
            if origin is not None and not origin.resolve().is_relative_to(
                    self.repository.top.resolve()):
                digests[entry] = _digest(origin)
        return digests

    def _search_path(self, tree: Path, entries: list[str]) -> list[str]:
        """The worktree's ``src/``, the entries' packages and ``PYTHONPATH``, mapped into it."""
        folders = [*(_package_root(entry, self.cwd) for entry in entries),
                   *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
        mapped = [str(tree / "src")] if (tree / "src").is_dir() else []
        for folder in filter(None, folders):
            try:
                inside = Path(folder).resolve().relative_to(self.repository.top.resolve())
            except ValueError:
                mapped.append(str(folder))
            else:
                mapped.append(str(tree / inside))
        return list(dict.fromkeys(mapped))

    # -- the base's process -----------------------------------------------------------------

    def _call(self, tree: Path, argv: list[str], entries: list[str], module: str) -> None:
        cwd = tree / self.repository.prefix
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(self._search_path(tree, entries))}
        process = subprocess.Popen([self.python, "-m", module, *argv],
                                   cwd=cwd if cwd.is_dir() else tree, env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True)
        try:
            _, err = process.communicate()
        except BaseException:  # Ctrl-C or SIGTERM: the base process goes first
            process.kill()
            process.wait()
            raise
        if process.returncode != 0:
            # Paths in the worktree, which is about to go, read as the repository's own.
            reason = _failure(process.returncode, err).replace(f"{tree}{os.sep}", "")
            raise RevisionError(f"{self.label}: the base side failed: "
                                f"{reason.removesuffix('; --debug shows the traceback')}")

    def _versions(self) -> dict[str, object]:
        done = subprocess.run([self.python, "-c", _VERSIONS], capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            raise RevisionError(f"--base-python {self.python}: it cannot run "
                                f"({_failure(done.returncode, done.stderr)})")
        return json.loads(done.stdout)


@contextlib.contextmanager
def base_goldens(side: BaseSide, entries: list[str]) -> Iterator[Path]:
    """A temporary copy of the base's float64 goldens of ``entries`` (checks write beside them)."""
    command = ["golden", "update", *(arg for i in range(len(entries))
                                     for arg in ("--model", f"{{entry:{i}}}")),
               "--golden-dir", "{out}/goldens"]
    kept = side.run(entries, command, "goldens")
    with tempfile.TemporaryDirectory(prefix="torchparity-base-goldens-") as folder:
        goldens = Path(folder) / "goldens"
        shutil.copytree(kept / "goldens", goldens)
        yield goldens


def base_trace(side: BaseSide, entry: str, options: list[str],
               files: tuple[str, ...] = ()) -> Path:
    """The cached trace ``torchparity record ENTRY OPTIONS`` writes at the base."""
    # files: input files the options name, with absolute paths
    kept = side.run([entry], ["record", "{entry:0}", "-o", "{out}/trace", *options], "trace",
                    files)
    return kept / "trace"


def base_trajectories(side: BaseSide, case: str) -> Path:
    """The cached golden folder of zoo case ``case``'s trajectory at the base."""
    if not side.repository.has_file(side.commit, "src/torchparity/__init__.py"):
        raise RevisionError(f"{side.label}: train --base compares torchparity's own training "
                            "code across revisions, and the base has no src/torchparity")
    # the zoo and the trainer are torchparity's own: the base must be torchparity's source
    kept = side.run([], ["train", "--case", case, "--update-golden", "--golden-dir",
                         "{out}/goldens"], "golden trajectory")
    return kept / "goldens"


def base_model_trajectories(side: BaseSide, entry: str, steps: int, dtype: str) -> Path:
    """The cached golden folder of the model's float64 trajectory and band at the base."""
    # the base's model and recipe, trained by this torchparity when the base is not torchparity's
    # source
    kept = side.run([entry], ["train", "--model", "{entry:0}", "--steps", str(steps),
                              "--dtype", dtype, "--update-golden", "--golden-dir",
                              "{out}/goldens"], "golden trajectory and noise band")
    return kept / "goldens"


def base_training_step(side: BaseSide, entry: str, step: int, execution: list[str],
                       ops: str | None = None) -> Path:
    """The cache folder of the base's ``entry`` trained in float64 to ``step``, that step recorded.

    Args:
        side: the base revision.
        entry: the factory, as the working tree names it.
        step: the step recorded.
        execution: the judged run's backend, dtype and device.
        ops: A's ops of these modules (joined by commas) kept, nothing else: a second, small trace.
    """
    more = [] if ops is None else ["--ops", ops, "--ops-only"]
    worker = "torchparity.train.step_diagnosis.base_side"
    kept = side.run([entry], ["{entry:0}", str(step), *execution, "{out}/step", *more],
                    "training step", module=worker)
    return kept / "step"


def _filled(arg: str, entries: list[str], out: Path) -> str:
    for i, entry in enumerate(entries):
        arg = arg.replace(f"{{entry:{i}}}", entry)
    return arg.replace("{out}", str(out))


def _package_root(entry: str, cwd: Path) -> str | None:
    """The folder an entry ``pkg.mod:name`` imports ``pkg`` from (None: a file, or not found)."""
    top = entry.rpartition(":")[0].partition(".")[0]
    origin = _origin(top, cwd)
    if origin is None:
        return None
    return str(origin.parent.parent if origin.name == "__init__.py" else origin.parent)


def _origin(module: str, cwd: Path) -> Path | None:
    """The file ``module`` imports from with ``cwd`` first on the path (None: not found)."""
    if module.endswith(".py"):
        return None
    sys.path.insert(0, str(cwd))
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.path.remove(str(cwd))
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        return None
    return Path(spec.origin)


def _failure(status: int, stderr: str) -> str:
    """Why the base's process ended with ``status``: its own one-line error where it gave one."""
    if status < 0:
        return f"its process was killed by {signal.Signals(-status).name}"
    if status == 130:
        return "its process was interrupted"
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("torchparity ")]
    return (errors or lines or [f"its process exited with status {status}"])[-1]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cpu_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def _progress(line: str) -> None:
    """One step on stderr, read in CI logs: wrapped to 80 columns, paths whole."""
    print(wrapped(line), file=sys.stderr, flush=True)
