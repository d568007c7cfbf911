"""`token_digest`: a short, process-independent fingerprint of a staged token sequence."""

from __future__ import annotations

import hashlib

import torch


def token_digest(token_ids: torch.Tensor) -> str:
    """Hex blake2b (8-byte digest) over the int64 little-endian bytes of 1-D integer token ids."""
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1:
        raise ValueError("token_digest expects a 1-D tensor of token ids")
    if token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool:
        raise ValueError(f"token_digest expects integer token ids, got {token_ids.dtype}")
    array = token_ids.detach().to(device="cpu", dtype=torch.int64).contiguous().numpy()
    # '<i8' pins the byte order so that a big-endian host computes the same digest; the hash reads
    # the array's buffer (no copy of the bytes on a little-endian host).
    return hashlib.blake2b(array.astype("<i8", copy=False).data, digest_size=8).hexdigest()
