"""The one way torchparity hashes a tensor's values: sha256 over their raw little-endian bytes
(the byte order of every platform torch runs on, and of the safetensors format), so a digest
depends on the values only, never on the torch version, the device or the tensor's layout.

Goldens (``golden/store.py``: a tensor's sha256, the checksum of a case's weights and inputs)
and traces (``diagnosis/core/trace.py``: the digests of recorded weights and inputs) both feed their
tensors through :func:`update`; each puts its own header before the bytes, as its stored files
always have.
"""

from __future__ import annotations

import hashlib

import torch

from torchparity import sketching


def update(digest: hashlib._Hash, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """Feed ``tensor``'s values in order to ``digest``, in chunks that are buffers, not copies.

    A 0-dim, expanded or non-contiguous tensor gives the bytes of its values alike, and a
    tensor of gigabytes never needs a second copy of itself.

    Args:
        digest: a ``hashlib`` hash, after its owner's header.
        tensor: the values hashed, on any device.
        dtype: hash the values converted to this dtype instead of their own.
    """
    flat = tensor.detach().reshape(-1)
    for start in range(0, max(flat.numel(), 1), sketching.CHUNK):
        chunk = flat[start:start + sketching.CHUNK].to("cpu", dtype or flat.dtype).contiguous()
        digest.update(chunk.view(torch.uint8).numpy())


def sha256(tensor: torch.Tensor, header: str = "") -> str:
    """Hex sha256 of ``header`` followed by ``tensor``'s values.

    Args:
        tensor: the values hashed.
        header: what the digest starts with (a store's own prefix).

    Returns:
        The hex digest.
    """
    digest = hashlib.sha256(header.encode())
    update(digest, tensor)
    return digest.hexdigest()
