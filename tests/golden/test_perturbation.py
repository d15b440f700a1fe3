"""The reference cell's weights moved by one float64 rounding: each parameter's factors are the
period of factors read from an offset its name fixes, wrapping around, for any size."""

import pytest
import torch

from torchparity.golden import model_runs
from torchparity.sketching import seed_of


@pytest.mark.parametrize("numel", [1, 1000, model_runs._PERIOD - 3, model_runs._PERIOD,
                                   2 * model_runs._PERIOD + 11])
@pytest.mark.parametrize("name", ["lm_head.weight", "model.layers.0.mlp.up_proj.weight"])
def test_a_parameter_is_moved_by_the_period_read_from_its_names_offset(numel: int,
                                                                        name: str) -> None:
    value = torch.randn(numel, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    offset = seed_of(f"perturb.{name}") % model_runs._PERIOD
    period = model_runs._perturbation_factors()
    index = (offset + torch.arange(numel) % model_runs._PERIOD) % model_runs._PERIOD
    expected = value * period[index]
    moved = model_runs.perturbation(name, value.clone())
    assert torch.equal(moved, expected)
    assert 0 < (moved - value).abs().max() <= 2.0**-51 * value.abs().max()  # one rounding
