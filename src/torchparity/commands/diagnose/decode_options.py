"""The decoding options of ``record`` and ``diagnose``: ``--decode`` and how A's tokens are
chosen (given ``--tokens``, a beam search, sampling), checked together."""

from __future__ import annotations

import argparse

from torchparity.errors import UsageError

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
                        help="a teacher-forced decoding instead of a forward and backward (the "
                             "factory's step, or the built-in one of reference and "
                             "transformers models)")
    parser.add_argument("--sample", action="store_true",
                        help="A samples (inverse CDF, uniforms torchparity draws from --seed, "
                             "the same on every machine); B and the goldens are fed A's "
                             "samples and draw with the same uniforms")
    for flag, kind, metavar, text in _DECODE_VALUES:
        parser.add_argument(flag, type=kind, metavar=metavar, help=text)


def decode_options(args: argparse.Namespace) -> dict:
    """``steps``, ``tokens`` and ``beams`` of ``--steps`` / ``--tokens`` / ``--beams`` (with
    ``--length-penalty`` and ``--eos``); a usage error when they come without ``--decode``."""
    from torchparity.diagnosis.pipelines.decoding import STEPS
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
