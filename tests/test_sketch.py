"""Sketches: the estimate of an error's RMS has the spread the tolerance table states, a
sketched comparison passes legitimate reorderings and catches planted changes, and a sketch
is linear, deterministic and exact in its statistics and slices."""

from __future__ import annotations

import math

import pytest
import torch

import torchparity as tp
from torchparity import sketching, tolerance
from torchparity.comparison import StructureMismatch

SMALL_K = 1024  # the spread depends on k alone; a smaller k keeps the test fast


def test_estimate_of_a_dense_error_has_the_stated_spread():
    """Over 64 names (64 independent bucket draws) the RMS estimate of a dense error is
    unbiased, spreads by about 1 / sqrt(2k) and stays within z standard deviations."""
    gen = torch.Generator().manual_seed(0)
    error = torch.randn(50_000, generator=gen, dtype=torch.float64) * torch.rand(
        50_000, generator=gen, dtype=torch.float64)  # uneven magnitudes, as rounding errors
    zero = torch.zeros_like(error)
    true = error.square().mean().sqrt().item()
    ratios = torch.tensor([
        sketching.error_estimate(sketching.sketch(error, f"t{i}", size=SMALL_K),
                                 sketching.sketch(zero, f"t{i}", size=SMALL_K)) / true
        for i in range(64)])
    spread = tolerance.sketch_spread(SMALL_K)
    assert abs(ratios.mean().item() - 1) < 3 * spread / math.sqrt(len(ratios))
    assert 0.6 * spread < ratios.std().item() < 1.3 * spread
    assert (ratios - 1).abs().max().item() < tolerance.SKETCH.confidence * spread


def test_a_sketch_made_again_is_reused_only_while_its_tensor_is_unchanged(monkeypatch):
    """A tensor sketched again while unchanged gets the sketch made of it, also through another
    tensor object reading the same memory (detached, or a view of the same elements); one
    changed in place since then, through any view, a new one; a bucket stream reused is the
    stream drawn afresh."""
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(2))
    first = sketching.sketch(x, "x")
    assert sketching.sketch(x, "x") is first
    assert sketching.sketch(x.detach(), "x") is first
    assert sketching.sketch(x.view(100, 100).reshape(-1), "x") is first
    assert sketching.sketch(x[1:], "x") is not first
    x.view(100, 100)[0].mul_(2)
    assert sketching.sketch(x, "x") is not first
    x.view(100, 100)[0].div_(2)
    x.mul_(2)
    again = sketching.sketch(x, "x")
    assert again.rms == 2 * first.rms  # doubling every element is exact, and so is its RMS
    monkeypatch.setattr(sketching, "_STREAMS", sketching._Streams())  # nothing drawn yet
    monkeypatch.setattr(sketching, "_MADE", sketching._Made())
    assert sketching.sketch(x.clone(), "x").same_values(again)


def test_a_tensor_that_wraps_another_is_sketched_as_its_values():
    """A functional collective's result (what a tensor-parallel layer returns) wraps a tensor
    and has no storage whose data can be read: it is sketched as the tensor it wraps."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    assert sketching.sketch(AsyncCollectiveTensor(x), "x").same_values(
        sketching.sketch(x.clone(), "x"))


def test_a_change_of_one_element_is_estimated_exactly():
    zero = torch.zeros(300_000)
    one = zero.clone()
    one[123_456] = 3.0
    estimate = sketching.error_estimate(sketching.sketch(one, "w"), sketching.sketch(zero, "w"))
    # The one bucket holds 3.0 exactly; the estimate and the expected value are each a few
    # float64 roundings away from 3 / sqrt(n) (two square roots, two quotients, a product).
    roundings = 8 * tolerance.unit_roundoff("fp64")
    assert estimate == pytest.approx(3.0 / math.sqrt(one.numel()), rel=roundings)


def test_sketch_is_linear_deterministic_and_exact_in_its_statistics():
    gen = torch.Generator().manual_seed(1)
    n = sketching.CHUNK + 1000  # two chunks of the bucket stream
    # Multiples of 2**-5 below 2**5: every float64 sum of them, of their squares and of their
    # bucket shares is exact (at most 2**33 in steps of 2**-10), so linearity and the
    # statistics hold bit for bit, with no rounding to allow for but the last division.
    a, b = (torch.randint(-2**10, 2**10, (n,), generator=gen).float() / 32 for _ in "ab")
    sa, sb, sd = (sketching.sketch(x, "x") for x in (a, b, a.double() - b.double()))
    assert sketching.sketch(a.clone(), "x").same_values(sa)
    assert torch.equal(sa.projection - sb.projection, sd.projection)
    values = a.double()
    assert sa.rms == math.sqrt(values.square().sum().item() / n)
    assert sa.absmax == values.abs().max().item()
    assert sa.mean == values.sum().item() / n
    assert not sketching.sketch(a, "other").same_values(sa)


def test_slices_are_the_exact_first_and_last_rows():
    x = torch.arange(6 * 5000, dtype=torch.float32).reshape(6, 5000)
    sketched = sketching.sketch(x, "x")
    rows = tolerance.SKETCH.slice_elements
    assert torch.equal(sketched.slices, torch.cat([x[0, :rows], x[-1, :rows]]))
    assert sketched.slice_index(rows + 7) == (5, 7)


def _problem(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(96, 512, generator=gen, dtype=torch.float64)
    w = torch.randn(512, 512, generator=gen, dtype=torch.float64) / math.sqrt(512)
    return x, w


def _split_k(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The same product with its reduction in two halves: another legitimate order."""
    x, w = x.to(dtype), w.to(dtype)
    half = x.shape[1] // 2
    return x[:, :half] @ w[:half] + x[:, half:] @ w[half:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["forward", "grad"])
@pytest.mark.parametrize("seed", range(4))
def test_sketched_comparison_passes_another_reduction_order(monkeypatch, dtype, kind, seed):
    monkeypatch.setenv(sketching.SKETCH_ABOVE_ENV, "1000")
    x, w = _problem(seed)
    golden = {"y": sketching.sketch(x @ w, "y")}
    baseline = {"y": x.to(dtype) @ w.to(dtype)}
    result = tp.compare({"y": _split_k(x, w, dtype)}, golden, baseline, kind)
    assert result.ok, result.explain()
    assert "sketched" in " ".join(result.tensors[0].notes)


@pytest.mark.parametrize("seed", range(4))
def test_sketched_comparison_catches_a_change_the_full_rule_catches_with_room(seed):
    """A change of the weights whose RMS effect is twice what the full RMS rule lets pass,
    more than the sketch's margin squared costs, diverges; so does one confined to the last
    row (in the slices, judged max-abs)."""
    x, w = _problem(seed)
    golden, baseline = x @ w, x.float() @ w.float()
    exact = tp.compare({"y": _split_k(x, w, torch.float32)}, {"y": golden}, {"y": baseline},
                       "grad").tensors[0]
    shift = 2 * exact.budget.value / (x @ w).square().mean().sqrt().item()
    changed = _split_k(x, w * (1 + shift), torch.float32)
    sketched = tp.compare({"y": changed}, {"y": sketching.sketch(golden, "y")},
                          {"y": baseline}, "grad")
    assert not sketched.ok, sketched.explain()
    one_row = baseline.clone()
    one_row[-1, 3] += 1e-3 * golden.abs().max().item()
    assert not tp.compare({"y": one_row}, {"y": sketching.sketch(golden, "y")},
                          {"y": baseline}, "forward").ok


def test_a_nan_in_a_sketched_candidate_diverges():
    x, w = _problem(0)
    candidate = (x.float() @ w.float())
    candidate[40, 40] = math.nan
    result = tp.compare({"y": candidate}, {"y": sketching.sketch(x @ w, "y")},
                        {"y": x.float() @ w.float()}, "forward")
    assert not result.ok and "NaN/inf" in result.explain()


def test_sketches_of_other_buckets_are_refused_by_path():
    x, w = _problem(0)
    with pytest.raises(StructureMismatch, match=r'outputs\["y"\].*other buckets'):
        tp.compare({"y": sketching.sketch(x @ w, "a")}, {"y": sketching.sketch(x @ w, "b")})


def test_sketched_gradients_share_the_pass_noise_with_exact_ones(monkeypatch):
    """Gradients of one pass, some sketched and some exact, are judged together: a legitimate
    order passes, and the sketched member reports its estimate."""
    x, w = _problem(2)
    grads64 = {"layer.proj.weight": x.T @ (x @ w), "layer.proj.bias": (x @ w).sum(0)}
    grads32 = {"layer.proj.weight": x.float().T @ (x.float() @ w.float()),
               "layer.proj.bias": (x.float() @ w.float()).sum(0)}
    legit = {"layer.proj.weight": _split_k(x.T, x @ w, torch.float32),
             "layer.proj.bias": (x.float() @ w.float()).flip(0).sum(0)}
    golden = {"layer.proj.weight": sketching.sketch(grads64["layer.proj.weight"],
                                                    "layer.proj.weight"),
              "layer.proj.bias": grads64["layer.proj.bias"]}
    result = tp.compare(legit, golden, grads32, "grad")
    assert result.ok, result.explain()
    assert any("sketched" in " ".join(t.notes) for t in result.tensors)


def test_a_sketch_of_a_padded_tensor_leaves_the_padding_out():
    """Padded positions hold anything in the candidate (a padded query attends to nothing):
    the sketch was made with them at 0 and the candidate is masked alike, so garbage there
    passes while a change at a judged position still diverges."""
    torch.manual_seed(0)
    golden = torch.randn(2, 64, 2048, dtype=torch.float64)
    padding = torch.zeros(2, 64, dtype=torch.bool)
    padding[1, 48:] = True
    baseline = golden.float()
    sketched = {"h": sketching.sketch(sketching.masked(golden, padding), "h")}
    garbage = baseline.clone()
    garbage[1, 48:] = 1e6
    result = tp.compare({"h": garbage}, sketched, {"h": baseline}, padding=padding)
    assert result.ok, result.explain()
    assert result.tensors[0].left_out == 16 and "Left out" in result.explain()
    assert not tp.compare({"h": garbage}, {"h": sketching.sketch(golden, "h")},
                          {"h": baseline}).ok  # judged whole, the garbage diverges
    changed = garbage.clone()
    changed[0, 10] += 1e-3
    assert not tp.compare({"h": changed}, sketched, {"h": baseline}, padding=padding).ok


def test_a_float64_sketch_is_the_same_wherever_its_tensor_sits() -> None:
    # A float64 tensor is sketched where it lies (no float64 copy is made of it): its RMS
    # must not depend on where in memory that is (a view, a tensor read from a trace), which
    # MKL's dot does on values of a wide range.
    n = 1 << 20
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(n, dtype=torch.float64, generator=generator) * \
        torch.randn(n, dtype=torch.float64, generator=generator).mul(3).exp()
    expected = sketching.sketch(values, "output")
    for offset in range(1, 8):
        buffer = torch.empty(n + offset, dtype=torch.float64)
        buffer[offset:] = values
        assert sketching.sketch(buffer[offset:], "output").same_values(expected)


def test_a_stream_drawn_once_is_not_kept(monkeypatch):
    # A golden update sketches each gradient once: holding its stream would only cost memory.
    monkeypatch.setattr(sketching, "_STREAMS", sketching._Streams())
    monkeypatch.setattr(sketching, "_MADE", sketching._Made())
    x = torch.randn(sketching.CHUNK + 7, generator=torch.Generator().manual_seed(3))
    first = sketching.sketch(x, "x")
    assert not sketching._STREAMS._kept
    assert sketching.sketch(x.clone(), "x").same_values(first)
    assert len(sketching._STREAMS._kept) == 2  # drawn twice: kept (both chunks)
