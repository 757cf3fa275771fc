"""The GPU benchmark: a 7B-shaped random-weight Llama in bf16 with the Triton backend, against Hugging Face
`generate` on the same GPU, on the shared workload. Run by scripts/gpu_check.sh inside one device call.

Both sides run random weights (`load_format="dummy"` here, `from_config` for HF) with ignore_eos, so the
work is identical; HF one-at-a-time runs a subset to fit the call, and its tokens/s is the baseline.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

LLAMA_7B = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=11008,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="bfloat16")


def model_folder(tokenizer_dir: Path) -> Path:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    folder = Path(tempfile.mkdtemp(prefix="llama7b-"))
    cfg = dict(LLAMA_7B, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    (folder / "config.json").write_text(json.dumps(cfg))
    tok.save_pretrained(folder)
    return folder


def run_pagedserve(folder: Path, work: list) -> dict:
    from pagedserve import LLM, SamplingParams
    llm = LLM(str(folder), dtype="bfloat16", device="cuda", attention_backend="triton", load_format="dummy",
              max_num_batched_tokens=8192, max_num_seqs=256, gpu_memory_utilization=0.85)
    sps = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in work]
    llm.generate([r.prompt_token_ids for r in work[:4]], sps[:4], use_tqdm=False)   # warm-up (Triton JIT)
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in work], sps, use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"system": "pagedserve offline (bf16, triton)", "requests": len(work), "tokens": toks, "seconds": dt,
            "tok_s": toks / dt}


def run_hf(folder: Path, work: list, batch: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(folder)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    toks, t = 0, time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i:i + batch]
        width = max(r.prompt_tokens for r in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long, device="cuda")
        mask = torch.zeros_like(ids)
        for j, r in enumerate(chunk):   # left padding
            ids[j, width - r.prompt_tokens:] = torch.tensor(r.prompt_token_ids)
            mask[j, width - r.prompt_tokens:] = 1
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                           max_new_tokens=max(r.max_tokens for r in chunk))
        toks += sum(r.max_tokens for r in chunk)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    del model
    torch.cuda.empty_cache()
    return {"system": f"HF generate, batch {batch}", "requests": len(work), "tokens": toks, "seconds": dt,
            "tok_s": toks / dt}


def main() -> None:
    from loadtest.workload import load_workload
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=".gpu/tokenizer")
    ap.add_argument("--hf-requests", type=int, default=12, help="requests for the HF one-at-a-time baseline")
    ap.add_argument("--workload", default=None, help="defaults to ../shared/bench/workload.jsonl")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = load_workload(args.workload)
    folder = model_folder(Path(args.tokenizer))
    rows = [run_hf(folder, work[:args.hf_requests], 1), run_hf(folder, work[:48], 16), run_pagedserve(folder, work)]
    base = rows[0]["tok_s"]
    for r in rows:
        r["ratio"] = r["tok_s"] / base
        print(f"{r['system']:<40} {r['requests']:>4} req {r['tokens']:>6} tok {r['seconds']:>7.1f}s "
              f"{r['tok_s']:>9.1f} tok/s  {r['ratio']:>6.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
