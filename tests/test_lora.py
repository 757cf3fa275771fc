"""LoRA without a served model: the --lora-modules forms, the check of PEFT folders (one clear error per
problem), the scheduler's adapter registry and slots, the per-token delta against a per-token loop, and
the worker's manager on a tiny model against the weights merged by hand."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.config import EngineConfig
from common.lora import LoRAError, LoRARequest, check_lora_config, parse_lora_module, read_adapter
from common.protocol import WorkerInfo
from gpu_worker.lora.delta import LoRABatch, add_lora_torch
from loadtest.lora_adapters import build_adapter
from scheduler.engine_core import EngineCore
from scheduler.lora_registry import LoRARegistry
from scheduler.lora_slots import LoRASlots
from tests.test_scheduler import Harness, fake_adapter, prompt

pytestmark = pytest.mark.unit

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
TARGETS = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
           "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}


def hf_llama(hidden: int = HIDDEN, vocab: int = 96, layers: int = LAYERS, tie: bool = False):
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, tie_word_embeddings=tie)
    return tf.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def hf():
    return hf_llama()


@pytest.fixture(scope="module")
def adapter(hf, tmp_path_factory) -> Path:
    return build_adapter(hf, tmp_path_factory.mktemp("lora") / "a", 8, ("q_proj", "v_proj", "down_proj"), seed=1)


def edit_config(folder: Path, **changes) -> Path:
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder


def copy_adapter(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# ---- --lora-modules ----------------------------------------------------------------------------
def test_lora_modules_take_name_equals_path_and_vllm_json() -> None:
    assert parse_lora_module("sql=/a/b") == LoRARequest("sql", 0, "/a/b")
    assert parse_lora_module('{"name": "sql", "path": "/a", "base_model_name": "base"}') == \
        LoRARequest("sql", 0, "/a", "base")
    for bad in ("sql", "=/a", "sql=", '{"name": "x"}', '{"name": "x", "path": "/p", "rank": 8}', "{nope"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)


# ---- checking a PEFT folder ----------------------------------------------------------------------
def test_a_good_adapter_reports_rank_scaling_and_modules(adapter) -> None:
    info = read_adapter(str(adapter), TARGETS, LAYERS, 16)
    assert info.rank == 8 and info.scaling == pytest.approx(16 / 8)
    assert len(info.modules) == 3 * LAYERS and "model.layers.1.mlp.down_proj" in info.modules


def test_rslora_scales_by_the_square_root_of_the_rank(hf, tmp_path) -> None:
    folder = build_adapter(hf, tmp_path / "rs", 16, ("q_proj",), alpha=8, use_rslora=True)
    assert read_adapter(str(folder), TARGETS, LAYERS, 16).scaling == pytest.approx(8 / 4)


@pytest.mark.parametrize("case, code, message", [
    ("missing folder", 404, "does not exist"),
    ("no config", 404, "no adapter_config.json"),
    ("no weights", 404, "no adapter_model.safetensors"),
    ("pickle weights", 404, "safe_serialization=True"),
    ("rank above max", 400, "rank 8, above --max-lora-rank 4"),
    ("dora", 400, "use_dora"),
    ("bias", 400, "bias='all'"),
    ("malformed config", 400, "adapter_config.json of .* cannot be read"),
    ("config not an object", 400, "is not a JSON object"),
    ("alpha null", 400, "no valid lora_alpha"),
    ("damaged weights", 400, "adapter_model.safetensors of .* cannot be read"),
])
def test_each_bad_folder_gets_its_own_error(adapter, tmp_path, case, code, message) -> None:
    folder, max_rank = copy_adapter(adapter, tmp_path / "copy"), 16
    if case == "missing folder":
        folder = tmp_path / "nowhere"
    elif case == "no config":
        (folder / "adapter_config.json").unlink()
    elif case in ("no weights", "pickle weights"):
        (folder / "adapter_model.safetensors").rename(folder / ("adapter_model.bin" if case == "pickle weights" else "x"))
    elif case == "rank above max":
        max_rank = 4
    elif case == "dora":
        edit_config(folder, use_dora=True)
    elif case == "bias":
        edit_config(folder, bias="all")
    elif case == "malformed config":
        (folder / "adapter_config.json").write_text('{"r": 8,')
    elif case == "config not an object":
        (folder / "adapter_config.json").write_text("[8]")
    elif case == "alpha null":
        edit_config(folder, lora_alpha=None)
    elif case == "damaged weights":
        (folder / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(LoRAError, match=message) as e:
        read_adapter(str(folder), TARGETS, LAYERS, max_rank)
    assert e.value.code == code


@pytest.mark.parametrize("target", ["embed_tokens", "lm_head"])
def test_an_unsupported_target_is_named(hf, tmp_path, target) -> None:
    folder = build_adapter(hf, tmp_path / target, 4, ("q_proj", target))
    with pytest.raises(LoRAError, match=f"adapts '[^']*{target}[^']*'.* which pagedserve cannot adapt"):
        read_adapter(str(folder), TARGETS, LAYERS, 16)


def test_an_adapter_of_another_base_model_is_refused(tmp_path) -> None:
    wider = build_adapter(hf_llama(hidden=96), tmp_path / "wide", 4, ("q_proj",))
    with pytest.raises(LoRAError, match="trained for a different base model"):
        read_adapter(str(wider), TARGETS, LAYERS, 16)
    deeper = build_adapter(hf_llama(layers=3), tmp_path / "deep", 4, ("q_proj",))
    with pytest.raises(LoRAError, match="for layer 2, but this model has 2 layers"):
        read_adapter(str(deeper), TARGETS, LAYERS, 16)


def test_lora_options_are_checked_wherever_an_engine_starts() -> None:
    check_lora_config(True, 2, 16, None, ["a=/a", "b=/b"])
    for args, words in [((False, 1, 16, None, ["a=/a"]), "needs --enable-lora"),
                        ((True, 0, 16, None, None), "--max-loras must be a positive integer"),
                        ((True, 1, 0, None, None), "--max-lora-rank must be a positive integer"),
                        ((True, 4, 16, 2, None), "--max-cpu-loras \\(2\\) must be at least --max-loras \\(4\\)"),
                        ((True, 2, 16, None, ["a=/a", "a=/b"]), "names 'a' twice")]:
        with pytest.raises(ValueError, match=words):
            check_lora_config(*args)


def test_scheduler_and_workers_with_different_lora_flags_refuse_to_start() -> None:
    class Workers:
        def initialize(self, eos):
            return WorkerInfo(num_blocks=8, num_host_blocks=0, max_model_len=64, vocab_size=96, block_bytes=1,
                              max_loras=1, max_lora_rank=16)
    with pytest.raises(RuntimeError, match=r"workers run with LoRA .* \(1, 16\) but the scheduler with \(4, 16\)"):
        EngineCore(EngineConfig(enable_lora=True, max_loras=4), Workers(), [])


# ---- the registry --------------------------------------------------------------------------------
def test_registry_names_are_unique_and_keys_never_reused(adapter) -> None:
    reg = LoRARegistry(True, TARGETS, LAYERS, 16)
    first = reg.load(LoRARequest("a", 0, str(adapter)))
    with pytest.raises(LoRAError, match="already loaded") as e:
        reg.load(LoRARequest("a", 0, str(adapter)))
    assert e.value.code == 400 and e.value.param == "lora_name"
    reg.unload("a")
    with pytest.raises(LoRAError, match="not loaded") as e:
        reg.unload("a")
    assert e.value.code == 404
    again = reg.load(LoRARequest("a", 0, str(adapter)))
    assert again.key != first.key           # a worker's cached copy or a cached block of `first` never serves it


def test_registry_resolves_names_and_loads_offline_requests_once(adapter) -> None:
    reg = LoRARegistry(True, TARGETS, LAYERS, 16)
    assert reg.resolve(None) is None
    with pytest.raises(LoRAError, match="does not exist") as e:
        reg.resolve(LoRARequest("nope"))
    assert e.value.code == 404
    offline = reg.resolve(LoRARequest("a", 7, str(adapter)))
    assert reg.resolve(LoRARequest("a")) is offline and reg.resolve(LoRARequest("a", 7, str(adapter))) is offline
    with pytest.raises(LoRAError, match="give each adapter its own name"):
        reg.resolve(LoRARequest("a", 7, "/elsewhere"))
    with pytest.raises(LoRAError, match="--enable-lora"):
        LoRARegistry(False, TARGETS, LAYERS, 16).resolve(LoRARequest("a", 1, str(adapter)))


# ---- slots ---------------------------------------------------------------------------------------
def test_slots_are_least_recently_used_and_never_evict_the_steps_own() -> None:
    slots = LoRASlots(2)
    a, b, c = fake_adapter(1), fake_adapter(2), fake_adapter(3)
    assert slots.place([a]) == [(0, 1, a.path)]
    assert slots.place([b, b]) == [(1, 2, b.path)]
    assert slots.place([a]) == []                            # resident: nothing to send; a is now the newest
    assert slots.place([c]) == [(1, 3, c.path)]              # b was the least recently used
    assert slots.place([b, c]) == [(0, 2, b.path)]           # a is evicted, not c, which this step uses
    # a step whose new adapter comes first must not evict an old one that a later sequence of it uses:
    # c is the least recently used but in the step, so b goes
    assert slots.place([a, c]) == [(0, 1, a.path)] and dict(slots.slot_of) == {3: 1, 1: 0}
    assert slots.num_loads == 5
    with pytest.raises(RuntimeError, match="more than max_loras"):
        slots.place([a, b, c])


def test_admission_keeps_at_most_max_loras_adapters_running() -> None:
    keys: set[int] = set()
    slots = LoRASlots(1)
    assert slots.admits(None, keys) and not keys
    assert slots.admits(fake_adapter(1), keys) and keys == {1}
    assert slots.admits(fake_adapter(1), keys)
    assert not slots.admits(fake_adapter(2), keys) and keys == {1}


def test_one_slot_serves_two_adapters_by_swapping_between_steps() -> None:
    """--max-loras 1: every step runs one adapter (plus base-model sequences); the slot is refilled when
    the other adapter's turn comes, and every request is served in full."""
    h = Harness(block_size=4, num_blocks=64, max_loras=1)
    a, b = fake_adapter(1), fake_adapter(2)
    for i, lora in enumerate([a, b, a, None, b]):
        h.add(f"r{i}", prompt(i, 6), lora=lora, max_tokens=5, ignore_eos=True)
    results = h.run()
    adapters_per_step = [{h.runner.reqs_lora[s] for s in h.step_seq_ids(x)} - {0} for x in h.steps]
    assert all(len(k) <= 1 for k in adapters_per_step)
    assert {1} in adapters_per_step and {2} in adapters_per_step
    loads = [ld for x in h.steps for ld in x.lora_loads]
    # first come, first served across adapters: r0 (a), r1 (b), r2 (a), r4 (b), the slot refilled each time
    assert [(slot, key) for slot, key, _ in loads] == [(0, 1), (0, 2), (0, 1), (0, 2)]
    assert all(len(r.tokens) == 5 and r.finish_reason == "length" for r in results.values())
    base_steps = [i for i, x in enumerate(h.steps) if "r3" in h.step_seq_ids(x)]
    assert base_steps[0] == 0, "the base-model request does not wait for a slot"


def test_a_waiting_adapter_is_not_starved_by_a_stream_of_another() -> None:
    """--max-loras 1, adapter A's requests keep arriving: B's request, once skipped, stops further A requests
    from starting, so the running A's drain and B runs before the A's that arrived after it."""
    h = Harness(block_size=4, num_blocks=256, max_loras=1, max_num_seqs=4)
    a, b = fake_adapter(1), fake_adapter(2)
    h.add("a0", prompt(0, 6), lora=a, max_tokens=6, ignore_eos=True)
    h.step()
    h.add("b", prompt(1, 6), lora=b, max_tokens=3, ignore_eos=True)
    for i in range(1, 40):                  # one more A request every step
        h.add(f"a{i}", prompt(i + 1, 6), lora=a, max_tokens=6, ignore_eos=True)
        h.step()
        if h.results.get(("b", 0)) and h.results[("b", 0)].finish_reason:
            break
    assert h.results[("b", 0)].finish_reason == "length", "b never ran"
    started_after_b = [rid for rid in h.runner.reqs_lora if rid.startswith("a") and rid != "a0"]
    assert not started_after_b, f"A requests that arrived after b started before it: {started_after_b}"
    h.run()


def test_prefix_blocks_are_shared_within_an_adapter_only() -> None:
    p = prompt(7, 12)
    h = Harness(block_size=4, num_blocks=64, max_loras=2)
    a, b = fake_adapter(1), fake_adapter(2)
    h.add("first", p, lora=a, max_tokens=2)
    h.run()
    for rid, lora in [("same", a), ("other", b), ("base", None)]:
        h.add(rid, p, lora=lora, max_tokens=2)
        h.run()
    cached = {rid: r.num_cached_tokens for (rid, _), r in h.results.items()}
    assert cached == {"first": 0, "same": 8, "other": 0, "base": 0}


# ---- the delta -----------------------------------------------------------------------------------
def per_token_delta(x, a, bs, ranges, slots) -> torch.Tensor:
    """The definition, one token at a time: y_t[shard j] = (A_j[slot_t] @ x_t) @ B_j[slot_t]."""
    out = torch.zeros(x.shape[0], ranges[-1][1], dtype=torch.float64)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        for j, (lo, hi) in enumerate(ranges):
            h = a[s, j].double() @ x[t].double()
            out[t, lo:hi] = h @ bs[j][s].double()
    return out


def random_slots_layer(num_slots: int = 3, rank: int = 8, k: int = 40, outs: tuple[int, ...] = (24, 8, 8)):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(num_slots, len(outs), rank, k, generator=g)
    bs = [torch.randn(num_slots, rank, n, generator=g) for n in outs]
    starts = [sum(outs[:j]) for j in range(len(outs))]
    return a, bs, [(lo, lo + n) for lo, n in zip(starts, outs)]


@pytest.mark.parametrize("slots", [[0, -1, 2, 1, 1, -1, 0, 2, 2],      # any order: many short runs
                                   [-1, -1, 0, 0, 0, 1, 2, 2, 2]])    # ordered by adapter: one run each
def test_the_run_by_run_delta_equals_the_per_token_definition(slots) -> None:
    a, bs, ranges = random_slots_layer()
    x = torch.randn(9, a.shape[-1])
    slots = torch.tensor(slots)
    base = torch.randn(9, ranges[-1][1])
    batch = LoRABatch.build(slots, torch.device("cpu"))
    assert len(batch.runs) == len([s for i, s in enumerate(slots.tolist()) if s >= 0 and (i == 0 or slots[i - 1] != s)])
    y = add_lora_torch(base.clone(), x, a, bs, ranges, batch.runs)
    torch.testing.assert_close(y.double(), base.double() + per_token_delta(x, a, bs, ranges, slots),
                               rtol=1e-5, atol=1e-4)
    untouched = slots < 0
    assert torch.equal(y[untouched], base[untouched])    # base-model rows: exactly the base layer's output
