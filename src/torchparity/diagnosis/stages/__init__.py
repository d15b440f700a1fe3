"""The stages of a diagnosis, in the order the pipelines call them; none imports another:
``capture_a`` (A's calls), ``float64_golden`` (A in float64, replays for local goldens),
``propagated`` (B judged as it runs, then aligned), ``local`` (B's diverged modules on A's
inputs), ``entry`` (the argument that carries the divergence in), ``ops`` (the op and line)."""
