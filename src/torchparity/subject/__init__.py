"""A model under test, one home for every wing: factory, pytrees, calls, loss, :class:`Subject`."""

from torchparity.subject.model import Subject

__all__ = ["Subject"]
