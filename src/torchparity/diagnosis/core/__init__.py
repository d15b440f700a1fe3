"""What the stages of a diagnosis share: the hooks that capture a module call (capture), the
state a module keeps (state), the trace on disk (trace, trace_meta), running a model (run),
masks by meaning (masks), one call judged (judging), rows and results (results), B's calls
paired with A's (align), arguments compared by meaning (arguments), A's side as the stages read
it (reference, decode_reference) and progress bars (progress)."""
