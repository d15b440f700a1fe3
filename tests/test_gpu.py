"""CUDA parity (marker ``gpu``): every CUDA attention backend in every dtype against float64.

``pytest -m gpu`` runs these on the GPU; ``pytest -m gpu --device cpu`` runs the same test
functions on the CPU, where the backends that need CUDA skip with their reason, which proves
the tests' logic on a machine without a GPU. Each test:

- forward and backward of a zoo case on the inputs of its shipped goldens: logits, loss and
  every parameter gradient against the float64 goldens in ``golden/<case>/``, with the manual
  backend in the same dtype on the same device as baseline;
- 20 full training steps (the golden recipe) of an encoder-decoder and a decoder case against
  the float64 trajectory, within the noise band of the manual backend's rounding-only ensemble
  in the same dtype mode on the same device, both trained there once per case and dtype (a
  CUDA run's band is its device's, not the CPU's stored one: ``golden_and_band``; flash and
  cuDNN attention, which take no mask, train the unpadded variant of the recipe); tokens per
  second and the time to the first step go to the terminal summary.

dtype modes: fp32 (TF32 off), tf32 (TF32 on for cuBLAS and cuDNN), bf16 and fp16 (pure
low-precision models for forward/backward; autocast with fp32 master weights, and a grad scaler
for fp16, in training).

A green run means the cells ran: the terminal summary (``tests/conftest.py``) lists per backend
and dtype how many ran, ran forward only, failed or were skipped and why, and a backend that
the machine offers in a dtype but that ran none of its cells fails the run.

Flex attention is compiled on CUDA, and each case and dtype compiles anew; to keep
``pytest -m gpu`` within minutes it runs forward/backward for every case in bf16 and for the
trained cases in every dtype (and trains in every dtype).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import torchparity as tp
from torchparity import backends
from torchparity.errors import BackendUnavailable
from torchparity.golden import cases as golden_cases
from torchparity.golden.store import GoldenStore, default_golden_dir
from torchparity.pytest_plugin import add_summary_line
from torchparity.reference import build_model, sequence_loss, zoo
from torchparity.train.golden_trajectories import golden_and_band, golden_config
from torchparity.train.trainer import (
    DTYPE_MODES,
    Execution,
    TrainConfig,
    Trajectory,
    deterministic,
    train,
)
from torchparity.train.trajectory import NoiseBand, compare_trajectories

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("single_thread", "recompile_room")]

CUDA_BACKENDS = ["sdpa-math", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "flex"]
DTYPES = ["fp32", "tf32", "bf16", "fp16"]
TRAINED_CASES = ["encdec-prenorm", "llama-tiny"]
_PURE_DTYPE = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
               "fp16": torch.float16}


def _forward_backward_params():
    for case in zoo.names():
        for backend in CUDA_BACKENDS:
            for dtype in DTYPES:
                if backend == "flex" and dtype != "bf16" and case not in TRAINED_CASES:
                    continue
                yield pytest.param(case, backend, dtype, id=f"{case}-{backend}-{dtype}")


@pytest.fixture(scope="module")
def recompile_room():
    """Room for flex's one compiled graph per case, dtype and mask layout: past dynamo's
    default recompile limit (8) the compiled function would silently fall back to eager."""
    import torch._dynamo.config as dynamo_config

    name = next(n for n in ("recompile_limit", "cache_size_limit") if hasattr(dynamo_config, n))
    old = getattr(dynamo_config, name)
    setattr(dynamo_config, name, max(old, 512))
    yield
    setattr(dynamo_config, name, old)


def _skip_unless_available(backend: str, device: str, dtype: torch.dtype) -> None:
    reason = backends.available(device, dtype)[backend]
    if reason is not None:
        pytest.skip(reason)


@contextlib.contextmanager
def _mode(dtype: str, backend: str):
    with (deterministic(tf32=DTYPE_MODES[dtype].tf32, warn_only=True),
          backends.use(backend, intercept=False)):  # zoo models only: nothing to intercept
        yield


# --- forward and backward -------------------------------------------------------------------

_goldens: dict[str, dict[str, object]] = {}
_baselines: dict[tuple[str, str, str], dict[str, object]] = {}
_OUTPUTS = ("logits", "loss", "grads")


def _forward_backward(case: str, dtype: torch.dtype, device: str, *, grad: bool = True
                      ) -> dict[str, object]:
    """Logits, loss and (with ``grad``) every parameter's gradient on the inputs of the case's
    goldens, under whatever backend and TF32 setting are in force."""
    model = build_model(zoo.get(case).config, golden_cases.WEIGHT_SEED, dtype=dtype,
                        device=device)
    batch = golden_cases.golden_batch(zoo.get(case), device)
    with torch.set_grad_enabled(grad):
        logits = model(**batch)
        loss = sequence_loss(logits, batch)
    result: dict[str, object] = {"logits": {"logits": logits.detach()},
                                 "loss": {"loss": loss.detach()}}
    if grad:
        loss.backward()
        result["grads"] = {n: p.grad for n, p in model.named_parameters()}
    return result


def _golden(case: str) -> dict[str, object]:
    """The shipped float64 goldens of ``case`` (logits, loss, gradients), checked to be made
    from the weights and inputs the code builds today."""
    if case not in _goldens:
        store = GoldenStore(default_golden_dir(), "torchparity golden update {case}")
        goldens = golden_cases.load_case(store, zoo.get(case))
        now = golden_cases.current_checksums(zoo.get(case))
        for output in _OUTPUTS:
            if goldens[output].summary.get("checksums") != now:
                pytest.fail(f"the weights or inputs of {case} changed since its goldens were "
                            f"made; run `torchparity golden update {case}`", pytrace=False)
        _goldens[case] = {output: goldens[output].tensors for output in _OUTPUTS}
    return _goldens[case]


def _baseline(case: str, dtype: str, device: str) -> dict[str, object]:
    key = (case, dtype, device)
    if key not in _baselines:
        with _mode(dtype, "manual"):
            _baselines[key] = _forward_backward(case, _PURE_DTYPE[dtype], device)
    return _baselines[key]


def _assert_parity(candidate, golden, baseline, compute_dtype: str, outputs) -> None:
    for output in outputs:
        tp.assert_parity(candidate[output], golden[output], baseline[output],
                         golden_cases.OUTPUT_KINDS[output], compute_dtype=compute_dtype)


@pytest.mark.parametrize("case, backend, dtype", list(_forward_backward_params()))
def test_forward_and_backward_match_the_float64_golden(case, backend, dtype, device, gpu_cell):
    pure = _PURE_DTYPE[dtype]
    _skip_unless_available(backend, device, pure)
    golden, baseline = _golden(case), _baseline(case, dtype, device)
    try:
        with _mode(dtype, backend):
            candidate = _forward_backward(case, pure, device)
    except BackendUnavailable as no_backward:
        try:
            with _mode(dtype, backend):
                candidate = _forward_backward(case, pure, device, grad=False)
        except BackendUnavailable as exc:
            pytest.skip(str(exc))
        _assert_parity(candidate, golden, baseline, dtype, ("logits", "loss"))
        gpu_cell.forward_only(str(no_backward))
    _assert_parity(candidate, golden, baseline, dtype, _OUTPUTS)


# --- training steps -------------------------------------------------------------------------

# Flash and cuDNN attention take no mask, so they train on the unpadded variant of the recipe
# (every string of the longest length), whose float64 golden is trained here on the CPU.
_MASKLESS = {"sdpa-flash", "sdpa-cudnn"}
_golden_and_bands: dict[tuple, tuple[Trajectory, NoiseBand]] = {}
_SUMMARY = "torchparity training parity and throughput (20 steps)"


def _recipe(case: str, backend: str) -> TrainConfig:
    config = golden_config(case)
    return config.replace(min_len=config.max_len) if backend in _MASKLESS else config


def _summarise(node, run: Trajectory, verdict: str) -> None:
    ex, padded = run.execution, run.config.min_len < run.config.max_len
    add_summary_line(node, f"{_SUMMARY}, {ex.device}",
                     f"{run.config.case:15s} {'padded' if padded else 'unpadded':8s} "
                     f"{ex.backend:15s} {ex.dtype:5s} {run.tokens_per_second:>10,.0f} tok/s  "
                     f"first step {run.time_to_first_step:6.2f}s  {verdict}")


def _golden_and_band(config: TrainConfig, dtype: str, device: str
                     ) -> tuple[Trajectory, NoiseBand]:
    """The float64 trajectory of ``config`` and its band in ``dtype`` on ``device``, once."""
    key = (config, dtype, device)
    if key not in _golden_and_bands:
        _golden_and_bands[key] = golden_and_band(config, Execution("manual", dtype, device))
    return _golden_and_bands[key]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("case", TRAINED_CASES)
def test_training_steps_follow_the_golden_trajectory(case, backend, dtype, device, request):
    mode = DTYPE_MODES[dtype]
    _skip_unless_available(backend, device, mode.autocast_dtype or mode.param_dtype)
    config = _recipe(case, backend)
    try:
        candidate = train(config, Execution(backend, dtype, device))
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    golden, band = _golden_and_band(config, dtype, device)
    result = compare_trajectories(candidate, golden, band, compute_dtype=dtype)
    _summarise(request.node, candidate,
               f"{result.verdict} (headroom {result.max_headroom:.2f})")
    assert result.ok, result.explain()
