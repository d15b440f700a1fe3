"""Run every causal-LM family of the installed transformers through torchparity's commands.

For each family (a tiny seeded model, ``hf:FAMILY``) the sweep runs, in a process of the
family's own with a time limit: ``golden update`` then ``check`` of the unchanged model;
``diagnose`` of its eager against its sdpa implementation, forward and decoding; ``train
--model`` for a few steps; and two planted bugs that ``diagnose`` must find (half of one
attention's output scaled by 1 %, one norm's ops dropped). An oracle in plain code says what
the answers should be: it runs both implementations in float64 with forward hooks and finds
the first module whose outputs differ beyond rounding. The results are kept in
``WORK/results.jsonl`` (a rerun resumes) and written as a table to ``docs/compatibility.md``.

    python scripts/compatibility_sweep.py                      # every family
    python scripts/compatibility_sweep.py --families llama,mamba --jobs 2
    python scripts/compatibility_sweep.py --report-only        # the table from the results
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: A difference of float64 module outputs beyond this share of their scale is a real one:
#: float32 islands (rotary tables, norms computed in float32) that round a 1e-16 difference
#: the other way reach about 1e-7; a change of the math is far above.
REAL_DIFFERENCE = 1e-4
#: The commands in the order run, with what each must answer to pass.
COMMANDS = ("golden", "check", "diagnose", "decode", "train", "plant-scale", "plant-drop")
PLANTS = '''\
"""Planted bugs in a tiny {family}: written by scripts/compatibility_sweep.py."""
import torch
from torchparity.subject import hf_families


def _built():
    model = hf_families.tiny_model({family!r})
    return model, dict(model.named_modules())


def scaled():
    """The first half of {scaled!r}'s output features scaled by 1 % (the whole scaled, a
    norm after it, as Gemma 2's, would undo)."""
    model, modules = _built()

    def scale(module, args, output):
        first = output[0] if isinstance(output, tuple) else output
        half = first.shape[-1] // 2
        first = torch.cat((first[..., :half] * 1.01, first[..., half:]), -1)
        return (first, *output[1:]) if isinstance(output, tuple) else first

    modules[{scaled!r}].register_forward_hook(scale)
    return model, hf_families.prompts(model.config)


def dropped():
    """{dropped!r} returns its input: its ops are dropped."""
    model, modules = _built()
    modules[{dropped!r}].forward = lambda hidden_states, *args, **kwargs: hidden_states
    return model, hf_families.prompts(model.config)
'''


@dataclass
class Outcome:
    """One command's outcome on one family."""

    status: str  # pass, fail, n/a
    reason: str = ""
    seconds: float = 0.0


@dataclass
class FamilyResult:
    """Everything the sweep found for one family."""

    family: str
    builds: bool
    reason: str = ""
    oracle: dict = field(default_factory=dict)
    outcomes: dict[str, Outcome] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> FamilyResult:
        outcomes = {k: Outcome(**v) for k, v in data.pop("outcomes").items()}
        return cls(**data, outcomes=outcomes)


# --- the oracle: plain code, no torchparity judgement ------------------------------------


def oracle(family: str) -> dict:
    """Build ``family`` eager and sdpa in float64 on the same weights and compare every
    module's output: which implementations exist, whether they agree, and where not."""
    import torch

    from torchparity.errors import UsageError
    from torchparity.subject import hf_families

    try:
        model = hf_families.tiny_model(family)
    except UsageError as exc:
        return {"builds": False, "reason": str(exc)}
    except Exception as exc:  # the family's own code: its first line is the reason
        return {"builds": False, "reason": f"{type(exc).__name__}: {_first(exc)}"}
    # The unpadded prompt: eager attention's float64 mask overflows in its float32 softmax
    # on a padded row, and the oracle is the library's code as it is.
    inputs = {"input_ids": hf_families.prompts(model.config)["input_ids"][:1]}
    ran = {name for name, _, _ in _module_outputs(model, inputs)}  # a cross-attention may not
    found = {"builds": True, "attention": model.config._attn_implementation,
             "generates": bool(model.can_generate()), "scaled": _attention_module(model, ran),
             "dropped": _norm_module(model, ran)}
    outputs = {}
    for implementation in ("eager", "sdpa"):
        try:
            twin = hf_families.tiny_model(family, implementation, torch.float64)
            if getattr(twin, "_can_set_experts_implementation", lambda: False)():
                twin.set_experts_implementation("eager")  # grouped_mm has no float64
        except Exception as exc:
            found[implementation] = f"{type(exc).__name__}: {_first(exc)}"
            continue
        found[implementation] = "ok"
        outputs[implementation] = _module_outputs(twin, inputs)
    if len(outputs) == 2:
        found.update(_first_difference(outputs["eager"], outputs["sdpa"]))
    if found["generates"]:
        found["cache"] = _cache_difference(family)
    return found


def _cache_difference(family: str) -> float | None:
    """How far transformers' own cached greedy decoding of the two prompts, in float64, is
    from a full forward of each step's sequence (positions as ``generate`` makes them); None
    where generate cannot run or a side is not finite."""
    import inspect

    import torch

    from torchparity.subject import hf_families

    model = hf_families.tiny_model(family, dtype=torch.float64)
    if getattr(model, "_can_set_experts_implementation", lambda: False)():
        model.set_experts_implementation("eager")
    prompts = hf_families.prompts(model.config)
    takes_positions = "position_ids" in inspect.signature(model.forward).parameters
    try:
        with torch.no_grad():
            generated = model.generate(**prompts, max_new_tokens=4, do_sample=False,
                                       use_cache=True, output_logits=True,
                                       return_dict_in_generate=True, pad_token_id=0)
            worst = 0.0
            for step, logits in enumerate(generated.logits):
                length = prompts["input_ids"].shape[1] + step
                mask = torch.cat((prompts["attention_mask"],
                                  torch.ones(2, step, dtype=torch.long)), 1)
                positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
                full = model(input_ids=generated.sequences[:, :length], attention_mask=mask,
                             use_cache=False,
                             **({"position_ids": positions} if takes_positions else {}))
                last = full.logits[:, -1]
                if not (torch.isfinite(last).all() and torch.isfinite(logits).all()):
                    return None
                worst = max(worst, _relative(last, logits.to(last.dtype)))
    except Exception:  # a family generate cannot drive: the oracle has no answer
        return None
    return worst


def _module_outputs(model, inputs) -> list[tuple[str, object, object]]:
    """Each module's first floating input and output, in the order the modules finish."""
    import torch

    seen: list[tuple[str, object, object]] = []

    def first(value):
        value = value[0] if isinstance(value, tuple | list) and value else value
        ok = isinstance(value, torch.Tensor) and value.is_floating_point()
        return value.detach().clone() if ok else None

    def keep(name):
        def hook(module, args, kwargs, output):
            taken = first(args) if args else first(kwargs.get("hidden_states"))
            if (out := first(output)) is not None:
                seen.append((name, taken, out))
        return hook

    handles = [m.register_forward_hook(keep(n), with_kwargs=True)
               for n, m in model.named_modules() if n]
    with torch.no_grad():
        model(**inputs)
    for handle in handles:
        handle.remove()
    return seen


def _first_difference(a, b) -> dict:
    """The first module whose output differs beyond :data:`REAL_DIFFERENCE` while its input
    agrees: where the difference enters."""
    worst = 0.0
    b_by_call = {(name, i): (x, y) for i, (name, x, y) in _numbered(b)}
    for i, (name, into, out) in _numbered(a):  # a module called twice is paired call by call
        other_into, other_out = b_by_call.get((name, i), (None, None))
        difference = _relative(out, other_out)
        worst = max(worst, difference)
        if difference > REAL_DIFFERENCE and _relative(into, other_into) <= REAL_DIFFERENCE:
            return {"same": False, "first": name, "difference": difference}
    return {"same": True, "difference": worst}


def _numbered(calls):
    """Each call with its number among the calls of its module."""
    seen: dict[str, int] = {}
    for name, into, out in calls:
        seen[name] = seen.get(name, -1) + 1
        yield seen[name], (name, into, out)


def _relative(x, y) -> float:
    """The largest difference of two tensors' finite elements, over the first one's scale."""
    import torch

    if x is None or y is None or x.shape != y.shape:
        return 0.0
    finite = torch.isfinite(x) & torch.isfinite(y)
    scale = x[finite].abs().max().item() if finite.any() else 0.0
    return (x[finite] - y[finite]).abs().max().item() / scale if scale else 0.0


def _attention_module(model, ran: set[str]) -> str | None:
    """The last attention module that runs (the one of the last attention layer)."""
    names = [n for n, m in model.named_modules()
             if "attention" in type(m).__name__.lower() and "." in n and n in ran]
    outer = [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]
    return outer[-1] if outer else None


def _norm_module(model, ran: set[str]) -> str | None:
    """A norm inside the last layer of the first stack that runs (a multimodal family's
    vision tower does not on text), whose ops can be dropped."""
    from torch import nn

    stacks = [n for n, m in model.named_modules()
              if isinstance(m, nn.ModuleList) and len(m) and f"{n}.0" in ran]
    if not stacks:
        return None
    last = f"{stacks[0]}.{len(model.get_submodule(stacks[0])) - 1}."
    norms = [n for n, m in model.named_modules()
             if "norm" in type(m).__name__.lower() and n.startswith(last)
             and not list(m.children())]
    return norms[-1] if norms else None


# --- the commands ---------------------------------------------------------------------------


def run(command: list[str]) -> tuple[int, str, float]:
    """Run one torchparity command in this process: its exit code and its last line."""
    import contextlib
    import io

    from torchparity.cli import main as torchparity

    started = time.monotonic()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        try:
            code = torchparity(command)
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 2
    lines = [line.strip() for line in printed.getvalue().splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("torchparity")]
    return code, (said or lines or [""])[-1], time.monotonic() - started


def sweep_family(family: str, work: Path, steps: int) -> FamilyResult:
    """Every command on ``family``, in this process, judged by the oracle's answers."""
    folder = work / family
    folder.mkdir(parents=True, exist_ok=True)
    os.chdir(folder)
    found = oracle(family)
    if not found.pop("builds"):
        return FamilyResult(family, False, found["reason"])
    result = FamilyResult(family, True, oracle=found)
    entry, golden = f"hf:{family}", ["--golden-dir", str(folder / "golden")]
    both = found.get("eager") == "ok" and found.get("sdpa") == "ok"

    def command(name: str, argv: list[str], expect: int = 0, mentions: str | None = None,
                skip: str | None = None) -> None:
        if skip:
            result.outcomes[name] = Outcome("n/a", skip)
            return
        code, last, seconds = run(argv)
        ok = code == expect and (mentions is None or mentions in last_output(folder, name))
        reason = "" if ok else f"exit {code}: {last}"
        result.outcomes[name] = Outcome("pass" if ok else "fail", reason, round(seconds, 1))

    command("golden", ["golden", "update", "--model", entry, *golden])
    # Where the library's two implementations differ, the cells of the one the model was
    # not built with fail, and only they.
    # and where its cached decoding parts from its full recompute, the decode-cache row fails
    differs = not found.get("same", True)
    expect = 1 if differs or (found.get("cache") or 0) > REAL_DIFFERENCE else 0
    command("check", ["check", "--model", entry, *golden, "--backend", "manual",
                      "--backend", "sdpa", "--backend", "hf-eager", "--dtype", "fp32",
                      "--jobs", "1", "--json", "check.json"], expect=expect,
            skip=None if result.outcomes["golden"].status == "pass" else "no goldens")
    no_pair = None if both else "one attention implementation only"
    command("diagnose", ["diagnose", f"{entry},attn=eager", f"{entry},attn=sdpa",
                         "--json", "diagnose.json"], expect=int(differs),
            mentions=found["first"] if differs else None, skip=no_pair)
    command("decode", ["diagnose", f"{entry},attn=eager", f"{entry},attn=sdpa", "--decode",
                       "--steps", "4", "--json", "decode.json"], expect=int(differs),
            skip=no_pair or (None if found["generates"] else "does not generate"))
    command("train", ["train", "--model", entry, "--steps", str(steps), "--update-golden",
                      "--golden-dir", str(folder / "train")])
    if result.outcomes["train"].status == "pass":
        command("train", ["train", "--model", entry, "--steps", str(steps), "--check",
                          "--golden-dir", str(folder / "train")])
    plants = folder / "plants.py"
    plants.write_text(PLANTS.format(family=family, scaled=found["scaled"],
                                    dropped=found["dropped"]))
    command("plant-scale", ["diagnose", entry, f"{plants}:scaled", "--json",
                            "plant-scale.json"], expect=1, mentions=found["scaled"],
            skip=None if found["scaled"] else "no attention module")
    command("plant-drop", ["diagnose", entry, f"{plants}:dropped", "--json",
                           "plant-drop.json"], expect=1, mentions=found["dropped"],
            skip=None if found["dropped"] else "no norm inside a layer")
    return result


def sweep_in_child(family: str, work: Path, steps: int, timeout: float) -> FamilyResult:
    """:func:`sweep_family` in a process of its own, ended past ``timeout`` seconds."""
    out = work / family / "result.json"
    out.unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run([sys.executable, __file__, "--family", family, "--work",
                               str(work), "--steps", str(steps)], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return FamilyResult(family, True, f"the sweep of this family ran past {timeout:.0f} s")
    if not out.exists():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return FamilyResult(family, True, f"the sweep of this family crashed: {last}")
    return FamilyResult.from_json(json.loads(out.read_text()))


def last_output(folder: Path, name: str) -> str:
    """The JSON a diagnose wrote, as text: the module it names is looked for in it."""
    path = folder / f"{name}.json"
    return path.read_text() if path.exists() else ""


# --- the report -----------------------------------------------------------------------------


def write_report(results: list[FamilyResult], out: Path, command_line: str) -> None:
    """docs/compatibility.md: the counts, a row per family and every failure's reason."""
    import torch
    import transformers

    from torchparity.subject import hf_families

    built = [r for r in results if r.builds]
    passing = [r for r in built if not r.reason
               and all(o.status != "fail" for o in r.outcomes.values())]
    lines = [
        "# Compatibility with transformers families",
        "",
        f"{len(results)} of the {len(hf_families.families())} causal-LM families of "
        f"transformers {transformers.__version__} (torch {torch.__version__}), each as a tiny "
        "seeded model (`hf:FAMILY`), through each command. Regenerate with:",
        "",
        "```bash",
        command_line,
        "```",
        "",
        f"{len(results)} families tried; {len(built)} build a tiny model; "
        f"{len(passing)} of those pass every command that applies to them "
        f"({100 * len(passing) / max(len(built), 1):.0f}%).",
        "",
        "What each column runs, and what passes:",
        "",
        "| column | command | passes when |",
        "| --- | --- | --- |",
        "| golden | `golden update --model hf:F` | exit 0 |",
        "| check | `check --model hf:F --backend manual --backend sdpa --backend hf-eager "
        "--dtype fp32` | exit 0 (the unchanged model), or 1 where the oracle says the two "
        "implementations differ, or that the model's cached decoding parts from its full "
        "recompute |",
        "| diagnose | `diagnose hf:F,attn=eager hf:F,attn=sdpa` | the oracle's answer: exit 0 "
        "where the two agree in float64, else exit 1 naming the oracle's module |",
        "| decode | the same with `--decode --steps 4` | as diagnose |",
        "| train | `train --model hf:F --steps N --update-golden`, then `--check` | exit 0 |",
        "| plant-scale | `diagnose hf:F plants.py:scaled` (half of one attention's output "
        "x 1.01) | "
        "exit 1 naming that module |",
        "| plant-drop | `diagnose hf:F plants.py:dropped` (one norm's ops dropped) | exit 1 "
        "naming that module |",
        "",
        "The oracle builds the eager and the sdpa model in float64 on the same weights (MoE "
        "experts on their eager implementation) and compares every module's output on the "
        "unpadded prompt with forward hooks; a difference "
        f"beyond {REAL_DIFFERENCE:g} of the output's scale is a real one. It also runs "
        "transformers' own `generate` (greedy, cached, float64) on the two prompts, the "
        "second left-padded, and compares each step's logits with a full forward of the "
        "sequence so far.",
        "",
        "| family | attn | golden | check | diagnose | decode | train | plant-scale "
        "| plant-drop |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    mark = {"pass": "✓", "fail": "✗", "n/a": "–"}
    for r in results:
        if not r.builds:
            lines.append(f"| {r.family} | – | not built | | | | | | |")
            continue
        cells = [mark[r.outcomes[c].status] if c in r.outcomes else " " for c in COMMANDS]
        lines.append(f"| {r.family} | {r.oracle.get('attention', '')} | {' | '.join(cells)} |")
    lines += ["", "## Failures and reasons", ""]
    for r in results:
        if r.reason:
            lines.append(f"- **{r.family}**: " + (r.reason if r.builds else
                                                   f"no tiny model: {r.reason}"))
        for name, outcome in r.outcomes.items():
            if outcome.status == "fail":
                lines.append(f"- **{r.family}** {name}: {outcome.reason}")
    differ = [r for r in built if r.oracle.get("same") is False]
    lines += ["", "## Families whose eager and sdpa implementations differ in float64", ""]
    lines += [f"- {r.family}: first at `{r.oracle['first']}` "
              f"({r.oracle['difference']:.2g} of its scale)" for r in differ] or ["- none"]
    parted = [r for r in built if (r.oracle.get("cache") or 0) > REAL_DIFFERENCE]
    lines += ["", "## Families whose cached decoding parts from a full recompute (generate)", ""]
    lines += [f"- {r.family}: {r.oracle['cache']:.2g} of the logits' scale" for r in parted] \
        or ["- none"]
    out.write_text("\n".join(lines) + "\n")


def _first(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma-separated model types (default: all)")
    parser.add_argument("--work", type=Path, default=ROOT / ".sweep",
                        help="goldens, traces and results.jsonl (default: .sweep/)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "compatibility.md")
    parser.add_argument("--jobs", type=int, default=1, help="families at once")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per family")
    parser.add_argument("--steps", type=int, default=20, help="train steps")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--redo", action="store_true", help="sweep the families again")
    parser.add_argument("--family", help=argparse.SUPPRESS)  # one family, in a child
    args = parser.parse_args()
    if args.family:
        result = sweep_family(args.family, args.work.resolve(), args.steps)
        (args.work / args.family / "result.json").write_text(json.dumps(asdict(result)))
        return
    from torchparity.subject import hf_families

    families = args.families.split(",") if args.families else hf_families.families()
    args.work.mkdir(parents=True, exist_ok=True)
    store = args.work / "results.jsonl"
    done = {}
    if store.exists():
        for line in store.read_text().splitlines():
            result = FamilyResult.from_json(json.loads(line))
            done[result.family] = result
    todo = [] if args.report_only else [f for f in families if args.redo or f not in done]
    print(f"{len(todo)} families to sweep, {len(done)} already in {store}", flush=True)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        running = {pool.submit(sweep_in_child, f, args.work.resolve(), args.steps,
                               args.timeout): f for f in todo}
        for future in concurrent.futures.as_completed(running):
            result = future.result()
            done[result.family] = result
            with store.open("a") as out:
                out.write(json.dumps(asdict(result)) + "\n")
            failed = [n for n, o in result.outcomes.items() if o.status == "fail"]
            print(f"{result.family}: " + (result.reason or (
                f"failed {', '.join(failed)}" if failed else "pass")), flush=True)
    chosen = [done[f] for f in families if f in done]
    command_line = "python scripts/compatibility_sweep.py" + (
        f" --families {args.families}" if args.families else "")
    write_report(chosen, args.out, command_line)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
