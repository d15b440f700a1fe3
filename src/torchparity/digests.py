"""The one way torchparity hashes a tensor's values: sha256 over their raw little-endian bytes.

Little-endian is every torch platform's order and safetensors', so a digest depends on the values
only, never on the torch version, device or layout. Goldens and traces feed their tensors through
:func:`update`, each after its own header.
"""

from __future__ import annotations

import hashlib

import torch

from torchparity import sketching


def update(digest: hashlib._Hash, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """Feed ``tensor``'s values (in ``dtype`` if given) to ``digest`` as buffers, not copies."""
    # a 0-dim, expanded or strided tensor gives its values' bytes alike; gigabytes never need a
    # second copy
    flat = tensor.detach().reshape(-1)
    for start in range(0, max(flat.numel(), 1), sketching.CHUNK):
        chunk = flat[start:start + sketching.CHUNK].to("cpu", dtype or flat.dtype).contiguous()
        digest.update(chunk.view(torch.uint8).numpy())


def sha256(tensor: torch.Tensor, header: str = "") -> str:
    """Hex sha256 of ``header`` (a store's own prefix) followed by ``tensor``'s values."""
    digest = hashlib.sha256(header.encode())
    update(digest, tensor)
    return digest.hexdigest()
