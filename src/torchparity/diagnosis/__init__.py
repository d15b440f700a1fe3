"""Divergence diagnosis: where two models part, module by module, then op by op.

Four rooms, one way down: ``pipelines`` (a diagnosis end to end; the public entry points in
``pipelines.forward``), ``stages`` (one module each, importing no other stage), ``reports``
(terminal, JSON, HTML) and ``core`` (what the stages share)."""
