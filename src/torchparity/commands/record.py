"""``torchparity record``: write a model's module-by-module trace on the base revision.

The model comes from an entry point ``package.module:factory`` (or ``path/to/file.py:factory``),
see :class:`torchparity.subject.Subject`. With ``--decode`` the trace holds a teacher-forced
decoding instead of one forward (and backward) pass.
"""

from __future__ import annotations

import argparse

import torch

from torchparity.commands.common import dtype_name
from torchparity.dtypes import CASTABLE, torch_dtype
from torchparity.errors import UsageError
from torchparity.subject import Subject


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("entry", help="package.module:factory or file.py:factory returning "
                                      "(model, inputs) or (model, inputs, loss_fn), or a dict "
                                      "with those keys and 'step'")
    parser.add_argument("-o", "--output", required=True, metavar="PATH",
                        help="trace directory to write (replaced if it is a trace)")
    add_selection_arguments(parser)
    add_decode_arguments(parser)
    parser.add_argument("--backend", help="attention backend to run the model under")


def add_selection_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared with ``torchparity diagnose``."""
    parser.add_argument("--no-backward", dest="backward", action="store_false",
                        help="compare forward outputs only (no gradients; decoding never "
                             "takes any)")
    parser.add_argument("--include", action="append", metavar="PATTERN",
                        help="only modules matching this glob (or 're:REGEX'); repeatable")
    parser.add_argument("--exclude", action="append", metavar="PATTERN",
                        help="skip modules matching this glob (or 're:REGEX'); repeatable")
    parser.add_argument("--dtype", type=dtype_name, choices=CASTABLE,
                        help="run copies of the models in this dtype (fp64: compare A and B in "
                             "float64, where changes below fp32 noise show); default: as given")


#: The decoding options that take a value: flag, type, metavar, help.
_DECODE_VALUES = (
    ("--steps", int, "N", "decoding steps after the prompt (default 8, or the length of the "
                          "--tokens sequences)"),
    ("--tokens", str, "FILE", "tokens to feed instead of A's greedy choices: one sequence of "
                              "ids per line (a beam search's or a seeded sampler's output)"),
    ("--beams", int, "K", "run a beam search of K beams with A; B and the goldens follow its "
                          "parents and tokens (the factory's 'reorder', or the built-in one, "
                          "reorders the state between steps)"),
    ("--length-penalty", float, "X", "with --beams: the n-best ranks hypotheses by summed "
                                     "log-probability over length**X (default 1.0, as "
                                     "generate)"),
    ("--eos", int, "ID", "with --beams: the token id that ends a hypothesis (default: none, "
                         "every hypothesis runs all --steps)"),
    ("--temperature", float, "T", "with --sample: divide the logits by T (default 1.0)"),
    ("--top-k", int, "K", "with --sample: keep the K most likely tokens (default: all)"),
    ("--top-p", float, "P", "with --sample: keep the fewest most likely tokens whose "
                            "probability reaches P (default: all)"),
    ("--seed", int, "N", "with --sample: the seed of the uniforms (default 0)"),
)


def add_decode_arguments(parser: argparse.ArgumentParser) -> None:
    """The decoding options shared with ``torchparity diagnose``."""
    parser.add_argument("--decode", action="store_true",
                        help="diagnose a teacher-forced decoding (the factory's step, or the "
                             "built-in one of reference and transformers models)")
    parser.add_argument("--sample", action="store_true",
                        help="A samples (inverse CDF, uniforms torchparity draws from --seed, "
                             "the same on every machine); B and the goldens are fed A's "
                             "samples and draw with the same uniforms")
    for flag, kind, metavar, text in _DECODE_VALUES:
        parser.add_argument(flag, type=kind, metavar=metavar, help=text)


def dtype_option(args: argparse.Namespace) -> torch.dtype | None:
    """The torch dtype ``--dtype`` names (None when not given)."""
    return torch_dtype(args.dtype) if args.dtype else None


def decode_options(args: argparse.Namespace) -> dict:
    """``steps``, ``tokens`` and ``beams`` of ``--steps`` / ``--tokens`` / ``--beams`` (with
    ``--length-penalty`` and ``--eos``); a usage error when they come without ``--decode``."""
    from torchparity.diagnosis.decoding import STEPS
    from torchparity.subject.beams import LENGTH_PENALTY, BeamSettings
    from torchparity.subject.decoding import read_tokens

    if not args.decode:
        if args.steps is not None or args.tokens or args.beams is not None or args.sample:
            raise UsageError("--steps, --tokens, --beams and --sample describe a decoding; add "
                             "--decode")
        return {}
    if args.beams is None and (args.length_penalty is not None or args.eos is not None):
        raise UsageError("--length-penalty and --eos are options of a beam search; add "
                         "--beams K")
    if args.beams is not None and (args.beams < 1 or args.tokens):
        raise UsageError(f"--beams {args.beams}: search with one beam or more" if not args.tokens
                         else "--beams searches for its own tokens; give --beams or --tokens")
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps {args.steps}: decode at least one step after the prompt")
    tokens = read_tokens(args.tokens, args.steps) if args.tokens else None
    steps = tokens.shape[1] if tokens is not None else args.steps or STEPS
    beams = None if args.beams is None else BeamSettings(
        args.beams, LENGTH_PENALTY if args.length_penalty is None else args.length_penalty,
        args.eos)
    return {"steps": steps, "tokens": tokens, "beams": beams, "sample": _sampling(args)}


def _sampling(args: argparse.Namespace):
    """The settings of ``--sample`` and its options, or None without it."""
    from torchparity.subject.sampling import SEED, TEMPERATURE, SampleSettings

    given = [f"--{name.replace('_', '-')}" for name in ("temperature", "top_k", "top_p", "seed")
             if getattr(args, name) is not None]
    if not args.sample:
        if given:
            raise UsageError(f"{', '.join(given)}: options of sampling; add --sample")
        return None
    if args.beams is not None or args.tokens:
        raise UsageError("--sample draws its own tokens, without beams; give one of --sample, "
                         "--beams and --tokens")
    settings = SampleSettings(TEMPERATURE if args.temperature is None else args.temperature,
                              args.top_k, args.top_p, SEED if args.seed is None else args.seed)
    if settings.temperature <= 0 or (settings.top_k is not None and settings.top_k < 1) or \
            (settings.top_p is not None and not 0 < settings.top_p <= 1):
        raise UsageError("--temperature must be above 0, --top-k at least 1 and --top-p in "
                         "(0, 1]")
    return settings


def rebuilt(entry: str):
    """``rebuild()`` for a golden of the model of ``entry``: the factory called again."""
    return lambda: Subject.load(entry).model


def run(args: argparse.Namespace) -> int:
    from torchparity.diagnosis.api import record
    from torchparity.diagnosis.decoding import record_decode
    from torchparity.diagnosis.reference import golden_warning
    from torchparity.diagnosis.trace import open_trace

    decoding = decode_options(args)
    subject = Subject.load(args.entry)
    if decoding:
        path = record_decode(subject.model, subject.inputs, args.output,
                             step=subject.stepper(), reorder=subject.reorderer(),
                             include=args.include, exclude=args.exclude,
                             backend=args.backend, dtype=dtype_option(args),
                             rebuild=rebuilt(args.entry), **decoding)
    else:
        path = record(subject.model, subject.inputs, args.output, loss_fn=subject.loss_fn,
                      backward=args.backward, include=args.include, exclude=args.exclude,
                      backend=args.backend, dtype=dtype_option(args), padding=subject.padding)
    meta, _ = open_trace(path)
    warning = golden_warning(meta["golden"])
    if warning:
        print(warning)
    what = ""
    if decoding:
        search = (f" ({decoding['beams'].beams} beams)" if decoding["beams"] else
                  " (sampled)" if decoding["sample"] else "")
        what = f"a decoding of {meta['steps']} step(s){search} of"
    print(f"recorded {what} {type(subject.model).__name__} to {path}".replace("  ", " "))
    return 0
