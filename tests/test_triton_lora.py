"""The Triton LoRA kernels (shrink + expand, one gather per token) against the torch path's run-by-run
GEMMs, which test_lora.py checks against the per-token definition. Without a GPU the kernels run in
the Triton interpreter (TRITON_INTERPRET=1), set before they are jitted (see test_triton_qgemm.py)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from gpu_worker.kernels.triton_jit import interpret_mode  # noqa: E402
from gpu_worker.kernels.triton_lora import add_lora  # noqa: E402
from gpu_worker.lora.delta import LoRABatch, add_lora_torch  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _interpreter_on_cpu() -> None:
    if DEVICE.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        assert interpret_mode()


def case(outs: tuple[int, ...], num_slots: int, rank: int, k: int, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(num_slots, len(outs), rank, k, generator=g)
    bs = [torch.randn(num_slots, rank, n, generator=g) for n in outs]
    starts = [sum(outs[:j]) for j in range(len(outs))]
    ranges = [(lo, lo + n) for lo, n in zip(starts, outs)]
    x = torch.randn(tokens, k, generator=g)
    slots = torch.randint(-1, num_slots, (tokens,), generator=g)
    y = torch.randn(tokens, sum(outs), generator=g)
    return a, bs, ranges, x, slots, y


@pytest.mark.unit
@pytest.mark.parametrize("outs, num_slots, rank, k, tokens", [
    ((24, 8, 8), 3, 8, 40, 7),        # fused q/k/v shards, K not a multiple of the kernel's BLOCK_K
    ((72, 72), 2, 12, 64, 5),         # gate/up, a rank that is not a power of two, N past one BLOCK_N tile
    ((40,), 4, 16, 130, 9),           # one shard, rank 16, several K chunks
    ((16,), 1, 4, 16, 3),             # --max-loras 1
])
def test_triton_kernels_match_the_torch_path(outs, num_slots, rank, k, tokens) -> None:
    a, bs, ranges, x, slots, y = case(outs, num_slots, rank, k, tokens, seed=len(outs) * 10 + rank)
    want = add_lora_torch(y.clone(), x, a, bs, ranges, LoRABatch.build(slots, torch.device("cpu")).runs)
    got = add_lora(y.clone().to(DEVICE), x.to(DEVICE), a.to(DEVICE), [b.to(DEVICE) for b in bs], ranges,
                   slots.to(DEVICE)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    untouched = slots < 0
    assert torch.equal(got[untouched], y[untouched]), "a base-model row changed"


@pytest.mark.unit
def test_a_batch_without_adapters_changes_nothing() -> None:
    a, bs, ranges, x, _, y = case((8, 8), 2, 4, 16, 4, seed=3)
    slots = torch.full((4,), -1)
    got = add_lora(y.clone().to(DEVICE), x.to(DEVICE), a.to(DEVICE), [b.to(DEVICE) for b in bs], ranges,
                   slots.to(DEVICE)).cpu()
    assert torch.equal(got, y)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_on_cuda_matches_fp32(dtype) -> None:
    """Compiled on CUDA with the model's dtypes (numpy, and so the interpreter, has no bfloat16)."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA only")
    a, bs, ranges, x, slots, y = case((96, 32, 32), 4, 16, 256, 33, seed=7)
    want = add_lora_torch(y.clone(), x, a, bs, ranges, LoRABatch.build(slots, torch.device("cpu")).runs)
    cuda = [t.to("cuda", dtype) for t in (y, x, a)]
    got = add_lora(cuda[0], cuda[1], cuda[2], [b.to("cuda", dtype) for b in bs], ranges, slots.cuda())
    torch.testing.assert_close(got.float().cpu(), want, rtol=3e-2, atol=0.5)
