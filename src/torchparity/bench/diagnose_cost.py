"""Part ``diagnose``: what :func:`torchparity.diagnose` costs beside the plain step it explains.

On the first case at the first size and dtype, ``manual`` against ``sdpa``: ``diagnose`` (full
and streaming capture; also with a divergence planted in B, forward or gradient-only, so the op
drill-down runs) against a plain forward+backward of both, and ``--against`` a recorded trace
against one of B, in time, peak memory and by stage.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from torchparity.bench.models import model_config, size_fields, timing_model
from torchparity.bench.rounds import Progress, Row, interleaved, na_row, paired_ratio
from torchparity.bench.settings import DIAGNOSE_BACKENDS, BenchSettings, Size
from torchparity.bench.stages import per_plain, stage_seconds
from torchparity.bench.timing import peak_bytes, wall_time
from torchparity.diagnosis.pipelines.forward import diagnose, diagnose_against, record
from torchparity.dtypes import torch_dtype
from torchparity.reference import sequence_loss, zoo

if TYPE_CHECKING:
    from torchparity.diagnosis.reports.diagnosis import DiagnosisReport


def diagnose_rows(settings: BenchSettings, progress: Progress) -> list[Row]:
    """One row: seconds, peak bytes and stages of each contender, and the targets' ratios."""
    if settings.threads:
        torch.set_num_threads(settings.threads)
    return [_diagnose_case(settings.cases[0], settings.sizes[0], settings.dtypes[0],
                           settings, progress)]


def _diagnose_case(case: str, size: Size, dtype: str, settings: BenchSettings,
                   progress: Progress) -> Row:
    device = torch.device(settings.device)
    config = model_config(case, size)
    fields = {**size_fields(case, config, size), "dtype": dtype,
              "models": " vs ".join(DIAGNOSE_BACKENDS)}
    model_a, model_b = (timing_model(config.replace(attention_backend=name), device,
                                     torch_dtype(dtype)) for name in DIAGNOSE_BACKENDS)
    batch = {key: value.to(device) for key, value in
             zoo.make_batch(config, size.batch_size, size.seq_len, seed=0, padding="none").items()}

    def plain(*models: torch.nn.Module) -> Callable[[], None]:
        def run_once() -> None:
            for model in models:
                model.zero_grad(set_to_none=True)
                sequence_loss(model(**batch), batch).backward()
        return run_once

    reports: dict[str, DiagnosisReport] = {}

    planted = copy.deepcopy(model_a)
    planted.decoder.layers[0].attn_norm.eps *= 1000  # a divergence: the drill-down runs
    planted_grad = copy.deepcopy(model_a)
    _scale_gradient(planted_grad.decoder.layers[0].mlp_norm)

    def diagnosis(name: str, stream: bool, b: torch.nn.Module = model_b
                  ) -> Callable[[], None]:
        def run_once() -> None:
            for model in (model_a, b):
                model.zero_grad(set_to_none=True)
            reports[name] = diagnose(model_a, b, batch, loss_fn=sequence_loss,
                                     stream=stream, progress=False)
        return run_once

    def against() -> None:  # B against a trace A's revision recorded
        model_b.zero_grad(set_to_none=True)
        reports["against"] = diagnose_against(trace, model_b, batch, loss_fn=sequence_loss,
                                              progress=False)

    contenders = {"plain": plain(model_a, model_b), "diagnose": diagnosis("diagnose", False),
                  "stream": diagnosis("stream", True),
                  "planted": diagnosis("planted", False, planted),
                  "planted_grad": diagnosis("planted_grad", False, planted_grad),
                  "plain_b": plain(model_b),
                  "against": against}
    progress.start("diagnose", len(contenders) * (1 + settings.warmup + settings.rounds))
    try:
        with tempfile.TemporaryDirectory(prefix="torchparity-bench-") as tmp:
            trace = record(model_a, batch, Path(tmp) / "a.tptrace", loss_fn=sequence_loss,
                           progress=False)
            times = interleaved(list(contenders), lambda name: wall_time(contenders[name], device),
                                settings.rounds, settings.warmup, progress, f"diagnose {case}")
            timed = dict(reports)  # the last round's: the peak-memory runs are profiled
            peaks = {}
            for name, contender in contenders.items():
                progress.advance(f"diagnose {case}: peak memory, {name}")
                peaks[name] = peak_bytes(contender, device)
    except Exception as exc:  # a failing diagnose is a finding to report, not a crash
        return na_row(f"diagnose failed: {type(exc).__name__}: {str(exc).splitlines()[0]}",
                      **fields)
    row = {**fields, "status": "ok"}
    for name in contenders:
        row[f"{name}_s"] = statistics.median(times[name])
        row[f"{name}_peak_bytes"] = peaks[name]
    for name in ("diagnose", "stream", "planted", "planted_grad"):
        row[f"{name}_time_ratio"] = 1 / paired_ratio(times["plain"], times[name])
        row[f"{name}_peak_ratio"] = peaks[name] / peaks["plain"]
    row["against_time_ratio"] = 1 / paired_ratio(times["plain_b"], times["against"])
    for name in ("diagnose", "stream", "planted", "planted_grad", "against"):
        plain_s = row["plain_b_s" if name == "against" else "plain_s"]
        row[f"{name}_split"] = per_plain(stage_seconds(timed[name], times[name][-1]), plain_s)
    # the drill-down against one plain forward+backward of the model (B's), not of both
    row["drill_down_ratio"] = max(row[f"{name}_split"]["op drill-down"] for name in
                                  ("planted", "planted_grad")) * row["plain_s"] / row["plain_b_s"]
    return row


def _scale_gradient(module: torch.nn.Module) -> None:
    """``module`` computing the same outputs with a gradient 1% larger: only a backward shows it."""
    class GradientScaled(type(module)):
        def forward(self, *args: object, **kwargs: object) -> object:
            out = super().forward(*args, **kwargs)
            return out + 0.01 * (out - out.detach())  # the same values, 1.01 × the gradient

    module.__class__ = GradientScaled
