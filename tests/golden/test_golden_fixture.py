"""Tests of the ``golden`` pytest fixture in a throw-away project run by a real pytest: update
under two xdist workers loses nothing and fails every test that wrote, each test (and each
parameter) keeps its own goldens, unchanged values pass, a mismatch fails and leaves the
obtained values, a missing golden fails with the command that creates it; and the two files of
a golden stay a pair under concurrent writers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from importlib.metadata import entry_points
from pathlib import Path

import torch

from torchparity.golden.fixture import folder_of_test
from torchparity.golden.store import GoldenStore

SRC = Path(__file__).resolve().parents[2] / "src"
N_PARAMETRIZED = 24

TEST_MODULE = f'''
import os

import pytest
import torch


def values():
    shift = float(os.environ.get("SHIFT", "0"))
    x = torch.linspace(-1, 1, 16, dtype=torch.float32)
    return {{"y": torch.tanh(x) + shift, "ids": torch.arange(4)}}


def test_forward(golden):
    golden.check("logits", values())


def test_other_forward(golden):
    golden.check("logits", {{"y": torch.ones(5)}})


def test_grad(golden):
    golden.check("grad", torch.linspace(0, 1, 8, dtype=torch.float64), kind="grad")


@pytest.mark.parametrize("i", range({N_PARAMETRIZED}))
def test_many(golden, i):
    golden.check("x", {{"x": torch.full((3,), float(i))}})
'''


def run_pytest(project: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    plugin = [] if any(ep.name == "torchparity" for ep in entry_points(group="pytest11")) else [
        "-p", "torchparity.pytest_plugin"]
    environ = {**os.environ, **env,
               "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
         *plugin, *args],
        cwd=project, env=environ, capture_output=True, text=True, timeout=600)


def test_golden_fixture_lifecycle(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_model.py").write_text(TEST_MODULE)
    store = GoldenStore(tests / "golden" / "test_model")
    goldens = {"test_forward": "logits", "test_other_forward": "logits", "test_grad": "grad",
               **{f"test_many-{i}": "x" for i in range(N_PARAMETRIZED)}}

    # Two xdist workers write goldens at once: every file arrives intact, and every test that
    # wrote one errors so that an update left on cannot pass.
    update = run_pytest(tmp_path, "-n", "2", "--torchparity-golden-update", "tests")
    assert update.returncode == 1, update.stdout + update.stderr
    assert f"{len(goldens)} passed, {len(goldens)} errors" in update.stdout
    assert update.stdout.count("golden written, rerun without --torchparity-golden-update") \
        >= len(goldens)
    assert store.cases() == sorted(goldens)
    for test, output in goldens.items():
        assert store.outputs(test) == [output]
        store.read(test, output)  # validates tensors against the JSON summary
    assert not [p for p in store.root.rglob("*") if p.name.endswith(".tmp")]
    assert "torchparity goldens written" in update.stdout
    assert str(store.paths("test_many-7", "x")[0]) in update.stdout

    forward = store.paths("test_forward", "logits")[0]
    for path in store.paths("test_grad", "grad"):
        path.unlink()
    golden_bytes = forward.read_bytes()
    changed = run_pytest(tmp_path, "tests", SHIFT="1e-3")
    assert changed.returncode == 1
    out = changed.stdout
    assert "golden 'logits': diverged" in out
    assert store.obtained_path("test_forward", "logits").exists()
    assert forward.read_bytes() == golden_bytes
    assert "pytest tests/test_model.py::test_forward --torchparity-golden-update" in out
    assert ("create it with `pytest tests/test_model.py::test_grad --torchparity-golden-update`"
            in out)
    # test_other_forward's "logits" is its own; the goldens the change does not touch pass.
    assert f"2 failed, {N_PARAMETRIZED + 1} passed" in out


def test_golden_names_come_from_the_node_id():
    assert folder_of_test("tests/test_m.py::test_logits") == "test_logits"
    assert folder_of_test("test_m.py::TestBlock::test_logits[cpu-2]") == \
        "TestBlock.test_logits-cpu-2"
    odd = [folder_of_test(f"t.py::test_x[{p}]") for p in ("a b", "a/b", "a_b", "a" * 300)]
    assert odd[2] == "test_x-a_b"
    assert len(set(odd)) == 4  # made safe for a file name, still apart
    assert all(len(name) <= 120 and "/" not in name and " " not in name for name in odd)


def test_the_two_files_of_a_golden_stay_a_pair_under_concurrent_writers(tmp_path):
    store = GoldenStore(tmp_path)
    # Each writer's tensors differ in shape, so a JSON of one beside the tensors of the other
    # is caught by the read's consistency check.
    writers = {size: {"x": torch.arange(size, dtype=torch.float64)} for size in (3, 5)}
    store.write("case", "out", writers[3])
    errors: list[BaseException] = []

    def repeat(action) -> None:
        try:
            for _ in range(25):
                action()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=repeat, args=(lambda t=t: store.write("case", "out", t),))
               for t in writers.values()]
    threads.append(threading.Thread(target=repeat, args=(lambda: store.read("case", "out"),)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    assert store.read("case", "out").tensors["x"].numel() in writers
