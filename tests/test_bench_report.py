"""The benchmark's arithmetic and its llama.cpp row's set-up: ratios against HF one-at-a-time and against
llama-server's best row, and the build options taken from the CPU's flags (never AMX, never -march=native)."""
from __future__ import annotations

import pytest

from loadtest import llama_cpp
from loadtest.report import RequestTiming, SystemResult, format_table, with_ratios

pytestmark = pytest.mark.unit


def row(name: str, tokens: int, wall: float, pagedserve: bool = False) -> SystemResult:
    timing = RequestTiming(f"{name}-0", 0.0, [0.1 * (i + 1) for i in range(tokens)], tokens)
    return SystemResult(name, wall_s=wall, timings=[timing], is_pagedserve=pagedserve)


def test_ratios_are_against_hf1_and_llama_servers_best_row():
    rows = [row("hf-1", 100, 10.0), row("llamacpp-c1", 100, 4.0), row("llamacpp-c16", 100, 2.0),
            row("http-c64", 100, 0.5, pagedserve=True), SystemResult.failed("llamacpp-c64", "not built")]
    sums = {s["system"]: s for s in with_ratios(rows)}
    assert sums["http-c64"]["vs_hf1"] == pytest.approx(20.0)
    assert sums["http-c64"]["vs_llamacpp"] == pytest.approx(4.0)       # 200 tok/s over the best, 50 (c16)
    assert sums["llamacpp-c1"]["vs_llamacpp"] == pytest.approx(0.5)
    assert sums["llamacpp-c1"]["of_issue_ceiling"] is None               # only pagedserve rows get it
    table = format_table(list(sums.values()))
    assert "vs l.cpp" in table and "llamacpp-c64" in table and "n/a (not built)" in table


def test_without_a_llama_row_the_ratio_is_empty():
    sums = with_ratios([row("hf-1", 10, 1.0), row("offline", 40, 1.0, pagedserve=True)])
    assert sums[1]["vs_llamacpp"] is None and sums[1]["vs_hf1"] == pytest.approx(4.0)


@pytest.mark.parametrize("flags, on, off", [
    ({"avx", "avx2", "fma", "f16c"}, {"GGML_AVX2", "GGML_FMA"}, {"GGML_AVX512", "GGML_AVX512_VNNI"}),
    ({"avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8"},
     {"GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16"}, {"GGML_AVX512_VBMI"}),
])
def test_llama_cpp_builds_for_the_flags_the_cpu_reports(flags, on, off):
    opts = dict(o[2:].split("=") for o in llama_cpp.cmake_options(flags))
    assert opts["GGML_NATIVE"] == "OFF"
    assert all(opts[f"GGML_AMX_{k}"] == "OFF" for k in ("TILE", "INT8", "BF16"))   # even where the CPU has AMX
    assert all(opts[o] == "ON" for o in on) and all(opts[o] == "OFF" for o in off)
    assert llama_cpp.isa_tag(flags) == ("avx512" if "avx512f" in flags else "avx2")


def test_the_cache_is_per_cpu_kind_and_an_unbuilt_server_is_none(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(llama_cpp, "cpu_flags", lambda: {"avx2"})
    assert llama_cpp.cache_dir() == tmp_path / "llama-server" / f"{llama_cpp.VERSION}-avx2"
    assert llama_cpp.binary() is None
    with pytest.raises(RuntimeError, match="python -m loadtest.llama_cpp build"):
        llama_cpp.LlamaServer(tmp_path / "m.gguf", 1, 64, 2)
