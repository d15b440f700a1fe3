"""``bench --model``: a user's model per backend, and what ``check --model`` costs on it.

Per backend and dtype: the time to the first training step (start-up) and the steady step over
``rounds`` more, backends timed in turn so drifting load spreads over all; with ``--compile``,
each backend in both compile forms against itself eagerly.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time

import torch
from torch import nn

from torchparity import backends
from torchparity.bench.rounds import Row
from torchparity.dtypes import DTYPES
from torchparity.errors import BackendUnavailable
from torchparity.golden.cases import check_case
from torchparity.golden.cells import REFERENCE, Cell
from torchparity.golden.model_check import backend_names, check_subject
from torchparity.golden.model_runs import HF_EAGER, cell_attention
from torchparity.golden.store import GoldenStore, default_golden_dir
from torchparity.golden.user_models import model_store, write_goldens
from torchparity.reference import zoo
from torchparity.subject import Subject
from torchparity.subject.compiling import MODES, CompileFailed, compiled
from torchparity.subject.running import Inputs
from torchparity.subject.trees import flatten_tensors
from torchparity.threads import single_thread

#: The zoo case whose check the model's check is compared with, and the backends of both.
ZOO_CASE = "llama-tiny"
CHECK_BACKENDS = ("manual", "sdpa", "sdpa-math", "sdpa-flash")


def model_throughput_rows(subject: Subject, dtypes: list[str], rounds: int = 5,
                    device: str = "cpu") -> list[Row]:
    """One row per backend and dtype: tokens/s, first and steady step seconds, or why ``n/a``."""
    rows = []
    for dtype in dtypes:
        models: dict[str, tuple[nn.Module, Inputs]] = {}
        for backend in backend_names([subject]):
            row = {"model": subject.name, "backend": backend, "dtype": dtype}
            started = time.perf_counter()
            try:
                model, inputs, calls = _first_step(subject, backend, dtype, device)
            except BackendUnavailable as exc:
                rows.append({**row, "status": "n/a", "reason": str(exc)})
                continue
            if calls == 0 and backend not in ("manual", HF_EAGER):
                rows.append({**row, "status": "n/a", "reason": backends.NO_SDPA_CALLS_REASON})
                continue
            models[backend] = (model, inputs)
            rows.append({**row, "status": "ok", "first_step_s": time.perf_counter() - started,
                         "times": []})
        timed = {r["backend"]: r for r in rows if r["dtype"] == dtype and r["status"] == "ok"}
        for _ in range(rounds):
            for backend, (model, inputs) in models.items():
                timed[backend]["times"].append(
                    _timed_step(subject, model, inputs, backend, device))
        tokens = _tokens(subject.inputs)
        for row in timed.values():
            times = row.pop("times")
            row["step_s"] = statistics.median(times)
            row["tokens_per_s"] = tokens / row["step_s"]
            row["spread"] = (max(times) - min(times)) / row["step_s"] if times else None
    return rows


def compiled_rows(subject: Subject, dtypes: list[str], eager: list[Row],
                  rounds: int = 5, device: str = "cpu", backend_names: list[str] | None = None,
                  ) -> list[Row]:
    """A user's model compiled, per backend, dtype and form, against the same backend eagerly."""
    # each compiled on its own (dynamo afresh: its own counts), steps interleaved with eager ones
    # under the same load; only what ran eagerly compiles
    rows = []
    for row in eager:
        if row["status"] != "ok" or row["dtype"] not in dtypes or (
                backend_names and row["backend"] not in backend_names):
            continue
        for form in MODES:
            rows.append(_compiled_row(subject, row, form, rounds, device))
    return rows


def _compiled_row(subject: Subject, eager: Row, form: str, rounds: int,
                  device: str) -> Row:
    backend, dtype = eager["backend"], eager["dtype"]
    row = {"model": subject.name, "backend": backend, "dtype": dtype, "compile": form}
    attention = cell_attention(subject, backend)
    model, inputs = subject.placed(device, DTYPES[dtype], attention)
    eager_model, eager_inputs = subject.placed(device, DTYPES[dtype], attention)
    times, eager_times = [], []
    try:
        with compiled(model, form) as log:
            started = time.perf_counter()
            with _backend(backend):
                _step(subject, model, inputs)
            first = time.perf_counter() - started
            for _ in range(rounds):
                eager_times.append(_timed_step(subject, eager_model, eager_inputs, backend,
                                               device))
                times.append(_timed_step(subject, model, inputs, backend, device))
    except CompileFailed as exc:
        return {**row, "status": "n/a", "reason": str(exc)}
    step_s = statistics.median(times)
    tokens_per_s = _tokens(subject.inputs) / step_s
    return {**row, "status": "ok", "first_step_s": first, "compile_s": log.compile_seconds,
            "graphs": log.graphs, "graph_breaks": log.graph_breaks,
            "recompiles": log.recompiles,
            "steady_recompiles": sum(len(c.recompiles) for c in log.calls[1:]),
            "step_s": step_s, "tokens_per_s": tokens_per_s,
            "spread": (max(times) - min(times)) / step_s,
            "vs_eager": statistics.median(eager_times) / step_s}


def _first_step(subject: Subject, backend: str, dtype: str, device: str,
                ) -> tuple[nn.Module, Inputs, int | None]:
    """Copy the model into ``dtype`` and run one step: (model, inputs, SDPA calls made)."""
    attention = cell_attention(subject, backend)
    model, inputs = subject.placed(device, DTYPES[dtype], attention)
    with _backend(backend) as intercepted:
        _step(subject, model, inputs)
    return model, inputs, None if intercepted is None else intercepted.calls


def _timed_step(subject: Subject, model: nn.Module, inputs: Inputs, backend: str, device: str
                ) -> float:
    with _backend(backend):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        _step(subject, model, inputs)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    return time.perf_counter() - started


def _backend(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if name == HF_EAGER else backends.use(name)


def _step(subject: Subject, model: nn.Module, inputs: Inputs) -> None:
    model.zero_grad(set_to_none=True)
    output = subject.forward(model, inputs)
    subject.loss(output, inputs, flatten_tensors(output)).backward()


def _tokens(inputs: Inputs) -> int:
    """Tokens per step: ``input_ids``' (or the first integer tensor's), else batch x length."""
    flat = flatten_tensors(inputs, "inputs")
    ids = flat.get("inputs.input_ids")
    if ids is None:
        ids = next((t for t in flat.values() if not t.is_floating_point()), None)
    if ids is not None:
        return ids.numel()
    first = next(iter(flat.values()))
    return first.shape[0] * (first.shape[1] if first.dim() > 1 else 1)


def check_cost(subject: Subject) -> Row:
    """What ``check --model`` costs on ``subject``, beside the zoo check and plain steps."""
    # plain_ratio: the check as a multiple of one plain training step per cell
    cells = [REFERENCE, *(Cell(b, "fp32") for b in CHECK_BACKENDS)]
    with tempfile.TemporaryDirectory() as folder, single_thread():
        store = model_store(subject, folder)
        write_goldens(subject, store)
        started = time.perf_counter()
        model_rows = check_subject(subject, store, cells)
        model_s = time.perf_counter() - started
        zoo_store = GoldenStore(default_golden_dir())
        started = time.perf_counter()
        check_case(zoo_store, zoo.get(ZOO_CASE), cells)
        zoo_s = time.perf_counter() - started
        plain_s = sum(_plain_step(subject, cell) for cell in cells)
    return {"model": subject.name, "zoo_case": ZOO_CASE, "cells": len(cells),
            "model_check_s": model_s, "zoo_check_s": zoo_s, "ratio": model_s / zoo_s,
            "plain_steps_s": plain_s, "plain_ratio": model_s / plain_s,
            "model_check_ok": all(r.ok for r in model_rows)}


def _plain_step(subject: Subject, cell: Cell, rounds: int = 3) -> float:
    """Median seconds of one forward, loss and backward as ``cell`` runs it, after one untimed."""
    model, inputs, _ = _first_step(subject, cell.backend, cell.dtype, cell.device)
    return statistics.median(_timed_step(subject, model, inputs, cell.backend, cell.device)
                             for _ in range(rounds))
