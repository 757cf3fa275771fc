"""LoRA adapters as the whole engine sees them: vLLM's `LoRARequest`, the `--lora-modules` forms, and the
check of a PEFT folder (adapter_config.json + adapter_model.safetensors) against the model it would adapt.

The check reads the config and the safetensors header only, so the scheduler can refuse a bad adapter at
once (with the reason) before any worker loads a tensor. What a model can adapt is the worker's to say:
`LoRATargets` maps each adaptable module kind ("q_proj", ...) to its (in, out) features.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# adapter_config.json keys whose (truthy) value changes the math in ways we do not implement
_UNSUPPORTED_OPTIONS = ("use_dora", "lora_bias", "modules_to_save", "rank_pattern", "alpha_pattern", "fan_in_fan_out",
                        "layer_replication", "trainable_token_indices", "use_qalora", "alora_invocation_tokens",
                        "target_parameters", "use_bdlora")
_TENSOR = re.compile(r"(?:base_model\.model\.)?(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])\.weight")

LoRATargets = dict[str, tuple[int, int]]      # module kind -> (in_features, out_features)


@dataclass
class LoRARequest:
    """vLLM's LoRARequest: an adapter by name, with its folder. Over HTTP only the name travels (the
    scheduler knows the folder); the offline API sends all three and registers the adapter on first use."""
    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
    base_model_name: str | None = None

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


class LoRAError(ValueError):
    """An adapter that cannot be served, with the HTTP status to answer (404 not found, 400 otherwise) and
    the field at fault (the folder, unless the name is)."""

    def __init__(self, message: str, code: int = 400, param: str = "lora_path"):
        super().__init__(message)
        self.code, self.param = code, param


@dataclass(frozen=True)
class AdapterInfo:
    """What the check learned: the rank, the factor the B matrices are scaled by, and the modules adapted
    (HF paths such as "model.layers.0.self_attn.q_proj")."""
    rank: int
    scaling: float
    modules: tuple[str, ...]


def check_lora_config(enable_lora: bool, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None,
                      lora_modules: list[str] | None) -> None:
    """The LoRA engine options, checked once wherever an engine starts (CLI, LLM, processes)."""
    if lora_modules and not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
    if max_cpu_loras is not None and max_cpu_loras < max_loras:
        raise ValueError(f"--max-cpu-loras ({max_cpu_loras}) must be at least --max-loras ({max_loras})")
    names: set[str] = set()
    for spec in lora_modules or []:
        name = parse_lora_module(spec).lora_name
        if name in names:
            raise ValueError(f"--lora-modules names {name!r} twice")
        names.add(name)


def parse_lora_module(spec: str) -> LoRARequest:
    """One `--lora-modules` entry: `name=path`, or vLLM's JSON `{"name", "path", "base_model_name"}` (also as
    a dict, from LLM(lora_modules=[...]))."""
    spec = json.dumps(spec) if isinstance(spec, dict) else spec.strip()
    if spec.startswith("{"):
        try:
            raw = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {spec!r}: invalid JSON ({e})") from None
        unknown = set(raw) - {"name", "path", "base_model_name"}
        if unknown or not isinstance(raw.get("name"), str) or not isinstance(raw.get("path"), str):
            raise ValueError(f"--lora-modules {spec!r}: expected {{\"name\": ..., \"path\": ...}} and optionally "
                             f"\"base_model_name\"" + (f"; unknown: {', '.join(sorted(unknown))}" if unknown else ""))
        return LoRARequest(raw["name"], 0, raw["path"], raw.get("base_model_name"))
    name, eq, path = spec.partition("=")
    if not eq or not name or not path:
        raise ValueError(f"--lora-modules {spec!r}: expected name=path or a JSON object")
    return LoRARequest(name, 0, path)


def split_tensor_name(name: str) -> tuple[str, str] | None:
    """("model.layers.0.self_attn.q_proj", "A") for a PEFT tensor name; None for one we cannot adapt."""
    m = _TENSOR.fullmatch(name)
    return (m.group(1), m.group(4)) if m else None


def read_adapter(path: str, targets: LoRATargets, num_layers: int, max_rank: int) -> AdapterInfo:
    """Check a PEFT LoRA folder against the model; raise LoRAError saying exactly what does not fit."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAError(f"the LoRA adapter path {path!r} does not exist or is not a folder", 404)
    if not (folder / CONFIG_FILE).is_file():
        raise LoRAError(f"no {CONFIG_FILE} in {path!r}: not a PEFT adapter folder", 404)
    try:
        cfg = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAError(f"{CONFIG_FILE} of {path!r} cannot be read: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{CONFIG_FILE} of {path!r} is not a JSON object")
    rank, scaling = _rank_and_scaling(cfg, max_rank, path)
    shapes = _tensor_shapes(folder)
    modules = _check_tensors(shapes, targets, num_layers, rank)
    return AdapterInfo(rank, scaling, modules)


def _rank_and_scaling(cfg: dict[str, Any], max_rank: int, path: str) -> tuple[int, float]:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{path!r} is a {cfg.get('peft_type')} adapter; only LoRA is supported")
    set_options = [k for k in _UNSUPPORTED_OPTIONS if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        set_options.append(f"bias={cfg['bias']!r}")
    if set_options:
        raise LoRAError(f"the adapter {path!r} uses {', '.join(set_options)}, which pagedserve does not support")
    rank = cfg.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"{CONFIG_FILE} of {path!r} has no valid rank r ({rank!r})")
    if rank > max_rank:
        raise LoRAError(f"the adapter {path!r} has rank {rank}, above --max-lora-rank {max_rank}")
    alpha = cfg.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoRAError(f"{CONFIG_FILE} of {path!r} has no valid lora_alpha ({alpha!r})")
    return rank, alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)


def _tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        other = " (adapter_model.bin is a pickle: save with safe_serialization=True)" \
            if (folder / "adapter_model.bin").is_file() else ""
        raise LoRAError(f"no {WEIGHTS_FILE} in {str(folder)!r}{other}", 404)
    from safetensors import safe_open
    try:
        with safe_open(str(weights), framework="numpy") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:      # safetensors raises its own error types for a damaged header
        raise LoRAError(f"{WEIGHTS_FILE} of {str(folder)!r} cannot be read: {e}") from None


def _check_tensors(shapes: dict[str, tuple[int, ...]], targets: LoRATargets, num_layers: int,
                   rank: int) -> tuple[str, ...]:
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        m = _TENSOR.fullmatch(name)
        if m is None or m.group(3) not in targets:
            what = m.group(3) if m else name.removeprefix("base_model.model.")
            raise LoRAError(f"the adapter adapts {what!r} (tensor {name}), which pagedserve cannot adapt; "
                            f"supported target modules: {', '.join(targets)}")
        module, layer, kind, ab = m.groups()
        if int(layer) >= num_layers:
            raise LoRAError(f"tensor {name} is for layer {layer}, but this model has {num_layers} layers: the "
                            f"adapter was trained for a different base model")
        fan_in, fan_out = targets[kind]
        want = (rank, fan_in) if ab == "A" else (fan_out, rank)
        if shape != want:
            raise LoRAError(f"tensor {name} has shape {shape}, but this model's {kind} needs {want} at rank "
                            f"{rank}: the adapter was trained for a different base model")
        pairs.setdefault(module, {})[ab] = shape
    half = sorted(m for m, ab in pairs.items() if len(ab) != 2)
    if half:
        raise LoRAError(f"the adapter has lora_A without lora_B (or the reverse) for {', '.join(half)}")
    if not pairs:
        raise LoRAError("the adapter has no LoRA tensors")
    return tuple(sorted(pairs))
