"""The quantization quality and memory table: one row per method on the default model, against the fp32
reference (the GGUF expanded at load, `--quantization none`), measured in one run.

    python -m loadtest.quant_report [--requests 96] [--speed] [--only "fp8 KV" ...] [--json FILE]

Columns:
  * weight MiB: parameters and packed weights resident on the worker (what it logs at start-up);
  * KV tok/GiB: tokens of KV cache one GiB holds in the method's cache dtype;
  * top-1 and KL: teacher-forced on the shared workload's prompts (every prompt position's next-token
    distribution, taken from the engine's own logits with prompt_logprobs on): how often the most
    likely token is the reference's, and the mean KL(reference || method) in nats;
  * c1 / c64 tok/s (with --speed): loadtest/quant_bench.py's rows, one pass per method, methods in turn.

AWQ and GPTQ rows need checkpoints of the default model, which no hub provides here: its fp32 weights
are round-to-nearest quantized into each format (loadtest/quant_checkpoints.py), without the
calibration data real AWQ/GPTQ use, so those rows show the formats' cost and speed and an upper bound on
their error.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from common.model_source import ModelSource
from loadtest.quality import LogitTap, compare
from loadtest.quant_checkpoints import write_quantized
from loadtest.workload import load_workload
from pagedserve import LLM

GROUP = 64           # 576 = 9 x 64: SmolLM2's hidden size takes groups of 64, not 128
METHODS: dict[str, tuple[str, dict[str, Any]]] = {   # row: (checkpoint, engine arguments)
    "none (fp32 reference)": ("gguf", dict(quantization="none")),
    "int8 (dynamic)": ("gguf", dict(quantization="int8")),
    "fp8 weights (at load)": ("gguf", dict(quantization="fp8")),
    "gguf Q4_1 kept": ("gguf", dict(quantization="gguf")),
    f"awq g{GROUP} (RTN)": ("awq", dict(quantization="awq")),
    f"gptq g{GROUP} sym (RTN)": ("gptq", dict(quantization="gptq")),
    "fp8 KV cache (e4m3)": ("gguf", dict(quantization="none", kv_cache_dtype="fp8")),
    "fp8 KV cache (e4m3, no rotation)": ("gguf", dict(quantization="none", kv_cache_dtype="fp8",
                                                      kv_cache_rotation=False)),
    "fp8 KV cache (e4m3, calculated scales)": ("gguf", dict(quantization="none", kv_cache_dtype="fp8",
                                                            calculate_kv_scales=True)),
    "fp8 KV cache (e5m2)": ("gguf", dict(quantization="none", kv_cache_dtype="fp8_e5m2")),
}


def write_default_as_hf(folder: Path) -> Path:
    """The default model's fp32 weights (its GGUF expanded) as a Hugging Face folder."""
    import transformers as tf
    from safetensors.torch import save_file

    from gpu_worker.gguf_tensors import iter_gguf
    src = ModelSource.resolve(None)
    mc = src.model_config()
    cfg = tf.LlamaConfig(vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
                         num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_heads,
                         num_key_value_heads=mc.num_kv_heads, head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps,
                         rope_theta=mc.rope_theta, max_position_embeddings=mc.max_position_embeddings,
                         tie_word_embeddings=mc.tie_word_embeddings, bos_token_id=mc.bos_token_id,
                         eos_token_id=mc.eos_token_ids[0] if mc.eos_token_ids else None)
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(folder)
    src.load_tokenizer().save_pretrained(folder)
    save_file({name: t.contiguous() for name, t in iter_gguf(src)}, str(folder / "model.safetensors"))
    return folder


def checkpoints(work: Path, methods: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, str | None]:
    if {ckpt for ckpt, _ in methods.values()} == {"gguf"}:
        return {"gguf": None}
    hf = write_default_as_hf(work / "fp32")
    write_quantized(hf, work / "awq", work / "awq-ref", method="awq", group=GROUP)
    write_quantized(hf, work / "gptq", work / "gptq-ref", method="gptq", group=GROUP, sym=True)
    return {"gguf": None, "awq": str(work / "awq"), "gptq": str(work / "gptq")}


def quality(paths: dict[str, str | None], n_requests: int,
            methods: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Top-1 agreement and mean KL against the reference over every prompt position."""
    engines = {name: LLM(paths[ckpt], dtype="float32", kv_cache_memory=0.25, swap_space=0, max_num_batched_tokens=1024,
                         enable_prefix_caching=False, **kw) for name, (ckpt, kw) in methods.items()}
    rows = {name: {"weight_mib": e.engine.weight_bytes / 2**20, "kv_tokens_per_gib": kv_tokens_per_gib(e)}
            for name, e in engines.items()}
    prompts = [(list(r.prompt_token_ids), 0) for r in load_workload()[:n_requests]]
    for name, r in compare({name: LogitTap(e) for name, e in engines.items()}, prompts).items():
        rows[name].update(r)
    return rows


def kv_tokens_per_gib(llm: LLM) -> float:
    runner = llm.engine.executor.runner
    nbytes = sum(t.numel() * t.element_size() for kv in runner.kv_caches for t in kv)
    tokens = runner.kv_caches[0][0].shape[0] * runner.block_size
    return tokens / (nbytes / 2**30)


def speed(paths: dict[str, str | None], threads: int | None,
          methods: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    from loadtest.quant_bench import measure
    out = {}
    for name, (ckpt, kw) in methods.items():
        kw = dict(kw)
        row = measure(kw.pop("quantization"), threads, paths[ckpt], **kw)
        out[name] = {"c1_tok_s": row["c1_tok_s"], "c1_decode_tok_s": row["c1_decode_tok_s"], "c64_tok_s": row["c64_tok_s"]}
        print(f"{name}: {out[name]}", flush=True)
    return out


def table(rows: dict[str, dict[str, float]]) -> str:
    ref = rows[next(iter(rows))]
    lines = ["| method | weight MiB | of fp32 | KV tok/GiB | top-1 | mean KL | c1 tok/s | c1 decode tok/s | c64 tok/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        sp = [f"{r[k]:.1f}" if k in r else "-" for k in ("c1_tok_s", "c1_decode_tok_s", "c64_tok_s")]
        lines.append(f"| {name} | {r['weight_mib']:.1f} | {r['weight_mib'] / ref['weight_mib']:.1%} | "
                     f"{r['kv_tokens_per_gib']:,.0f} | {r['top1']:.1%} | {r['mean_kl']:.4f} | " + " | ".join(sp) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=96, help="workload requests whose prompts are teacher-forced")
    p.add_argument("--speed", action="store_true", help="also measure c1 and c64 tok/s per method")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                   help="only the methods whose name contains one of these (the reference always runs first)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    ref = next(iter(METHODS))
    methods = {n: m for n, m in METHODS.items() if n == ref or not args.only or any(t in n for t in args.only)}
    with tempfile.TemporaryDirectory() as tmp:
        paths = checkpoints(Path(tmp), methods)
        rows = quality(paths, args.requests, methods)
        if args.speed:
            for name, r in speed(paths, args.threads, methods).items():
                rows[name].update(r)
    print(f"positions: {rows[next(iter(rows))]['positions']}")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"methods": rows}, indent=1))


if __name__ == "__main__":
    main()
