"""``dtype=torch.float64``: A and B compared in float64, where changes below fp32 noise show.

The plant is an RMSNorm computing ``rsqrt(clamp_min(mean(x^2), eps))`` instead of
``rsqrt(mean(x^2) + eps)`` (eps 1e-6): the outputs move by about 1e-6 relative, inside fp32's
rounding noise and far outside float64's. The expectation is the planted module, known
independently of the diagnosis.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import torchparity as tp
from torchparity.cli import main
from torchparity.errors import UsageError
from torchparity.reference import build_model, sequence_loss, zoo
from torchparity.reference.norms import RMSNorm

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster

PLANTED = "decoder.layers.1.mlp_norm"


class ClampedRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True).clamp_min(self.eps))
        return self.weight * h.to(x.dtype)


def planted_pair() -> tuple:
    cfg = zoo.get("llama-tiny").config
    model_a = build_model(cfg, seed=0)
    model_b = copy.deepcopy(model_a)
    model_b.get_submodule(PLANTED).__class__ = ClampedRMSNorm
    return model_a, model_b, zoo.make_batch(cfg, batch_size=2, seq_len=8, seed=0)


def test_change_below_fp32_noise_is_not_reported_in_fp32_but_suggests_fp64() -> None:
    model_a, model_b, batch = planted_pair()
    report = tp.diagnose(model_a, model_b, batch, loss_fn=sequence_loss)
    assert report.first_divergence is None, report.render()
    assert report.first_grad_divergence is None, report.render()
    summary = report.summary()
    assert "float32: A and B as given" in summary
    assert "below the noise" in summary and "--dtype fp64" in summary


def test_float64_mode_localises_the_change() -> None:
    model_a, model_b, batch = planted_pair()
    report = tp.diagnose(model_a, model_b, batch, loss_fn=sequence_loss, dtype=torch.float64)
    assert report.first_divergence is not None, report.render()
    assert report.first_divergence.module == PLANTED, report.render()
    assert "float64: A and B both cast to float64" in report.summary()
    # The caller's models are left in their dtype.
    assert next(model_a.parameters()).dtype == next(model_b.parameters()).dtype == torch.float32


def test_identical_models_in_float64_mode_are_identical() -> None:
    model_a, _, batch = planted_pair()
    report = tp.diagnose(model_a, copy.deepcopy(model_a), batch, dtype=torch.float64)
    assert report.first_divergence is None and report.output.verdict == "identical"
    assert "below the noise" not in report.summary()


def test_float64_mode_through_a_recorded_trace(tmp_path: Path) -> None:
    model_a, model_b, batch = planted_pair()
    trace = tp.record(model_a, batch, tmp_path / "base.tptrace", loss_fn=sequence_loss,
                      dtype=torch.float64)
    report = tp.diagnose_against(trace, model_b, batch, loss_fn=sequence_loss)
    assert report.first_divergence.module == PLANTED, report.render()
    assert "float64: A and B both cast to float64" in report.summary()
    plain = tmp_path / "plain.tptrace"
    tp.record(model_a, batch, plain, loss_fn=sequence_loss)
    report = tp.diagnose_against(plain, model_b, batch, loss_fn=sequence_loss)
    assert report.first_divergence is None and "--dtype fp64" in report.summary()


def test_dtype_must_be_floating() -> None:
    model_a, model_b, batch = planted_pair()
    with pytest.raises(UsageError, match="floating torch dtype"):
        tp.diagnose(model_a, model_b, batch, dtype=torch.int64)


FACTORY = """
import copy
from test_diagnose_dtype import planted_pair
from torchparity.reference import sequence_loss

def make_a():
    model_a, _, batch = planted_pair()
    return model_a, batch, sequence_loss

def make_b():
    _, model_b, batch = planted_pair()
    return model_b, batch, sequence_loss
"""


def test_cli_dtype_option(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    (tmp_path / "planted.py").write_text(FACTORY)
    a, b = f"{tmp_path}/planted.py:make_a", f"{tmp_path}/planted.py:make_b"
    assert main(["diagnose", a, b, "--json", str(tmp_path / "fp32.json")]) == 0
    assert "--dtype fp64" in json.loads((tmp_path / "fp32.json").read_text())["summary"]
    assert main(["diagnose", a, b, "--dtype", "float64", "--json",
                 str(tmp_path / "fp64.json")]) == 1
    assert json.loads((tmp_path / "fp64.json").read_text())["first_divergence"]["module"] == PLANTED
    assert main(["record", a, "-o", str(tmp_path / "t"), "--dtype", "fp64"]) == 0
    assert main(["diagnose", b, "--against", str(tmp_path / "t")]) == 1
    capsys.readouterr()
    assert main(["diagnose", b, "--against", str(tmp_path / "t"), "--dtype", "fp64"]) == 2
    with pytest.raises(SystemExit) as exit_info:  # argparse: one line, exit 2
        main(["diagnose", a, b, "--dtype", "int8"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--dtype: invalid choice: 'int8'" in err
