"""What a user gets from ``pip install torchparity``: a wheel that carries the zoo's goldens, so
``torchparity check`` works from any directory; the license it declares; ``py.typed``; one
version; ``hypothesis`` for ``torchparity.strategies`` or a message saying how to get it."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest

import torchparity

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_license_file_is_the_declared_license(pyproject):
    project = pyproject["project"]
    assert project["license"] == "BSD-3-Clause"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("BSD 3-Clause License\n")
    assert "Copyright (c) 2026, the torchparity authors" in text
    assert "Neither the name of the copyright holder nor the names of its" in text


def test_the_version_lives_in_one_place(pyproject):
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["hatch"]["version"]["path"] == "src/torchparity/__init__.py"


def test_the_package_is_typed():
    assert (Path(torchparity.__file__).parent / "py.typed").is_file()


def test_the_shipped_goldens_go_where_the_package_looks_for_them(pyproject):
    from torchparity.golden.store import SHIPPED_GOLDENS

    wheel = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert wheel["force-include"] == {"golden": f"torchparity/{SHIPPED_GOLDENS}"}


def test_the_goldens_are_found_from_any_directory(tmp_path, monkeypatch):
    from torchparity.golden.store import GOLDEN_DIR_ENV, GoldenStore, default_golden_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(GOLDEN_DIR_ENV, raising=False)
    package = Path(torchparity.__file__).resolve().parent
    from_source_tree = package == ROOT / "src" / "torchparity"
    expected = ROOT / "golden" if from_source_tree else package / "goldens"
    assert default_golden_dir().resolve() == expected
    assert "llama-tiny" in GoldenStore(default_golden_dir()).cases()


def test_public_names_do_not_shadow_modules():
    # Were `tp.compare` a function beside a module torchparity/compare.py, importing the
    # module anywhere would rebind `tp.compare` to it.
    for name in torchparity.__all__:
        if importlib.util.find_spec(f"torchparity.{name}") is not None:
            assert inspect.ismodule(getattr(torchparity, name)), name


def test_strategies_without_hypothesis_say_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "hypothesis", None)  # makes `import hypothesis` fail
    monkeypatch.delitem(sys.modules, "torchparity.strategies", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'torchparity\[strategies\]'"):
        importlib.import_module("torchparity.strategies")


@pytest.mark.slow
def test_a_wheel_in_a_fresh_environment_checks_from_an_empty_directory(tmp_path):
    """Build the wheel, install it with torch into a new virtualenv, run from an empty folder."""
    timings = {}

    def timed(step: str, *command: str | Path, cwd: Path = tmp_path) -> str:
        started = time.perf_counter()
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        result = subprocess.run([str(c) for c in command], cwd=cwd, env=env,
                                capture_output=True, text=True, timeout=1800)
        timings[step] = time.perf_counter() - started
        assert result.returncode == 0, f"{step}: {result.stdout}\n{result.stderr}"
        return result.stdout

    wheels = tmp_path / "wheels"
    timed("build the wheel", sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps",
          "-w", wheels)
    (wheel,) = wheels.glob("torchparity-*.whl")
    venv.create(tmp_path / "env", with_pip=True)
    python = tmp_path / "env" / "bin" / "python"
    timed("install", python, "-m", "pip", "install", "--quiet", "torch==2.13.0", wheel)
    empty = tmp_path / "empty"
    empty.mkdir()

    out = timed("torchparity check", tmp_path / "env" / "bin" / "torchparity", "check",
                "--case", "llama-tiny", cwd=empty)
    assert "OK:" in out
    golden_dir = timed("golden dir", python, "-c",
                       "from torchparity.golden.store import default_golden_dir as d; print(d())",
                       cwd=empty).strip()
    assert Path(golden_dir).parts[-2:] == ("torchparity", "goldens")
    assert "site-packages" in Path(golden_dir).parts
    version = timed("version", python, "-m", "torchparity", "--version", cwd=empty)
    assert version == f"torchparity {torchparity.__version__}\n"
    metadata = timed("metadata", python, "-c", "import importlib.metadata as m; "
                     "print(m.version('torchparity'))", cwd=empty)
    assert metadata.strip() == torchparity.__version__
    print(", ".join(f"{step} {seconds:.0f} s" for step, seconds in timings.items()))
