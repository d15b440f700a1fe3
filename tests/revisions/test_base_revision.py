"""``--base REV`` on a throwaway repository: the base's goldens and traces are made in a
worktree of their own and cached, the head is judged against them, and the user's repository
(branches, HEAD, index, working tree, stash, worktrees) is left as it was, also when the base's
process is interrupted or fails.

The expectations come from the changes themselves: the tanh GELU is a real change of the MLP's
math (so the float64 goldens must fail and a decoding must name ``mlp``), the parallel block's
sum in another order only rounds differently (so every cell must pass).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import torchparity
import toy_repo
from torchparity.cli import main
from torchparity.revisions.worktree import Repository

# One SDPA cell besides the float64 reference: the base's goldens are what is under test.
CELLS = ("--backend", "sdpa", "--dtype", "fp32")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache shared by the tests of this module, so a base is made once."""
    with pytest.MonkeyPatch.context() as patch:
        folder = tmp_path_factory.mktemp("cache")
        patch.setenv("TORCHPARITY_CACHE_DIR", str(folder))
        yield folder / "base"


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    return toy_repo.make_repository(tmp_path_factory.mktemp("toy"))


@pytest.fixture
def repo(repository, cache, monkeypatch):
    """The toy repository as the working directory; its models.py restored afterwards."""
    monkeypatch.chdir(repository)
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    yield repository
    toy_repo.git(repository, "checkout", "--quiet", "models.py")


def test_check_base_fails_a_real_change_passes_a_reordered_sum_and_reuses_the_base(
        repo, cache, capsys, tmp_path):
    toy_repo.change(repo, "real")
    before = toy_repo.state(repo)
    summary, junit = tmp_path / "summary.md", tmp_path / "check.xml"
    assert main(["check", "--model", "models.py:make", "--base", "HEAD", *CELLS,
                 "--summary", str(summary), "--junit", str(junit)]) == 1
    out, err = capsys.readouterr()
    assert toy_repo.state(repo) == before
    assert "goldens made in" in err and "from the cache" not in err
    assert max(map(len, err.splitlines())) <= 80, err  # progress read in a CI log
    assert "FAIL models.make reference fp64 cpu outputs: diverged" in out

    lines = summary.read_text().splitlines()
    assert len(lines) <= 40 and "❌" in lines[0]
    # A plain sentence first, then the exact command that finds the module that changed.
    assert lines[2].startswith("The outputs of `models.make` changed: ")
    assert lines[4] == "Next: `torchparity diagnose models.py:make --base HEAD`"
    assert any("`models.make` | reference fp64 cpu | outputs | diverged" in line for line in lines)
    cases = ET.parse(junit).getroot().iter("testcase")
    verdicts = {case.get("name"): (case.find("properties/property").get("value"),
                                   case.find("failure") is not None) for case in cases}
    assert verdicts["reference fp64 cpu outputs"] == ("diverged", True)
    assert all(verdict in ("identical", "within", "diverged") and failed == (
        verdict == "diverged") for verdict, failed in verdicts.values())

    toy_repo.git(repo, "checkout", "--quiet", "models.py")
    toy_repo.change(repo, "reordered")
    before = toy_repo.state(repo)
    assert main(["check", "--model", "models.py:make", "--base", "HEAD", *CELLS]) == 0
    out, err = capsys.readouterr()
    assert toy_repo.state(repo) == before
    assert "goldens from the cache" in err and "--no-base-cache" in err
    assert max(map(len, err.splitlines())) <= 80, err
    assert not (repo / "golden").exists()  # the user's goldens are never written
    assert [p.name for p in cache.iterdir()] == [p.name for p in cache.iterdir()
                                                 if not p.name.startswith(".staging")]


def _line_of(code: str) -> int:
    """The line of the toy repository's models.py that holds ``code``."""
    return next(i for i, text in enumerate(toy_repo.MODELS.splitlines(), 1) if code in text)


def test_diagnose_base_decode_names_the_module_and_the_step(repo, capsys, tmp_path):
    toy_repo.change(repo, "real")
    before = toy_repo.state(repo)
    report, junit = tmp_path / "report.json", tmp_path / "diagnose.xml"
    assert main(["diagnose", "models.py:make", "--base", "HEAD", "--decode", "--steps", "2",
                 "--json", str(report), "--junit", str(junit)]) == 1
    assert toy_repo.state(repo) == before
    decode = json.loads(report.read_text())["decode"]
    assert decode["first_module"] == "mlp @ step 0"
    # A's ops of mlp recorded at the base on the divergence: the changed gelu, at its line
    op = decode["first_op"]
    base_line, head_line = toy_repo.CHANGES["real"]
    line = _line_of(base_line)
    assert op is not None and op["name"].startswith("aten::gelu"), op
    assert op["b_stack"][0] == op["a_stack"][0] == f"models.py:{line}"
    assert op["code"] == {"a": base_line, "b": head_line}
    out, err = capsys.readouterr()
    assert "mlp @ step 0" in " ".join(out.split())  # wrapped at 80
    assert "--ops mlp" in err
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    assert {c.get("name") for c in cases} >= {"step 0 logits", "mlp @ step 0"}
    assert all(c.find("properties/property").get("name") == "verdict" for c in cases)

    toy_repo.git(repo, "checkout", "--quiet", "models.py")
    toy_repo.change(repo, "reordered")
    assert main(["diagnose", "models.py:make", "--base", "HEAD", "--decode", "--steps",
                 "2"]) == 0
    assert "--ops" not in capsys.readouterr().err  # nothing diverged: nothing more recorded


def test_diagnose_base_drills_down_to_both_sides_lines_and_records_ops_only_on_a_change(
        repo, capsys, tmp_path):
    base_line, head_line = toy_repo.CHANGES["real"]
    toy_repo.change(repo, "real")
    before = toy_repo.state(repo)
    report = tmp_path / "report.json"
    assert main(["diagnose", "models.py:make", "--base", "HEAD", "--json", str(report)]) == 1
    assert toy_repo.state(repo) == before
    err = capsys.readouterr().err
    assert "--ops mlp" in err  # A's ops recorded at the base for the divergent module only
    op = json.loads(report.read_text())["first_divergence"]["op"]
    line = _line_of(base_line)
    assert op["name"].startswith("aten::gelu") and op["kind"] == "differs"
    assert op["b_stack"][0] == op["a_stack"][0] == f"models.py:{line}"
    assert op["code"] == {"a": base_line, "b": head_line}
    assert "approximate default (A) vs 'tanh' (B)" in op["arguments"]

    toy_repo.git(repo, "checkout", "--quiet", "models.py")
    toy_repo.change(repo, "reordered")
    assert main(["diagnose", "models.py:make", "--base", "HEAD"]) == 0
    assert "--ops" not in capsys.readouterr().err  # nothing diverged: nothing more recorded


def test_a_base_that_fails_or_is_interrupted_is_one_line_and_leaves_the_repository(
        repo, capsys):
    toy_repo.commit_variant(repo, "interrupted", 'raise KeyboardInterrupt\n')
    toy_repo.commit_variant(repo, "broken", 'import a_module_that_is_not_there\n')
    before = toy_repo.state(repo)
    for branch, reason in (("interrupted", "its process was interrupted"),
                           ("broken", "No module named 'a_module_that_is_not_there'")):
        assert main(["check", "--model", "models.py:make", "--base", branch, *CELLS]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"torchparity check: error: --base {branch} (")
        assert "the base side failed" in err[-1] and reason in err[-1]
        assert toy_repo.state(repo) == before


def test_revisions_git_cannot_name_and_files_missing_at_the_base_are_one_line(
        repo, capsys, tmp_path, monkeypatch):
    (repo / "new.py").write_text((repo / "models.py").read_text())
    before = toy_repo.state(repo)
    for argv, message in (
            (["check", "--model", "models.py:make", "--base", "no-such-branch"],
             "--base no-such-branch: git cannot name that commit"),
            (["check", "--model", "new.py:make", "--base", "HEAD"],
             "the factory file new.py does not exist at the base"),
            (["diagnose", "models.py:make", "--base", "HEAD", "--against", "x.tptrace"],
             "with --base give one entry point"),
            (["diagnose", "models.py:make", "--base", "HEAD", "--decode", "--ops", "mlp"],
             "--ops drills down a forward diagnosis"),
            (["train", "--case", "llama-tiny", "--base", "HEAD"], "add --check"),
            (["train", "--case", "llama-tiny", "--check", "--base", "HEAD"],
             "the base has no src/torchparity")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert toy_repo.state(repo) == before
    (repo / "new.py").unlink()
    monkeypatch.chdir(tmp_path)
    assert main(["check", "--model", "models.py:make", "--base", "HEAD"]) == 2
    assert "needs a git repository" in capsys.readouterr().err
    with monkeypatch.context() as no_git:
        no_git.setenv("PATH", str(tmp_path))
        assert main(["check", "--model", "models.py:make", "--base", "HEAD"]) == 2
    assert "needs git, and there is no git on PATH" in capsys.readouterr().err


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGINT, pytest.param(signal.SIGTERM,
                                                                  marks=pytest.mark.slow)])
def test_ctrl_c_during_the_base_run_removes_the_worktree(repo, cache, tmp_path, signum):
    """SIGINT (Ctrl-C) or SIGTERM (a cancelled CI job) reaches torchparity while the base's
    factory runs: the base's process is ended, the worktree removed and pruned, nothing is left
    in the temporary folder."""
    started = tmp_path / "started"
    toy_repo.commit_variant(repo, f"slow-{signum.name}",
                            f"open({str(started)!r}, 'w').close()\nimport time\n"
                            "time.sleep(120)\n")
    before = toy_repo.state(repo)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-m", "torchparity", "check", "--model", "models.py:make", "--base",
         f"slow-{signum.name}", "--no-base-cache", *CELLS], cwd=repo, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(temporary)},
        # As from a terminal: SIGINT at its default. A test worker can have it ignored (a
        # library of an earlier test set that), and a child inherits an ignored signal.
        preexec_fn=_sigint_default)
    deadline = time.monotonic() + 120
    while not started.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert started.exists(), process.communicate()
    process.send_signal(signum)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "torchparity check: interrupted" in err
    assert toy_repo.state(repo) == before
    assert list(temporary.iterdir()) == []


def test_three_dots_name_the_merge_base_as_git_diff_reads_them(repo):
    toy_repo.commit_variant(repo, "feature", "pass\n")
    main = toy_repo.git(repo, "rev-parse", "main").strip()
    feature = toy_repo.git(repo, "rev-parse", "feature").strip()
    repository = Repository.around(repo, "--base")
    assert repository.resolve("feature...main", "--base") == main  # feature branched off main
    assert repository.resolve("main...feature", "--base") == main
    assert repository.resolve("feature", "--base") == feature
    assert repository.resolve("feature~1", "--base") == main


@pytest.mark.slow
def test_train_base_fails_against_a_base_whose_training_math_differs(tmp_path, monkeypatch,
                                                                     capsys):
    """A copy of torchparity's source whose SiLU is scaled (a real change of the MLP): the
    golden trajectory trained there is not what this revision trains."""
    repo = tmp_path / "torchparity"
    source = Path(torchparity.__file__).parent
    shutil.copytree(source, repo / "src" / "torchparity",
                    ignore=shutil.ignore_patterns("__pycache__"))
    mlp = repo / "src" / "torchparity" / "reference" / "mlp.py"
    mlp.write_text(mlp.read_text().replace('"silu": F.silu', '"silu": lambda x: F.silu(1.01 * x)'))
    toy_repo.git(repo, "init", "--quiet", "--initial-branch=main")
    toy_repo.git(repo, "config", "user.name", "Toy Author")
    toy_repo.git(repo, "config", "user.email", "toy@example.com")
    toy_repo.git(repo, "add", "-A")
    toy_repo.git(repo, "commit", "--quiet", "-m", "SiLU scaled")
    before = toy_repo.state(repo)
    monkeypatch.chdir(repo)
    monkeypatch.setenv("TORCHPARITY_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["train", "--case", "llama-tiny", "--check", "--base", "HEAD"]) == 1
    out = capsys.readouterr().out
    assert "diverged" in out
    assert toy_repo.state(repo) == before
