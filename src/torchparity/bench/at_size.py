"""``bench --model``: what the safety net costs on a real-size model, beside one plain step.

Three fresh processes in turn, each with its wall time and peak resident memory: a plain step
(the factory loaded, a first step, then the timed one, on one thread as the check runs), ``golden
update`` into a temporary folder, and ``check`` against those goldens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torchparity.bench.rounds import Document

#: One plain step of a factory's model: load, a first step, a timed step; JSON on stdout.
_PLAIN_STEP = """
import json, sys, time
import torch
from torchparity.subject import Subject
from torchparity.subject.trees import flatten_tensors

def step(subject):
    subject.model.zero_grad(set_to_none=True)
    output = subject.forward(subject.model, subject.inputs)
    subject.loss(output, subject.inputs, flatten_tensors(output)).backward()

torch.set_num_threads(1)
started = time.perf_counter()
subject = Subject.load(sys.argv[1])
subject.model.eval()
loaded = time.perf_counter()
step(subject)
first = time.perf_counter()
step(subject)
print(json.dumps({"load_s": loaded - started, "first_step_s": first - loaded,
                  "step_s": time.perf_counter() - first,
                  "parameters": sum(p.numel() for p in subject.model.parameters())}))
"""


def measure(entry: str, dtypes: list[str], backends: list[str] | None = None) -> Document:
    """Seconds, peak bytes, golden bytes and the check's cells of ``entry``, each in a process."""
    with tempfile.TemporaryDirectory(prefix="torchparity-bench-") as folder:
        goldens, report = Path(folder) / "golden", Path(folder) / "check.json"
        plain = _timed("the plain step", [sys.executable, "-c", _PLAIN_STEP, entry])
        timing = json.loads(plain["stdout"].strip().splitlines()[-1])
        golden = _timed("golden update", _cli("golden", "update", "--model", entry,
                                              "--golden-dir", str(goldens)))
        size = sum(p.stat().st_size for p in goldens.rglob("*") if p.is_file())
        options = [*(a for d in dtypes for a in ("--dtype", d)),
                   *(a for b in backends or [] for a in ("--backend", b))]
        check = _timed("check", _cli("check", "--model", entry, "--golden-dir", str(goldens),
                                     "--json", str(report), *options))
        rows = json.loads(report.read_text())["results"] if report.exists() else []
    # multiples of the plain step leave out the factory's load, which every process pays once
    step, load = timing["step_s"], timing["load_s"]
    return {
        "model": entry, "parameters": timing["parameters"], "dtypes": dtypes,
        "plain": {**timing, "peak_bytes": plain["peak_bytes"]},
        "golden": {"s": golden["s"], "peak_bytes": golden["peak_bytes"], "bytes": size,
                   "exit": golden["exit"], "steps": (golden["s"] - load) / step},
        "check": {"s": check["s"], "peak_bytes": check["peak_bytes"], "exit": check["exit"],
                  "cells": len({(r["backend"], r["dtype"]) for r in rows}),
                  "failed": sorted({f"{r['backend']} {r['dtype']} {r['output']}"
                                    for r in rows if not r["ok"]}),
                  "steps": (check["s"] - load) / step},
    }


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "torchparity.cli", *args]


def _timed(label: str, command: list[str]) -> Document:
    """Run ``command`` to its end: wall seconds, peak resident bytes, exit status, stdout."""
    started = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = subprocess.Popen(command, stdout=out, stderr=err)
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if child.returncode not in (0, 1):  # 1: a cell diverged, which the result reports
        from torchparity.errors import UsageError

        last = (stderr.strip().splitlines() or ["(no message)"])[-1]
        raise UsageError(f"bench --model: {label} failed with exit status {child.returncode}: "
                         f"{last}")
    # ru_maxrss is in kilobytes on Linux.
    return {"s": seconds, "peak_bytes": usage.ru_maxrss * 1024, "exit": child.returncode,
            "stdout": stdout}
