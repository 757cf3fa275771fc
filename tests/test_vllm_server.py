"""A vLLM user's launch line, end to end: 30+ flags from vLLM's documentation and deployment examples start
a server that serves a tiny model by its hub id from a local cache (offline); a line of flags we do not
support stops at once, naming each."""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import openai
import pytest

from pagedserve import cli
from tests.hub_cache import add_to_hub_cache
from tests.server_utils import run_server

pytestmark = pytest.mark.e2e
KEY = "vllm-style-key"
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def launch_line(hub: str, template: str, tokenizer: str) -> list[str]:
    """Flags as vLLM spells them (a few are ours: --kv-cache-memory sizes the CPU cache, --num-threads)."""
    return [
        "--model", "tiny-org/tiny-llama", "--download-dir", hub, "--revision", "main",
        "--tokenizer", tokenizer, "--served-model-name", "tiny", "tiny-alias",
        "--dtype", "float32", "--max-model-len", "1k", "--max-num-seqs", "8", "--max-num-batched-tokens", "2k",
        "--block-size", "16", "--swap-space", "0", "--gpu-memory-utilization", "0.85", "--seed", "1",
        "--enable-prefix-caching", "--enable-chunked-prefill", "--enforce-eager", "--trust-remote-code",
        "--disable-log-requests", "--disable-log-stats", "--tensor-parallel-size", "1", "-pp", "1",
        "--distributed-executor-backend", "mp", "--kv-cache-dtype", "auto", "--load-format", "safetensors",
        "--generation-config", "auto", "--override-generation-config", '{"top_p": 0.95}',
        "--chat-template", template, "--response-role", "assistant",
        "--allowed-origins", '["*"]', "--max-logprobs", "20", "--uvicorn-log-level", "warning",
        "--tokenizer-mode", "auto", "--scheduling-policy", "fcfs", "--disable-uvicorn-access-log",
        "--max-seq-len-to-capture", "1024", "--api-server-count", "1", "--num-gpu-blocks-override", "256",
        "--kv-cache-memory", "0.05", "--num-threads", "1",
    ]


UNSUPPORTED = [("-pp", "2"), ("--tool-parser-plugin", "plugin.py"), ("--guided-decoding-backend", "outlines"),
               ("--ssl-keyfile", "key.pem"), ("--distributed-executor-backend", "ray"), ("--enable-sleep-mode",),
               ("--cpu-offload-gb", "2"), ("--speculative-model", "draft"), ("--task", "embed"),
               ("--reasoning-parser", "deepseek_r1"), ("--limit-mm-per-prompt", '{"image": 1}')]


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_model) -> str:
    cache = tmp_path_factory.mktemp("hub")
    snapshot = add_to_hub_cache(cache, "tiny-org/tiny-llama", tiny_model("llama"))
    # the model's generation config: max_new_tokens caps every request, as in vLLM
    (snapshot / "generation_config.json").write_text(json.dumps({"max_new_tokens": 4, "temperature": 0.7}))
    return str(cache)


def test_a_vllm_launch_line_starts_and_serves(hub, tmp_path, default_tokenizer):
    (tmp_path / "template.jinja").write_text(TEMPLATE)
    default_tokenizer.save_pretrained(tmp_path / "tokenizer")          # a tokenizer folder, no config.json
    line = launch_line(hub, str(tmp_path / "template.jinja"), str(tmp_path / "tokenizer"))
    assert sum(a.startswith("-") for a in line) >= 25
    with run_server(*line, log_dir=tmp_path, env={"HF_HUB_OFFLINE": "1"}, api_key=KEY) as s:
        sdk = openai.OpenAI(base_url=f"{s.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        assert [m.id for m in sdk.models.list().data] == ["tiny", "tiny-alias"]
        c = sdk.completions.create(model="tiny-alias", prompt="The capital of", max_tokens=5, temperature=0,
                                   extra_body={"ignore_eos": True})
        assert c.model == "tiny-alias" and c.usage.completion_tokens == 4      # capped by max_new_tokens
        chat = sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                           temperature=0)
        assert chat.choices[0].message.role == "assistant" and chat.usage.prompt_tokens > 0
        req = urllib.request.Request(f"{s.url}/tokenize", json.dumps({"messages": [{"role": "user", "content": "Hi"}]})
                                     .encode(), {"Content-Type": "application/json"})
        tokens = json.loads(urllib.request.urlopen(req, timeout=30).read())
        assert tokens["count"] == chat.usage.prompt_tokens          # our template, as the chat route used it
        log = s.log()
        for flag in ("--enforce-eager", "--trust-remote-code", "--enable-chunked-prefill", "--disable-log-requests"):
            assert flag in log, f"no notice for {flag}"


def test_unsupported_flags_each_stop_the_launch_naming_themselves(capsys):
    for flag in UNSUPPORTED:
        with pytest.raises(SystemExit) as e:
            cli.parse_args(cli.build_parser(), ["serve", *flag])
        err = capsys.readouterr().err
        assert e.value.code == 2 and flag[0] in err and "not supported" in err, (flag, err)
    # the whole line, as a user runs it: refused before any process starts or any model is read
    r = subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", *[a for f in UNSUPPORTED for a in f]],
                       capture_output=True, text=True, timeout=60)
    named = [f[0] for f in UNSUPPORTED if f[0] in r.stderr]
    assert r.returncode == 2 and "not supported" in r.stderr and named, r.stderr
    assert not any(line in r.stderr for line in ("model weights", "KV cache:", "Traceback")), r.stderr
