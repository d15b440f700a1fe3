"""The decode part of ``torchparity bench``: one row timing record + diagnose of a decoding
against two plain decodings of the same models."""

from __future__ import annotations

import dataclasses
import math

import pytest

from torchparity.bench import report
from torchparity.bench.decode_cost import STEPS, decode_rows
from torchparity.bench.rounds import Progress
from torchparity.bench.settings import default_settings
from torchparity.bench.stages import OTHER, REPORT, RUNS, STAGES
from torchparity.bench.targets import evaluate_targets


def test_the_decode_part_times_a_decoding_diagnosis_against_two_plain_decodings() -> None:
    settings = dataclasses.replace(default_settings("cpu", quick=True), rounds=1, warmup=0,
                                   threads=1)
    (row,) = decode_rows(settings, Progress())
    assert row["status"] == "ok" and row["steps"] == STEPS == 16
    # The diagnosis runs both decodings and more (A's float64 golden, the captures).
    assert row["diagnosis_s"] > row["plain_s"] > 0 and math.isfinite(row["decode_time_ratio"])
    assert row["first_step"] is None  # manual and sdpa attention agree within the budget
    title, headers, cells = report._decode([row])
    assert "× plain" in headers and cells[0][headers.index("steps")] == "16"
    # Where the time goes: the stages of the record and the diagnosis add up to the timed
    # call (one round: its median is that round, whose report is split), none negative.
    split = row["diagnosis_split"]
    assert list(split) == [RUNS, *STAGES, OTHER, REPORT] and split[RUNS] > 0
    assert all(share >= 0 for share in split.values())
    timed = sum(split[s] for s in (RUNS, *STAGES, OTHER)) * row["plain_s"]
    assert timed == pytest.approx(row["diagnosis_s"])
    _, headers, cells = report._diagnose_split([], [row])
    assert cells[0][headers.index("capture")].startswith("record + --against, greedy")
    result = {"diagnose": [], "decode": [row], "check": [], "throughput": [],
              "settings": {"device": "cpu"}}
    (target,) = evaluate_targets(result)
    assert target["target"] == "decode_time" and target["limit"] == "<= 4"
