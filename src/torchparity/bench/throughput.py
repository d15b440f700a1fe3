"""Part ``throughput``: backend speed, first step, peak memory and compiles, per backend.

Per reference model, size, dtype and backend, each backend in its own fresh process
(:mod:`torchparity.bench.worker`), CUDA steps timed with CUDA events; a backend that cannot run
has a row with ``status: "n/a"`` and the ``reason``.
"""

from __future__ import annotations

import statistics

from torchparity import backends
from torchparity.bench.models import model_config, size_fields, tokens_per_step
from torchparity.bench.rounds import Progress, Row, interleaved, na_row, paired_ratio, spread
from torchparity.bench.settings import BenchSettings, Size
from torchparity.bench.worker import Job, Worker, workers
from torchparity.dtypes import torch_dtype


def throughput_rows(settings: BenchSettings, progress: Progress) -> list[Row]:
    """A row per case x size x dtype x backend, then per size x dtype x backend for attention."""
    groups = [(workload, case, size, dtype)
              for workload, cases in (("model", settings.cases), ("attention", settings.cases[:1]))
              for case in cases for size in settings.sizes for dtype in settings.dtypes]
    count = sum(len(_runnable(settings, dtype)) for *_, dtype in groups)
    progress.start("throughput", count * (2 + settings.warmup + settings.rounds
                                          + settings.compile))
    # the attention-only rows (model "attention", of the first case) show how much of a difference
    # is the kernel's
    rows: list[Row] = []
    for group in groups:
        rows += _throughput_group(*group, settings, progress)
    return rows


def _runnable(settings: BenchSettings, dtype: str) -> list[str]:
    probe = backends.available(settings.device, torch_dtype(dtype))
    return [name for name in settings.backends if probe[name] is None]


def _throughput_group(workload: str, case: str, size: Size, dtype: str, settings: BenchSettings,
                      progress: Progress) -> list[Row]:
    config = model_config(case, size)
    label = f"{case if workload == 'model' else 'attention'} {size.name} {dtype}"
    fields = {**size_fields(case, config, size), "dtype": dtype,
              "tokens_per_step": tokens_per_step(config, size)}
    if workload == "attention":
        fields.update(model="attention", tokens_per_step=size.batch_size * size.seq_len)
    probe = backends.available(settings.device, torch_dtype(dtype))
    jobs = {name: Job(config.to_dict(), size.batch_size, size.seq_len, "none", dtype,
                      settings.device, name, settings.compile, settings.threads, workload)
            for name in _runnable(settings, dtype)}
    with workers(jobs) as started:
        measured = _drive(started, settings, progress, label)
    rows = []
    for name in settings.backends:
        if probe[name] is not None:
            rows.append(na_row(probe[name], **fields, backend=name))
        elif started[name].error is not None:
            rows.append(na_row(started[name].error, **fields, backend=name))
        else:
            rows.append({**fields, "backend": name, "status": "ok", **measured[name]})
    _add_ratios(rows)
    return rows


def _drive(started: dict[str, Worker], settings: BenchSettings, progress: Progress,
           label: str) -> dict[str, Row]:
    """First steps one after another, warm-up, interleaved rounds, then memory and compiles."""
    names = list(started)
    for name in names:
        started[name].receive()  # built and ready
    first = {}
    for name in names:
        progress.advance(f"{label}: first step, {name}")
        first[name] = started[name].call("first")
    times = interleaved(names, lambda name: started[name].call("step"), settings.rounds,
                        settings.warmup, progress, label)
    measured = {}
    for name in names:
        progress.advance(f"{label}: peak memory, {name}")
        peak = started[name].call("peak")
        compiled = None
        if settings.compile:
            progress.advance(f"{label}: compile counts, {name}")
            compiled = started[name].call("compile_stats")
        if started[name].error is None:
            measured[name] = _measurement(first[name], times[name], peak, compiled)
    return measured


def _measurement(first: Row, times: list[float], peak: int,
                 compiled: dict[str, int] | None) -> Row:
    row = {
        "mode": first["mode"],
        "first_step_s": first["seconds"],
        "step_s": statistics.median(times),
        "spread": spread(times),
        "times_s": times,
        "peak_bytes": peak,
    }
    if first["note"]:
        row["note"] = first["note"]
    if compiled is not None:
        row.update(compiled)
    return row


def _add_ratios(rows: list[Row]) -> None:
    """tok/s for every measured row; ratios to ``manual`` where both ran forward+backward."""
    manual = next((r for r in rows if r["backend"] == "manual" and r["status"] == "ok"), None)
    for row in rows:
        if row["status"] != "ok":
            continue
        row["tok_per_s"] = row["tokens_per_step"] / row["step_s"]
        if manual is None:
            row.setdefault("note", "no ratio: the manual backend was not measured")
        elif row["mode"] != manual["mode"]:
            row["note"] = (f"{row.get('note', '')}; no ratio: {row['mode']} is not comparable "
                           f"with manual's {manual['mode']}").lstrip("; ")
        else:
            row["ratio_vs_manual"] = paired_ratio(manual["times_s"], row["times_s"])
            row["peak_vs_manual"] = row["peak_bytes"] / manual["peak_bytes"]
