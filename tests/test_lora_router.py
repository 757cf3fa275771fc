"""The router's LoRA surface against a scripted engine: `model` naming an adapter, /v1/models cards with
their parent, the run-time load/unload endpoints (forwarded, with the scheduler's refusals as OpenAI
errors) and the lora metrics."""
from __future__ import annotations

import pytest

from common.lora import LoRARequest
from router.engine_client import EngineRejected
from common.model_source import ModelSource
from tests.test_router_unit import MODEL, FakeEngine, post, run_http, sse

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok():
    return ModelSource.resolve(None).load_tokenizer()


class LoRAEngine(FakeEngine):
    """A FakeEngine that keeps adapters the way the scheduler does and reports them in its Stats."""

    def __init__(self, tok, adapters: dict[str, str] | None = None):
        super().__init__(tok)
        self.adapters = dict(adapters or {})
        self.stats.values.update(max_lora=2, lora_running=["sql"], lora_waiting=[], lora_requests={"sql": 3})
        self._publish()

    def _publish(self) -> None:
        self.stats.values["lora_adapters"] = [[n, p, None] for n, p in self.adapters.items()]

    async def load_lora(self, request_id: str, lora: LoRARequest, timeout: float = 60.0) -> None:
        if lora.lora_name in self.adapters:
            raise EngineRejected(400, f"the LoRA adapter {lora.lora_name!r} is already loaded", "lora_name")
        if lora.lora_path.startswith("/missing"):
            raise EngineRejected(404, f"the LoRA adapter path {lora.lora_path!r} does not exist", "lora_path")
        self.adapters[lora.lora_name] = lora.lora_path
        self._publish()

    async def unload_lora(self, request_id: str, name: str, timeout: float = 30.0) -> None:
        if self.adapters.pop(name, None) is None:
            raise EngineRejected(404, f"the LoRA adapter {name!r} is not loaded", "lora_name")
        self._publish()


def test_model_names_an_adapter_and_responses_carry_its_name(tok) -> None:
    async def scenario(client, engine, app):
        r = await post(client, "/v1/completions", {"model": "sql", "prompt": "Hi", "max_tokens": 3})
        assert r.status == 200 and (await r.json())["model"] == "sql"
        r = await post(client, "/v1/chat/completions", {"model": "sql", "stream": True, "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "Hi"}]})
        chunks = [e for e in await sse(r) if e != "[DONE]"]
        assert chunks and all(c["model"] == "sql" for c in chunks)
        r = await post(client, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert (await r.json())["model"] == MODEL
        assert engine.loras == ["sql", "sql", None]
    run_http(tok, scenario, engine=LoRAEngine(tok, {"sql": "/adapters/sql"}))


def test_an_unknown_model_is_refused_by_the_router_when_lora_is_off(tok) -> None:
    async def scenario(client, engine, app):
        r = await post(client, "/v1/completions", {"model": "sql", "prompt": "Hi", "max_tokens": 3})
        assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        assert engine.added == []
    run_http(tok, scenario)


def test_the_schedulers_404_for_an_unknown_adapter_is_model_not_found(tok) -> None:
    engine = LoRAEngine(tok)
    engine.reject = EngineRejected(404, "The model `nope` does not exist.", "model")

    async def scenario(client, engine, app):
        r = await post(client, "/v1/completions", {"model": "nope", "prompt": "Hi", "max_tokens": 3})
        err = (await r.json())["error"]
        assert r.status == 404 and err["code"] == "model_not_found" and err["param"] == "model"
    run_http(tok, scenario, engine=engine)


def test_models_lists_adapters_with_their_parent(tok) -> None:
    async def scenario(client, engine, app):
        cards = (await (await client.get("/v1/models")).json())["data"]
        assert [c["id"] for c in cards] == [MODEL, "sql"]
        assert cards[1]["parent"] == MODEL and cards[1]["root"] == "/adapters/sql"
    run_http(tok, scenario, engine=LoRAEngine(tok, {"sql": "/adapters/sql"}))


def test_load_and_unload_at_run_time(tok) -> None:
    async def scenario(client, engine, app):
        r = await post(client, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": "/adapters/chat"})
        assert r.status == 200 and await r.text() == "Success: LoRA adapter 'chat' added successfully."
        ids = [c["id"] for c in (await (await client.get("/v1/models")).json())["data"]]
        assert ids == [MODEL, "chat"]
        r = await post(client, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": "/adapters/chat"})
        assert r.status == 400 and "already loaded" in (await r.json())["error"]["message"]
        r = await post(client, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/missing/x"})
        assert r.status == 404 and (await r.json())["error"]["param"] == "lora_path"
        r = await post(client, "/v1/unload_lora_adapter", {"lora_name": "chat"})
        assert r.status == 200 and "removed successfully" in await r.text()
        r = await post(client, "/v1/unload_lora_adapter", {"lora_name": "chat"})
        assert r.status == 404
    run_http(tok, scenario, engine=LoRAEngine(tok), allow_lora_updates=True)


def test_run_time_updates_are_off_unless_the_environment_allows_them(tok) -> None:
    async def scenario(client, engine, app):
        r = await post(client, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": "/adapters/chat"})
        assert r.status == 404 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in (await r.json())["error"]["message"]
        r = await post(client, "/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert r.status == 404 and engine.adapters == {"sql": "/adapters/sql"}
    run_http(tok, scenario, engine=LoRAEngine(tok, {"sql": "/adapters/sql"}))


@pytest.mark.parametrize("path, body, param", [
    ("/v1/load_lora_adapter", {"lora_path": "/a"}, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "a"}, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a", "load_inplace": True}, "load_inplace"),
    ("/v1/unload_lora_adapter", {"lora_name": ""}, "lora_name"),
])
def test_malformed_adapter_calls_are_400_naming_the_field(tok, path, body, param) -> None:
    async def scenario(client, engine, app):
        r = await post(client, path, body)
        err = (await r.json())["error"]
        assert r.status == 400 and err["param"] == param
        assert engine.adapters == {}
    run_http(tok, scenario, engine=LoRAEngine(tok), allow_lora_updates=True)


def test_metrics_show_lora_requests_info_and_requests_per_adapter(tok) -> None:
    async def scenario(client, engine, app):
        text = await (await client.get("/metrics")).text()
        info = next(line for line in text.splitlines() if line.startswith("pagedserve:lora_requests_info{"))
        assert 'running_lora_adapters="sql"' in info and 'max_lora="2"' in info
        assert f'pagedserve:lora_requests_total{{lora_name="sql",model_name="{MODEL}"}} 3.0' in text
    run_http(tok, scenario, engine=LoRAEngine(tok, {"sql": "/adapters/sql"}))
