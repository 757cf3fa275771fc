"""Sliding-window and soft-capped attention in the torch backend, on every path it has (native decode
kernel, padded SDPA decode groups, fresh prefills, chunks behind context), against the definition."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.attention.torch_backend import TorchAttentionBackend
from gpu_worker.kernels import native
from tests.attention_cases import dense_reference, make_meta, rand

pytestmark = pytest.mark.unit
CPU = torch.device("cpu")
# decodes far past the window and inside it, a fresh prefill longer than the window, chunks behind context
MIXED = [(20, 1), (0, 19), (13, 7), (5, 1), (0, 1), (33, 17), (0, 3), (8, 8), (3, 1)]
NATIVE = [False] + ([True] if native.available() else [])


@pytest.mark.parametrize("native_on", NATIVE, ids=lambda n: "native" if n else "sdpa")
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (1, None), (16, None), (None, 5.0), (6, 5.0)])
def test_torch_backend_matches_the_definition(window, softcap, native_on):
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, bs = 4, 2, 32, 8
    num_blocks = sum((c + q + bs - 1) // bs for c, q in MIXED) + 3
    meta = make_meta(MIXED, bs, num_blocks, gen, CPU)
    k_cache, v_cache = (rand((num_blocks, bs, hkv, d), torch.float32, gen, CPU) for _ in range(2))
    query = rand((sum(q for _, q in MIXED), hq, d), torch.float32, gen, CPU) * 3     # peaked scores
    key, value = (c.view(-1, hkv, d)[meta.slot_mapping] for c in (k_cache, v_cache))
    backend = TorchAttentionBackend(native=native_on)
    got = backend.forward(query, key, value, k_cache, v_cache, backend.prepare(meta), d ** -0.5,
                          window=window, softcap=softcap)
    want = dense_reference(query, k_cache, v_cache, meta, d ** -0.5, window, softcap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    if window is not None and window < 8:     # the window changes the answer: the test can tell
        assert not torch.allclose(got, dense_reference(query, k_cache, v_cache, meta, d ** -0.5, None, softcap),
                                  atol=1e-3)
