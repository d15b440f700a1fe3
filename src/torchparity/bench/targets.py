"""The project's speed targets, judged against one benchmark result."""

from __future__ import annotations

from torchparity.bench.rounds import Document, Row

TARGETS = {
    "diagnose_time": ("diagnose time / plain fwd+bwd of both models", "<=", 3.0),
    "against_time": ("diagnose --against time / plain fwd+bwd of B", "<=", 2.5),
    "stream_peak": ("streaming diagnose peak memory / plain run's", "<=", 2.5),
    "drill_down_time": ("op drill-down time (forward, or backward for a gradient-only change) "
                        "/ plain fwd+bwd of the model", "<=", 1.0),
    "decode_time": ("record + diagnose of 16 decoding steps / two plain 16-step decodings",
                    "<=", 4.0),
    "check_wall": ("`torchparity check` wall time (s)", "<=", 15.0),
    "twins_wall": ("`torchparity twins` search of 100 examples of a small attention twin: "
                   "wall time (s)", "<=", 60.0),
    "sdpa_speedup": ("fastest SDPA backend tok/s / manual's (CPU fp32, seq >= 512)", ">=", 1.5),
}


def evaluate_targets(result: Document) -> list[Row]:
    """A row per speed target; ``met`` None where the run did not measure it (``note``: why)."""
    out = []
    for row in result["diagnose"]:
        where = _where(row)
        out.append(_target("diagnose_time", where, row.get("diagnose_time_ratio"), row))
        out.append(_target("against_time", where, row.get("against_time_ratio"), row))
        out.append(_target("stream_peak", where, row.get("stream_peak_ratio"), row))
        out.append(_target("drill_down_time", where, row.get("drill_down_ratio"), row))
    for row in result["decode"]:
        out.append(_target("decode_time", _where(row), row.get("decode_time_ratio"), row))
    for row in result["check"]:
        out.append(_target("check_wall", f"{row.get('logical_cores', '?')} logical cores",
                           row.get("wall_s"), row))
    for row in result.get("twins", []):
        out.append(_twins_target(row))
    for where, best in _best_sdpa(result).items():
        out.append(_target("sdpa_speedup", where, best, {}))
    return out


def _twins_target(row: Row) -> Row:
    # The target counts 100 examples: a shorter search (--quick) is not judged by it.
    where = f"{row.get('examples', '?')} examples, {row.get('logical_cores', '?')} logical cores"
    if row.get("examples") != 100 or "wall_s" not in row:
        reason = row.get("reason") or "the target counts 100 examples; run without --quick"
        return _target("twins_wall", where, None, {"reason": reason})
    return _target("twins_wall", where, row["wall_s"], row)


def _where(row: Row) -> str:
    return " ".join(str(row[k]) for k in ("model", "case", "size", "dtype", "search") if k in row)


def _target(key: str, where: str, measured: float | None, row: Row) -> Row:
    text, op, limit = TARGETS[key]
    met = None if measured is None else (measured <= limit if op == "<=" else measured >= limit)
    entry = {"target": key, "description": text, "where": where, "limit": f"{op} {limit:g}",
             "measured": measured, "met": met}
    if measured is None:
        entry["note"] = row.get("reason", "not measured in this run")
    return entry


def _best_sdpa(result: Document) -> dict[str, float | None]:
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
