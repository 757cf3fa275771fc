"""Sliding-window models end to end: greedy output equal to HF with prompts 4x the window, and the block
accounting that shows a windowed KV group releasing its blocks as a sequence grows."""
from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from tests.test_correctness import Reference
from tests.hf_reference import compare_greedy

pytestmark = pytest.mark.slow

WINDOW, BLOCK = 8, 4          # the tiny models' window (loadtest/tiny_model.py), in blocks of 4 tokens


def run_recording(llm: LLM, prompts: list[list[int]], max_new: int) -> tuple[list, list[list[int]]]:
    """Greedy outputs, and after every step each running sequence's blocks per KV group."""
    sched = llm.engine.scheduler
    held: list[list[int]] = []
    schedule = sched.schedule

    def recording():
        out = schedule()
        held.extend(sched.kv.blocks_held(seq.seq_id) for seq in sched.running)
        return out
    sched.schedule = recording
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=1),
                        use_tqdm=False)
    return outs, held


@pytest.mark.parametrize("arch", ["gemma3", "mistral-window"])
def test_windowed_groups_hold_only_the_window_and_outputs_equal_hf(arch, tiny_model, default_tokenizer, tmp_path):
    if arch == "mistral-window":      # every layer windowed: one KV group, released as it grows
        from loadtest.tiny_model import build_tiny_model
        folder = build_tiny_model(tmp_path / "m", "mistral", default_tokenizer, sliding_window=WINDOW)
    else:
        folder = tiny_model(arch)
    text = ("Once upon a time there was a king who had three daughters, and the youngest of them was so beautiful "
            "that the sun itself was astonished whenever it shone upon her face.")
    prompt = default_tokenizer.encode(text)[:4 * WINDOW]
    assert len(prompt) == 4 * WINDOW
    llm = LLM(str(folder), dtype="float32", block_size=BLOCK, max_num_batched_tokens=BLOCK, kv_cache_memory=0.02,
              swap_space=0)
    windows = llm.engine.scheduler.config.kv_group_windows
    outs, held = run_recording(llm, [prompt], 12)
    cmp = compare_greedy(outs[0].outputs[0].token_ids, [r[0] for r in outs[0].outputs[0].logprobs],
                         Reference(folder)(prompt, 12))
    assert cmp.flips == 0 and cmp.max_logprob_err < 1e-4
    # the accounting: per step, the blocks of each group; a windowed group never holds more than
    # window / block + 2 (here 4) while the full groups grow to the whole sequence (44 tokens: 11 blocks)
    accounting = "\n".join(f"step {i}: {h}" for i, h in enumerate(held))
    for g, w in enumerate(windows):
        most = max(h[g] for h in held)
        if w is None:
            assert most == -(-(len(prompt) + 11) // BLOCK), accounting
        else:
            assert most <= WINDOW // BLOCK + 2, accounting
            assert held[-1][g] <= WINDOW // BLOCK + 1, accounting
    assert any(w is not None for w in windows)
    llm.engine.scheduler.kv.check_all_free()
