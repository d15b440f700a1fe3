"""The stages of a diagnosis, in the order the pipelines call them; no stage imports another:

1. :mod:`.capture_a`: capture A (every selected module's inputs, outputs, gradients);
2. :mod:`.float64_golden`: A in float64, and replays of each call for local goldens;
3. :mod:`.propagated`: B run and judged against the golden as it runs, then aligned;
4. :mod:`.local`: B's diverged modules replayed on A's recorded inputs;
5. :mod:`.entry`: where a mask, position or cache argument carries the divergence in;
6. :mod:`.ops`: the first divergence drilled down to its op and source line.
"""
