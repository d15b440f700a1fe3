"""Stage 6 of a diagnosis: the operation, and its source line, where a module's divergence
enters.

The first divergent module's recorded call (or the one the user names) is run three times on
A's recorded inputs with its ops captured (:mod:`.capture`): A, the golden (a float64 copy of
A's module) and B. The streams are aligned as sequences (:mod:`.align`), each paired op judged
under the tolerance model (:mod:`.judge`) and the answer said as a maintainer wants it
(:mod:`.report`). The cost is three replays of one module, nothing when no module diverges.
A module that keeps state across calls (a cache on itself) is replayed on the state it had
when the recorded call started, as the module-level replays are. Before an op is named,
B's call runs once more: what differs between its two runs (nondeterminism) joins the
budgets of the ops it reaches instead of being called a change.

At a step of a decoding the module's first call is captured as the side decodes along the
reference's tokens (:func:`ops_at_steps`), and A's and B's ops are aligned and judged
(:func:`judged_streams`).

The stage's entry is :func:`drill_down` (:mod:`.rows`); one aligned call's ops are
:mod:`.calls`'.
"""

from torchparity.diagnosis.stages.ops.calls import a_side, judged_streams, ops_at_steps
from torchparity.diagnosis.stages.ops.recorded import keep_ops
from torchparity.diagnosis.stages.ops.report import ForwardCause, NoOps, OpReport
from torchparity.diagnosis.stages.ops.rows import drill_down

__all__ = ["ForwardCause", "NoOps", "OpReport", "a_side", "drill_down", "judged_streams",
           "keep_ops", "ops_at_steps"]
