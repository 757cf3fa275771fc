"""A vLLM launch line, parsed: vLLM's flag names, aliases and sizes; notices for flags that mean nothing
here; one clear error (exit 2, naming the flag) for what we do not do, before any process starts; hub
ids from a local cache, offline."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from common.model_source import ModelNotFound, ModelSource
from pagedserve import cli
from pagedserve.vllm_flags import COMPAT_FLAGS
from tests.hub_cache import add_to_hub_cache

pytestmark = pytest.mark.unit


def parse(*argv: str):
    return cli.parse_args(cli.build_parser(), ["serve", *argv])


def refused(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_model_positional_or_flag():
    assert parse("default")[0].model == "default"
    assert parse("--model", "default")[0].model == "default"
    assert parse("default", "--model", "default")[0].model == "default"


def test_the_model_twice_and_a_missing_model_are_errors(capsys, tmp_path):
    assert "given twice" in refused(capsys, "default", "--model", str(tmp_path))
    err = refused(capsys, "--model", str(tmp_path / "nope"))
    assert "--model" in err and "not found" in err


@pytest.mark.parametrize("text,value", [("32768", 32768), ("32k", 32000), ("32K", 32768), ("25.6k", 25600),
                                        ("1m", 10**6), ("auto", None), ("-1", None)])
def test_sizes_parse_as_vllm_reads_them(text, value):
    assert parse("--max-model-len", text)[0].max_model_len == value


def test_a_bad_size_names_its_flag(capsys):
    assert "--max-model-len" in refused(capsys, "--max-model-len", "32q")
    assert "--max-num-batched-tokens" in refused(capsys, "--max-num-batched-tokens", "1.5k5")


def test_aliases_and_lists():
    args, _ = parse("-tp", "1", "-q", "gguf", "--num-gpu-blocks-override", "64", "--api-server-count", "3",
                    "--served-model-name", "a", "b", "--api-key", "k1", "k2", "--max-num-batched-tokens", "2k")
    assert (args.tensor_parallel_size, args.quantization, args.num_gpu_blocks, args.router_replicas) == (1, "gguf", 64, 3)
    assert args.served_model_name == ["a", "b"] and args.api_key == ["k1", "k2"]
    assert args.max_num_batched_tokens == 2000
    flags = cli.engine_flags(args)               # the children get our canonical spellings
    assert flags[flags.index("--quantization") + 1] == "gguf" and "--num-gpu-blocks" in flags


@pytest.mark.parametrize("value", ["float33", "fp64"])
def test_a_bad_dtype_is_an_error(capsys, value):
    err = refused(capsys, "--dtype", value)
    assert "--dtype" in err and "bfloat16" in err


def test_a_bad_dtype_exits_2_within_5_seconds():
    """The whole command, as a user runs it: nothing starts, the flag is named."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", "--dtype", "flaot16"], capture_output=True,
                       text=True, timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 2 and "--dtype 'flaot16'" in r.stderr, r.stderr
    assert took < 5.0, f"took {took:.1f}s"


@pytest.mark.parametrize("argv", [("--enforce-eager",), ("--trust-remote-code",), ("--disable-log-requests",),
                                  ("--enable-chunked-prefill",), ("--no-enable-chunked-prefill",),
                                  ("--max-seq-len-to-capture", "8192"), ("--distributed-executor-backend", "mp"),
                                  ("--uvicorn-log-level", "warning"), ("-O", "3")])
def test_meaningless_flags_are_accepted_with_a_notice(argv):
    _, notices = parse(*argv)
    assert len(notices) == 1 and argv[0] in notices[0].split(":")[0].split(" ")[0].split("/") + \
        [notices[0].split(":")[0].split(" ")[0]]


@pytest.mark.parametrize("argv,named", [(("-pp", "2"), "--pipeline-parallel-size/-pp 2"),
                                        (("--distributed-executor-backend", "ray"), "--distributed-executor-backend"),
                                        (("--tool-call-parser", "hermes"), "--tool-call-parser"),
                                        (("--enable-auto-tool-choice",), "--enable-auto-tool-choice"),
                                        (("--ssl-keyfile", "k.pem"), "--ssl-keyfile"),
                                        (("--scheduling-policy", "priority"), "--scheduling-policy"),
                                        (("--cpu-offload-gb", "4"), "--cpu-offload-gb"),
                                        (("--task", "embed"), "--task")])
def test_unsupported_flags_are_errors_naming_them(capsys, argv, named):
    err = refused(capsys, *argv)
    assert named in err and "not supported" in err


def test_the_values_that_mean_nothing_pass_silently():
    _, notices = parse("-pp", "1", "-dp", "1", "--cpu-offload-gb", "0", "--task", "generate")
    assert notices == []


def test_every_compat_flag_is_documented_and_unique():
    names = [n for f in COMPAT_FLAGS for n in f.names]
    assert len(names) == len(set(names))
    assert all(f.notice or f.reason for f in COMPAT_FLAGS)
    cli.build_parser()           # no compat flag collides with one of ours (argparse would raise)


def test_router_flags_are_validated_in_the_parent(capsys, tmp_path):
    assert "--chat-template" in refused(capsys, "--chat-template", str(tmp_path / "missing.jinja"))
    assert "does not parse" in refused(capsys, "--chat-template", "{% if %}")
    assert "--generation-config" in refused(capsys, "--generation-config", str(tmp_path))
    assert "--override-generation-config" in refused(capsys, "--override-generation-config", "[1]")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}\n{% endfor %}")
    assert parse("--chat-template", str(template))[0].chat_template == str(template)


def test_a_hub_id_resolves_from_the_local_cache_offline(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    add_to_hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", tiny_model("llama"))
    src = ModelSource.resolve("tiny-org/tiny-llama", download_dir=str(tmp_path / "hub"))
    assert src.kind == "hf" and src.name == "tiny-org/tiny-llama" and (src.path / "config.json").is_file()
    assert src.model_config().arch == "llama"
    with pytest.raises(ModelNotFound, match="not in .* and HF_HUB_OFFLINE is set"):
        ModelSource.resolve("tiny-org/absent", download_dir=str(tmp_path / "hub"))
    with pytest.raises(ModelNotFound, match="revision v9"):
        ModelSource.resolve("tiny-org/tiny-llama", download_dir=str(tmp_path / "hub"), revision="v9")


def test_generation_defaults_come_from_the_generation_config(tmp_path, tiny_model):
    folder = tiny_model("llama")
    src = ModelSource.resolve(str(folder))
    own = src.generation_defaults("auto")
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text('{"temperature": 0.3, "top_k": 20, "max_new_tokens": 64, '
                                                  '"do_sample": true}')
    assert src.generation_defaults(str(other)) == {"temperature": 0.3, "top_k": 20, "max_tokens": 64}
    assert src.generation_defaults("vllm") == {}
    assert isinstance(own, dict)
