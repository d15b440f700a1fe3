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
from torchparity.pytest_plugin import gpu_device
from torchparity.subject.model import Subject
from torchparity.train import model_trajectories as mt
from torchparity.train.ensemble import members_count
from torchparity.train.step_diagnosis import user_step as uts
from torchparity.train.step_diagnosis.base_side import record_step
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


@pytest.mark.parametrize("variant, verdict", [("base", 0), ("warmup_short", 1)])
def test_a_bf16_check_is_judged_by_the_fp32_golden_with_a_band_measured_on_the_spot(
        goldens_20, monkeypatch, tmp_path, capsys, variant, verdict):
    """One golden serves every dtype: the float64 trajectory of the fp32 golden is the truth,
    the bf16 band is measured around this code's own float64 run (so a bug is in neither),
    said with its cost before it runs, and not stored. A warm-up one step short moves the
    first update by 11%, beyond bf16's band."""
    before = sorted(p.name for p in (goldens_20 / "user_lm.lm").iterdir())
    monkeypatch.setenv("USER_LM_VARIANT", variant)
    out = tmp_path / "verdict.json"
    assert train_cli("--steps", "5", "--check", "--dtype", "bf16", "--golden-dir",
                     str(goldens_20), "--json", str(out)) == verdict
    raw = capsys.readouterr().out
    printed = raw.replace("\n  ", " ")
    assert "no stored band for bf16: measuring one now (" in printed
    assert "--update-golden --dtype bf16" in printed
    assert "band: measured here, not stored" in printed
    # a path longer than the line is folded inside it
    assert str(goldens_20 / "user_lm.lm" / "trajectory_fp32.safetensors") in raw.replace(
        "\n  ", "")
    comparison = json.loads(out.read_text())["comparison"]
    assert comparison["compute_dtype"] == "bf16"
    assert any(note.startswith("band: measured here") for note in comparison["notes"])
    if verdict:
        assert comparison["first_divergence"] == {"step": 1, "quantity": "update_norm"}
    assert sorted(p.name for p in (goldens_20 / "user_lm.lm").iterdir()) == before


def test_a_check_says_where_its_stored_band_comes_from(goldens_20, monkeypatch, capsys):
    monkeypatch.setenv("USER_LM_VARIANT", "base")
    assert train_cli("--steps", "3", "--check", "--golden-dir", str(goldens_20)) == 0
    raw = capsys.readouterr().out
    printed = raw.replace("\n  ", " ")
    golden = goldens_20 / "user_lm.lm" / "trajectory_fp32.safetensors"
    members = members_count(Execution(OWN_ATTENTION))
    assert "band: stored with the golden " in printed
    assert str(golden) in raw.replace("\n  ", "")  # a path longer than the line is folded
    assert f"({members} rounding-only runs" in printed


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



@pytest.mark.parametrize("mode", [["--update-golden"], ["--check", "--nproc", "2"]])
def test_diagnose_with_update_golden_or_nproc_is_one_line_exit_2_and_no_golden(
        mode, tmp_path, capsys):
    assert main(["train", "--model", ENTRY, "--steps", "3", *mode, "--diagnose",
                 "--golden-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--diagnose drills down a run of one process that leaves its band" in err, err
    assert len(err.splitlines()) == 1 and not list(tmp_path.iterdir())


# What each change touches first decides the stage: the loss normalised per micro-batch is
# the step's loss (forward), the GELU's backward the gradients, and weight decay on the norms
# or a shorter warm-up the update alone, of the no-decay group or of every group. Without
# --base A would be this very code: no module table, and the output says why.
@pytest.mark.parametrize("variant, stage, groups, reason", [
    ("per_micro_batch", "forward", set(), "add --base REV"),
    ("gelu_backward", "backward", {"decay", "no_decay"}, "add --base REV"),
    ("decay_norms", "optimizer", {"no_decay"}, "no module to look for"),
    ("warmup_short", "optimizer", {"decay", "no_decay"}, "no module to look for"),
])
def test_diagnose_names_the_stage_and_the_groups_that_leave_the_band(
        goldens_20, monkeypatch, tmp_path, capsys, variant, stage, groups, reason):
    monkeypatch.setenv("USER_LM_VARIANT", variant)
    out = tmp_path / "verdict.json"
    assert train_cli("--steps", "5", "--check", "--diagnose", "--golden-dir", str(goldens_20),
                     "--json", str(out)) == 1
    data = json.loads(out.read_text())
    diagnosis, first = data["diagnosis"], data["comparison"]["first_divergence"]
    assert (diagnosis["stage"], diagnosis["step"]) == (stage, first["step"])
    assert set(diagnosis["groups"]) == groups
    assert all(share > 1 for share in diagnosis["groups"].values())
    assert diagnosis["modules"] is None and reason in diagnosis["reason"]
    printed = capsys.readouterr().out.replace("\n  ", " ")
    assert f"diagnosis: step {first['step']} parts in" in printed and reason in printed


# The golden stores its optimizer's groups: a change of them is named, as the cause, before
# any norm is read. The norms in the decay group change which parameters the per-group norms
# are of (the stage alone would read "backward"); betas act from the second update (Adam's
# first is the gradient's sign whatever they are).
@pytest.mark.parametrize("variant, step, cause", [
    ("norms_in_decay", 1, "5 parameters moved from group no_decay to decay: "
                          "blocks.0.attn_norm.weight, blocks.0.mlp_norm.weight, "
                          "blocks.1.attn_norm.weight, blocks.1.mlp_norm.weight, norm.weight"),
    ("warmup_short", 1, "lr at step 1 in groups decay, no_decay: 0.0003 (A) vs 0.0003333 (B)"),
    ("betas_changed", 2, "betas at step 1 in groups decay, no_decay: (0.9, 0.95) (A) vs "
                         "(0.9, 0.99) (B)"),
    ("eps_changed", 1, "eps at step 1 in groups decay, no_decay: 1e-08 (A) vs 1e-06 (B)"),
    ("decay_norms", 1, "weight_decay at step 1 in group no_decay: 0 (A) vs 0.1 (B)"),
])
def test_diagnose_names_a_change_of_the_optimizers_groups_as_the_cause(
        goldens_20, monkeypatch, tmp_path, capsys, variant, step, cause):
    monkeypatch.setenv("USER_LM_VARIANT", variant)
    out = tmp_path / "verdict.json"
    assert train_cli("--steps", "3", "--check", "--diagnose", "--golden-dir", str(goldens_20),
                     "--json", str(out)) == 1
    diagnosis = json.loads(out.read_text())["diagnosis"]
    assert (diagnosis["stage"], diagnosis["step"], diagnosis["causes"]) == (
        "optimizer", step, [cause])
    assert diagnosis["modules"] is None
    printed = capsys.readouterr().out.replace("\n  ", " ")
    assert f"diagnosis: step {step} parts in the optimizer" in printed and cause in printed


def test_a_module_table_that_passes_is_not_printed_under_a_run_that_fails(
        goldens_20, monkeypatch, tmp_path, capsys):
    """The loss normalised per micro-batch parts at the forward stage; without --base the
    table compares the code with itself (manual attention against SDPA's math kernel) and no
    module parts: a "Verdict: pass" under exit 1 would contradict it, so one line says the
    model's call agrees and the table stays in the JSON."""
    monkeypatch.setenv("USER_LM_VARIANT", "per_micro_batch")
    out = tmp_path / "verdict.json"
    assert train_cli("--steps", "3", "--check", "--diagnose", "--backend", "sdpa-math",
                     "--golden-dir", str(goldens_20), "--json", str(out)) == 1
    diagnosis = json.loads(out.read_text())["diagnosis"]
    assert diagnosis["stage"] == "forward"
    assert diagnosis["modules"]["first_divergence"] is None
    printed = capsys.readouterr().out.replace("\n  ", " ")
    assert "Verdict: pass" not in printed
    step = diagnosis["step"]
    assert f"A's and B's call of the model at step {step} agree module by module" in printed


def test_diagnose_of_a_refactor_within_the_band_has_nothing_to_diagnose(goldens_20, monkeypatch,
                                                                        tmp_path, capsys):
    monkeypatch.setenv("USER_LM_VARIANT", "fused")
    out = tmp_path / "verdict.json"
    assert train_cli("--steps", "5", "--check", "--diagnose", "--golden-dir", str(goldens_20),
                     "--json", str(out)) == 0
    assert json.loads(out.read_text())["diagnosis"] is None
    assert "nothing to diagnose" in capsys.readouterr().out


def test_without_base_a_backend_is_judged_against_manual_attention_in_the_same_code(
        monkeypatch):
    """Without --base A is the code itself, its attention call run by torchparity's manual
    attention: SDPA's math kernel computes the same, so no module parts, and the note says
    the table cannot speak for the code."""
    stage = uts.StepStage(2, "backward", "grad_norm", math.inf)
    diagnosis = uts.diagnose_user_step(load(monkeypatch, "base"), Execution("sdpa-math"), stage)
    assert diagnosis.report.ok
    assert diagnosis.report.meta.backends == ["manual fp32 cpu", "sdpa-math fp32 cpu"]
    assert "a change of code shows only as the stage" in diagnosis.note
    assert "add --base REV" in diagnosis.note


@pytest.fixture(scope="module")
def base_step_1(tmp_path_factory):
    """The original's step 1 recorded as the base side of --base records it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("USER_LM_VARIANT", "base")
        subject = Subject.load(ENTRY)
    return record_step(subject, 1, Execution(OWN_ATTENTION, "fp32"),
                           tmp_path_factory.mktemp("base") / "step")


def diagnosed_against_base(monkeypatch, base_step, variant: str):
    subject = load(monkeypatch, variant)
    stage = uts.StepStage(1, "backward", "grad_norm", math.inf)
    return subject, uts.diagnose_user_step(subject, Execution(OWN_ATTENTION, "fp32"), stage,
                                           base=base_step)


def test_a_gelu_with_another_backward_is_found_in_the_block_that_calls_it(base_step_1,
                                                                          monkeypatch):
    """The GELU's custom backward judged against the base's step: its forward is exact, so
    no module's output parts; backward reaches the last block first, whose forward calls the
    GELU (no module of its own holds it)."""
    subject, diagnosis = diagnosed_against_base(monkeypatch, base_step_1, "gelu_backward")
    assert diagnosis.report.first_divergence is None
    last = f"blocks.{len(subject.model.blocks) - 1}"
    assert diagnosis.report.first_grad_divergence.module == last


def test_a_fused_projection_loads_the_bases_three_weights_and_nothing_parts(base_step_1,
                                                                           monkeypatch):
    """The base's q, k and v weights found in the fused projection (concatenated, as the
    goldens pair them) and its calls aligned as fused: the same mathematics, no module
    parts."""
    subject, diagnosis = diagnosed_against_base(monkeypatch, base_step_1, "fused")
    assert diagnosis.reason is None and diagnosis.report.ok
    fused = {r.module for r in diagnosis.report.rows if r.how == "fused"}
    assert fused == {f"blocks.{i}.attn.qkv" for i in range(len(subject.model.blocks))}

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
    repo = _repository(tmp_path, monkeypatch)
    for variant, status in (("warmup_short", 1), ("fused", 0)):
        _with_default_variant(repo, variant)
        assert main(["train", "--model", "user_lm.py:lm", "--steps", "30",
                     "--base", "HEAD"]) == status, variant
    assert toy_repo.git(repo, "status", "--porcelain").strip() == "M user_lm.py"


@pytest.mark.slow
def test_diagnose_base_rev_names_the_gelus_block_and_its_op(tmp_path, monkeypatch, capsys):
    """HEAD's model as base; a working tree whose GELU has another backward parts at step 1
    in the backward pass, found in the last block (its forward calls the GELU) down to the
    op, against the base's recorded step; one whose no-decay group decays parts in that
    group's update, with no module to look for."""
    repo = _repository(tmp_path, monkeypatch)
    out = tmp_path / "verdict.json"
    _with_default_variant(repo, "gelu_backward")
    assert main(["train", "--model", "user_lm.py:lm", "--steps", "5", "--base", "HEAD",
                 "--diagnose", "--json", str(out)]) == 1
    diagnosis = json.loads(out.read_text())["diagnosis"]
    assert (diagnosis["stage"], diagnosis["step"]) == ("backward", 1)
    modules = diagnosis["modules"]
    assert modules["first_divergence"] is None
    blocks = len(Subject.load(f"{repo / 'user_lm.py'}:lm").model.blocks)
    assert modules["first_grad_divergence"]["module"] == f"blocks.{blocks - 1}"
    assert modules["first_grad_divergence"]["op"] is not None
    assert "A is the base's code" in capsys.readouterr().out.replace("\n  ", " ")
    _with_default_variant(repo, "decay_norms")
    assert main(["train", "--model", "user_lm.py:lm", "--steps", "5", "--base", "HEAD",
                 "--diagnose", "--json", str(out)]) == 1
    diagnosis = json.loads(out.read_text())["diagnosis"]
    assert (diagnosis["stage"], list(diagnosis["groups"])) == ("optimizer", ["no_decay"])
    assert diagnosis["modules"] is None
    # The norms moved into the decay group: the base's golden holds its groups, the cause is
    # named and no module table (whose verdict would be a pass) stands under the failure.
    _with_default_variant(repo, "norms_in_decay")
    capsys.readouterr()
    assert main(["train", "--model", "user_lm.py:lm", "--steps", "5", "--base", "HEAD",
                 "--diagnose", "--json", str(out)]) == 1
    diagnosis = json.loads(out.read_text())["diagnosis"]
    assert diagnosis["stage"] == "optimizer" and diagnosis["modules"] is None
    assert diagnosis["causes"][0].startswith("5 parameters moved from group no_decay to decay")
    assert "Verdict: pass" not in capsys.readouterr().out
    assert toy_repo.git(repo, "status", "--porcelain").strip() == "M user_lm.py"


def _repository(tmp_path: Path, monkeypatch) -> Path:
    """A git repository holding the user's model, committed; the current folder."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "user_lm.py").write_text((HERE / "user_lm.py").read_text())
    toy_repo.git(repo, "init", "--quiet", "--initial-branch=main")
    toy_repo.git(repo, "config", "user.name", "Toy Author")
    toy_repo.git(repo, "config", "user.email", "toy@example.com")
    toy_repo.git(repo, "add", "-A")
    toy_repo.git(repo, "commit", "--quiet", "-m", "a user's model")
    monkeypatch.chdir(repo)
    monkeypatch.setenv("TORCHPARITY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("USER_LM_VARIANT", raising=False)
    return repo


def _with_default_variant(repo: Path, variant: str) -> None:
    """The working tree's model: the committed one whose default variant is ``variant``."""
    default = 'os.environ.get("USER_LM_VARIANT", "base")'
    source = (HERE / "user_lm.py").read_text()
    (repo / "user_lm.py").write_text(
        source.replace(default, default.replace('"base"', f'"{variant}"')))


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
