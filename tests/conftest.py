"""Shared fixtures: the default model's tokenizer and tiny random-weight models built at test time, and the
rule that every test carries exactly one tier marker."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from common.model_source import ModelSource
from loadtest.tiny_model import build_tiny_model

TINY_ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2",
              "gemma3")   # llama3: Llama with Llama 3 rope scaling
TIERS = ("unit", "slow", "e2e", "gpu")


@pytest.hookimpl(tryfirst=True)     # before -m deselects anything: an unmarked test must not just vanish
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test belongs to exactly one tier, so `-m unit` (or slow, e2e, gpu) selects a whole, known set."""
    wrong = [f"{item.nodeid}: {tiers or 'no tier'}" for item in items
             if len(tiers := [t for t in TIERS if item.get_closest_marker(t)]) != 1]
    if wrong:
        raise pytest.UsageError("tests need exactly one of the markers " + ", ".join(TIERS) + ":\n" + "\n".join(wrong))


@pytest.fixture
def force_isa(monkeypatch):
    """force_isa("avx2"): cap the native kernels' instruction set for this test (PAGEDSERVE_CPU_ISA)."""
    from gpu_worker.kernels import native

    def force(isa: str) -> None:
        monkeypatch.setenv("PAGEDSERVE_CPU_ISA", isa)
        native.reread_isa_cap()
    yield force
    monkeypatch.undo()
    native.reread_isa_cap()


@pytest.fixture(scope="session")
def default_tokenizer():
    """The default model's tokenizer; PAGEDSERVE_TEST_TOKENIZER names a saved copy where the model's package
    is absent (the GPU machine: scripts/gpu_check.sh carries one)."""
    saved = os.environ.get("PAGEDSERVE_TEST_TOKENIZER")
    if saved:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(saved)
    return ModelSource.resolve(None).load_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, default_tokenizer):
    """tiny_model(arch) -> folder path; each architecture is built once per session."""
    cache: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in cache:
            cache[arch] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, default_tokenizer)
        return cache[arch]
    return get
