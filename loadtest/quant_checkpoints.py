"""Quantized checkpoints (tiny ones in the tests, the default model's in the quant report) written the way AutoAWQ (GEMM), AutoGPTQ (v1) / GPTQModel (v2)
and FP8 writers lay them out, each with the fp32 folder of its dequantized weights for HF transformers.

The packing follows the writers' own loops (AutoAWQ's interleaved nibble order, GPTQ's row-wise words,
v1's zero - 1), written forwards here so that the loader's unpacking is checked against an independent
implementation rather than its own inverse.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
INPUT_OF = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp",
            "o_proj": "o", "down_proj": "down"}   # projections fed by the same activations share an act order


def quantize(w: torch.Tensor, group: int, bits: int, sym: bool, perm: np.ndarray | None):
    """GPTQ/AWQ-style min-max group quantization along the inputs taken in `perm` order.
    Returns q [N, K] (original input order), zeros [G, N], fp16 scales [G, N] and g_idx [K]."""
    n, k = w.shape
    maxq = (1 << bits) - 1
    order = np.arange(k) if perm is None else perm
    wg = w[:, order].double().reshape(n, k // group, group)
    if sym:
        scale = (2 * wg.abs().amax(-1) / maxq).clamp(min=1e-6)
        zero = torch.full_like(scale, float((maxq + 1) // 2))
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = ((hi - lo) / maxq).clamp(min=1e-6)
        zero = (-lo / scale).round().clamp(1, maxq)        # v1 stores zero - 1: a zero of 0 cannot be written
    scale = scale.half().double()
    qg = (wg / scale[..., None] + zero[..., None]).round().clamp(0, maxq)
    q = torch.empty(n, k, dtype=torch.int64)
    q[:, torch.from_numpy(order)] = qg.reshape(n, k).long()
    g_idx = np.empty(k, dtype=np.int32)
    g_idx[order] = np.arange(k) // group
    return q, zero.t().long(), scale.t().half(), g_idx


def dequantized(q, zeros, scales, g_idx) -> torch.Tensor:
    g = torch.from_numpy(g_idx.astype(np.int64))
    return ((q.t().double() - zeros[g].double()) * scales[g].double()).t().float()


def _words(values: np.ndarray, bits: int) -> np.ndarray:
    """Sum values[..., j] << bits*j over the last axis into int32 words."""
    shifts = np.arange(values.shape[-1], dtype=np.uint64) * bits
    return (values.astype(np.uint64) << shifts).sum(-1).astype(np.uint32).view(np.int32)


def pack_awq(q, zeros, scales) -> dict[str, torch.Tensor]:
    iw = q.t().numpy()                                   # [K, N]
    k, n = iw.shape
    qweight = _words(iw.reshape(k, n // 8, 8)[:, :, AWQ_ORDER], 4)
    qzeros = _words(zeros.numpy().reshape(zeros.shape[0], n // 8, 8)[:, :, AWQ_ORDER], 4)
    return {"qweight": torch.from_numpy(qweight), "qzeros": torch.from_numpy(qzeros), "scales": scales}


def pack_gptq(q, zeros, scales, g_idx, bits: int, v2: bool) -> dict[str, torch.Tensor]:
    per = 32 // bits
    iw = q.t().numpy()                                   # [K, N]
    k, n = iw.shape
    qweight = _words(iw.reshape(k // per, per, n).transpose(0, 2, 1), bits)
    z = zeros.numpy() - (0 if v2 else 1)
    qzeros = _words(z.reshape(z.shape[0], n // per, per), bits)
    return {"qweight": torch.from_numpy(qweight), "qzeros": torch.from_numpy(qzeros), "scales": scales,
            "g_idx": torch.from_numpy(g_idx)}


def _perm(name: str, layer: int, k: int, shared: bool) -> np.ndarray:
    key = INPUT_OF[name] if shared else name
    return np.random.default_rng([layer, sum(map(ord, key))]).permutation(k)


def write_quantized(src: Path, dst: Path, ref: Path, method: str, group: int = 32, bits: int = 4,
                    sym: bool = False, desc_act: bool = False, v2: bool = False, shared_order: bool = True,
                    fp8_block: list[int] | None = None) -> None:
    """Quantize the linear layers of the HF folder `src` into a `method` checkpoint at `dst`, and save the
    dequantized weights as a plain fp32 folder at `ref` (the reference HF runs)."""
    state = load_file(str(src / "model.safetensors"))
    out, plain, quantized = {}, dict(state), set()
    for name, w in state.items():
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in LINEARS or parts[-1] != "weight":
            continue
        prefix, proj, layer = name[:-len(".weight")], parts[-2], int(parts[2])
        quantized.add(name)
        if method == "fp8":
            packed, plain[name] = fp8_parts(w, fp8_block)
        else:
            perm = _perm(proj, layer, w.shape[1], shared_order) if desc_act else None
            q, zeros, scales, g_idx = quantize(w, group if group > 0 else w.shape[1], bits, sym, perm)
            plain[name] = dequantized(q, zeros, scales, g_idx)
            packed = pack_awq(q, zeros, scales) if method == "awq" else pack_gptq(q, zeros, scales, g_idx, bits, v2)
        out.update({f"{prefix}.{k}": v for k, v in packed.items()})
    out.update({k: v for k, v in state.items() if k not in quantized})
    for folder, tensors in ((dst, out), (ref, plain)):
        folder.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, folder / f.name)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = _config(method, group, bits, sym, desc_act, v2, fp8_block)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))


def _config(method, group, bits, sym, desc_act, v2, fp8_block) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
                "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": fp8_block}


def fp8_parts(w: torch.Tensor, block: list[int] | None):
    """float8_e4m3fn weights with a per-tensor weight_scale, or per [bn, bk] block weight_scale_inv."""
    fmax = torch.finfo(torch.float8_e4m3fn).max
    if block is None:
        scale = w.abs().max() / fmax
        w8 = (w / scale).to(torch.float8_e4m3fn)
        return {"weight": w8, "weight_scale": scale.reshape(())}, w8.float() * scale
    bn, bk = block
    n, k = w.shape
    blocks = w.reshape(n // bn, bn, k // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)) / fmax                # [n/bn, k/bk]
    w8 = (blocks / scale[:, None, :, None]).reshape(n, k).to(torch.float8_e4m3fn)
    ref = (w8.float().reshape(n // bn, bn, k // bk, bk) * scale[:, None, :, None]).reshape(n, k)
    return {"weight": w8, "weight_scale_inv": scale}, ref


def write_fp8_per_channel_reference(src: Path, ref: Path) -> None:
    """The fp32 folder of what `--quantization fp8` makes of `src` at load: each linear row scaled so its
    largest weight is fp8's largest value, rounded to float8_e4m3fn."""
    state = load_file(str(src / "model.safetensors"))
    fmax = torch.finfo(torch.float8_e4m3fn).max
    for name, w in state.items():
        parts = name.split(".")
        if len(parts) > 2 and parts[-2] in LINEARS and parts[-1] == "weight":
            scale = w.abs().amax(dim=1, keepdim=True) / fmax
            state[name] = (w / scale).to(torch.float8_e4m3fn).float() * scale
    ref.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, ref / f.name)
    save_file(state, str(ref / "model.safetensors"))
