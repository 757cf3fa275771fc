"""Multi-LoRA over HTTP with `pagedserve serve --enable-lora`, on the tiny Llama and on the default model:
an adapter from --lora-modules and one loaded at run time, each matching Hugging Face with the adapter
merged by peft (greedy, fp32), alone and in concurrent mixed traffic; unloading ends the name; /v1/models
and /metrics show the adapters. ("tiny" is the served model name in both.)"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
import torch

from common.model_source import ModelSource
from loadtest.lora_adapters import build_adapter, merged_reference
from tests.hf_reference import hf_greedy
from common.protocol import HEARTBEAT_S
from tests.server_utils import async_wait_until, run_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MAX_TOKENS = 12
TEXTS = ["The history of the printing press", "Once upon a time", "Machine learning is"]


@pytest.fixture(scope="module", params=["tiny_llama", "default_model"])
def setup(request, tiny_model, default_tokenizer, tmp_path_factory):
    """(model flags, adapter a1, adapter a2, expected text per adapter name) for the tiny Llama, and for the
    default model expanded to fp32 (`--quantization none`, what Hugging Face computes from the GGUF)."""
    from transformers import AutoModelForCausalLM
    if request.param == "tiny_llama":
        model_args, std = [str(tiny_model("llama"))], 0.3
        hf = AutoModelForCausalLM.from_pretrained(model_args[0], dtype=torch.float32).eval()
    else:
        src = ModelSource.resolve(None)
        model_args, std = ["--quantization", "none"], 0.05
        hf = AutoModelForCausalLM.from_pretrained(str(src.path.parent), gguf_file=src.path.name,
                                                  dtype=torch.float32).eval()
    tmp = tmp_path_factory.mktemp("lora-http")
    a1 = build_adapter(hf, tmp / "a1", 8, ("q_proj", "v_proj", "down_proj"), seed=1, std=std)
    a2 = build_adapter(hf, tmp / "a2", 16, ("k_proj", "o_proj", "gate_proj", "up_proj"), seed=2, std=std)
    models = {None: hf, "a1": merged_reference(hf, a1), "a2": merged_reference(hf, a2)}
    expected = {name: [default_tokenizer.decode(hf_greedy(m, default_tokenizer.encode(t), MAX_TOKENS, None).token_ids)
                       for t in TEXTS] for name, m in models.items()}
    assert expected["a1"] != expected[None] and expected["a2"] != expected[None]
    return model_args, a1, a2, expected


@pytest.fixture(scope="module")
def server(setup, tmp_path_factory):
    model_args, a1, _, _ = setup
    a1_json = json.dumps({"name": "a1", "path": str(a1), "base_model_name": "tiny-base"})
    # --dtype float32: HF's outputs exactly; bf16 matmuls (auto on a bf16 CPU) would change mixed batches
    with run_server(*model_args, "--dtype", "float32", "--served-model-name", "tiny", "--kv-cache-memory", "0.1",
                    "--swap-space", "0",
                    "--num-threads", "1", "--enable-lora", "--max-loras", "2", "--lora-modules", a1_json,
                    log_dir=tmp_path_factory.mktemp("lora-http-logs"),
                    env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as s:
        yield s


async def complete(session: aiohttp.ClientSession, url: str, model: str, prompt: str) -> tuple[int, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body) as r:
        return r.status, await r.json()


async def texts(url: str, calls: list[tuple[str, str]]) -> list[str]:
    """The completions of (model, prompt) calls, sent concurrently."""
    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(*(complete(s, url, m, p) for m, p in calls))
    assert all(code == 200 for code, _ in results), results
    return [body["choices"][0]["text"] for _, body in results]


async def post(url: str, path: str, body: dict) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.post(f"{url}{path}", json=body) as r:
        return r.status, await r.text()


async def get(url: str, path: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"{url}{path}") as r:
        return await r.text()


async def _metrics_with(url: str, line: str) -> str | None:
    text = await get(url, "/metrics")
    return text if line in text else None


def test_adapters_served_at_start_and_loaded_at_run_time_match_hf(server, setup) -> None:
    _, a1, a2, expected = setup

    async def scenario() -> None:
        cards = json.loads(await get(server.url, "/v1/models"))["data"]
        assert [(c["id"], c.get("parent")) for c in cards] == [("tiny", None), ("a1", "tiny-base")]
        assert await texts(server.url, [("a1", t) for t in TEXTS]) == expected["a1"]

        assert await post(server.url, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(a2)}) == \
            (200, "Success: LoRA adapter 'a2' added successfully.")
        assert [c["id"] for c in json.loads(await get(server.url, "/v1/models"))["data"]] == ["tiny", "a1", "a2"]
        mixed = [(m, t) for t in TEXTS for m in ("a1", "a2", "tiny")]
        want = [expected[None if m == "tiny" else m][TEXTS.index(t)] for m, t in mixed]
        assert await texts(server.url, mixed) == want, "concurrent requests mixing both adapters and the base"

        code, text = await post(server.url, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(a2)})
        assert code == 400 and "already loaded" in text
        assert (await post(server.url, "/v1/unload_lora_adapter", {"lora_name": "a2"}))[0] == 200
        async with aiohttp.ClientSession() as s:
            code, body = await complete(s, server.url, "a2", TEXTS[0])
        assert code == 404 and body["error"]["code"] == "model_not_found"
        assert await texts(server.url, [("a1", TEXTS[0]), ("tiny", TEXTS[0])]) == [expected["a1"][0],
                                                                                    expected[None][0]]
        # the name again, from another folder: nothing of the old a2 (worker copy, cached blocks) is served
        assert (await post(server.url, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(a1)}))[0] == 200
        assert await texts(server.url, [("a2", t) for t in TEXTS]) == expected["a1"]
        # the engine's counters reach /metrics with the next Stats heartbeat
        counted = 'pagedserve:lora_requests_total{lora_name="a2",model_name="tiny"} 6.0'
        metrics = await async_wait_until(lambda: _metrics_with(server.url, counted), 10 * HEARTBEAT_S,
                                         f"/metrics shows {counted}")
        assert "pagedserve:lora_requests_info{" in metrics and 'max_lora="2"' in metrics
    asyncio.run(scenario())


@pytest.mark.parametrize("body, code, words", [
    ({"lora_name": "x", "lora_path": "/no/such/adapter"}, 404, "does not exist"),
    ({"lora_name": "a1", "lora_path": "/no/such/adapter"}, 400, "already loaded"),
])
def test_bad_run_time_loads_are_refused_with_the_reason(server, body, code, words) -> None:
    got_code, text = asyncio.run(post(server.url, "/v1/load_lora_adapter", body))
    assert got_code == code and words in json.loads(text)["error"]["message"]


def test_an_adapter_of_another_model_is_refused_at_load(server, setup, tmp_path: Path) -> None:
    import transformers as tf
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    other = build_adapter(tf.LlamaForCausalLM(cfg), tmp_path / "other", 4, ("q_proj",))
    code, text = asyncio.run(post(server.url, "/v1/load_lora_adapter", {"lora_name": "o", "lora_path": str(other)}))
    assert code == 400 and "different base model" in json.loads(text)["error"]["message"]
