"""This process as one rank of ``torchrun``: who it is, joining and leaving the process group
(one backend choice: gloo on the CPU, nccl on CUDA; one timeout, :func:`collective_timeout`),
meeting the other ranks between phases and naming the ones that do not come, or stop
answering (:mod:`~torchparity.distributed.heartbeat`)."""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import signal
import socket
import sys
import threading
from typing import TYPE_CHECKING

import torch

from torchparity.distributed import heartbeat, launch
from torchparity.errors import TorchParityError, UsageError

if TYPE_CHECKING:
    from torch.distributed import Store

#: Seconds a collective waits for the other ranks (environment variable, default 300).
COLLECTIVE_TIMEOUT_ENV = "TORCHPARITY_COLLECTIVE_TIMEOUT"
_DEFAULT_COLLECTIVE_TIMEOUT = 300.0


def rank() -> int:
    """This process's rank.

    Returns:
        ``$RANK``, 0 outside torchrun.
    """
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """The number of ranks.

    Returns:
        ``$WORLD_SIZE``, 1 outside torchrun.
    """
    return int(os.environ.get("WORLD_SIZE", "1"))


def seconds_from_env(name: str, default: float) -> float:
    """The seconds ``$name`` holds (``default`` where unset or empty); :class:`UsageError` for
    one that is not a number."""
    text = os.environ.get(name)
    try:
        return float(text) if text else default
    except ValueError:
        raise UsageError(f"${name}={text!r} is not a number of seconds") from None


def collective_timeout() -> float:
    """Seconds a collective waits for the other ranks before naming those that did not come.

    Returns:
        ``$TORCHPARITY_COLLECTIVE_TIMEOUT``, default 300.
    """
    return seconds_from_env(COLLECTIVE_TIMEOUT_ENV, _DEFAULT_COLLECTIVE_TIMEOUT)


def device_type() -> str:
    """The device the ranks' tensors live on.

    Returns:
        ``cuda`` when this machine has a GPU for the ranks (nccl joins gloo), else ``cpu``.
    """
    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"


def join(prog: str = "torchparity") -> None:
    """Join the ranks' process group once (gloo, with nccl where this rank has a GPU), and beat
    and watch: a rank silent for :func:`silence_limit` seconds ends this one (exit 2), in a
    line beginning with ``prog``."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=collective_timeout())
    if device_type() == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise UsageError(f"nccl needs one GPU per rank: local rank {local}, "
                             f"{torch.cuda.device_count()} GPU(s) here")
        torch.cuda.set_device(local)
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout,
                                device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo", timeout=timeout)
    _store().set(f"{_PROCESS_KEY}{rank()}", f"{socket.gethostname()} {os.getpid()}")
    global _heartbeat
    _heartbeat = heartbeat.Heartbeat(_store(), rank(), world_size())
    _watching.set()
    heartbeat.beat_and_watch(_heartbeat, silence_limit(),
                             functools.partial(_end_on_silence, prog, _heartbeat.store),
                             _watching)


#: The most seconds a rank may go unheard before the watch ends the run (less where half
#: the collective timeout is less): a rank that computes beats every second, however slowly.
_WATCH_SECONDS = 10.0
#: Seconds of silence after which a failed collective names a rank as not answering.
_SILENT_SECONDS = 5.0
_heartbeat: heartbeat.Heartbeat | None = None
#: Set while another rank's silence is a fault: from joining until this rank leaves.
_watching = threading.Event()


def silence_limit() -> float:
    """Seconds another rank may go unheard before this rank ends the run, naming it.

    Returns:
        Half the collective timeout, at most 10: well before a collective would give up.
    """
    return min(collective_timeout() / 2, _WATCH_SECONDS)


def _end_on_silence(prog: str, store: Store, silent: dict[int, float]) -> None:
    """End the run: one line naming the ranks not heard, and where they were (left for the
    launcher too: :func:`~torchparity.distributed.launch.record_silence`), those ranks killed
    where they run on this machine, and this rank ended (exit 2). Ranks that have left are not
    waited for, and so not named."""
    named = {other: seconds for other, seconds in silent.items()
             if not store.check([f"{_LEFT_KEY}{other}"])}
    if not named or not _watching.is_set():
        return
    said = ", ".join(_not_answering(store, other, seconds) for other, seconds in named.items())
    launch.record_silence(rank(), said)
    print(f"{prog}: rank {rank()}: error: {said}; ending the run", file=sys.stderr, flush=True)
    for other in named:
        _kill_if_here(store, other)
    os._exit(2)  # as a timed-out collective would; atexit's leave() would wait for the rank


def _kill_if_here(store: Store, other: int) -> None:
    """SIGKILL rank ``other`` where it runs on this machine: a stopped process heeds no other
    signal, and torchrun would first send it SIGTERM and wait 30 s."""
    key = f"{_PROCESS_KEY}{other}"
    if store.check([key]):
        host, _, pid = store.get(key).decode().rpartition(" ")
        if host == socket.gethostname():
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)


def leave() -> None:
    """Leave the process group, and exit only once every rank has: a rank still in its group when
    a peer's gloo connection closes aborts, so each notes its leaving in the store and waits."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    store = _store()  # outlives the group: torchrun's agent serves it
    try:
        dist.barrier()
    except RuntimeError:  # a rank that died has nothing to wait for
        dist.destroy_process_group()
        return
    _watching.clear()  # every rank came: from now on each ends by itself
    dist.destroy_process_group()
    store.set(f"{_LEFT_KEY}{rank()}", "left")
    with contextlib.suppress(RuntimeError):  # the store's own timeout: torchrun ends the rest
        store.wait([f"{_LEFT_KEY}{other}" for other in range(world_size())])


def abandon() -> None:
    """Leave the process group at once, waiting for no other rank: a rank that fails alone
    then ends, and torchrun stops the others, which would wait for it in their next
    collective (or in :func:`leave`'s barrier) until the collective timeout."""
    import torch.distributed as dist

    _watching.clear()
    if dist.is_initialized():
        with contextlib.suppress(RuntimeError):  # the others then wait for it no more
            _store().set(f"{_LEFT_KEY}{rank()}", "abandoned")
        dist.destroy_process_group()


def together(what: str) -> None:
    """Wait until every rank reaches ``what`` (a no-op outside a group); a rank that does not come
    within the timeout is named (gloo; nccl says what it can)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=collective_timeout())
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
        else:
            dist.barrier()
    except RuntimeError as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TorchParityError(f"the ranks did not all reach {what} within "
                               f"{timeout.total_seconds():.0f}s: {message}") from None


_PHASE_KEY = "torchparity/phase/"
_LEFT_KEY = "torchparity/left/"
#: Where each rank runs: ``host pid``.
_PROCESS_KEY = "torchparity/process/"


def mark(phase: str) -> None:
    """Note in the store that this rank is at ``phase``, for a failed collective's message."""
    import torch.distributed as dist

    if dist.is_initialized():
        _store().set(f"{_PHASE_KEY}{rank()}", phase)


def where_others_are() -> str:
    """Which ranks are not where this one is, said when a collective fails or times out.

    Returns:
        ``rank 1 is at sharding the fp32 run``, or "every rank is here" when none.
    """
    store = _store()
    phases = {other: _phase(store, other) or "its start" for other in range(world_size())}
    here = phases[rank()]
    silent = _heartbeat.silent(_SILENT_SECONDS) if _heartbeat is not None else {}
    behind = [_not_answering(store, r, silent[r]) if r in silent else f"rank {r} is at {phase}"
              for r, phase in phases.items() if phase != here or r in silent]
    return ", ".join(behind) or "every rank is here"


def _not_answering(store: Store, other: int, seconds: float) -> str:
    """``rank 1 has not answered for 10s (stopped, or frozen) at PHASE``."""
    phase = _phase(store, other)
    return (f"rank {other} has not answered for {seconds:.0f}s (stopped, or frozen)"
            + (f" at {phase}" if phase else ""))


def _phase(store: Store, other: int) -> str | None:
    """Where rank ``other`` last said it was (:func:`mark`), or None: it said nothing yet."""
    key = f"{_PHASE_KEY}{other}"
    return store.get(key).decode() if store.check([key]) else None


def _store() -> Store:
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


#: What the messages of gloo's and NCCL's own failures (a peer gone, a timeout) contain.
_TRANSPORT_WORDS = ("third_party/gloo/", "NCCL error", "ProcessGroupNCCL", "ProcessGroupGloo")


def collective_failed(exc: BaseException) -> bool:
    """Whether ``exc`` came from a collective (torch.distributed, or a DTensor's gather beneath
    the dispatcher), or wraps one."""
    import traceback

    def distributed(frame: traceback.FrameSummary) -> bool:
        return "torch/distributed/" in frame.filename.replace(os.sep, "/")

    if any(distributed(frame) for frame in traceback.extract_tb(exc.__traceback__)):
        return True
    cause = exc.__cause__
    if any(word in str(cause) for word in _TRANSPORT_WORDS):  # raised by the transport itself
        return True
    frames = traceback.extract_tb(cause.__traceback__) if cause is not None else []
    return bool(frames) and distributed(frames[-1])
