"""The settings of one router replica, each with its default stated once.

The `pagedserve router` flags are generated from these fields (pagedserve/cli.py), `pagedserve serve`
re-emits them to its child routers from a RouterConfig, and router/serve.py reads nothing else, so the
CLI, the child processes and the server cannot disagree about a default again.

A field's metadata may say how the CLI spells it: "flag" renames its flag (the frontend address has always
been `--connect`), "env" defaults it from an environment variable, which is also how `serve` hands the
value to its routers (the API keys: never on argv, where `ps` would show them), "json" reads a list the
way vLLM does (`--allowed-origins '["https://a.example"]'`; a comma-separated list works too).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.config import env_flag

API_KEY_ENV = "PAGEDSERVE_API_KEY"       # one key, or a JSON list of keys
VLLM_API_KEY_ENV = "VLLM_API_KEY"         # vLLM's, read when ours is unset
# vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter, off by default there and here: they
# make the server read folders a client names
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
DEFAULT_FRONTEND = "tcp://127.0.0.1:5557"      # the scheduler's router-facing (frontend) socket


@dataclass
class RouterConfig:
    """Every setting of a router replica; the `router` subcommand's flags map one-to-one onto these fields."""
    model: str | None = None                  # whose tokenizer and config to load; the CLI's positional MODEL
    tokenizer: str | None = None              # the model's tokenizer unless set (see EngineConfig)
    revision: str | None = None
    download_dir: str | None = None
    frontend_address: str = field(default=DEFAULT_FRONTEND, metadata={"flag": "--connect"})
    host: str = "127.0.0.1"
    port: int = 8000
    # the model ids clients may send; the first is the one responses carry. Default: the model's name
    served_model_name: list[str] | None = None
    api_key: list[str] | None = field(default=None, metadata={"env": (API_KEY_ENV, VLLM_API_KEY_ENV)})  # []: no auth
    max_body_bytes: int = 16 << 20            # nginx's client_max_body_size (docker/nginx.conf) matches it
    shutdown_timeout: float = 30.0            # seconds in-flight requests get to finish on SIGTERM
    access_log: bool = False
    chat_template: str | None = None          # a file, or the Jinja template itself; default the tokenizer's
    response_role: str = "assistant"          # the role chat responses carry
    generation_config: str = "auto"           # auto | vllm | FOLDER: where request defaults come from
    override_generation_config: str | None = None   # JSON object over those defaults, e.g. {"temperature": 0.5}
    allowed_origins: list[str] = field(default_factory=lambda: ["*"], metadata={"json": True})   # CORS
    allowed_methods: list[str] = field(default_factory=lambda: ["*"], metadata={"json": True})
    allowed_headers: list[str] = field(default_factory=lambda: ["*"], metadata={"json": True})
    allow_credentials: bool = False
    disable_fastapi_docs: bool = False        # vLLM's name: no /docs, /openapi.json
    enable_auto_tool_choice: bool = False     # vLLM's: "tool_choice": "auto" (the default with tools) parses calls
    tool_call_parser: str | None = None       # hermes | llama3_json: how the model writes its calls


def runtime_lora_updating_allowed() -> bool:
    return env_flag(RUNTIME_LORA_ENV)
