"""A vLLM launch line, parsed: vLLM's flag names, aliases and sizes; notices for flags that mean nothing
here; one clear error (exit 2, naming the flag) for what we do not do, before any process starts; hub
ids from a local cache, offline."""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys

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


def test_a_model_swallowed_by_served_model_name_is_an_error(capsys, tiny_model):
    folder = str(tiny_model("llama"))
    err = refused(capsys, "--served-model-name", "tiny", folder)
    assert "give the model first" in err and folder in err
    assert parse(folder, "--served-model-name", "tiny", "tiny-2")[0].served_model_name == ["tiny", "tiny-2"]


def test_the_model_twice_and_a_missing_model_are_errors(capsys, tmp_path):
    assert "given twice" in refused(capsys, "default", "--model", str(tmp_path))
    err = refused(capsys, "--model", str(tmp_path / "nope"))
    assert "--model" in err and "not found" in err


@pytest.mark.parametrize("text,value", [("32768", 32768), ("32k", 32000), ("32K", 32768), ("25.6k", 25600),
                                        ("1m", 10**6), ("4.1m", 4_100_000), ("auto", None), ("-1", None)])
def test_sizes_parse_as_vllm_reads_them(text, value):
    assert parse("--max-model-len", text)[0].max_model_len == value


def test_a_bad_size_names_its_flag(capsys):
    assert "--max-model-len" in refused(capsys, "--max-model-len", "32q")
    assert "--max-num-batched-tokens" in refused(capsys, "--max-num-batched-tokens", "1.5k5")
    assert "whole number" in refused(capsys, "--max-model-len", "1.5K")       # binary units: whole numbers


def test_aliases_and_lists():
    args, _ = parse("-tp", "2", "-q", "gguf", "--num-gpu-blocks-override", "64", "--api-server-count", "3",
                    "--served-model-name", "a", "b", "--api-key", "k1", "k2", "--max-num-batched-tokens", "2k")
    assert (args.tensor_parallel_size, args.quantization, args.num_gpu_blocks, args.router_replicas) == (2, "gguf", 64, 3)
    assert args.served_model_name == ["a", "b"] and args.api_key == ["k1", "k2"]
    assert args.max_num_batched_tokens == 2000
    flags = cli.engine_flags(args)               # the children get our canonical spellings
    assert flags[flags.index("--quantization") + 1] == "gguf" and "--num-gpu-blocks" in flags


@pytest.mark.parametrize("value", ["float33", "fp64"])
def test_a_bad_dtype_is_an_error(capsys, value):
    err = refused(capsys, "--dtype", value)
    assert "--dtype" in err and "bfloat16" in err


def test_prefix_caching_hash_algo_is_a_real_flag(capsys):
    args, notices = parse("--prefix-caching-hash-algo", "blake2b")
    assert not notices and cli.engine_config(args).prefix_caching_hash_algo == "blake2b"
    flags = cli.engine_flags(args)
    assert flags[flags.index("--prefix-caching-hash-algo") + 1] == "blake2b"
    err = refused(capsys, "--prefix-caching-hash-algo", "builtin")   # the unkeyed hash of CVE-2025-25183
    assert "--prefix-caching-hash-algo" in err and "sha256" in err


def test_a_bad_dtype_exits_2_before_anything_starts():
    """The whole command, as a user runs it: the flag is named, and no process started or model was read
    (no start-up log line; a wall-clock bound would only measure the machine's load)."""
    r = subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", "--dtype", "flaot16"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--dtype 'flaot16'" in r.stderr, r.stderr
    assert not any(line in r.stderr for line in ("model weights", "KV cache:", "Traceback")), r.stderr


@pytest.mark.parametrize("argv", [("--enforce-eager",), ("--trust-remote-code",), ("--disable-log-requests",),
                                  ("--enable-chunked-prefill",), ("--no-enable-chunked-prefill",),
                                  ("--max-seq-len-to-capture", "8192"), ("--distributed-executor-backend", "mp"),
                                  ("--uvicorn-log-level", "warning"), ("-O", "3")])
def test_meaningless_flags_are_accepted_with_a_notice(argv):
    _, notices = parse(*argv)
    flag = notices[0].split(":")[0].split(" ")[0]          # "--x", "--a/-b", or "--no-x"
    assert len(notices) == 1 and argv[0] in flag.split("/")


@pytest.mark.parametrize("argv,named", [(("-pp", "2"), "--pipeline-parallel-size/-pp 2"),
                                        (("--distributed-executor-backend", "ray"), "--distributed-executor-backend"),
                                        (("--tool-parser-plugin", "p.py"), "--tool-parser-plugin"),
                                        (("--guided-decoding-backend", "outlines"), "--guided-decoding-backend"),
                                        (("--ssl-keyfile", "k.pem"), "--ssl-keyfile"),
                                        (("--scheduling-policy", "priority"), "--scheduling-policy"),
                                        (("--cpu-offload-gb", "4"), "--cpu-offload-gb"),
                                        (("--task", "embed"), "--task")])
def test_unsupported_flags_are_errors_naming_them(capsys, argv, named):
    err = refused(capsys, *argv)
    assert named in err and "not supported" in err


def test_the_tool_flags_are_checked(capsys):
    assert "--enable-auto-tool-choice requires --tool-call-parser" in refused(capsys, "--enable-auto-tool-choice")
    assert "expected one of hermes, llama3_json" in refused(capsys, "--tool-call-parser", "mistral")
    args, notices = parse("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes" and notices == []


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
    model = tmp_path / "model"
    shutil.copytree(tiny_model("llama"), model)
    (model / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.9, "top_k": 0, "eos_token_id": 2}')
    src = ModelSource.resolve(str(model))
    assert src.generation_defaults("auto") == {"temperature": 0.6, "top_p": 0.9, "top_k": -1}    # 0: off
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text('{"temperature": 0.3, "top_k": 20, "max_new_tokens": 64, '
                                                  '"do_sample": true}')
    assert src.generation_defaults(str(other)) == {"temperature": 0.3, "top_k": 20, "max_tokens": 64}
    assert src.generation_defaults("vllm") == {}
    # --override-generation-config merges in vLLM's (HF's) names; what is no sampling default is dropped
    assert src.generation_defaults("auto", {"max_new_tokens": 8, "temperature": 0.1, "do_sample": False}) == \
        {"temperature": 0.1, "top_p": 0.9, "top_k": -1, "max_tokens": 8}
    assert src.generation_defaults("vllm", {"repetition_penalty": 1.2}) == {"repetition_penalty": 1.2}


def test_a_bad_generation_override_is_refused_at_start(capsys):
    err = refused(capsys, "--override-generation-config", '{"temperature": "hot"}')
    assert "--override-generation-config" in err


def test_a_tokenizer_folder_needs_no_model_config(tmp_path, default_tokenizer):
    default_tokenizer.save_pretrained(tmp_path / "tok")
    args, _ = parse("--tokenizer", str(tmp_path / "tok"))
    src = ModelSource.from_config(args)
    assert src.tokenizer_path == (tmp_path / "tok").resolve()
    assert src.load_tokenizer().encode("paged") == default_tokenizer.encode("paged")


def test_engine_config_survives_the_trip_to_a_child_process():
    """What serve and AsyncLLMEngine hand their children (config_flags) parses back to the same config,
    dict-valued options included (LLM(speculative_config={...}), lora_modules as dicts)."""
    from common.config import EngineConfig
    config = EngineConfig(model=None, max_model_len=4096, max_num_batched_tokens=2048, tensor_parallel_size=2,
                          quantization="int8", enable_prefix_caching=False, kv_cache_memory=0.5,
                          speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                          enable_lora=True, lora_modules=["a=/x", '{"name": "b", "path": "/y"}'])
    child = cli.build_parser().parse_args(["worker", *cli.config_flags(config)])
    back = cli.engine_config(child)
    assert back.speculative_config == '{"method": "ngram", "num_speculative_tokens": 3}'
    assert dataclasses.replace(back, speculative_config=config.speculative_config) == config
