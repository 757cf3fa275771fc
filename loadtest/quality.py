"""How far a fast mode's next-token distributions are from fp32's: teacher-forced top-1 agreement and
mean KL divergence, on the shared workload (#16: "the quality of every fast mode is measured").

    python -m loadtest.quality [--requests 32] [--new-tokens 64] [--json FILE]

The reference (`--dtype float32`) first decodes each prompt greedily for `--new-tokens` tokens; every
mode then reads prompt + continuation in one prefill with prompt_logprobs on, and each position of the
continuation (the fp32 greedy path) is compared: how often the mode's most likely token is the
reference's, and KL(reference || mode) in nats. Steps are prefill chunks of 64 rows (ENGINE), the
packed weights' bf16 path under `--dtype auto` on a CPU with bf16 hardware (the AMX tile kernel where it
runs); "steps of 512 rows" measures the bf16 copy's GEMM of larger chunks. Decode steps of up to 8 rows
stay on the packed fp32 kernel there and are at least this close. On a CPU without bf16 hardware,
"steps of 8 rows" measures what decode steps run: the packed vector kernel with int16 activations.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from loadtest.workload import load_workload
from pagedserve import LLM, SamplingParams

MODES: dict[str, dict[str, Any]] = {        # row: engine arguments; the first row is the reference
    "float32 (reference)": dict(dtype="float32"),
    "auto (the default)": dict(),
    "auto, steps of 512 rows": dict(max_num_batched_tokens=512),
    "auto, steps of 8 rows": dict(max_num_batched_tokens=8),
    "auto, fp32 KV cache": dict(kv_cache_dtype="float32"),
    "bfloat16 throughout": dict(dtype="bfloat16"),
}
# Prefill in chunks of 64 rows: each chunk reads the earlier ones from the KV cache, in the cache dtype, as
# decodes do, and 64 rows are beyond the packed vector kernel (GEMM_MAX_ROWS): under --dtype auto on AMX
# they run on the tile kernel, as decode steps of 9 or more sequences do, and without bf16 hardware on the
# int16 panels (kernels/qgemm_panel_i16.cpp), as decode steps of 9 or more do (41 or more with
# speculation: packed.I16_VECTOR_MAX_ROWS). The row with steps of 512
# rows measures the larger prefill chunks (the tiles on AMX, oneDNN's GEMM on the bf16 copy with other bf16
# hardware, the int16 panels without).
ENGINE = dict(kv_cache_memory=0.25, swap_space=0, max_num_batched_tokens=64, enable_prefix_caching=False)


class LogitTap:
    """Every logits row the engine computes for one request, in position order: with prompt_logprobs on,
    each chunk's prompt rows, then the last position's (sampled) row. The runner computes a step's sampled
    row before its prompt rows, so that row is held apart and appended last: otherwise the last chunk's
    rows come out shifted by one, which only matched the reference's when both chunked alike."""

    def __init__(self, llm: LLM):
        self.llm, self.rows, self.sampled, self._sampling = llm, [], [], False
        runner = llm.engine.executor.runner
        inner, sample = runner.model.compute_logits, runner._sample
        runner.model.compute_logits = lambda hidden: self._keep(inner(hidden))

        def sampling(*args):
            self._sampling = True
            try:
                return sample(*args)
            finally:
                self._sampling = False
        runner._sample = sampling

    def _keep(self, logits: torch.Tensor) -> torch.Tensor:
        (self.sampled if self._sampling else self.rows).append(logits.float())
        return logits

    def logprobs(self, prompt: list[int]) -> torch.Tensor:
        self.rows, self.sampled = [], []
        self.llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        out = torch.cat(self.rows + self.sampled).log_softmax(-1)
        assert out.shape[0] == len(prompt), f"{out.shape[0]} logits rows for a {len(prompt)}-token prompt"
        return out


def compare(taps: dict[str, LogitTap], sequences: list[tuple[list[int], int]]) -> dict[str, dict[str, float]]:
    """Top-1 agreement and mean KL of every tap against the first, over each (tokens, first position)
    pair's positions from `first` on; one sequence at a time, so full logits never pile up."""
    names = list(taps)
    agree, kl, positions = dict.fromkeys(names, 0), dict.fromkeys(names, 0.0), 0
    for i, (tokens, first) in enumerate(sequences):
        if i % 16 == 0:
            print(f"quality: sequence {i} of {len(sequences)}", flush=True)
        ref = taps[names[0]].logprobs(tokens)[first:]
        positions += ref.shape[0]
        for name in names:
            lp = ref if name == names[0] else taps[name].logprobs(tokens)[first:]
            agree[name] += int((lp.argmax(-1) == ref.argmax(-1)).sum())
            kl[name] += float((ref.exp() * (ref - lp)).sum())
    return {n: {"top1": agree[n] / positions, "mean_kl": kl[n] / positions, "positions": positions} for n in names}


def greedy_paths(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], int]]:
    """Each prompt followed by the engine's greedy continuation, with the position that predicts its
    first generated token."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
                        use_tqdm=False)
    return [(p + list(o.outputs[0].token_ids), len(p) - 1) for p, o in zip(prompts, outs)]


def measure(requests: int = 32, new_tokens: int = 64, model: str | None = None,
            modes: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, float]]:
    modes = modes or MODES
    engines = {name: LLM(model, **{**ENGINE, **kw}) for name, kw in modes.items()}
    prompts = [list(r.prompt_token_ids) for r in load_workload()[:requests]]
    sequences = greedy_paths(next(iter(engines.values())), prompts, new_tokens)
    rows = compare({name: LogitTap(e) for name, e in engines.items()}, sequences)
    for name, e in engines.items():
        runner = e.engine.executor.runner
        matmuls = str(runner.matmul_dtype or runner.dtype).replace("torch.", "")
        if runner.int16_activations:
            matmuls += ", int16 x (every packed product)"
        rows[name].update(matmul_dtype=matmuls,
                          kv_cache_dtype=str(runner.kv_dtype).replace("torch.", ""))
        e.engine.shutdown()
    return rows


def table(rows: dict[str, dict[str, Any]]) -> str:
    lines = ["| mode | matmuls | KV cache | top-1 vs fp32 | mean KL (nats) |", "|---|---|---|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['matmul_dtype']} | {r['kv_cache_dtype']} | {r['top1']:.2%} | {r['mean_kl']:.5f} |")
    return "\n".join(lines) + f"\n({next(iter(rows.values()))['positions']} positions along fp32's greedy path)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=32, help="workload prompts to continue and compare")
    p.add_argument("--new-tokens", type=int, default=64, help="fp32 greedy tokens appended to each prompt")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    rows = measure(args.requests, args.new_tokens)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
