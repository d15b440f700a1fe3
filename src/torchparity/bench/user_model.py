"""``bench --model``: a user's model per backend, and what ``check --model`` costs on it.

Per backend and dtype, in this process: the time to the first training step (copying the
model into the dtype, the first forward, loss and backward: what start-up costs) and the
steady step time over ``rounds`` further steps, as tokens per second. Backends are timed in
turn, round by round, so drifting machine load spreads over all of them. With ``--compile``,
each backend also compiled in both forms: the first step with its compiling, the graphs,
breaks and recompiles, and the steady speed against the same backend eagerly.

The check's cost compares ``check --model`` on the model with the same cells of
``torchparity check`` on a zoo case, both in this process on one thread: the ratio is what
checking a user's model costs beyond the zoo's own check.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from typing import Any

import torch
from torch import nn

from torchparity import backends
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
                    device: str = "cpu") -> list[dict[str, Any]]:
    """A user's model's speed on every backend and dtype.

    Args:
        subject: the user's model.
        dtypes: the dtype names.
        rounds: the measured rounds.
        device: where it runs.

    Returns:
        One row per backend and dtype: tokens/s, first-step and steady step seconds, or the
        reason the backend cannot run (``status`` ``n/a``).
    """
    rows = []
    for dtype in dtypes:
        models: dict[str, Any] = {}
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


def compiled_rows(subject: Subject, dtypes: list[str], eager: list[dict[str, Any]],
                  rounds: int = 5, device: str = "cpu", backend_names: list[str] | None = None,
                  ) -> list[dict[str, Any]]:
    """A user's model compiled, against the same backend eagerly.

    Each contender is compiled and timed on its own (dynamo starts afresh for each, so its
    counts are its own), its steps interleaved with steps of the same backend eagerly: the
    ratio compares steps taken under the same load.

    Args:
        subject: the user's model.
        dtypes: the dtype names.
        eager: rows of :func:`model_throughput_rows`; only what ran eagerly is compiled.
        rounds: the measured rounds.
        device: where it runs.
        backend_names: limits the backends.

    Returns:
        One row per backend, dtype and compile form: the time to the first step (compiling
        included, and how much of it compiled), graphs, graph breaks and recompiles (also
        those of the steady steps, which should be none), tokens/s and its ratio to eager
        (``vs_eager``), or why it did not compile (``n/a``).
    """
    rows = []
    for row in eager:
        if row["status"] != "ok" or row["dtype"] not in dtypes or (
                backend_names and row["backend"] not in backend_names):
            continue
        for form in MODES:
            rows.append(_compiled_row(subject, row, form, rounds, device))
    return rows


def _compiled_row(subject: Subject, eager: dict[str, Any], form: str, rounds: int,
                  device: str) -> dict[str, Any]:
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


def _backend(name: str) -> Any:
    return contextlib.nullcontext() if name == HF_EAGER else backends.use(name)


def _step(subject: Subject, model: nn.Module, inputs: Inputs) -> None:
    model.zero_grad(set_to_none=True)
    output = subject.forward(model, inputs)
    subject.loss(output, inputs, flatten_tensors(output)).backward()


def _tokens(inputs: Inputs) -> int:
    """Tokens per step: the elements of ``input_ids`` (or of the first integer tensor), else
    batch x length of the first tensor."""
    flat = flatten_tensors(inputs, "inputs")
    ids = flat.get("inputs.input_ids")
    if ids is None:
        ids = next((t for t in flat.values() if not t.is_floating_point()), None)
    if ids is not None:
        return ids.numel()
    first = next(iter(flat.values()))
    return first.shape[0] * (first.shape[1] if first.dim() > 1 else 1)


def check_cost(subject: Subject) -> dict[str, Any]:
    """What ``check --model`` costs on ``subject``, beside the zoo check and plain steps.

    The check as a multiple of one plain training step per cell (``plain_ratio``) says what it
    costs beyond running the model once per cell.

    Args:
        subject: the user's model.

    Returns:
        Seconds of ``check --model``, of the zoo check of :data:`ZOO_CASE` in the same cells
        (reference, then :data:`CHECK_BACKENDS` in fp32), of one plain step in each cell
        (``plain_steps_s``), and the ratio.
    """
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
    """The median seconds of one forward, loss and backward of the model as ``cell`` runs it
    (its dtype and backend, a first step untimed)."""
    model, inputs, _ = _first_step(subject, cell.backend, cell.dtype, cell.device)
    return statistics.median(_timed_step(subject, model, inputs, cell.backend, cell.device)
                             for _ in range(rounds))
