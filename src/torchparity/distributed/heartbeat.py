"""Each rank's heartbeat, and the watch every rank keeps on the others' beats.

A thread adds one to this rank's counter in the store every second (a computing rank beats
on; a stopped one, or one frozen holding the GIL, does not) and reads the others'. Silence
is measured on this rank's monotonic clock since it last saw a counter move; a late look
starts every count afresh rather than blame the others."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import Store

#: Seconds between two beats of a rank, and between two looks at the others'.
BEAT_SECONDS = 1.0
#: A look this many seconds after the previous one counts every rank's silence afresh.
LATE_SECONDS = 3.0
_ALIVE_KEY = "torchparity/alive/"


class Heartbeat:
    """This rank's beat in ``store``, and what it last heard of the other ranks' beats."""

    def __init__(self, store: Store, rank: int, world_size: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.rank, self.clock = store, rank, clock
        self.others = [other for other in range(world_size) if other != rank]
        #: rank -> (its counter, when this rank last saw the counter move)
        self.heard: dict[int, tuple[int, float]] = {}
        self._last_look: float | None = None

    def beat(self) -> None:
        """Note in the store that this rank is alive."""
        self.store.add(f"{_ALIVE_KEY}{self.rank}", 1)

    def look(self) -> None:
        """Read the other ranks' counters, noting which moved since the last look."""
        now = self.clock()
        late = self._last_look is not None and now - self._last_look > LATE_SECONDS
        self._last_look = now
        for other in self.others:
            count = self.store.add(f"{_ALIVE_KEY}{other}", 0)  # reads without waiting
            seen = self.heard.get(other)
            if late or seen is None or seen[0] != count:
                self.heard[other] = (count, now)

    def silent(self, longer_than: float) -> dict[int, float]:
        """The other ranks not heard for over ``longer_than`` seconds: rank -> seconds of
        silence."""
        now = self.clock()
        return {other: now - when for other, (_, when) in sorted(self.heard.items())
                if now - when > longer_than}


def beat_and_watch(heartbeat: Heartbeat, limit: float,
                   on_silence: Callable[[dict[int, float]], None],
                   watching: threading.Event) -> threading.Thread:
    """A started daemon thread that beats and looks every second; while ``watching`` is set, it
    calls ``on_silence(rank -> seconds)`` when ranks are silent past ``limit`` (it ends this
    rank, or returns where the silence is no fault)."""
    def run() -> None:
        while True:
            try:
                heartbeat.beat()
                heartbeat.look()
                silent = heartbeat.silent(limit) if watching.is_set() else {}
                if silent:
                    on_silence(silent)
            except Exception:  # the store went with torchrun's agent: nothing left to tell
                return
            time.sleep(BEAT_SECONDS)

    thread = threading.Thread(target=run, name="torchparity-heartbeat", daemon=True)
    thread.start()
    return thread
