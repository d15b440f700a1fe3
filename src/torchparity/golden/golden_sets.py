"""A case's golden folder replaced as a whole: an interrupted update leaves the old set or the new.

An update writes into a staging folder beside ``<root>/<case>`` (links to the files it leaves
alone) and switches it in under the switch lock readers take:

- ``.<case>.partial-<pid>``: a set being written; the next update of the case removes it;
- ``.<case>.new-<inode>``: a complete set (the commit point), named by its folder's inode;
- the switch: one ``renameat2(RENAME_EXCHANGE)`` with ``<case>`` on Linux, after which the name
  holds the old set and is removed; elsewhere two renames, via ``.<case>.old-<inode>``.

The next reader or update finishes a committed switch and removes the rest; SIGINT and SIGTERM
wait while the switch runs; a second update at once is refused by the update lock.

``TORCHPARITY_FAULT_AT=K[:kind]`` stops a process at its K-th step of disk work (the fault
tests): ``kill`` (SIGKILL, the default), ``interrupt``, ``term`` or an errno's name (``ENOSPC``).
A file's step falls half-way through writing it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from filelock import FileLock, Timeout

from torchparity.errors import TorchParityError

FAULT_ENV = "TORCHPARITY_FAULT_AT"
# Switch locks shared by all golden folders (by a hash of the path): two folders on one lock
# merely wait for each other, and the lock files, which outlive their use, stay few.
_SWITCH_LOCKS = 64
_PARTIAL, _NEW, _OLD = ".partial-", ".new-", ".old-"
_locks: dict[Path, FileLock] = {}
_turns: dict[Path, threading.RLock] = {}  # the threads of this process, by update lock
_guard = threading.Lock()
_steps = 0


class GoldenBusy(TorchParityError):
    """Another process is updating the same golden folder."""


def _lock_folder() -> Path:
    """The lock files' folder: per user, in the temporary folder (not a repository or package)."""
    user = f"-{os.getuid()}" if hasattr(os, "getuid") else ""
    folder = Path(tempfile.gettempdir()) / f"torchparity-locks{user}"
    folder.mkdir(exist_ok=True)
    return folder


def _lock(path: Path, timeout: float = -1) -> FileLock:
    """One lock object per file in this process, so that a thread holding it may take it again."""
    if path not in _locks:
        _locks[path] = FileLock(path, timeout=timeout)
    return _locks[path]


def switch_lock(folder: Path) -> FileLock:
    """The lock under which ``folder``'s set is switched and read."""
    digest = hashlib.sha256(str(folder.resolve()).encode()).digest()
    return _lock(_lock_folder() / f"{digest[0] % _SWITCH_LOCKS}.lock")


def fault_point() -> None:
    """Count one step of disk work; stop the process at the step ``TORCHPARITY_FAULT_AT`` names."""
    global _steps
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    _steps += 1
    at, _, kind = spec.partition(":")
    if _steps != int(at):
        return
    if kind.startswith("E"):  # an errno's name: ENOSPC, EROFS...
        code = getattr(errno, kind)
        raise OSError(code, os.strerror(code))
    os.kill(os.getpid(), {"interrupt": signal.SIGINT, "term": signal.SIGTERM}.get(
        kind, signal.SIGKILL))


class FolderUpdate:
    """The new set of a golden folder ``<root>/<case>``, written beside it, then committed."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.staging: Path | None = None
        self.switched = False
        digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
        self._update_lock = _lock_folder() / f"update-{digest}.lock"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the folder's update lock, refusing in one line while another process holds it."""
        with _guard:
            turn = _turns.setdefault(self._update_lock, threading.RLock())
        with turn:
            lock = _lock(self._update_lock, timeout=0)
            owner = self._update_lock.with_suffix(".owner")
            try:
                lock.acquire()
            except Timeout:
                try:
                    holder = owner.read_text(encoding="utf-8").strip() or "another process"
                except OSError:
                    holder = "another process"
                raise GoldenBusy(f"the goldens in {self.folder} are being updated by {holder} "
                                 f"(lock {self._update_lock}); wait for it to end, then rerun"
                                 ) from None
            try:
                if lock.lock_counter == 1:
                    owner.write_text(f"process {os.getpid()} ({' '.join(sys.argv)})",
                                     encoding="utf-8")
                yield
            finally:
                lock.release()

    def recover(self) -> None:
        """Finish a killed update's committed switch, remove half-written sets (lock held)."""
        with switch_lock(self.folder):
            settle(self.folder)
            for leftover in _siblings(self.folder, _PARTIAL):
                shutil.rmtree(leftover, ignore_errors=True)

    def path(self, name: str) -> Path:
        """Where the new set's file ``name`` goes: the staging folder, made with links first."""
        if self.staging is None:
            root = self.folder.parent
            root.mkdir(parents=True, exist_ok=True)
            staging = root / f".{self.folder.name}{_PARTIAL}{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            self.staging = staging
            if self.folder.is_dir():
                shutil.copytree(self.folder, staging, copy_function=_link_or_copy)
            else:
                staging.mkdir()
            fault_point()
        return self.staging / name

    def write_file(self, name: str, data: bytes) -> None:
        """Write ``data`` as the new set's file ``name``, durably, with the umask's mode."""
        path = self.path(name)
        path.unlink(missing_ok=True)  # a link to the live file: never written through
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as handle:
            half = len(data) // 2
            handle.write(data[:half])
            handle.flush()
            fault_point()
            handle.write(data[half:])
            handle.flush()
            os.fsync(handle.fileno())

    def commit(self) -> None:
        """Switch the new set in (nothing if no file was written); SIGINT and SIGTERM wait."""
        if self.staging is None:
            return
        _fsync(self.staging)
        with _signals_deferred(), switch_lock(self.folder):
            fault_point()
            new = self.staging.with_name(
                f".{self.folder.name}{_NEW}{os.stat(self.staging).st_ino}")
            os.rename(self.staging, new)
            self.staging = None
            _fsync(new.parent)
            try:
                fault_point()
                _switch(new, self.folder)
            except BaseException:
                shutil.rmtree(new, ignore_errors=True)
                raise
            self.switched = True
            _fsync(new.parent)
            fault_point()
            settle(self.folder)

    def abort(self) -> None:
        """Remove the staging folder of a set that was not committed."""
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None


def settle(folder: Path) -> None:
    """Finish what a killed switch of ``folder`` left (switch lock held): new in, old out."""
    for new in _siblings(folder, _NEW):
        named = int(new.name.rpartition("-")[2])
        if folder.is_dir() and os.stat(folder).st_ino == named:
            shutil.rmtree(new)  # switched: the name holds the old set
        elif os.stat(new).st_ino == named:
            _switch(new, folder)
    for old in _siblings(folder, _OLD):
        if folder.is_dir():
            shutil.rmtree(old)


def _siblings(folder: Path, kind: str) -> list[Path]:
    root = folder.parent
    if not root.is_dir():
        return []
    prefix = f".{folder.name}{kind}"
    return sorted(p for p in root.iterdir() if p.name.startswith(prefix)
                  and p.name[len(prefix):].isdigit())


def _switch(new: Path, folder: Path) -> None:
    """Put the set ``new`` at ``folder``: one exchange where the system has it."""
    if not folder.exists():
        os.rename(new, folder)
    elif not _exchange(new, folder):
        old = folder.with_name(f".{folder.name}{_OLD}{os.stat(folder).st_ino}")
        os.rename(folder, old)
        try:
            os.rename(new, folder)
        except BaseException:
            os.rename(old, folder)
            raise
        return
    shutil.rmtree(new, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux's renameat2); False where unsupported."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_cwd, rename_exchange = -100, 2
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _fsync(folder: Path) -> None:
    """Make a folder's entries durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt while the block runs, so that the cleanup runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM received in the block are delivered after it, not inside it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # recorded, not blocked: a blocked signal reaches another thread (torch's), and Python acts on
    # it in the main thread anyway
    received: list[int] = []
    previous = {number: signal.signal(number, lambda number, frame: received.append(number))
                for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        for number in received[:1]:
            signal.raise_signal(number)
