"""Part ``decode``: the cost of a decoding diagnosis across revisions.

``record --decode`` of A, then ``diagnose --against`` of B, over :data:`STEPS` steps, timed
against a plain decoding of A and of B along the same tokens (with ``--beams K``, also a beam
search); the models are the ``diagnose`` part's, every contender in this process.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from torchparity.bench.models import model_config, timing_model
from torchparity.bench.rounds import Progress, Row, interleaved, na_row, paired_ratio
from torchparity.bench.settings import DIAGNOSE_BACKENDS, BenchSettings
from torchparity.bench.stages import per_plain, stage_seconds
from torchparity.bench.timing import wall_time
from torchparity.diagnosis.pipelines.decoding import diagnose_decode_against, record_decode
from torchparity.dtypes import torch_dtype
from torchparity.reference import zoo
from torchparity.subject.beams import BeamSearch, BeamSettings, builtin_reorder, expand_prompt
from torchparity.subject.decoding import Fed, builtin_step, teacher_forced

#: Decoding steps after the prompt.
STEPS = 16
#: The decoder-only case decodings are timed on when the first case is an encoder-decoder.
FALLBACK_CASE = "llama-tiny"


def decode_rows(settings: BenchSettings, progress: Progress) -> list[Row]:
    """A row per search (greedy, beams): record + diagnose against two plain decodings, by stage."""
    # decode_time_ratio's goal is at most 4; the record of A's side counts with the runs
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
    models = [timing_model(config.replace(attention_backend=name), device, torch_dtype(dtype))
              for name in DIAGNOSE_BACKENDS]
    prompt = {key: value.to(device) for key, value in zoo.make_batch(
        config, size.batch_size, size.seq_len, seed=0, padding="none").items()}
    searches = [None] + ([BeamSettings(settings.beams)] if settings.beams else [])
    return [_decode_row(models, prompt, beams, settings, progress, device, case,
                        {**fields, "search": f"{beams.beams} beams" if beams else "greedy"})
            for beams in searches]


def _decode_row(models: list[torch.nn.Module], prompt: dict[str, torch.Tensor],
                beams: BeamSettings | None, settings: BenchSettings, progress: Progress,
                device: torch.device, case: str, fields: Row) -> Row:
    model_a, model_b = models
    step, reorder = builtin_step(model_a), builtin_reorder(model_a)
    searched = expand_prompt(prompt, beams.beams) if beams else prompt
    search = BeamSearch(beams, _prompts(prompt)) if beams else None
    with torch.no_grad():
        first = teacher_forced(step, model_a, searched, STEPS, reorder=reorder,
                               decide=search and search.decide)

    def plain() -> None:
        with torch.no_grad():
            if beams:  # A searches, B follows its choices
                teacher_forced(step, model_a, searched, STEPS, reorder=reorder,
                               decide=BeamSearch(beams, _prompts(prompt)).decide)
                teacher_forced(step, model_b, searched, STEPS, Fed(first.tokens, first.parents),
                               reorder=reorder)
                return
            for model in (model_a, model_b):
                teacher_forced(step, model, prompt, STEPS, first.tokens)

    reports, recorded = [], []

    def diagnosis() -> None:
        with tempfile.TemporaryDirectory(prefix="torchparity-bench-") as tmp:
            start = time.perf_counter()
            trace = record_decode(model_a, prompt, Path(tmp) / "a.tptrace", steps=STEPS,
                                  beams=beams, progress=False)
            recorded.append(time.perf_counter() - start)
            reports.append(diagnose_decode_against(trace, model_b, prompt, progress=False))

    contenders = {"plain": plain, "diagnosis": diagnosis}
    progress.start("decode", len(contenders) * (settings.warmup + settings.rounds))
    try:
        times = interleaved(list(contenders), lambda name: wall_time(contenders[name], device),
                            settings.rounds, settings.warmup, progress,
                            f"decode {case} ({fields['search']})")
    except Exception as exc:  # a failing diagnosis is a finding to report, not a crash
        return na_row(f"decoding diagnosis failed: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0]}", **fields)
    report = reports[-1]
    plain_s = statistics.median(times["plain"])
    return {**fields, "status": "ok", "plain_s": plain_s,
            "diagnosis_s": statistics.median(times["diagnosis"]),
            "decode_time_ratio": 1 / paired_ratio(times["plain"], times["diagnosis"]),
            "diagnosis_split": per_plain(stage_seconds(report, times["diagnosis"][-1],
                                                       recorded[-1]), plain_s),
            "first_step": report.first_step, "flips": len(report.flips),
            "beam_swaps": len(report.swaps)}


def _prompts(prompt: dict[str, torch.Tensor]) -> int:
    """The prompts of a batch."""
    return next(iter(prompt.values())).shape[0]
