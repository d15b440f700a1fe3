"""Stage 6 of a diagnosis: the operation, and its source line, where a module's divergence
enters.

The first divergent module's recorded call (or the one named) is replayed on A's inputs with
its ops captured (``.capture``) as A, the golden and B, on the state it had when the call
started; the streams are aligned (``.align``), each op judged (``.judge``) and the answer
said (``.report``): three replays of one module. B's call runs once more, and what differs
between its runs (nondeterminism) joins the budgets of the ops it reaches. At a step of a
decoding the module's first call is captured as the side decodes (:func:`ops_at_steps`,
:func:`judged_streams`). The entry is :func:`drill_down` (``.rows``)."""

from torchparity.diagnosis.stages.ops.calls import a_side, judged_streams, ops_at_steps
from torchparity.diagnosis.stages.ops.recorded import keep_ops
from torchparity.diagnosis.stages.ops.report import ForwardCause, NoOps, OpReport
from torchparity.diagnosis.stages.ops.rows import drill_down

__all__ = ["ForwardCause", "NoOps", "OpReport", "a_side", "drill_down", "judged_streams",
           "keep_ops", "ops_at_steps"]
