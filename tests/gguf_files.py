"""Tiny GGUF files written at test time with gguf-py, as llama.cpp's converter would write them.

gguf-py cannot quantize to the k-quant types, so a k-quant matrix is random block bytes with finite
scales; `from_hf_model` then puts the file's own (dequantized) weights back into the Hugging Face
folder, so HF on that folder is the exact reference for the GGUF file."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from gpu_worker.quantization.gguf import GGUFTensor

QUANTIZABLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)    # gguf-py writes these; k-quants get random blocks
HF_TO_GGUF_ARCH = {"llama": "llama", "mixtral": "llama", "phi3": "phi3", "qwen2_moe": "qwen2moe",
                   "qwen3_moe": "qwen3moe", "gemma2": "gemma2", "gemma3_text": "gemma3"}


def gguf_tensor(qtype: T, rows: int, k: int, seed: int = 0, values: np.ndarray | None = None) -> GGUFTensor:
    """A [rows, k] tensor in `qtype`: quantized from `values` (default random floats), or (k-quants,
    which gguf-py cannot write) random block bytes with finite f16 scales."""
    rng = np.random.default_rng(seed)
    if qtype == T.Q2_K:                  # d and dmin are its last four bytes
        blocks = rng.integers(0, 256, (rows * k // 256, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
        blocks[:, -4:] = rng.uniform(1e-4, 2e-3, (blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
        return GGUFTensor(blocks.reshape(rows, -1), qtype, (rows, k))
    if qtype in QUANTIZABLE:
        x = values if values is not None else rng.standard_normal((rows, k)).astype(np.float32) * 0.05
        raw = quantize(np.ascontiguousarray(x, np.float32), qtype)
    else:
        block, nbytes = GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (rows * k // block, nbytes), dtype=np.uint8)
        f16 = lambda n: rng.uniform(1e-4, 2e-3, (blocks.shape[0], n)).astype(np.float16).view(np.uint8)  # noqa: E731
        if qtype == T.Q6_K:
            blocks[:, 208:210] = f16(1)
        else:
            blocks[:, 0:4] = f16(2)
        raw = blocks.reshape(rows, -1)
    return GGUFTensor(raw, qtype, (rows, k))


# ---- a Hugging Face folder as a GGUF file ----------------------------------------------------------
_L = r"model\.layers\.(\d+)\."
_NAMES = [(re.compile(p), r) for p, r in [
    (r"model\.embed_tokens\.weight", "token_embd.weight"), (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"), (_L + r"input_layernorm\.weight", r"blk.\1.attn_norm.weight"),
    (_L + r"pre_feedforward_layernorm\.weight", r"blk.\1.ffn_norm.weight"),
    (_L + r"post_feedforward_layernorm\.weight", r"blk.\1.post_ffw_norm.weight"),
    (_L + r"self_attn\.([qkv])_proj\.(weight|bias)", r"blk.\1.attn_\2.\3"),
    (_L + r"self_attn\.qkv_proj\.weight", r"blk.\1.attn_qkv.weight"),
    (_L + r"self_attn\.o_proj\.weight", r"blk.\1.attn_output.weight"),
    (_L + r"self_attn\.([qk])_norm\.weight", r"blk.\1.attn_\2_norm.weight"),
    (_L + r"mlp\.gate_up_proj\.weight", r"blk.\1.ffn_up.weight"),
    (_L + r"mlp\.(gate|up|down)_proj\.weight", r"blk.\1.ffn_\2.weight"),
    (_L + r"(?:mlp|block_sparse_moe)\.gate\.weight", r"blk.\1.ffn_gate_inp.weight"),
    (_L + r"mlp\.shared_expert\.(gate|up|down)_proj\.weight", r"blk.\1.ffn_\2_shexp.weight"),
    (_L + r"mlp\.shared_expert_gate\.weight", r"blk.\1.ffn_gate_inp_shexp.weight"),
]]
_EXPERT = re.compile(_L + r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(w[123]|(?:gate|up|down)_proj)\.weight")
_EXPERT_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def _gguf_name(hf: str, model_type: str) -> str:
    if model_type.startswith("gemma"):
        m = re.fullmatch(_L + r"post_attention_layernorm\.weight", hf)
        if m:
            return f"blk.{m[1]}.post_attention_norm.weight"
    m = re.fullmatch(_L + r"post_attention_layernorm\.weight", hf)
    if m:
        return f"blk.{m[1]}.ffn_norm.weight"
    for pat, repl in _NAMES:
        m = pat.fullmatch(hf)
        if m:
            return m.expand(repl)
    raise KeyError(hf)


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row interleave for its rope (the loader undoes it)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def from_hf_model(folder: Path, out: Path, qtypes: dict[str, T], default: T = T.Q8_0) -> Path:
    """Write the HF model in `folder` as the GGUF file `out`; each matrix whose GGUF name contains a key
    of `qtypes` gets that type (the first key that matches), others `default`; vectors stay F32. The
    folder's safetensors are rewritten with the file's dequantized weights (HF's layout and values)."""
    from gguf import GGUFWriter
    from safetensors.torch import load_file, save_file
    cfg = json.loads((folder / "config.json").read_text())
    mt = cfg["model_type"]
    arch = HF_TO_GGUF_ARCH[mt]
    state = load_file(str(folder / "model.safetensors"))
    tensors: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, str]] = {}
    for name in state:
        m = _EXPERT.fullmatch(name)
        if m:
            experts.setdefault((int(m[1]), _EXPERT_PART[m[3]]), {})[int(m[2])] = name
        else:
            tensors[name] = state[name].float().numpy()
    w = GGUFWriter(str(out), arch)
    _write_metadata(w, cfg, arch)
    heads = {"q": cfg["num_attention_heads"], "k": cfg.get("num_key_value_heads") or cfg["num_attention_heads"]}
    seed = 0
    for hf_name, value in tensors.items():
        gname = _gguf_name(hf_name, mt)
        if mt.startswith("gemma") and hf_name.endswith("norm.weight"):
            value = value + 1.0
        if gname.endswith("ffn_gate_inp_shexp.weight"):
            value = value.reshape(-1)
        perm = re.search(r"attn_([qk])\.", gname) if arch == "llama" else None
        if perm:
            value = _permute(value, heads[perm[1]])
        if value.ndim != 2 or gname.endswith("ffn_gate_inp.weight"):
            w.add_tensor(gname, np.ascontiguousarray(value, np.float32))
            continue
        seed += 1
        qtype = next((t for key, t in qtypes.items() if key in gname), default)
        t = gguf_tensor(qtype, *value.shape, seed=seed, values=value)
        w.add_tensor(gname, t.raw, raw_dtype=qtype)
        back = dequantize(t.raw, qtype).reshape(value.shape)
        if perm:
            back = _unpermute(back, heads[perm[1]])
        if mt.startswith("gemma") and hf_name.endswith("norm.weight"):
            back = back - 1.0
        state[hf_name] = torch.from_numpy(np.array(back, np.float32)).to(state[hf_name].dtype)
    for (layer, part), by_expert in sorted(experts.items()):
        names = [by_expert[e] for e in sorted(by_expert)]
        stacked = np.stack([state[n].float().numpy() for n in names])                  # [E, rows, k]
        qtype = next((t for key, t in qtypes.items() if key in f"ffn_{part}_exps"), default)
        e, rows, k = stacked.shape
        seed += 1
        t = gguf_tensor(qtype, e * rows, k, seed=seed, values=stacked.reshape(e * rows, k))
        w.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", t.raw.reshape(e, rows, -1), raw_dtype=qtype)
        back = dequantize(t.raw, qtype).reshape(e, rows, k)
        for i, n in enumerate(names):
            state[n] = torch.from_numpy(np.array(back[i], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"), {"format": "pt"})
    return out


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_metadata(w, cfg: dict, arch: str) -> None:
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    u32 = {"block_count": cfg["num_hidden_layers"], "embedding_length": cfg["hidden_size"],
           "feed_forward_length": cfg["intermediate_size"], "attention.head_count": cfg["num_attention_heads"],
           "attention.head_count_kv": cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
           "context_length": cfg["max_position_embeddings"], "vocab_size": cfg["vocab_size"]}
    if cfg.get("head_dim"):
        u32["attention.key_length"] = u32["attention.value_length"] = cfg["head_dim"]
    f32 = {"attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"], "rope.freq_base": full.get("rope_theta", 1e4)}
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        u32 |= {"expert_count": experts, "expert_used_count": cfg["num_experts_per_tok"]}
        if cfg.get("moe_intermediate_size"):
            u32["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
        if cfg.get("shared_expert_intermediate_size"):
            u32["expert_shared_feed_forward_length"] = cfg["shared_expert_intermediate_size"]
        if "norm_topk_prob" in cfg:
            w.add_bool(f"{arch}.expert_weights_norm", bool(cfg["norm_topk_prob"]))
    if cfg.get("sliding_window"):
        u32["attention.sliding_window"] = cfg["sliding_window"]
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key):
            f32[key] = cfg[key]
    if arch == "gemma3":
        f32["rope.freq_base_swa"] = rope["sliding_attention"]["rope_theta"]
    if arch.startswith("gemma"):
        w.add_array(f"{arch}.attention.sliding_window_pattern",
                    [t == "sliding_attention" for t in cfg["layer_types"]])
    if arch == "phi3":
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        u32["rope.dimension_count"] = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        if rope.get("rope_type") == "longrope":
            u32["rope.scaling.original_context_length"] = cfg["original_max_position_embeddings"]
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    for k, v in u32.items():
        w.add_uint32(f"{arch}.{k}", int(v))
    for k, v in f32.items():
        w.add_float32(f"{arch}.{k}", float(v))
    for key, field in (("eos_token_id", "tokenizer.ggml.eos_token_id"), ("bos_token_id", "tokenizer.ggml.bos_token_id")):
        if isinstance(cfg.get(key), int):
            w.add_uint32(field, cfg[key])
