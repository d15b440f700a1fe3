"""Start ``torchrun`` on this machine and never leave anything behind.

- Rendezvous is c10d on ``127.0.0.1:0``: the OS picks a live port, so parallel runs cannot
  race for one.
- torchrun runs in a session of its own: on a timeout or Ctrl-C its group gets SIGTERM, then
  SIGKILL; every worker dies with torchrun (:func:`die_with_parent`).
- A worker that raises writes ``rank<N>.error`` (:func:`record_failure`) and torchrun stops
  the others; the error names the first failed rank (a killed one from torchrun's report).
- A worker that finds ranks silent (``.heartbeat``) names them (:func:`record_silence`).
- A command's own exit status (``check``: 1) is recorded (:func:`record_outcome`) and
  :func:`launch` returns the worst. Workers' stdout lines go to ``log`` as they arrive."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from torchparity.errors import TorchParityError

#: Seconds between SIGTERM and SIGKILL when a run is stopped.
GRACE_SECONDS = 10.0
#: Seconds the other ranks have to end by themselves once one recorded an error.
FAILED_GRACE_SECONDS = 3.0
_POLL_SECONDS = 0.5
_ERROR_DIR = "TORCHPARITY_ERROR_DIR"
_SIGKILL = 9
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RankOutcome:
    """The worst exit status the ranks recorded (:func:`record_outcome`) and its one-line
    message (None: no rank had one)."""

    status: int = 0
    message: str | None = None


def launch(module: str, args: list[str], *, nproc: int, timeout: float,
           log: Callable[[str], None] | None = None) -> RankOutcome:
    """Run ``python -m module *args`` as ``nproc`` ranks under torchrun, leaving nothing behind.

    Args:
        module: the module each rank runs.
        args: its command line.
        nproc: the ranks.
        timeout: seconds the whole run may take.
        log: called with each line the workers print, as it arrives.

    Returns:
        The worst exit status the ranks recorded, or 0.

    Raises:
        TorchParityError: a rank failed, naming it and its message, or the run timed out
            (everything started is stopped first).
    """
    with tempfile.TemporaryDirectory(prefix="torchparity-run-") as tmp:
        errors = Path(tmp)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", uuid.uuid4().hex,
               "--max-restarts", "0", "-m", module, *args]
        stderr_path = errors / "torchrun.stderr"
        with open(stderr_path, "w") as stderr:
            proc = subprocess.Popen(cmd, env=_worker_env(errors), stdout=subprocess.PIPE,
                                    stderr=stderr, text=True, start_new_session=True)
            reader = threading.Thread(target=_forward, args=(proc.stdout, log), daemon=True)
            reader.start()
            try:
                code = _wait(proc, timeout, errors)
            except subprocess.TimeoutExpired:
                stop(proc)
                raise TorchParityError(f"torchrun did not finish within {timeout:.0f}s "
                                       f"({_first_failure(errors) or 'no rank reported an error'}"
                                       "); every process was stopped") from None
            except BaseException:  # Ctrl-C included: nothing may outlive the caller
                stop(proc)
                raise
            finally:
                reader.join(timeout=5)
        first = _first_failed(errors)
        if first is not None and first.suffix == ".silent":
            raise TorchParityError(f"{first.read_text()}; every rank was stopped")
        outcome = _recorded_outcome(errors)
        died = _died(stderr_path.read_text(), errors) if code != 0 else None
        if code != 0 and (died or outcome is None or outcome.status == 0):
            # a rank that died first is the cause; the others' errors follow from it
            failure = died or _first_failure(errors) or _tail(stderr_path.read_text())
            raise TorchParityError(f"torchrun failed with exit status {code}: {failure}")
        return outcome or RankOutcome()


def stop(proc: subprocess.Popen, grace: float = GRACE_SECONDS) -> None:
    """End ``proc``'s process group: SIGTERM, then SIGKILL after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)
            return


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (torchrun) dies; a no-op elsewhere."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, _SIGKILL)


def record_failure(rank: int, exc: BaseException) -> None:
    """Leave ``exc``'s one-line message where :func:`launch` finds it (inside a worker)."""
    folder = os.environ.get(_ERROR_DIR)
    if folder:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
        Path(folder, f"rank{rank}.error").write_text(text)


def record_outcome(status: int, message: str | None = None) -> None:
    """Leave this rank's exit status and message where :func:`launch` finds them (a no-op
    outside a run it started)."""
    folder, rank = os.environ.get(_ERROR_DIR), os.environ.get("RANK")
    if folder and rank is not None:
        Path(folder, f"rank{rank}.outcome").write_text(f"{status}\n{message or ''}")


def record_silence(rank: int, said: str) -> None:
    """Leave where :func:`launch` finds it that this rank ends the run because ranks fell silent
    (``said``: which, how long, where); a no-op outside a run it started."""
    folder = os.environ.get(_ERROR_DIR)
    if folder:  # whole when the launcher sees it: it stops every rank at once
        part = Path(folder, f"rank{rank}.silent.part")
        part.write_text(said)
        part.replace(part.with_suffix(""))


def _wait(proc: subprocess.Popen, timeout: float, errors: Path) -> int:
    """torchrun's exit status once it ends, or :data:`FAILED_GRACE_SECONDS` after a rank recorded
    an error (a stopped or deaf rank must not hold the run); ``TimeoutExpired`` past
    ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.wait(timeout=max(0.0, min(_POLL_SECONDS, deadline - time.monotonic())))
        if time.monotonic() >= deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout)
        failed = _first_failed(errors)
        if failed is not None and (failed.suffix == ".silent" or
                                   time.time() - failed.stat().st_mtime > FAILED_GRACE_SECONDS):
            stop(proc, grace=0.0)  # the workers die with torchrun (die_with_parent)
            return proc.wait()


def _first_failed(errors: Path) -> Path | None:
    """The earliest file in which a rank recorded an error (an exception, an exit status
    above 1, or other ranks' silence), or None. A failed check (1) is every rank's verdict:
    rank 0 may still be writing its reports when the others have ended."""
    failures = [*errors.glob("rank*.error"), *errors.glob("rank*.silent")] + [
        path for path in errors.glob("rank*.outcome") if _outcome(path).status > 1]
    return min(failures, key=lambda path: path.stat().st_mtime_ns, default=None)


def _outcome(path: Path) -> RankOutcome:
    status, _, message = path.read_text().partition("\n")
    return RankOutcome(int(status or 0), message.strip() or None)


def _recorded_outcome(errors: Path) -> RankOutcome | None:
    """The outcome of the rank that failed first (the others' failures follow from it: a
    collective it broke), else of the ranks that all succeeded (None: none recorded one)."""
    outcomes = {path: _outcome(path) for path in errors.glob("rank*.outcome")}
    failed = [path for path, outcome in outcomes.items() if outcome.status != 0]
    if failed:
        return outcomes[min(failed, key=lambda path: path.stat().st_mtime_ns)]
    return next(iter(outcomes.values()), None)


def _died(stderr: str, errors: Path) -> str | None:
    """``rank N died (...)`` when the root cause torchrun reports is a worker that ended
    without a word (killed: it recorded no outcome nor error), else None."""
    cause = stderr.rpartition("Root Cause")[2]
    rank = re.search(r"^\s*rank\s*:\s*(\d+)", cause, re.M)
    if rank and any((errors / f"rank{rank.group(1)}.{kind}").exists()
                    for kind in ("outcome", "error")):
        return None
    how = re.search(r"^\s*traceback\s*:\s*(Signal [^\n]*)", cause, re.M) or re.search(
        r"^\s*exitcode\s*:\s*(-?\d+)", cause, re.M)
    if not (rank and how):
        return None
    what = how.group(1).strip()
    what = what if what.startswith("Signal") else f"exit code {what}"
    return f"rank {rank.group(1)} died ({what}) without reporting an error"


def _first_failure(errors: Path) -> str | None:
    """``rank N: message`` of the earliest error a rank recorded, or None."""
    reports = sorted(errors.glob("rank*.error"), key=lambda p: p.stat().st_mtime_ns)
    if not reports:
        return None
    first = reports[0]
    return f"rank {first.stem.removeprefix('rank')}: {first.read_text()}"


def _forward(stream: IO[str], log: Callable[[str], None] | None) -> None:
    for line in stream:
        if log is not None:
            log(line.rstrip("\n"))


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), None)


def _worker_env(errors: Path) -> dict[str, str]:
    """The workers' environment: this package importable, loopback only, one thread each, big
    tensors' memory returned to the system when freed."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    # Every tensor of 64 KiB or more gets pages of its own, returned when it is freed: glibc's
    # threshold otherwise rises with the first big tensor freed, and the whole model a rank
    # frees when its plan shards it stays in the rank's heap.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 16))
    env["PYTHONUNBUFFERED"] = "1"
    env[_ERROR_DIR] = str(errors)
    loopback = _loopback_interface()
    if loopback:
        env["GLOO_SOCKET_IFNAME"] = loopback
    return env


def _tail(text: str, lines: int = 6) -> str:
    return " | ".join((text or "no output").strip().splitlines()[-lines:])
