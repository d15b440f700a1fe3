"""The training study (``torchparity calibrate --training``) at toy size, 2 seeds and 3 steps:
the refactors it counts are rounding-only (float64 says so), a bug planted at full strength is
caught and one at 1e-12 is not, the rates are counted from the verdicts, and a horizon is
judged as ``torchparity train --model ... --check --steps N`` judges it. The band's members
under other instruction sets are left out here (each is a process of its own); one test runs a
member in its own process and finds the seed and variant the entry names."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from torchparity import machine, tolerance
from torchparity.calibration import training_report
from torchparity.calibration.rates import Rate
from torchparity.calibration.training import TrainingResults, TrainingSettings, study_training
from torchparity.calibration.training_models import (
    ENTRY,
    ENVIRONMENT,
    REFACTORS,
    SCALED_BUGS,
    UserLM,
)
from torchparity.cli import main
from torchparity.comparison.tensor import json_safe
from torchparity.subject.model import Subject
from torchparity.train.trainer import OWN_ATTENTION, Execution, Trajectory
from torchparity.train.user_model import UserRecipe, train_user_model

pytestmark = pytest.mark.rounding

TOY = TrainingSettings({"fp32": 2}, horizons=(2, 3), refactors=("fused", "heads_permuted"),
                       bugs=("lr_scaled", "decay_norms"), strengths=(1.0, 1e-12))


@pytest.fixture
def native_only(monkeypatch):
    """The band without the members under other instruction sets (a process each)."""
    monkeypatch.setattr(machine, "capabilities", lambda: [machine.native_capability()])


@pytest.fixture(scope="module")
def toy() -> TrainingResults:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(machine, "capabilities", lambda: [machine.native_capability()])
        return study_training(TOY)


def trained(lm: UserLM, steps: int, dtype: str) -> Trajectory:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENVIRONMENT, lm.spec())
        subject = Subject.load(ENTRY)
    return train_user_model(subject, UserRecipe(ENTRY, steps), Execution(OWN_ATTENTION, dtype))


@pytest.mark.parametrize("refactor", list(REFACTORS))
def test_a_refactor_trains_the_originals_trajectory_in_float64(refactor):
    # The recipe takes its cross-entropy of `.float()` logits, float32 even in a float64 run:
    # float64 runs agree to float32 rounding, a few (at most 16) roundings over two steps.
    roundings = 16 * tolerance.unit_roundoff("fp32")
    original, changed = trained(UserLM(1), 2, "fp64"), trained(UserLM(1, refactor), 2, "fp64")
    for quantity, values in original.series().items():
        assert changed.series()[quantity].tolist() == pytest.approx(values.tolist(),
                                                                    rel=roundings)


@pytest.mark.parametrize("bug", list(SCALED_BUGS))
def test_a_bug_of_strength_0_is_no_change(bug):
    # per_micro_batch splits the batch in two: at strength 0 it is the accumulated refactor
    plain = "accumulated" if bug == "per_micro_batch" else "base"
    expected = trained(UserLM(1, plain), 2, "fp32").series()
    assert trained(UserLM(1, bug, 0.0), 2, "fp32").series().keys() == expected.keys()
    for quantity, values in trained(UserLM(1, bug, 0.0), 2, "fp32").series().items():
        assert values.tolist() == expected[quantity].tolist(), quantity


def test_a_bug_at_full_strength_is_caught_and_at_1e_12_is_not(toy):
    for bug in TOY.bugs:
        for horizon in TOY.horizons:
            assert toy.thresholds(bug, "fp32", horizon) == [1.0, 1.0], (bug, horizon)
    negligible = [v for v in toy.verdicts if v.eps == 1e-12]
    assert len(negligible) == 2 * 2 * 2 and not any(v.diverged for v in negligible)
    # caught at the first step already: the run stopped at the first horizon
    assert {v.steps_trained for v in toy.verdicts if v.eps == 1.0} == {2}


def test_the_false_alarm_rate_is_counted_from_the_refactors_verdicts(toy):
    for horizon in TOY.horizons:
        checks = [v for v in toy.verdicts if v.eps is None and v.horizon == horizon]
        assert sorted((v.variant, v.seed) for v in checks) == [
            ("fused", 0), ("fused", 1), ("heads_permuted", 0), ("heads_permuted", 1)]
        assert not any(v.diverged for v in checks)
        assert toy.false_alarms("fp32", horizon) == Rate(0, 4)
        assert toy.largest_share("fp32", horizon) == max(v.headroom for v in checks) < 1
    section = training_report.training_section(toy, command="torchparity calibrate --training")
    assert "| fp32 | 3 | 0 of 4 (0%, <= 53% at 95%) |" in section
    assert "| lr_scaled | the learning-rate schedule times (1 + eps) | fp32 | 2 | 1 | 1 |" \
        in section
    written = json.loads(json.dumps(json_safe(toy.to_dict())))  # what --json writes
    again = TrainingResults.from_dict(written)
    assert training_report.training_section(again, command="torchparity calibrate --training") \
        == section


def test_a_horizon_is_judged_as_a_shorter_check_judges_it(toy, native_only, monkeypatch,
                                                           tmp_path):
    monkeypatch.setenv(ENVIRONMENT, UserLM(1).spec())
    golden = ["--golden-dir", str(tmp_path)]
    assert main(["train", "--model", ENTRY, "--steps", "3", "--update-golden", *golden]) == 0
    for lm, horizon in ((UserLM(1, "lr_scaled", 1.0), 2), (UserLM(1, "fused"), 2),
                        (UserLM(1, "fused"), 3)):
        monkeypatch.setenv(ENVIRONMENT, lm.spec())
        out = tmp_path / "verdict.json"
        status = main(["train", "--model", ENTRY, "--steps", str(horizon), "--check", *golden,
                       "--json", str(out)])
        checked = json.loads(out.read_text())["comparison"]
        (study,) = [v for v in toy.verdicts if (v.seed, v.variant, v.horizon) ==
                    (1, lm.variant, horizon) and v.eps in (None, 1.0)]
        assert status == (1 if study.diverged else 0)
        # one computation in two processes: equal but for the JSON's decimal digits
        assert checked["max_headroom"] == pytest.approx(study.headroom,
                                                        rel=tolerance.unit_roundoff("fp64"))


def test_a_process_of_its_own_builds_the_seed_and_variant_the_environment_names():
    """What a band's member under another instruction set relies on: the entry, loaded in a
    process of its own, builds the model and data of the seed and variant named."""
    code = ("import json, sys; from torchparity.subject.model import Subject; "
            "s = Subject.load(sys.argv[1]); print(json.dumps(["
            "{k: v.double().sum().item() for k, v in s.model.state_dict().items()}, "
            "s.batches(1)['tokens'].tolist()]))")

    def built(lm: UserLM) -> list:
        done = subprocess.run([sys.executable, "-c", code, ENTRY], capture_output=True,
                              env={**os.environ, ENVIRONMENT: lm.spec()}, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    lm = UserLM(1, "fused")
    weights, tokens = built(lm)
    assert weights == {k: v.double().sum().item() for k, v in lm.build().state_dict().items()}
    assert tokens == lm.batches(1)["tokens"].tolist() != UserLM(0).batches(1)["tokens"].tolist()
    assert "blocks.0.attn.qkv.weight" in weights


def test_a_model_is_named_by_its_spec():
    lm = UserLM(3, "lr_scaled", 3e-7)
    assert UserLM.parse(lm.spec()) == lm and UserLM.parse("") == UserLM()
    with pytest.raises(ValueError, match="unknown variant 'fuse'"):
        UserLM(variant="fuse")


def test_the_bound_is_clopper_pearsons():
    # The bisection ends within 2**-60; the binomial sums in logs cost a few dozen roundings.
    roundings = 64 * tolerance.unit_roundoff("fp64")
    assert Rate(0, 10).upper == pytest.approx(1 - 0.05 ** (1 / 10), rel=roundings)
    p = Rate(1, 10).upper  # P(X <= 1) = (1 - p)^10 + 10 p (1 - p)^9 is 5% there
    assert (1 - p) ** 10 + 10 * p * (1 - p) ** 9 == pytest.approx(0.05, rel=roundings)
    assert Rate(10, 10).upper == 1 and math.isnan(Rate(0, 0).upper)
    assert str(Rate(0, 50)) == "0 of 50 (0%, <= 5.8% at 95%)"


@pytest.mark.parametrize(("argv", "message"), [
    (["--seeds", "0"], "--seeds 0: give N or DTYPE=N, N at least 1"),
    (["--seeds", "fp16=3"], "--seeds fp16=3: give N or DTYPE=N"),
    (["--dtype", "fp16"], "--training trains in fp32 or bf16, not fp16"),
    (["--horizon", "0"], "--horizon must be at least 1 step, got 0"),
])
def test_the_command_refuses_bad_options_in_one_line(argv, message, capsys):
    assert main(["calibrate", "--training", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
