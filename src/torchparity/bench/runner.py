"""Throughput, start-up and the cost of the safety net itself (``torchparity bench``).

:func:`run` measures three parts and returns one JSON-ready document (schema :data:`SCHEMA`):

- ``throughput``: for each reference model, size, dtype and attention backend, forward+backward
  tokens/s, its ratio to the ``manual`` backend, the wall time of the first step in a fresh
  process, the peak tensor memory of a step and, with ``compile=True``, dynamo's graphs, graph
  breaks and recompiles;
- ``diagnose``: the time of :func:`torchparity.diagnose` (full capture and streaming) over a plain
  forward+backward of both models, and their peak memory over the plain run's;
- ``decode``: record + diagnose of a decoding across revisions over two plain decodings
  (:mod:`torchparity.bench.decode`);
- ``check``: the wall time of ``torchparity check``.

Method, chosen to survive noisy shared machines: every contender is warmed up, then measured in
rounds; in each round every contender runs once, in an order that rotates from round to round,
so slow drift (other jobs, clocks, heat) hits all of them alike. Times are medians over the
rounds and ratios are medians of the per-round ratios, reported beside the absolute numbers.
Each backend runs in its own fresh process (see :mod:`torchparity.bench.worker`), and on CUDA
steps are timed with CUDA events. A row that could not be measured has ``status: "n/a"`` and a
``reason``; every number present is finite.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import multiprocessing
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from torchparity import backends
from torchparity.bench.worker import Job, peak_bytes, serve, timing_model, wall_time
from torchparity.errors import UsageError
from torchparity.reference import TransformerConfig, sequence_loss, zoo

SCHEMA = "torchparity.bench/1"
PARTS = ("throughput", "diagnose", "decode", "check")
#: The reference models: a Llama-style decoder and a classic pre-norm encoder-decoder.
REFERENCE_CASES = ("llama-tiny", "encdec-prenorm")
#: ``diagnose`` is timed on the most common question: manual attention against plain SDPA.
DIAGNOSE_BACKENDS = ("manual", "sdpa")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Size:
    """Model dimensions and batch shape of one benchmark size (layers per stack)."""

    name: str
    d_model: int
    n_heads: int
    n_layers: int
    d_ff: int
    vocab_size: int
    seq_len: int
    batch_size: int


QUICK_SIZES = (Size("tiny", 32, 4, 1, 64, 64, 32, 2),)
CPU_SIZES = (
    Size("s", 128, 4, 2, 512, 1024, 512, 2),
    Size("m", 256, 4, 2, 1024, 1024, 1024, 1),
)
GPU_SIZES = (
    Size("m", 512, 8, 4, 2048, 8192, 512, 8),
    Size("l", 1024, 16, 4, 4096, 32000, 2048, 4),
)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a benchmark run depends on; recorded in the result as given."""

    device: str
    dtypes: tuple[str, ...]
    sizes: tuple[Size, ...]  # diagnose runs at the first
    cases: tuple[str, ...] = REFERENCE_CASES
    backends: tuple[str, ...] = tuple(backends.names())
    rounds: int = 5
    warmup: int = 1
    compile: bool = False
    parts: tuple[str, ...] = PARTS
    quick: bool = False
    threads: int | None = None  # torch intra-op threads of the measured processes
    beams: int | None = None  # the decode part also times a beam search of this many beams


def default_settings(device: str = "cpu", quick: bool = False, size_names: tuple[str, ...] = (),
                     **changes: Any) -> Settings:
    """Settings sized for ``device``: on the CPU the default run takes minutes on 2 cores
    (fp32 only; bf16 without native CPU support is many times slower, ask with ``dtypes``);
    ``quick`` is a seconds-long smoke run of every part except ``check``. ``size_names``
    picks among the device's sizes; ``changes`` override fields. Invalid values raise
    :class:`~torchparity.errors.UsageError`."""
    if quick:
        base = Settings(device, ("float32",), QUICK_SIZES, rounds=3, warmup=1, quick=True)
    elif torch.device(device).type == "cuda":
        base = Settings(device, ("bfloat16", "float32"), GPU_SIZES)
    else:
        base = Settings(device, ("float32",), CPU_SIZES)
    known = {size.name: size for size in base.sizes}
    unknown = [name for name in size_names if name not in known]
    if unknown:
        raise UsageError(f"--size {unknown[0]}: sizes on {device}"
                         f"{' with --quick' if quick else ''} are {', '.join(known)}")
    if size_names:
        changes["sizes"] = tuple(known[name] for name in size_names)
    given = {key: value for key, value in changes.items() if value not in (None, ())}
    settings = dataclasses.replace(base, **given)
    _validate(settings)
    return settings


def _validate(s: Settings) -> None:
    if torch.device(s.device).type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {s.device}: CUDA is not available here; use --device cpu")
    for dtype in s.dtypes:
        if dtype not in DTYPES:
            raise UsageError(f"--dtype {dtype}: choose from {', '.join(DTYPES)}")
    for case in s.cases:
        if case not in zoo.names():
            raise UsageError(f"--case {case}: unknown zoo case; choose from "
                             f"{', '.join(zoo.names())}")
    for name in s.backends:
        if name not in backends.names():
            raise UsageError(f"--backend {name}: choose from {', '.join(backends.names())}")
    for part in s.parts:
        if part not in PARTS:
            raise UsageError(f"unknown part {part!r}: choose from {', '.join(PARTS)}")
    if s.threads is not None and s.threads < 1:
        raise UsageError(f"--threads {s.threads}: needs at least 1")
    if s.beams is not None and s.beams < 1:
        raise UsageError(f"--beams {s.beams}: search with one beam or more")
    if s.rounds < 1 or s.warmup < 0:
        raise UsageError(f"--rounds must be >= 1 and --warmup >= 0 (got {s.rounds}, {s.warmup})")


def model_config(case: str, size: Size) -> TransformerConfig:
    """Zoo case ``case`` scaled to ``size``; its variant choices (norms, positions, GQA share)
    are kept."""
    base = zoo.get(case).config
    kv_heads = None if base.n_kv_heads is None else max(
        1, size.n_heads * base.kv_heads // base.n_heads)
    changes: dict[str, Any] = dict(
        d_model=size.d_model, n_heads=size.n_heads, n_kv_heads=kv_heads, head_dim=None,
        n_layers=size.n_layers, d_ff=size.d_ff, vocab_size=size.vocab_size,
        max_positions=max(base.max_positions, size.seq_len),
    )
    if base.is_encoder_decoder:
        changes.update(n_encoder_layers=size.n_layers, src_vocab_size=size.vocab_size)
    return base.replace(**changes)


def tokens_per_step(config: TransformerConfig, size: Size) -> int:
    """Tokens a step reads: an encoder-decoder reads a source and a target sequence."""
    return size.batch_size * size.seq_len * (2 if config.is_encoder_decoder else 1)


# --------------------------------------------------------------------------------------------
# The whole run


def run(settings: Settings, progress: Progress | None = None) -> dict[str, Any]:
    """Measure the parts in ``settings.parts``; returns the result document.

    Guarantees: every part in PARTS has a list of rows (a skipped part: one ``n/a`` row saying
    why); a row has ``status`` ``"ok"`` or ``"n/a"`` with a ``reason``; numbers are finite.
    """
    progress = progress or Progress()
    started = time.time()
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "machine": machine_info(settings.device, settings.threads),
        "settings": dataclasses.asdict(settings),
    }
    from torchparity.bench.decode import decode_rows  # it builds on this module

    measures = {"throughput": throughput_rows, "diagnose": diagnose_rows,
                "decode": decode_rows, "check": check_rows}
    for part, measure in measures.items():
        if part in settings.parts:
            result[part] = measure(settings, progress)
        else:
            result[part] = [na_row(f"not measured: the {part} part was skipped (--skip {part})")]
    result["machine"]["load_average_end"] = _load_average()
    result["wall_s"] = time.time() - started
    result["targets"] = evaluate_targets(result)
    return result


class Progress:
    """Progress callbacks; the CLI passes one that draws a bar. The default draws nothing."""

    def start(self, part: str, total: int) -> None:
        """A part begins that will call :meth:`advance` ``total`` times."""

    def advance(self, description: str) -> None:
        """One unit of work is done; ``description`` says what runs now."""


def na_row(reason: str, **fields: Any) -> dict[str, Any]:
    """A row that could not be measured, with the reason why."""
    return {**fields, "status": "n/a", "reason": reason}


def machine_info(device: str, threads: int | None = None) -> dict[str, Any]:
    """The machine the numbers come from: CPU, cores, memory, versions, GPU, load, and the
    torch threads of the measured processes (``threads``, else torch's default)."""
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "torch_threads": threads or torch.get_num_threads(),
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
        "load_average_start": _load_average(),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# --------------------------------------------------------------------------------------------
# Rounds: interleaved, rotating order


def rotated(items: list[str], round_index: int) -> list[str]:
    """``items`` starting at position ``round_index`` (mod len): each runs first in turn."""
    if not items:
        return []
    shift = round_index % len(items)
    return items[shift:] + items[:shift]


def paired_ratio(reference: list[float], times: list[float]) -> float:
    """Median over rounds of ``reference[r] / times[r]``: > 1 means faster than the reference.

    Pairing by round cancels drift that a ratio of two medians would keep."""
    return statistics.median(r / t for r, t in zip(reference, times, strict=True))


def spread(times: list[float]) -> float:
    """Interquartile range over the median: 0.05 means the middle half lies within 5%."""
    if len(times) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(times)


# --------------------------------------------------------------------------------------------
# Part 1: backend throughput, first step, peak memory, compiles


def throughput_rows(settings: Settings, progress: Progress) -> list[dict[str, Any]]:
    """One row per case × size × dtype × backend (see the module docstring), and per size ×
    dtype × backend for the attention call of the first case alone (``model: "attention"``),
    which shows how much of the whole model's difference is the kernel's."""
    groups = [(workload, case, size, dtype)
              for workload, cases in (("model", settings.cases), ("attention", settings.cases[:1]))
              for case in cases for size in settings.sizes for dtype in settings.dtypes]
    workers = sum(len(_runnable(settings, dtype)) for *_, dtype in groups)
    progress.start("throughput", workers * (2 + settings.warmup + settings.rounds
                                            + settings.compile))
    rows: list[dict[str, Any]] = []
    for group in groups:
        rows += _throughput_group(*group, settings, progress)
    return rows


def _runnable(settings: Settings, dtype: str) -> list[str]:
    probe = backends.available(settings.device, getattr(torch, dtype))
    return [name for name in settings.backends if probe[name] is None]


def _throughput_group(workload: str, case: str, size: Size, dtype: str, settings: Settings,
                      progress: Progress) -> list[dict[str, Any]]:
    config = model_config(case, size)
    label = f"{case if workload == 'model' else 'attention'} {size.name} {dtype}"
    fields = {**_size_fields(case, config, size), "dtype": dtype,
              "tokens_per_step": tokens_per_step(config, size)}
    if workload == "attention":
        fields.update(model="attention", tokens_per_step=size.batch_size * size.seq_len)
    probe = backends.available(settings.device, getattr(torch, dtype))
    jobs = {name: Job(config.to_dict(), size.batch_size, size.seq_len, "none", dtype,
                      settings.device, name, settings.compile, settings.threads, workload)
            for name in _runnable(settings, dtype)}
    with _workers(jobs) as workers:
        measured = _drive(workers, settings, progress, label)
    rows = []
    for name in settings.backends:
        if probe[name] is not None:
            rows.append(na_row(probe[name], **fields, backend=name))
        elif workers[name].error is not None:
            rows.append(na_row(workers[name].error, **fields, backend=name))
        else:
            rows.append({**fields, "backend": name, "status": "ok", **measured[name]})
    _add_ratios(rows)
    return rows


def _size_fields(case: str, config: TransformerConfig, size: Size) -> dict[str, Any]:
    return {"case": case, "model": config.architecture, "size": size.name,
            "d_model": size.d_model, "n_layers": size.n_layers, "seq_len": size.seq_len,
            "batch_size": size.batch_size}


def _drive(workers: dict[str, _Worker], settings: Settings, progress: Progress,
           label: str) -> dict[str, dict[str, Any]]:
    """First steps one after another, warm-up, interleaved rounds, then memory and compiles."""
    names = list(workers)
    for name in names:
        workers[name].receive()  # built and ready
    first = {}
    for name in names:
        progress.advance(f"{label}: first step, {name}")
        first[name] = workers[name].call("first")
    for step in range(settings.warmup):
        for name in names:
            progress.advance(f"{label}: warm-up {step + 1}, {name}")
            workers[name].call("step")
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(settings.rounds):
        for name in rotated(names, round_index):
            progress.advance(f"{label}: round {round_index + 1}/{settings.rounds}, {name}")
            seconds = workers[name].call("step")
            if seconds is not None:
                times[name].append(seconds)
    measured = {}
    for name in names:
        progress.advance(f"{label}: peak memory, {name}")
        peak = workers[name].call("peak")
        compiled = None
        if settings.compile:
            progress.advance(f"{label}: compile counts, {name}")
            compiled = workers[name].call("compile_stats")
        if workers[name].error is None:
            measured[name] = _measurement(first[name], times[name], peak, compiled)
    return measured


def _measurement(first: dict[str, Any], times: list[float], peak: int,
                 compiled: dict[str, int] | None) -> dict[str, Any]:
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


def _add_ratios(rows: list[dict[str, Any]]) -> None:
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


class _Worker:
    """One worker process (:func:`torchparity.bench.worker.serve`) and the pipe to it.

    After the first error the worker is done: ``error`` holds the reason and every later
    ``call`` returns None without asking it.
    """

    def __init__(self, job: Job) -> None:
        ctx = _context()
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child, job), name=f"bench-{job.backend}")
        self.process.start()
        child.close()
        self.error: str | None = None

    def receive(self) -> Any:
        if self.error is not None:
            return None
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(timeout=5)
            status, value = "error", f"the worker process died (exit code {self.process.exitcode})"
        if status == "error":
            self.error = value
            return None
        return value

    def call(self, command: str) -> Any:
        if self.error is None:
            try:
                self.conn.send(command)
            except OSError:
                pass  # it died; receive() reports how
        return self.receive()

    def close(self) -> None:
        try:
            self.conn.send("close")
        except OSError:
            pass
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()
        self.conn.close()


@contextmanager
def _workers(jobs: dict[str, Job]) -> Iterator[dict[str, _Worker]]:
    workers: dict[str, _Worker] = {}
    try:
        for name, job in jobs.items():
            workers[name] = _Worker(job)
        yield workers
    finally:
        for worker in workers.values():
            worker.close()


@functools.cache
def _context() -> Any:
    # Workers fork from a server that imported torch and nothing ran yet: each starts fresh
    # (no CUDA context, no loaded kernels, empty dynamo caches) without paying the import.
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torchparity.bench.worker"])
    return ctx


# --------------------------------------------------------------------------------------------
# Part 2: the cost of diagnose


def diagnose_rows(settings: Settings, progress: Progress) -> list[dict[str, Any]]:
    """``diagnose`` (full and streaming capture) against a plain forward+backward of both
    models, in time and in peak memory: on the first case, at the diagnose size, in the first
    dtype. Its cost follows module count and tensor sizes, not the architecture."""
    if importlib.util.find_spec("torchparity.diagnosis.api") is None:
        return [na_row("not measured: torchparity.diagnosis.api is not part of this installation")]
    if settings.threads:
        torch.set_num_threads(settings.threads)
    progress.start("diagnose", 5 * (1 + settings.warmup + settings.rounds))
    return [_diagnose_case(settings.cases[0], settings.sizes[0], settings.dtypes[0],
                           settings, progress)]


def _diagnose_case(case: str, size: Size, dtype: str, settings: Settings,
                   progress: Progress) -> dict[str, Any]:
    from torchparity.diagnosis.api import diagnose, diagnose_against, record

    device = torch.device(settings.device)
    config = model_config(case, size)
    fields = {**_size_fields(case, config, size), "dtype": dtype,
              "models": " vs ".join(DIAGNOSE_BACKENDS)}
    model_a, model_b = (timing_model(config.replace(attention_backend=name), device,
                                     getattr(torch, dtype)) for name in DIAGNOSE_BACKENDS)
    batch = {key: value.to(device) for key, value in
             zoo.make_batch(config, size.batch_size, size.seq_len, seed=0, padding="none").items()}

    def plain() -> None:
        for model in (model_a, model_b):
            model.zero_grad(set_to_none=True)
            sequence_loss(model(**batch), batch).backward()

    def plain_b() -> None:
        model_b.zero_grad(set_to_none=True)
        sequence_loss(model_b(**batch), batch).backward()

    reports = {}

    def diagnosis(stream: bool) -> Callable[[], None]:
        def run_once() -> None:
            for model in (model_a, model_b):
                model.zero_grad(set_to_none=True)
            reports[stream] = diagnose(model_a, model_b, batch, loss_fn=sequence_loss,
                                       stream=stream, progress=False)
        return run_once

    def against() -> None:  # B against a trace A's revision recorded
        model_b.zero_grad(set_to_none=True)
        reports["against"] = diagnose_against(trace, model_b, batch, loss_fn=sequence_loss,
                                              progress=False)

    contenders = {"plain": plain, "diagnose": diagnosis(False), "stream": diagnosis(True),
                  "plain_b": plain_b, "against": against}
    try:
        with tempfile.TemporaryDirectory(prefix="torchparity-bench-") as tmp:
            trace = record(model_a, batch, Path(tmp) / "a.tptrace", loss_fn=sequence_loss,
                           progress=False)
            times, peaks = _interleave(contenders, device, settings, progress,
                                       f"diagnose {case}")
    except Exception as exc:  # a failing diagnose is a finding to report, not a crash
        return na_row(f"diagnose failed: {type(exc).__name__}: {str(exc).splitlines()[0]}",
                      **fields)
    row = {**fields, "status": "ok"}
    for name in contenders:
        row[f"{name}_s"] = statistics.median(times[name])
        row[f"{name}_peak_bytes"] = peaks[name]
    for name in ("diagnose", "stream"):
        row[f"{name}_time_ratio"] = 1 / paired_ratio(times["plain"], times[name])
        row[f"{name}_peak_ratio"] = peaks[name] / peaks["plain"]
    row["against_time_ratio"] = 1 / paired_ratio(times["plain_b"], times["against"])
    for name, key in (("diagnose", False), ("stream", True), ("against", "against")):
        plain_s = row["plain_b_s" if key == "against" else "plain_s"]
        split = diagnose_split(reports[key])
        row[f"{name}_split"] = {part: s / plain_s for part, s in split.items()}
    return row


def diagnose_split(report: Any) -> dict[str, float]:
    """Seconds of one diagnosis by part: the runs (A, its float64 golden, B's call structure
    and run), judging while B runs, module replays (with the search for where a divergence
    enters), B's float64 check (only when nothing diverged) and rendering the report (table,
    JSON, HTML: what the command adds)."""
    seconds = dict(report.meta["seconds"])
    judging = seconds.pop("judging while B runs", 0.0)
    replays = sum(seconds.pop(phase, 0.0) for phase in (
        "A, golden and B: module replays", "where the first divergence enters"))
    float64 = seconds.pop("B in float64: forward", 0.0)
    start = time.perf_counter()
    report.render(width=80), report.to_json(), report.to_html()
    rendering = time.perf_counter() - start
    return {"runs": sum(seconds.values()) - judging, "judging": judging, "replays": replays,
            "float64 check": float64, "report": rendering}


def _interleave(contenders: dict[str, Callable[[], None]], device: torch.device,
                settings: Settings, progress: Progress, label: str,
                ) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Warm-up, rotating rounds of wall times, then one peak-memory run per contender."""
    names = list(contenders)
    for step in range(settings.warmup):
        for name in names:
            progress.advance(f"{label}: warm-up {step + 1}, {name}")
            contenders[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(settings.rounds):
        for name in rotated(names, round_index):
            progress.advance(f"{label}: round {round_index + 1}/{settings.rounds}, {name}")
            times[name].append(wall_time(contenders[name], device))
    peaks = {}
    for name in names:
        progress.advance(f"{label}: peak memory, {name}")
        peaks[name] = peak_bytes(contenders[name], device)
    return times, peaks


# --------------------------------------------------------------------------------------------
# Part 3: the wall time of `torchparity check`

CHECK_COMMAND = ("torchparity", "check")


def check_rows(settings: Settings, progress: Progress) -> list[dict[str, Any]]:
    """Wall time of ``torchparity check`` with no options, run as a user runs it."""
    fields = {"command": " ".join(CHECK_COMMAND), "logical_cores": os.cpu_count()}
    if settings.quick:
        return [na_row("not measured: --quick does not time `torchparity check` (about a "
                       "minute); run without --quick", **fields)]
    if importlib.util.find_spec("torchparity.commands.check") is None:
        return [na_row("not measured: `torchparity check` is not part of this installation",
                       **fields)]
    progress.start("check", 1)
    progress.advance("torchparity check")
    src = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    start, cpu_start = time.perf_counter(), _children_cpu_s()
    done = subprocess.run([sys.executable, "-m", "torchparity.cli", *CHECK_COMMAND[1:]],
                          env=env, capture_output=True, text=True)
    seconds, cpu_seconds = time.perf_counter() - start, _children_cpu_s() - cpu_start
    last_line = (done.stderr.strip().splitlines() or [""])[-1]
    if done.returncode == 2:
        return [na_row(f"torchparity check could not run: {last_line}", **fields)]
    # CPU time beside wall time: on a shared machine the wall clock also counts other jobs.
    row = {**fields, "status": "ok", "wall_s": seconds, "cpu_s": cpu_seconds,
           "exit_code": done.returncode}
    if done.returncode != 0:
        row["note"] = f"check reported failures (exit {done.returncode}); the time still counts"
    return [row]


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# --------------------------------------------------------------------------------------------
# Targets

TARGETS = {
    "diagnose_time": ("diagnose time / plain fwd+bwd of both models", "<=", 3.0),
    "against_time": ("diagnose --against time / plain fwd+bwd of B", "<=", 2.0),
    "stream_peak": ("streaming diagnose peak memory / plain run's", "<=", 2.5),
    "decode_time": ("record + diagnose of 16 decoding steps / two plain 16-step decodings",
                    "<=", 4.0),
    "check_wall": ("`torchparity check` wall time (s)", "<=", 60.0),
    "sdpa_speedup": ("fastest SDPA backend tok/s / manual's (CPU fp32, seq >= 512)", ">=", 1.5),
}


def evaluate_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The project's speed targets against this run's numbers; ``met`` is None when the run
    did not measure what a target needs (``note`` says why)."""
    out = []
    for row in result["diagnose"]:
        where = _where(row)
        out.append(_target("diagnose_time", where, row.get("diagnose_time_ratio"), row))
        out.append(_target("against_time", where, row.get("against_time_ratio"), row))
        out.append(_target("stream_peak", where, row.get("stream_peak_ratio"), row))
    for row in result["decode"]:
        out.append(_target("decode_time", _where(row), row.get("decode_time_ratio"), row))
    for row in result["check"]:
        out.append(_target("check_wall", f"{row.get('logical_cores', '?')} logical cores",
                           row.get("wall_s"), row))
    for where, best in _best_sdpa(result).items():
        out.append(_target("sdpa_speedup", where, best, {}))
    return out


def _where(row: dict[str, Any]) -> str:
    return " ".join(str(row[k]) for k in ("model", "case", "size", "dtype", "search") if k in row)


def _target(key: str, where: str, measured: float | None, row: dict[str, Any]) -> dict[str, Any]:
    text, op, limit = TARGETS[key]
    met = None if measured is None else (measured <= limit if op == "<=" else measured >= limit)
    entry = {"target": key, "description": text, "where": where, "limit": f"{op} {limit:g}",
             "measured": measured, "met": met}
    if measured is None:
        entry["note"] = row.get("reason", "not measured in this run")
    return entry


def _best_sdpa(result: dict[str, Any]) -> dict[str, float | None]:
    if result["settings"]["device"] != "cpu":
        return {}
    best: dict[str, float | None] = {}
    for row in result["throughput"]:
        if row.get("dtype") != "float32" or row.get("seq_len", 0) < 512:
            continue
        where = _where(row)
        best.setdefault(where, None)
        ratio = row.get("ratio_vs_manual")
        if row["backend"].startswith("sdpa") and ratio is not None:
            best[where] = max(ratio, best[where] or 0.0)
    return best
