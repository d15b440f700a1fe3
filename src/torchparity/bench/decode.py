"""The cost of a decoding diagnosis across revisions (``bench`` part ``decode``).

``record --decode`` of A (its decoding captured at every step, beside its float64 golden) and
then ``diagnose --against`` of B, over :data:`STEPS` steps after the prompt, timed against what
the reviewer's test runs anyway: a plain decoding of A and one of B along the same tokens. The
models are those of the ``diagnose`` part (the first case at the first size, ``manual`` against
``sdpa`` attention), prompted with the size's batch; every contender runs in this process, in
rounds whose order rotates.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from torchparity.bench.runner import (
    DIAGNOSE_BACKENDS,
    Progress,
    Settings,
    model_config,
    na_row,
    paired_ratio,
    rotated,
)
from torchparity.bench.worker import timing_model, wall_time
from torchparity.reference import zoo

#: Decoding steps after the prompt.
STEPS = 16
#: The decoder-only case decodings are timed on when the first case is an encoder-decoder.
FALLBACK_CASE = "llama-tiny"


def decode_rows(settings: Settings, progress: Progress) -> list[dict[str, Any]]:
    """One row: seconds of record + diagnose of a decoding, of two plain decodings, and their
    ratio (``decode_time_ratio``; the goal is at most 4)."""
    from torchparity.diagnosis.decode import diagnose_decode_against, record_decode
    from torchparity.subject.decoding import builtin_step, teacher_forced

    if settings.threads:
        torch.set_num_threads(settings.threads)
    case = next((c for c in settings.cases if not zoo.get(c).config.is_encoder_decoder),
                FALLBACK_CASE)
    size, dtype = settings.sizes[0], settings.dtypes[0]
    device = torch.device(settings.device)
    config = model_config(case, size)
    fields = {"model": case, "size": size.name, "d_model": size.d_model,
              "n_layers": size.n_layers, "batch_size": size.batch_size,
              "seq_len": size.seq_len, "dtype": dtype, "steps": STEPS,
              "models": " vs ".join(DIAGNOSE_BACKENDS)}
    model_a, model_b = (timing_model(config.replace(attention_backend=name), device,
                                     getattr(torch, dtype)) for name in DIAGNOSE_BACKENDS)
    prompt = {key: value.to(device) for key, value in zoo.make_batch(
        config, size.batch_size, size.seq_len, seed=0, padding="none").items()}
    step = builtin_step(model_a)
    with torch.no_grad():
        tokens = teacher_forced(step, model_a, prompt, STEPS).tokens

    def plain() -> None:
        with torch.no_grad():
            for model in (model_a, model_b):
                teacher_forced(step, model, prompt, STEPS, tokens)

    reports = []

    def diagnosis() -> None:
        with tempfile.TemporaryDirectory(prefix="torchparity-bench-") as tmp:
            trace = record_decode(model_a, prompt, Path(tmp) / "a.tptrace", steps=STEPS,
                                  progress=False)
            reports.append(diagnose_decode_against(trace, model_b, prompt, progress=False))

    contenders = {"plain": plain, "diagnosis": diagnosis}
    progress.start("decode", len(contenders) * (settings.warmup + settings.rounds))
    times: dict[str, list[float]] = {name: [] for name in contenders}
    try:
        for index in range(settings.warmup + settings.rounds):
            phase = "warm-up" if index < settings.warmup else "round"
            for name in rotated(list(contenders), index):
                progress.advance(f"decode {case}: {phase} {index + 1}, {name}")
                seconds = wall_time(contenders[name], device)
                if index >= settings.warmup:
                    times[name].append(seconds)
    except Exception as exc:  # a failing diagnosis is a finding to report, not a crash
        return [na_row(f"decoding diagnosis failed: {type(exc).__name__}: "
                       f"{str(exc).splitlines()[0]}", **fields)]
    report = reports[-1]
    return [{**fields, "status": "ok", "plain_s": statistics.median(times["plain"]),
             "diagnosis_s": statistics.median(times["diagnosis"]),
             "decode_time_ratio": 1 / paired_ratio(times["plain"], times["diagnosis"]),
             "first_step": report.first_step, "flips": len(report.flips)}]
