"""Divergence diagnosis: where two models part, module by module, then op by op.

Four rooms, one way down:

- :mod:`.pipelines`: a diagnosis end to end (a forward pass, a decoding, the ranks of
  torchrun, a compiled B, a training step), each calling the stages in order;
- :mod:`.stages`: the stages themselves, one module each, importing no other stage;
- :mod:`.reports`: what a person reads (the terminal table, JSON, HTML);
- :mod:`.core`: what the stages share (A's reference, the trace format, hooks, state,
  alignment, results).

The public entry points (``tp.diagnose``, ``tp.record``, ...) live in :mod:`.pipelines.forward`.
"""
