"""A rank that stops answering (SIGSTOP, frozen) is named by the others' watch on its
heartbeat well before the collective timeout, and the run ends in one line with nothing left
running; a rank that is only slow, or that has left, is never named.

The watch's arithmetic runs on a store of this process and a clock of the test's own; one
launch of two ranks under torchrun (a few seconds of imports each) runs the whole story."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed import HashStore

from processes import leftover
from torchparity.cli import main
from torchparity.distributed import launch
from torchparity.distributed.heartbeat import LATE_SECONDS, Heartbeat
from torchparity.errors import TorchParityError

MODELS = Path(__file__).resolve().parents[1] / "sharded_models.py"


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beating(store: HashStore, rank: int, clock: Clock, world_size: int = 3) -> Heartbeat:
    return Heartbeat(store, rank, world_size, clock=clock)


def test_a_rank_that_beats_is_never_silent_and_one_that_stops_is_counted_from_its_last_beat():
    store, clock = HashStore(), Clock()
    watcher, slow, stopped = (beating(store, rank, clock) for rank in range(3))
    for second in range(12):
        slow.beat()
        if second < 4:  # stops after its fourth beat
            stopped.beat()
        watcher.look()
        clock.now += 1.0
    # last moved at the look of second 3; the clock now reads second 12
    assert watcher.silent(longer_than=5.0) == {2: 9.0}
    assert watcher.silent(longer_than=9.0) == {}


def test_a_look_that_comes_late_counts_every_silence_afresh():
    # This rank itself held up (descheduled, or the store slow): the others' counters may not
    # have moved in its eyes for a reason of its own, so none is blamed for that gap.
    store, clock = HashStore(), Clock()
    watcher, other = beating(store, 0, clock, 2), beating(store, 1, clock, 2)
    other.beat()
    watcher.look()
    clock.now += LATE_SECONDS + 20.0
    watcher.look()
    assert watcher.silent(longer_than=5.0) == {}
    for _ in range(6):  # looks on time from then on: silent for 6 s since the late look
        clock.now += 1.0
        watcher.look()
    assert watcher.silent(longer_than=5.0) == {1: 6.0}


RANKS_SCRIPT = '''
import os
import signal
import sys
import time

from torchparity.distributed import group, launch

launch.die_with_parent()  # as every rank the launcher starts
group.join("torchparity test")
group.mark("the busy phase")
limit = group.silence_limit()
until = time.monotonic() + limit  # busy in Python, then asleep: only slow, for 1.5 limits
while time.monotonic() < until:
    sum(range(1000))
time.sleep(limit / 2)
group.together("the end of the busy phase")
group.mark("the stopped phase")
if group.rank() == 1:
    with open(sys.argv[1], "w") as stopped:
        stopped.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP)
group.together("the end of the stopped phase")
'''


#: Seconds a collective waits in the script: a silence of 4 s (half of it) ends the run.
TIMEOUT = 8.0


@pytest.fixture
def ranks_script(tmp_path, monkeypatch) -> tuple[str, Path]:
    """The module the ranks run (named after this process, to look for leftovers by), and
    the file in which rank 1 notes when it stopped."""
    monkeypatch.setenv("TORCHPARITY_COLLECTIVE_TIMEOUT", str(TIMEOUT))
    module = f"silent_rank_{os.getpid()}"
    (tmp_path / f"{module}.py").write_text(RANKS_SCRIPT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    return module, tmp_path / "stopped"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="looks for leftovers in /proc")
def test_a_stopped_rank_ends_the_run_well_before_the_collective_timeout(ranks_script):
    module, stopped_at = ranks_script
    with pytest.raises(TorchParityError) as failed:
        launch.launch(module, [str(stopped_at)], nproc=2, timeout=300)
    after = time.time() - float(stopped_at.read_text())
    said = str(failed.value)
    silence = re.fullmatch(r"rank 1 has not answered for (\d+)s \(stopped, or frozen\) at the "
                           r"stopped phase; every rank was stopped", said)
    assert silence, said
    assert TIMEOUT / 2 <= int(silence.group(1)) < TIMEOUT
    assert after < TIMEOUT, f"{after:.1f}s after the stop"
    assert not leftover(module)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="looks for leftovers in /proc")
def test_under_your_own_torchrun_the_stopped_rank_is_killed_by_the_rank_that_names_it(
        ranks_script):
    # torchrun itself would send the stopped rank SIGTERM, which a stopped process does not
    # heed, and SIGKILL only 30 s later.
    module, stopped_at = ranks_script
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m",
                          module, str(stopped_at)], capture_output=True, text=True, timeout=300)
    after = time.time() - float(stopped_at.read_text())
    named = [line for line in run.stderr.splitlines() if "has not answered" in line]
    assert run.returncode != 0
    assert len(named) == 1 and re.fullmatch(
        r"torchparity test: rank 0: error: rank 1 has not answered for \d+s \(stopped, or "
        r"frozen\) at the stopped phase; ending the run", named[0]), run.stderr
    assert after < 30.0, f"{after:.1f}s after the stop"
    assert not leftover(module)


@pytest.mark.slow
@pytest.mark.transformers
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="looks for leftovers in /proc")
def test_diagnose_across_ranks_names_a_stopped_rank_in_one_line(tmp_path, capsys, monkeypatch):
    # Rank 1 stops inside its forward, between two collectives; against a trace of the same
    # model recorded in one process.
    pytest.importorskip("transformers")
    monkeypatch.setenv("TORCHPARITY_COLLECTIVE_TIMEOUT", "30")
    trace = tmp_path / "mine.tptrace"
    assert main(["record", f"{MODELS}:mine_tp", "-o", str(trace)]) == 0
    capsys.readouterr()
    stops = f"{MODELS}:mine_rank_one_stops"
    assert main(["diagnose", stops, "--nproc", "2", "--against", str(trace)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    # 10 s of silence (or a second more), well inside the 30 s a collective would wait
    assert re.fullmatch(r"torchparity diagnose: error: rank 1 has not answered for 1[01]s "
                        r"\(stopped, or frozen\) at the forward and backward of the diagnosed "
                        r"model; every rank was stopped", err[0]), err[0]
    assert not leftover(f"{stops} ")
