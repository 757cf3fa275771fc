"""build_step_inputs: the flat batch the model runs, built from the worker's sequence states without
changing them; rows, positions, slots, logits rows (one per sampling sequence, k + 1 with k drafts),
prompt-logprob rows and per-row adapter ids."""
from __future__ import annotations

import copy

import pytest

import torch

from common.sampling_params import SamplingParams
from gpu_worker.step_inputs import SequenceState, build_step_inputs

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
BS = 4


def state(seq_id: str, tokens: list[int], computed: int, blocks: list[int], prompt_len: int | None = None,
          **kw) -> SequenceState:
    params = kw.pop("params", SamplingParams())
    return SequenceState(seq_id, tokens, prompt_len or len(tokens), params, blocks, computed, None, **kw)


def test_mixed_step_layout_and_no_side_effects() -> None:
    states = {"a": state("a", list(range(10, 16)), 0, [7, 3]),          # fresh prefill of 6
              "b": state("b", list(range(20, 29)), 8, [1, 5, 2]),       # decode at position 8
              "c": state("c", list(range(30, 40)), 4, [0, 6, 4])}       # chunk 4..7 of a 10-token prompt
    before = copy.deepcopy(states)
    inp = build_step_inputs(states, [("a", 6), ("b", 1), ("c", 4)], BS, CPU)
    assert inp.input_ids.tolist() == list(range(10, 16)) + [28] + list(range(34, 38))
    assert inp.positions.tolist() == [0, 1, 2, 3, 4, 5, 8, 4, 5, 6, 7]
    block_of = {"a": [7, 3], "b": [1, 5, 2], "c": [0, 6, 4]}
    seqs = ["a"] * 6 + ["b"] + ["c"] * 4
    expect = [block_of[s][p // BS] * BS + p % BS for s, p in zip(seqs, inp.positions.tolist())]
    assert inp.attn.slot_mapping.tolist() == expect
    assert inp.attn.query_start_loc.tolist() == [0, 6, 7, 11]
    assert inp.attn.context_lens.tolist() == [0, 8, 4] and inp.attn.seq_lens.tolist() == [6, 9, 8]
    assert inp.sample_seq_ids == ["a", "b"] and inp.num_samples == [1, 1]    # c has not reached its end
    assert inp.logits_indices.tolist() == [5, 6]
    assert inp.prompt_logprobs == {} and inp.lora_ids is None
    assert states == before, "building the inputs changed the worker's state"


def test_draft_tokens_are_run_and_sampled_after_each_position() -> None:
    st = state("s", [5, 6, 7], 2, [0, 2], spec_token_ids=[8, 9])   # known t0..t2, drafts d0 d1
    other = state("o", [1, 2], 1, [1])
    inp = build_step_inputs({"s": st, "o": other}, [("o", 1), ("s", 3)], BS, CPU)
    assert inp.input_ids.tolist() == [2, 7, 8, 9]
    assert inp.positions.tolist() == [1, 2, 3, 4]
    assert inp.sample_seq_ids == ["o", "s"] and inp.num_samples == [1, 3]
    assert inp.logits_indices.tolist() == [0, 1, 2, 3]            # after t2, after d0, after d1
    assert [s.seq_id for s in inp.sampling_states({"s": st, "o": other})] == ["o", "s", "s", "s"]


def test_adapter_ids_follow_rows_only_when_some_sequence_uses_one() -> None:
    states = {"x": state("x", [1, 2, 3], 0, [0], lora_id=2), "y": state("y", [4, 5], 1, [1])}
    inp = build_step_inputs(states, [("x", 3), ("y", 1)], BS, CPU)
    assert inp.lora_ids.tolist() == [2, 2, 2, 0]


def test_prompt_logprob_rows_per_chunk() -> None:
    params = SamplingParams(prompt_logprobs=1)
    tokens = list(range(50, 60))
    first = build_step_inputs({"p": state("p", tokens, 0, [0, 1, 2], params=params)}, [("p", 4)], BS, CPU)
    rows = first.prompt_logprobs["p"]
    assert rows.first_chunk and rows.rows.tolist() == [0, 1, 2, 3] and rows.next_ids.tolist() == tokens[1:5]
    last = build_step_inputs({"p": state("p", tokens, 8, [0, 1, 2], params=params)}, [("p", 2)], BS, CPU)
    rows = last.prompt_logprobs["p"]
    assert not rows.first_chunk and rows.rows.tolist() == [0] and rows.next_ids.tolist() == [59]


def test_profiling_step_keeps_positions_within_the_context(tiny_model, monkeypatch) -> None:
    """The memory-profiling forward runs a full token budget; where the budget exceeds max_model_len it is
    several sequences, since positions past the context index beyond the rope tables (on the GPU a
    device-side assert that killed the 7B benchmark's start-up)."""
    from common.config import EngineConfig
    from gpu_worker.model_runner import ModelRunner
    runner = ModelRunner(EngineConfig(model=str(tiny_model("llama")), dtype="float32", max_model_len=48,
                                      max_num_batched_tokens=130, kv_cache_memory=0.01))
    seen = []
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda sched: seen.append(sched) or execute(sched))
    runner._dummy_forward()
    lens = [len(s.token_ids) for s in seen[0].new_seqs]
    assert lens == [48, 48, 34] and not runner.seqs
