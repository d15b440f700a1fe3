"""Training parity of a user's own model (``torchparity train --model``): a user-style decoder
LM (``user_lm.py``: its own data, AdamW with a no-decay group, clipping, warm-up) judged by
the noise band of its rounding-only ensemble.

The expectations come from the changes themselves: a fused projection holding the original
weights, the bias added after the residual sum and accumulation over micro-batches normalised
by the step's tokens change rounding only, so every step must be within the band; each
training-only bug changes the mathematics, so the verdict must part, and at a step close to
the first one where the bug's run leaves the ensemble (its distance from the float64 run
beyond every member's, as measured, unpooled and unscaled).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import toy_repo
from torchparity import backends, tolerance
from torchparity.cli import main
from torchparity.golden import model_trajectories as mt
from torchparity.pytest_plugin import gpu_device
from torchparity.subject.model import Subject
from torchparity.train.trainer import OWN_ATTENTION, Execution
from torchparity.train.user_model import UserRecipe

HERE = Path(__file__).parent
ENTRY = f"{HERE / 'user_lm.py'}:lm"
REFACTORS = ("fused", "residual", "accumulated")
BUGS = ("per_micro_batch", "decay_norms", "gelu_backward", "warmup_short")


def load(monkeypatch, variant: str) -> Subject:
    monkeypatch.setenv("USER_LM_VARIANT", variant)
    return Subject.load(ENTRY)


def train_cli(*args: str) -> int:
    return main(["train", "--model", ENTRY, *args])


@pytest.fixture(scope="module")
def goldens_20(tmp_path_factory):
    """Goldens of 20 steps in fp32, made once by the command."""
    folder = tmp_path_factory.mktemp("goldens")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("USER_LM_VARIANT", "base")
        assert train_cli("--steps", "20", "--update-golden", "--golden-dir", str(folder)) == 0
    return folder


def test_a_fused_projection_is_within_the_band_over_20_steps(goldens_20, monkeypatch,
                                                              tmp_path, capsys):
    monkeypatch.setenv("USER_LM_VARIANT", "fused")
    out = tmp_path / "verdict.json"
    assert train_cli("--steps", "20", "--check", "--golden-dir", str(goldens_20),
                     "--json", str(out)) == 0
    verdict = json.loads(out.read_text())["comparison"]
    assert verdict["verdict"] == "within" and verdict["first_divergence"] is None
    judged = {(p["quantity"], p["step"]) for p in verdict["points"]}
    groups = ("grad_norm[decay]", "grad_norm[no_decay]", "update_norm[no_decay]")
    assert judged >= {(q, n) for q in ("loss", "grad_norm", *groups) for n in range(1, 21)}
    assert "could have detected changes" in capsys.readouterr().out


def test_a_warmup_one_step_short_diverges_at_step_1(goldens_20, monkeypatch, tmp_path,
                                                     capsys):
    monkeypatch.setenv("USER_LM_VARIANT", "warmup_short")
    out = tmp_path / "verdict.json"
    assert train_cli("--steps", "20", "--check", "--golden-dir", str(goldens_20),
                     "--json", str(out)) == 1
    first = json.loads(out.read_text())["comparison"]["first_divergence"]
    # the learning rate of step 1 is 1/9 of the peak instead of 1/10: the first update moves
    assert first == {"step": 1, "quantity": "update_norm"}
    assert "the runs part at step 1" in capsys.readouterr().out


@pytest.mark.parametrize("factory, says", [
    ("batches_not_callable", "returned a list as batches; it must be callable"),
    ("optimizer_not_callable", "returned a str as optimizer; it must be callable"),
    ("no_loss", "train_step of "),
])
def test_a_wrong_training_hook_is_one_line_exit_2_and_no_golden(factory, says, tmp_path,
                                                                capsys):
    entry = f"{HERE / 'bad_factories.py'}:{factory}"
    assert main(["train", "--model", entry, "--steps", "3", "--update-golden",
                 "--golden-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not list(tmp_path.iterdir())


def test_a_loss_that_turns_nan_names_the_step_exit_3_and_no_golden(tmp_path, capsys):
    entry = f"{HERE / 'bad_factories.py'}:nan_at_step_3"
    assert main(["train", "--model", entry, "--steps", "5", "--update-golden",
                 "--golden-dir", str(tmp_path)]) == 3
    err = capsys.readouterr().err.strip()
    assert "is nan at step 3" in err and len(err.splitlines()) == 1, err
    assert not list(tmp_path.iterdir())



def test_diagnose_with_a_users_model_is_refused_in_one_line(tmp_path, capsys):
    assert main(["train", "--model", ENTRY, "--steps", "3", "--check", "--diagnose",
                 "--golden-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--diagnose with --model" in err and len(err.splitlines()) == 1, err
    assert not list(tmp_path.iterdir())

# --- 200 steps ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def golden_200(tmp_path_factory):
    """The float64 trajectory and fp32 noise band of 200 steps, through the Python API."""
    store = mt.GoldenStore(tmp_path_factory.mktemp("goldens"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("USER_LM_VARIANT", "base")
        subject = Subject.load(ENTRY)
    mt.write_model_trajectory(subject, UserRecipe(ENTRY, 200), Execution(OWN_ATTENTION),
                              store)
    return store


def judged(store, monkeypatch, variant: str, dtype: str = "fp32"):
    subject = load(monkeypatch, variant)
    execution = Execution(OWN_ATTENTION, dtype)
    recipe = UserRecipe(ENTRY, 200)
    _, comparison = mt.check_model_trajectory(subject, recipe, execution, store)
    return comparison, mt.read_model_trajectory(subject, recipe, execution, store)


@pytest.mark.slow
@pytest.mark.parametrize("variant", REFACTORS)
def test_a_refactor_is_within_the_band_for_200_steps(golden_200, monkeypatch, variant):
    comparison, _ = judged(golden_200, monkeypatch, variant)
    assert comparison.verdict == "within", comparison.explain()


@pytest.mark.slow
@pytest.mark.parametrize("variant", BUGS)
def test_a_training_bug_fails_close_to_where_it_leaves_the_ensemble(golden_200, monkeypatch,
                                                                   variant):
    comparison, (_, band) = judged(golden_200, monkeypatch, variant)
    assert comparison.verdict == "diverged"
    left = min(p.step for p in comparison.points
               if p.error > band.spread[p.quantity][p.step - 1].item())
    pooled = tolerance.KINDS["trajectory_band"].pool_steps
    assert left <= comparison.first_divergence.step <= left + pooled, (left, comparison.explain())


@pytest.mark.slow
def test_bf16_passes_its_own_band_and_states_what_it_could_detect(tmp_path, monkeypatch,
                                                                 capsys):
    monkeypatch.setenv("USER_LM_VARIANT", "base")
    args = ("--steps", "200", "--dtype", "bf16", "--golden-dir", str(tmp_path))
    assert train_cli(*args, "--update-golden") == 0
    out = tmp_path / "verdict.json"
    monkeypatch.setenv("USER_LM_VARIANT", "fused")
    assert train_cli(*args, "--check", "--json", str(out)) == 0
    sensitivity = json.loads(out.read_text())["comparison"]["sensitivity"]
    # bf16 rounds at 2**-8: the band is orders of magnitude wider than fp32's, and says so
    assert 1e-3 < sensitivity["loss"] < 1 and math.isfinite(sensitivity["update_norm"])
    assert "could have detected changes, relative, at step 200: loss" in \
        capsys.readouterr().out.replace("\n  ", " ")


@pytest.mark.slow
def test_base_rev_judges_the_working_tree_against_the_revision(tmp_path, monkeypatch, capsys):
    """A repository holding the model: HEAD's recipe as base; a working tree whose warm-up is
    one step short diverges, one whose projection is fused passes."""
    repo = tmp_path / "repo"
    repo.mkdir()
    source = (HERE / "user_lm.py").read_text()
    (repo / "user_lm.py").write_text(source)
    toy_repo.git(repo, "init", "--quiet", "--initial-branch=main")
    toy_repo.git(repo, "config", "user.name", "Toy Author")
    toy_repo.git(repo, "config", "user.email", "toy@example.com")
    toy_repo.git(repo, "add", "-A")
    toy_repo.git(repo, "commit", "--quiet", "-m", "a user's model")
    monkeypatch.chdir(repo)
    monkeypatch.setenv("TORCHPARITY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("USER_LM_VARIANT", raising=False)
    for variant, status in (("warmup_short", 1), ("fused", 0)):
        default = 'os.environ.get("USER_LM_VARIANT", "base")'
        (repo / "user_lm.py").write_text(source.replace(
            default, default.replace('"base"', f'"{variant}"')))
        assert main(["train", "--model", "user_lm.py:lm", "--steps", "30",
                     "--base", "HEAD"]) == status, variant
    assert toy_repo.git(repo, "status", "--porcelain").strip() == "M user_lm.py"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", backends.names())
def test_a_training_step_of_the_user_model_on_cuda_is_within_its_band(backend, request,
                                                                     monkeypatch, tmp_path):
    """Every backend trains the user-style LM 20 steps on the GPU within the band of its own
    rounding-only ensemble there, around the float64 run (manual attention) on that GPU."""
    import torch

    device = gpu_device(request.config)
    reason = backends.available(device, torch.float32)[backend]
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("USER_LM_VARIANT", "base")
    args = ("--steps", "20", "--backend", backend, "--device", device,
            "--golden-dir", str(tmp_path))
    assert train_cli(*args, "--update-golden") == 0
    monkeypatch.setenv("USER_LM_VARIANT", "fused")
    out = tmp_path / "verdict.json"
    assert train_cli(*args, "--check", "--json", str(out)) == 0
    assert json.loads(out.read_text())["comparison"]["verdict"] == "within"
