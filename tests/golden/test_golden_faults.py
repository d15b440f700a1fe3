"""Golden writes under faults: an update stopped at each of its steps (killed, interrupted,
terminated, a full or read-only disk), a crash in the user's model, two updates at once, and
report paths that cannot be written. After each, a case's golden folder is byte-identical to its
old set or its new one, and the one line printed says which.

The exhaustive sweeps (a process killed at every step of a user's model's update and of a zoo
case's) are marked ``slow``; the default suite stops the store at every step in this process
and kills a process at a few chosen ones.
"""

from __future__ import annotations

import inspect
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torchparity.cli import main
from torchparity.golden import golden_sets
from torchparity.golden.cases import OUTPUT_KINDS
from torchparity.golden.golden_sets import FAULT_ENV, FolderUpdate, GoldenBusy
from torchparity.golden.store import GoldenStore, GoldenWriteError

MODELS = textwrap.dedent('''
    import os

    import torch

    import torchparity as tp


    def tiny():
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        tp.init_weights(model, seed=int(os.environ.get("TINY_SEED", "0")))
        if os.environ.get("TINY_CRASH"):
            model[1].register_forward_hook(lambda *args: 1 / 0)
        return model, (tp.random_tensor((2, 4), seed=1),)
''')
ENTRY = "models.py:tiny"
NAME = "models.tiny"
REPO = Path(__file__).resolve().parents[2]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def which_set(folder: Path, old: dict[str, bytes], new: dict[str, bytes]) -> str:
    """``old``, ``new`` or ``mixed``: what ``folder`` holds."""
    now = snapshot(folder)
    return "old" if now == old else "new" if now == new else "mixed"


def said(line: str) -> str:
    """The set the printed line says the folder holds."""
    return "new" if "are the new set" in line else "old" if "old set, unchanged" in line else "?"


# --- the store stopped at every step, in this process ---------------------------------------


def three_goldens(store: GoldenStore, scale: float) -> None:
    gen = torch.Generator().manual_seed(0)
    with store.replacing("case"):
        for output in ("outputs", "loss", "grads"):
            store.write("case", output, {"x": scale * torch.randn(5, generator=gen)},
                        {"kind": "forward", "scale": scale})


def steps_of(write) -> int:
    """How many steps of disk work ``write()`` makes."""
    os.environ[FAULT_ENV] = str(10**9)
    golden_sets._steps = 0
    try:
        write()
    finally:
        del os.environ[FAULT_ENV]
    return golden_sets._steps


@pytest.mark.parametrize("kind", ["ENOSPC", "interrupt"])
def test_a_set_stopped_at_every_step_is_the_old_or_the_new_one(tmp_path, monkeypatch, kind):
    # Ctrl-C as a terminal delivers it, whatever handler an earlier test in this process left
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _stopped_at_every_step(tmp_path, monkeypatch, kind)
    finally:
        signal.signal(signal.SIGINT, previous)


def _stopped_at_every_step(tmp_path, monkeypatch, kind):
    old_store, new_store = GoldenStore(tmp_path / "old"), GoldenStore(tmp_path / "new")
    three_goldens(old_store, 1.0)
    three_goldens(new_store, 1.0)
    three_goldens(new_store, 2.0)
    old, new = snapshot(old_store.root / "case"), snapshot(new_store.root / "case")
    steps = steps_of(lambda: three_goldens(GoldenStore(tmp_path / "count"), 1.0))
    assert steps >= 6 + 3  # each file, and the switch
    outcomes = []
    for k in range(1, steps + 1):
        root = tmp_path / f"at{k}"
        shutil.copytree(old_store.root, root)
        monkeypatch.setenv(FAULT_ENV, f"{k}:{kind}")
        monkeypatch.setattr(golden_sets, "_steps", 0)
        line = ""
        try:
            three_goldens(GoldenStore(root), 2.0)
        except KeyboardInterrupt as exc:
            line = "; ".join(exc.__notes__)
        except GoldenWriteError as exc:
            line = str(exc)
        outcomes.append((which_set(root / "case", old, new), said(line)))
        assert sorted(p.name for p in root.iterdir()) == ["case"], k  # nothing left beside
    assert ("mixed", "?") not in outcomes and all(held == told for held, told in outcomes)
    held = [held for held, _ in outcomes]
    # A write fails up to the switch; an interruption that arrives in the switch (its last
    # three steps) waits for it to end.
    assert held == ["old"] * (steps - 1 if kind == "ENOSPC" else steps - 3) + ["new"] * (
        1 if kind == "ENOSPC" else 3)


def test_a_killed_switch_is_finished_by_the_next_reader(tmp_path):
    """Killed between the commit and the switch: the folder holds the old set, and the next
    read switches the committed one in."""
    script = (f"import torch\nfrom torchparity.golden.store import GoldenStore\n"
              f"{inspect.getsource(three_goldens)}\n"
              f"three_goldens(GoldenStore({str(tmp_path / 'root')!r}), 2.0)")
    three_goldens(GoldenStore(tmp_path / "root"), 1.0)
    three_goldens(GoldenStore(tmp_path / "new"), 2.0)
    old, new = snapshot(tmp_path / "root" / "case"), snapshot(tmp_path / "new" / "case")
    steps = steps_of(lambda: three_goldens(GoldenStore(tmp_path / "count"), 1.0))
    for k, before in ((2, "old"), (steps - 1, "old")):  # mid-write; committed, not switched
        done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                              env={**os.environ, FAULT_ENV: str(k)}, timeout=120)
        assert done.returncode == -signal.SIGKILL
        assert which_set(tmp_path / "root" / "case", old, new) == before
    GoldenStore(tmp_path / "root").read("case", "loss")
    assert which_set(tmp_path / "root" / "case", old, new) == "new"
    three_goldens(GoldenStore(tmp_path / "root"), 2.0)  # the next update removes the rest
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == ["case"]


def test_files_follow_the_umask(tmp_path):
    for umask, mode in ((0o022, 0o644), (0o027, 0o640)):
        previous = os.umask(umask)
        try:
            three_goldens(GoldenStore(tmp_path / oct(umask)), 1.0)
        finally:
            os.umask(previous)
        assert {p.stat().st_mode & 0o777 for p in (tmp_path / oct(umask)).rglob("*.*")} == {mode}


def test_a_second_update_of_a_folder_is_refused_and_a_dead_holders_lock_taken_over(tmp_path):
    folder = tmp_path / "case"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, pathlib, time; from torchparity.golden.golden_sets "
         "import FolderUpdate\nwith FolderUpdate(pathlib.Path(sys.argv[1])).locked():\n"
         "    print('held', flush=True); time.sleep(120)", str(folder)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(GoldenBusy, match=f"being updated by process {holder.pid} .*lock "
                                             f".*update-.*lock.*wait for it to end"):
            three_goldens(GoldenStore(tmp_path), 1.0)
        assert not folder.exists()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    three_goldens(GoldenStore(tmp_path), 1.0)  # its lock died with it
    assert GoldenStore(tmp_path).read("case", "loss").summary["scale"] == 1.0
    with FolderUpdate(folder).locked():  # taken again in one process: not refused
        three_goldens(GoldenStore(tmp_path), 2.0)


# --- a user's model: the command line ---------------------------------------------------------


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """models.py, and its tiny model's old goldens (seed 0) and new ones (seed 1)."""
    folder = tmp_path_factory.mktemp("faults")
    (folder / "models.py").write_text(MODELS)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        assert main(["golden", "update", "--model", ENTRY, "--golden-dir", "old"]) == 0
        shutil.copytree(folder / "old", folder / "new")
        patch.setenv("TINY_SEED", "1")
        assert main(["golden", "update", "--model", ENTRY, "--golden-dir", "new"]) == 0
    return folder


@pytest.fixture
def sets(made, tmp_path, monkeypatch):
    """A copy of :func:`made`'s folder, the working directory, with the old and new sets."""
    folder = tmp_path / "models"
    shutil.copytree(made, folder)
    monkeypatch.chdir(folder)
    return folder, snapshot(folder / "old" / NAME), snapshot(folder / "new" / NAME)


def update(root: Path, fault: str | None = None, **limits: int
           ) -> subprocess.CompletedProcess[str]:
    """``golden update --model`` of the new seed into a copy of ``root``, in a process of its
    own stopped by ``fault`` (``TORCHPARITY_FAULT_AT``) or by resource ``limits``."""
    env = {**os.environ, "TINY_SEED": "1", FAULT_ENV: fault or ""}

    def limited() -> None:
        import resource

        # a SIGINT ignored by this process would be ignored by the child's Python too
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        for name, value in limits.items():
            resource.setrlimit(getattr(resource, name), (value, value))

    return subprocess.run([sys.executable, "-m", "torchparity", "golden", "update", "--model",
                           ENTRY, "--golden-dir", str(root)], cwd=root.parent, env=env,
                          capture_output=True, text=True, timeout=300, preexec_fn=limited)


def last_line(done: subprocess.CompletedProcess[str]) -> str:
    return done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""


@pytest.mark.parametrize("fault, status", [("4:term", 130), ("5:interrupt", 130)])
def test_a_stopped_update_keeps_the_old_set_and_says_so(sets, fault, status):
    folder, old, new = sets
    shutil.copytree(folder / "old", folder / "run")
    done = update(folder / "run", fault)
    assert done.returncode == status
    assert last_line(done) == (f"torchparity golden: interrupted: the goldens of {NAME} are "
                               f"the old set, unchanged")
    assert which_set(folder / "run" / NAME, old, new) == "old"


def test_a_full_disk_keeps_the_old_set_in_one_line(sets):
    folder, old, new = sets
    shutil.copytree(folder / "old", folder / "run")
    done = update(folder / "run", RLIMIT_FSIZE=400)
    assert done.returncode == 2
    assert last_line(done).startswith(f"torchparity golden: error: cannot write the goldens of "
                                      f"{NAME} in {folder / 'run'} (File too large): free space")
    assert last_line(done).endswith(f"the goldens of {NAME} are the old set, unchanged")
    assert which_set(folder / "run" / NAME, old, new) == "old"


def test_a_read_only_folder_and_a_crashing_model_keep_the_old_set(sets, monkeypatch, capsys):
    folder, old, new = sets
    monkeypatch.setenv("TINY_SEED", "1")
    monkeypatch.setenv(FAULT_ENV, "1:EROFS")
    monkeypatch.setattr(golden_sets, "_steps", 0)
    assert main(["golden", "update", "--model", ENTRY, "--golden-dir", "old"]) == 2
    line = capsys.readouterr().err.strip()
    assert "[Errno" not in line and line.endswith("(Read-only file system): make it writable, "
                                                  "or point --golden-dir / TORCHPARITY_GOLDEN_"
                                                  f"DIR at a writable folder; the goldens of "
                                                  f"{NAME} are the old set, unchanged")
    monkeypatch.delenv(FAULT_ENV)
    monkeypatch.setenv("TINY_CRASH", "1")
    assert main(["golden", "update", "--model", ENTRY, "--golden-dir", "old"]) == 3
    line = capsys.readouterr().err.strip()
    assert "ZeroDivisionError" in line and f"the goldens of {NAME} are the old set" in line
    assert which_set(folder / "old" / NAME, old, new) == "old"


def test_verify_names_a_mixed_set_and_the_command_that_repairs_it(sets, capsys):
    folder, old, new = sets
    for suffix in ("json", "safetensors"):  # grads of one update, the rest of another
        shutil.copy(folder / "new" / NAME / f"grads.{suffix}", folder / "old" / NAME)
    capsys.readouterr()
    assert main(["golden", "verify", "--model", ENTRY, "--golden-dir", "old"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"torchparity golden: error: the goldens of {NAME} in old are a mixed set: outputs.json "
        f"and grads.json record different checksums (an interrupted update of an older "
        f"torchparity left them); rerun `torchparity golden update --model {ENTRY} "
        f"--golden-dir old`")


@pytest.mark.parametrize("option, path, message", [
    ("--json", "missing/r.json", "--json missing/r.json: its folder {cwd}/missing does not "
                                 "exist; create it or choose another path"),
    ("--html", ".", "--html . is a folder; give a file path"),
    ("--junit", "models.py/r.xml", "--junit models.py/r.xml: {cwd}/models.py is a file, not a "
                                   "folder; choose another path"),
    ("--golden-dir", "models.py", "golden folder models.py is a file; give a folder path"),
])
def test_an_unwritable_output_path_is_refused_before_any_work(sets, capsys, option, path,
                                                              message):
    folder, _, _ = sets
    command = (["golden", "update"] if option == "--golden-dir" else ["check"])
    # Refused before the factory is loaded: it names no factory.
    assert main([*command, "--model", "models.py:not_there", option, path]) == 2
    assert capsys.readouterr().err.strip() == (
        f"torchparity {command[0]}: error: {message.format(cwd=folder)}")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_report_where_no_file_can_be_made_is_refused_before_any_work(sets, capsys):
    # Root may write anywhere its permission bits say no; /proc refuses everyone.
    assert main(["check", "--model", "models.py:not_there", "--json", "/proc/r.json"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("torchparity check: error: --json /proc/r.json cannot be made in "
                           "/proc (") and line.endswith("); choose another path")


# --- every step of an update, killed (the sweeps) -------------------------------------------


def sweep(folder: Path, old: dict[str, bytes], new: dict[str, bytes], run) -> dict[str, int]:
    """Kill ``run(root, fault)`` at each of its steps (until one runs to the end) and count what
    the folder held after it, and after the next read."""
    counts = {"runs": 0, "old": 0, "new": 0, "mixed": 0, "mixed after a read": 0}
    for k in range(1, 100):
        root = folder / f"at{k}"
        shutil.copytree(folder / "old", root)
        done = run(root, f"{k}:kill")
        case = next(p for p in root.iterdir() if not p.name.startswith("."))
        if done.returncode == 0:
            assert which_set(case, old, new) == "new"
            return counts
        assert done.returncode == -signal.SIGKILL, done.stderr
        counts["runs"] += 1
        counts[which_set(case, old, new)] += 1
        store = GoldenStore(root)
        store.read(case.name, store.outputs(case.name)[0])
        counts["mixed after a read"] += which_set(case, old, new) == "mixed"
    raise AssertionError("the update never ran to its end")


@pytest.mark.slow
def test_a_models_update_killed_at_every_step_leaves_no_mixed_set(sets):
    folder, old, new = sets
    counts = sweep(folder, old, new, update)
    print(counts)
    assert counts["runs"] >= 10 and counts["mixed"] == counts["mixed after a read"] == 0


@pytest.mark.slow
def test_a_zoo_cases_update_killed_at_every_step_leaves_no_mixed_set(tmp_path):
    """``mqa`` (a small zoo case) rewritten whole: its goldens stripped of their machine, as
    goldens once were, are rewritten file by file."""
    assert main(["golden", "update", "mqa", "--golden-dir", str(tmp_path / "new")]) == 0
    shutil.copytree(tmp_path / "new", tmp_path / "old")
    for output in OUTPUT_KINDS:
        path = tmp_path / "old" / "mqa" / f"{output}.json"
        path.write_text(path.read_text().replace('"cpu_capability"', '"capability"'))
    old, new = snapshot(tmp_path / "old" / "mqa"), snapshot(tmp_path / "new" / "mqa")

    def run(root: Path, fault: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "torchparity", "golden", "update", "mqa",
                               "--golden-dir", str(root)], env={**os.environ, FAULT_ENV: fault},
                              capture_output=True, text=True, timeout=300)

    counts = sweep(tmp_path, old, new, run)
    print(counts)
    assert counts["runs"] >= 2 * len(OUTPUT_KINDS) + 3
    assert counts["mixed"] == counts["mixed after a read"] == 0
