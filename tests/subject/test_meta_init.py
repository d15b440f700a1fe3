"""A model built on the meta device is materialised and filled by the factory's ``init``; a
parameter or buffer ``init`` leaves unfilled (a non-persistent buffer the model computed when
built, which the meta model does not hold) is refused in one line naming it, before any run
reads its garbage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchparity.cli import main
from torchparity.subject import Subject

FACTORIES = '''
import torch
from torch import nn

import torchparity as tp


class Rotary(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("freqs", self.frequencies(dim), persistent=False)

    @staticmethod
    def frequencies(dim: int) -> torch.Tensor:
        return 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim)

    def forward(self, x):
        angles = torch.arange(x.shape[1])[:, None] * self.freqs
        return x * angles.cos().repeat(1, 2)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.rotary = nn.Linear(8, 8), Rotary(8)

    def forward(self, x):
        return self.rotary(self.proj(x))


def _on_meta(init):
    with torch.device("meta"):
        model = Model()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    return {"model": model, "inputs": (x,), "init": init}


def weights_only():
    return _on_meta(lambda model: tp.init_weights(model, seed=0))


def _weights_and_frequencies(model):
    tp.init_weights(model, seed=0)
    model.rotary.freqs.copy_(Rotary.frequencies(8))


def weights_and_frequencies():
    return _on_meta(_weights_and_frequencies)
'''


@pytest.fixture
def models(tmp_path: Path) -> Path:
    path = tmp_path / "meta_models.py"
    path.write_text(FACTORIES)
    return path


def test_a_buffer_init_does_not_fill_is_named_in_one_line(models, tmp_path, capsys):
    golden = tmp_path / "golden"
    status = main(["golden", "update", "--model", f"{models}:weights_only",
                   "--golden-dir", str(golden)])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert len(err.splitlines()) == 1, err
    assert "its init left buffer rotary.freqs unfilled" in err
    assert not golden.exists() or not any(golden.rglob("*.safetensors"))


def test_a_buffer_init_computes_again_is_the_model_built_whole(models):
    subject = Subject.load(f"{models}:weights_and_frequencies")
    frequencies = 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
    assert torch.equal(subject.model.rotary.freqs, frequencies)
    assert not any(t.isnan().any() for t in subject.model.state_dict().values())
