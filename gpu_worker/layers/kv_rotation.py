"""A fixed orthogonal rotation of every head's q, k and v for an fp8 KV cache.

fp8 (e4m3) keeps 3 mantissa bits, so each cached element carries a relative error of up to 1/16, and the
error of a score q.k grows with sum_i q_i^2 k_i^2. Keys concentrate much of their energy in a few channels
(and queries in the same ones), so a few rounded products dominate. Rotating q and k by the same orthogonal
matrix R leaves every score unchanged ((qR).(kR) = q.k) but spreads each vector over all channels, which
shrinks that sum by up to the head size; rotating v by R and the attention output back by R^T leaves the
output unchanged too. In exact arithmetic nothing changes; in fp8 the cache keeps more of the signal.
The same idea rotates activations before low-bit quantization in QuaRot and SpinQuant.

R is the normalized Walsh-Hadamard matrix when the head size is a power of two (every entry +-1/sqrt(d):
the most even spread), else a fixed seeded random orthogonal matrix.
"""
from __future__ import annotations

import torch


def kv_rotation(head_dim: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[head_dim, head_dim] orthogonal: R @ R.T = I."""
    if head_dim & (head_dim - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        r = h / head_dim ** 0.5
    else:
        g = torch.Generator().manual_seed(head_dim)
        r, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64))
    return r.to(device=device, dtype=dtype)
