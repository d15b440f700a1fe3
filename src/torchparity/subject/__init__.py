"""A model under test, one home for every wing: loading a user's factory
(:mod:`~torchparity.subject.factory`), its pytrees of tensors (:mod:`~torchparity.subject.trees`),
calling it, casting its inputs and its default loss (:mod:`~torchparity.subject.running`),
``transformers`` models (:mod:`~torchparity.subject.hf`) and the :class:`Subject` that holds
them (:mod:`~torchparity.subject.model`). ``golden/``, ``diagnosis/`` and ``bench/`` run models
through here."""

from torchparity.subject.model import Subject

__all__ = ["Subject"]
