"""Training-step parity: determinism, the corpus, CPU backends over 20 steps, planted bugs."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import shutil

import numpy as np
import pytest
import torch

import torchparity as tp
from torchparity import backends, cli, tolerance
from torchparity.errors import BackendUnavailable
from torchparity.golden.store import GoldenMissing, GoldenStale, GoldenStore
from torchparity.pytest_plugin import add_summary_line
from torchparity.reference import zoo
from torchparity.train import trainer as train_module
from torchparity.train.data import BOS, EOS, FIRST_SYMBOL, IGNORE, PAD, SEP, TASKS, Corpus
from torchparity.train.golden_trajectories import (
    STORED_DTYPES,
    UPDATE_COMMAND,
    check_against_golden,
    golden_config,
    golden_store,
    is_stored,
    judge_against_run,
    read_golden_trajectory,
    trajectory_output,
)
from torchparity.train.step_diagnosis.case_step import diagnose_step
from torchparity.train.trainer import Execution, TrainConfig, Trajectory, learning_rate, train
from torchparity.train.trajectory import NoiseBand, compare_trajectories

SHORT = TrainConfig(case="llama-tiny", steps=4)


pytestmark = pytest.mark.usefixtures("single_thread")


def zero_band(run: Trajectory) -> NoiseBand:
    """A band that claims no rounding noise at all: only the floor of the budget remains."""
    return NoiseBand({q: torch.zeros(len(run.records), dtype=torch.float64)
                      for q in run.quantities()}, ["none"], "fp32")


# --- determinism ----------------------------------------------------------------------------


def test_deterministic_applies_its_settings_and_restores_them():
    torch.backends.cuda.matmul.allow_tf32 = True
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
              torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    try:
        with tp.deterministic(seed=3):
            assert torch.are_deterministic_algorithms_enabled()
            assert not torch.is_deterministic_algorithms_warn_only_enabled()
            assert not torch.backends.cuda.matmul.allow_tf32
            assert not torch.backends.cudnn.allow_tf32
            assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"]
        with tp.deterministic(tf32=True):
            assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        after = (torch.are_deterministic_algorithms_enabled(),
                 torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                 torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
        assert after == before
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


def test_deterministic_seeds_every_generator_and_puts_the_streams_back():
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    expected_next = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    with tp.deterministic(seed=7):
        inside = (torch.rand(3), random.random(), np.random.rand())
    # Python's own generators, seeded the documented way, give the values seen inside.
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    assert torch.equal(inside[0], torch.rand(3))
    assert inside[1:] == (random.random(), np.random.rand())
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    with tp.deterministic(seed=7):
        torch.rand(100)
    assert torch.equal(torch.rand(3), expected_next[0])
    assert (random.random(), np.random.rand()) == expected_next[1:]


def test_deterministic_as_a_plain_call_stays_until_restored():
    was = torch.are_deterministic_algorithms_enabled()
    handle = tp.deterministic(seed=0)
    try:
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        handle.restore()
    handle.restore()  # idempotent
    assert torch.are_deterministic_algorithms_enabled() == was


def test_nondeterminism_notes_name_the_cuda_backward_kernels():
    note = train_module.nondeterminism_note
    assert all(note(b, "cpu", warn_only=True) is None for b in backends.names())
    assert note("manual", "cuda", warn_only=True) is None
    assert note("sdpa-math", "cuda", warn_only=True) is None
    assert note("sdpa-flash", "cuda", warn_only=False) is None
    for backend in ("sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "flex", "sdpa"):
        assert backend in note(backend, "cuda", warn_only=True)
    assert "refuses strict" in note("sdpa-cudnn", "cuda", warn_only=False)


# --- the corpus -----------------------------------------------------------------------------


def _solve(task: str, xs: list[int]) -> list[int]:
    return {"copy": xs, "reverse": xs[::-1], "sort": sorted(xs)}[task]


@pytest.mark.parametrize("case", ["llama-tiny", "encdec-prenorm"])
def test_corpus_targets_are_the_task_applied_to_the_string(case):
    corpus = Corpus(zoo.get(case).config, batch_size=12, seed=5)
    batch = corpus.batch(3)
    seen_tasks = set()
    for b in range(batch.n_sentences):
        labels = [t for t in batch.labels[b].tolist() if t != IGNORE]
        assert labels[-1] == EOS
        if "input_ids" in batch.inputs:
            ids = [t for t in batch.inputs["input_ids"][b].tolist() if t != PAD]
            task, xs = TASKS[ids[0] - 4], ids[1:ids.index(SEP)]
            assert ids[ids.index(SEP) + 1:] == labels
        else:
            src = [t for t in batch.inputs["src_ids"][b].tolist() if t != PAD]
            tgt = [t for t in batch.inputs["tgt_ids"][b].tolist() if t != PAD]
            task, xs = TASKS[src[0] - 4], src[1:-1]
            assert src[-1] == EOS and tgt == [BOS, *labels[:-1]]
        seen_tasks.add(task)
        assert all(FIRST_SYMBOL <= x < corpus.vocab for x in xs)
        assert corpus.min_len <= len(xs) <= corpus.max_len
        assert labels[:-1] == _solve(task, xs)
        mask_key = "attention_mask" if "input_ids" in batch.inputs else "tgt_mask"
        ids_key = "input_ids" if "input_ids" in batch.inputs else "tgt_ids"
        assert torch.equal(batch.inputs[mask_key][b].bool(), batch.inputs[ids_key][b] != PAD)
    assert seen_tasks == set(TASKS)


def test_corpus_is_a_pure_function_of_seed_and_step_with_a_fixed_shape():
    corpus = Corpus(zoo.get("llama-tiny").config, batch_size=4)
    first, again, other = corpus.batch(1), corpus.batch(1), corpus.batch(2)
    assert torch.equal(first.inputs["input_ids"], again.inputs["input_ids"])
    assert not torch.equal(first.inputs["input_ids"], other.inputs["input_ids"])
    assert first.inputs["input_ids"].shape == other.inputs["input_ids"].shape
    assert not torch.equal(Corpus(corpus.model, 4, seed=1).batch(1).labels, first.labels)


def test_a_corpus_of_equal_lengths_is_unpadded_and_passes_no_masks():
    for case in ("llama-tiny", "encdec-prenorm"):
        batch = Corpus(zoo.get(case).config, batch_size=4, min_len=6, max_len=6).batch(1)
        assert not any(key.endswith("mask") for key in batch.inputs)
        assert all(bool((ids != PAD).all()) for ids in batch.inputs.values())


def test_learning_rate_warms_up_linearly_then_decays_to_the_floor():
    config = TrainConfig(steps=20, lr=1e-3, warmup_steps=4, min_lr_ratio=0.1)
    rates = [learning_rate(config, s) for s in range(1, 21)]
    # Each rate is at most three float64 roundings (the decimals written, a product) from the
    # value expected, each within a unit roundoff.
    roundings = 4 * tolerance.unit_roundoff("fp64")
    assert rates[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3], rel=roundings)
    assert all(a > b for a, b in zip(rates[3:], rates[4:], strict=False))
    assert rates[-1] == pytest.approx(1e-4, rel=roundings)


# --- runs -----------------------------------------------------------------------------------


def test_two_identical_runs_are_bit_identical_on_cpu():
    a, b = train(SHORT), train(SHORT)
    for quantity, values in a.series().items():
        assert torch.equal(values, b.series()[quantity]), quantity
    assert compare_trajectories(a, b, zero_band(b)).verdict == "identical"


def test_log_lines_have_the_production_format():
    lines: list[str] = []
    train(SHORT.replace(steps=3), log=lines.append, log_every=2)
    pattern = (r"Step (\d+)/3; acc: +[\d.]+; ppl: +[\d.]+; xent: [\d.]+; lr: [\d.e+-]+; "
               r"tok/s: +\d+; \d+s elapsed")
    assert [int(re.fullmatch(pattern, line).group(1)) for line in lines] == [2, 3]


@pytest.mark.slow
def test_the_loss_really_falls_below_what_ignoring_the_input_allows():
    config = TrainConfig(case="encdec-prenorm", task="copy", steps=150, batch_size=16,
                         lr=1e-2, warmup_steps=10)
    run = train(config)
    corpus = config.corpus()
    # A model that knows each string's length but not its symbols predicts EOS exactly and
    # is uniform over the symbols elsewhere: n/(n+1) * log(symbols) per target token.
    lengths = range(corpus.min_len, corpus.max_len + 1)
    blind = sum(n / (n + 1) for n in lengths) / len(lengths) * math.log(corpus.n_symbols)
    assert run.series()["loss"][-10:].mean() < blind


@pytest.mark.parametrize("case", ["llama-tiny", "encdec-prenorm", "alibi"])
@pytest.mark.parametrize("backend, dtype", [("sdpa", "fp32"), ("sdpa-math", "fp32"),
                                            ("sdpa-flash", "fp32"), ("sdpa", "bf16")])
def test_cpu_backends_follow_the_golden_trajectory_for_20_steps(case, backend, dtype,
                                                                 request):
    config = golden_config(case)
    candidate = train(config, Execution(backend, dtype))
    result = check_against_golden(candidate)
    assert result.ok, result.explain()
    assert result.calibration.startswith("noise band of") and result.compute_dtype == dtype
    assert len(result.points) == 3 * config.steps
    headroom = result.headroom_by_quantity()
    add_summary_line(
        request.node, "torchparity training parity (cpu, 20 steps)",
        f"{case:16s} {backend:11s} {dtype} {result.verdict:9s} headroom " +
        " ".join(f"{q}={h:.2f}" for q, h in headroom.items()))


def test_training_a_backend_without_a_cpu_backward_fails_with_the_reason():
    with pytest.raises(BackendUnavailable, match="flex has no backward pass on the CPU"):
        train(SHORT, Execution("flex"))


def test_micro_batches_change_the_rounding_only_and_stay_within_the_stored_band():
    config = golden_config("llama-tiny")
    split = train(config.replace(accum_steps=2))
    plain = train(config)
    differ = any(not torch.equal(split.series()[q], plain.series()[q])
                 for q in ("loss", "grad_norm", "update_norm"))
    assert differ, "a split that rounds identically tests nothing"
    assert is_stored(split.config, split.execution)  # judged by the stored band
    result = check_against_golden(split)
    assert result.ok, result.explain()


# --- planted bugs ---------------------------------------------------------------------------


def _sentence_normalisation(batch, normalization):
    return batch.n_sentences


def _no_clipping(params, norm, max_norm):
    return None


def _decay_group_without_decay(model, weight_decay):
    groups = _correct_param_groups(model, weight_decay)
    groups[0]["weight_decay"] = 0.0
    return groups


_correct_param_groups = train_module.param_groups


def _first_clipped_step(golden: Trajectory) -> int:
    clip = golden.config.clip_norm
    return next(r.step for r in golden.records if r.grad_norm > clip)


@pytest.mark.parametrize("bug, function, expected", [
    # Dividing by sentences scales the first gradient by tokens/sentences.
    ("loss normalised by sentences", "loss_denominator", lambda g: (1, {"grad_norm"})),
    # Weight decay acts in the first update (AdamW's decoupled term lr * wd * w).
    ("no weight decay in the matrix group", "param_groups", lambda g: (1, {"update_norm"})),
    # Clipping rescales the gradient from the first step whose norm exceeds the limit. AdamW
    # divides by the gradient's own scale, so at the very first step only eps can tell a
    # rescaled gradient apart; from the second clipped step on the moments differ.
    ("clipping switched off", "clip_gradients",
     lambda g: (_first_clipped_step(g), {"update_norm", "loss"})),
])
def test_planted_training_bugs_are_caught_at_the_right_step(bug, function, expected,
                                                            monkeypatch):
    replacement = {"loss_denominator": _sentence_normalisation, "clip_gradients": _no_clipping,
                   "param_groups": _decay_group_without_decay}[function]
    config = golden_config("llama-tiny")
    golden, _ = read_golden_trajectory("llama-tiny")
    monkeypatch.setattr(train_module, function, replacement)
    candidate = train(config)
    monkeypatch.undo()
    result = check_against_golden(candidate)
    first = result.first_divergence
    step, quantities = expected(golden)
    assert first is not None, f"{bug} went unnoticed: {result.explain()}"
    allowed = (step, step + 1) if function == "clip_gradients" else (step,)
    assert first.step in allowed and first.quantity in quantities, result.explain()
    assert f"part at step {first.step}" in result.explain()


def test_a_wrong_attention_backend_is_localised_by_diagnose_at_the_first_diverging_step(
        monkeypatch):
    def halved_scale(q, k, v, mask, bias, scale, causal, name):
        return backends._manual(q, k, v, mask, bias, scale / 2, causal, name)

    monkeypatch.setitem(backends._IMPLEMENTATIONS, "sdpa-math", halved_scale)
    config = TrainConfig(case="llama-tiny", steps=3)
    candidate = train(config, Execution("sdpa-math"))
    result = judge_against_run(candidate, config, Execution("manual"))
    first = result.first_divergence
    assert first is not None and first.step == 1 and first.quantity == "loss"
    report = diagnose_step(config, Execution("manual"), Execution("sdpa-math"), first.step,
                           backward=False)
    assert report.first_divergence is not None
    assert report.first_divergence.module.endswith("attn"), report.render()


# --- the judge on constructed trajectories --------------------------------------------------


def _with(run: Trajectory, step: int, **changes) -> Trajectory:
    records = list(run.records)
    records[step - 1] = dataclasses.replace(records[step - 1], **changes)
    return dataclasses.replace(run, records=records)


def test_a_nan_where_the_reference_is_finite_diverges_at_that_step():
    golden, band = read_golden_trajectory("llama-tiny")
    broken = _with(golden, 4, loss=math.nan)
    assert compare_trajectories(golden, golden, band, compute_dtype="fp32").ok
    result = compare_trajectories(broken, golden, band, compute_dtype="fp32")
    assert result.first_divergence.step == 4
    assert "nan" in result.first_divergence.note


def test_an_fp16_skipped_step_is_excused_only_where_a_member_of_the_band_overflowed_too():
    golden, band = read_golden_trajectory("llama-tiny")
    skipped = _with(golden, 2, grad_norm=math.inf, update_norm=0.0, skipped=True)
    alone = compare_trajectories(skipped, golden, band, compute_dtype="fp16")
    assert alone.first_divergence.step == 2
    overflowed = band.spread["grad_norm"].clone()
    overflowed[1] = math.inf  # a member's fp16 step 2 overflowed: its gradient norm is inf
    both = compare_trajectories(skipped, golden, NoiseBand(
        {**band.spread, "grad_norm": overflowed}, band.members, "fp16"), compute_dtype="fp16")
    assert all(p.ok for p in both.points if p.step == 2)
    assert any("skipped" in p.note for p in both.points)


def test_trajectories_of_different_recipes_are_refused():
    a = train(SHORT)
    with pytest.raises(ValueError, match="different recipes"):
        compare_trajectories(train(SHORT.replace(lr=1e-3)), a, zero_band(a))


# --- goldens --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", STORED_DTYPES)
@pytest.mark.parametrize("case", zoo.names())
def test_shipped_golden_trajectories_are_fresh_with_a_measured_band(case, dtype):
    golden, band = read_golden_trajectory(case, dtype)
    assert len(golden.records) == golden_config(case).steps
    assert all(math.isfinite(r.loss) and r.update_norm > 0 for r in golden.records)
    # The plain run and the runs on weights moved by one rounding, at least.
    assert len(band.members) >= 1 + tolerance.BAND_REROUNDINGS
    assert all(m.startswith(f"manual {dtype} cpu") for m in band.members), band.members
    for quantity, spread in band.spread.items():
        # Measured, not assumed: rounding moved every quantity of some member by the end.
        assert torch.isfinite(spread).all() and spread[-1] > 0, quantity


def test_only_the_golden_recipe_in_a_stored_dtype_is_read_from_the_store():
    config = golden_config("llama-tiny")
    assert is_stored(config, Execution("sdpa", "fp32"))
    assert is_stored(config.replace(accum_steps=4), Execution(dtype="bf16"))
    assert not is_stored(config, Execution(dtype="tf32"))
    assert not is_stored(config, Execution(dtype="fp32", device="cuda"))
    assert not is_stored(config.replace(lr=1e-3), Execution(dtype="fp32"))


def test_a_golden_made_with_another_recipe_is_stale_with_the_fix(tmp_path):
    source = golden_store().paths("llama-tiny", trajectory_output("fp32"))
    store = GoldenStore(tmp_path, UPDATE_COMMAND)
    target = store.paths("llama-tiny", trajectory_output("fp32"))
    target[0].parent.mkdir()
    for src, dst in zip(source, target, strict=True):
        shutil.copy(src, dst)
    summary = json.loads(target[1].read_text())
    summary["train_config"]["lr"] = 1.0
    target[1].write_text(json.dumps(summary))
    with pytest.raises(GoldenStale, match="training recipe.*torchparity train --case llama-tiny "
                                          "--update-golden"):
        read_golden_trajectory("llama-tiny", "fp32", store)
    with pytest.raises(GoldenMissing, match="--update-golden"):
        read_golden_trajectory("mqa", "fp32", store)


# --- the command line -----------------------------------------------------------------------


def test_cli_trains_checks_against_the_golden_and_writes_json(tmp_path, capsys):
    out = tmp_path / "run.json"
    code = cli.main(["train", "--case", "llama-tiny", "--backend", "sdpa", "--check",
                     "--log-every", "10", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "Step 20/20; acc:" in printed and "within: sdpa fp32 cpu vs manual fp64" in printed
    assert "training the float64 golden" not in printed  # read from the store
    data = json.loads(out.read_text())
    assert data["comparison"]["verdict"] == "within"
    assert data["comparison"]["calibration"].startswith("noise band of")
    assert len(data["trajectory"]["records"]) == 20


def test_cli_another_recipe_trains_its_golden_and_band_here_and_says_so(capsys):
    code = cli.main(["train", "--case", "llama-tiny", "--steps", "3", "--backend", "sdpa",
                     "--check"])
    printed = " ".join(capsys.readouterr().out.split())
    assert code == 0, printed
    assert re.search(r"training the float64 golden and the noise band \(\d+ rounding-only runs "
                     r"of manual fp32 cpu\) here: the recipe is not the golden one", printed)
    assert "within: sdpa fp32 cpu vs manual fp64 cpu (noise band of" in printed


def test_cli_against_a_backend_is_judged_within_that_runs_band(capsys):
    code = cli.main(["train", "--case", "llama-tiny", "--steps", "3", "--backend", "sdpa",
                     "--against", "manual"])
    printed = " ".join(capsys.readouterr().out.split())
    assert code == 0, printed
    assert "rounding-only runs of it for the noise band" in printed
    assert "within: sdpa fp32 cpu vs manual fp32 cpu (noise band of" in printed


def test_cli_check_catches_a_training_code_bug_against_the_stored_golden(monkeypatch, capsys):
    # The band stored with the golden was measured by the code that made the golden, so the
    # bug cannot inflate the budget as a band trained by the same buggy code would.
    monkeypatch.setattr(train_module, "loss_denominator", _sentence_normalisation)
    code = cli.main(["train", "--case", "llama-tiny", "--check"])
    printed = capsys.readouterr().out
    assert code == 1 and "part at step 1" in printed, printed


@pytest.mark.parametrize("argv, message", [
    (["--case", "nope"], "unknown zoo case 'nope'"),
    (["--case", "llama-tiny", "--backend", "flex"], "flex has no backward pass on the CPU"),
    (["--case", "llama-tiny", "--task", "spell"], "task='spell' is invalid"),
    (["--case", "llama-tiny", "--batch-size", "6", "--accum", "4"], "multiple of accum_steps"),
    (["--case", "llama-tiny", "--device", "tpu9"], "--device 'tpu9' is not a torch device"),
    (["--case", "all"], "--case all is only for --update-golden"),
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert cli.main(["train", "--steps", "2", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
def test_compiled_training_follows_the_golden_and_pays_for_compiling_in_its_first_step():
    candidate = train(golden_config("llama-tiny"), Execution(compile=True))
    result = check_against_golden(candidate)
    assert result.ok, result.explain()
    steady = max(r.seconds for r in candidate.records[1:])
    assert candidate.time_to_first_step > steady
