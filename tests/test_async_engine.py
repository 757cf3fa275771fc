"""AsyncLLMEngine: the seed's example on the default model, 64 concurrent streams against LLM.generate,
cancellation freeing everything, a killed worker failing every open stream, and shutdown leaving no process.

Each test starts its own engine processes (scheduler and worker) and stops them, whatever happens."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest

from loadtest.workload import load_workload
from pagedserve import LLM, AsyncLLMEngine, EngineDeadError, RequestOutputKind, SamplingParams
from tests.server_utils import async_wait_until

pytestmark = pytest.mark.e2e
SMALL = {"kv_cache_memory": 0.2, "swap_space": 0}


@contextlib.asynccontextmanager
async def engine_for(*args, **kwargs):
    engine = AsyncLLMEngine(*args, **kwargs)
    try:
        await engine._ready()
        yield engine
    finally:
        await engine.shutdown()
        assert all(p.poll() is not None for p in engine._procs.procs), "a process outlived shutdown()"


async def latest_stats(engine: AsyncLLMEngine, ok) -> dict:
    """The scheduler's counters once a heartbeat shows `ok(values)` (they arrive every HEARTBEAT_S)."""
    return await async_wait_until(lambda: engine._client.stats.values if ok(engine._client.stats.values) else None,
                                  10, "the scheduler's heartbeat to show it")


@pytest.mark.timeout(300)
def test_seed_example_three_prompts_stream_to_their_end() -> None:
    """As the seed writes it: three prompts through asyncio.gather, each streamed; cumulative outputs grow
    by prefix, the last is finished, and DELTA outputs add up to the same text."""
    prompts = ["Hello, my name is", "The capital of France is", "Write a short poem about the sea."]

    async def main():
        # fp32: the three runs compare texts, and with bf16 matmuls (`--dtype auto` on a bf16 CPU) a token
        # depends on which rows shared its steps, which the arrival of the three requests decides
        async with engine_for(**SMALL, dtype="float32") as engine:
            async def stream(i: int, prompt: str, kind: RequestOutputKind):
                outs = []
                async for output in engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                                           output_kind=kind), f"{kind.value}-{i}"):
                    outs.append(output)
                return outs
            cumulative = await asyncio.gather(*(stream(i, p, RequestOutputKind.CUMULATIVE) for i, p in enumerate(prompts)))
            deltas = await asyncio.gather(*(stream(i, p, RequestOutputKind.DELTA) for i, p in enumerate(prompts)))
            final = await stream(0, prompts[0], RequestOutputKind.FINAL_ONLY)
            return cumulative, deltas, final
    cumulative, deltas, final = asyncio.run(main())
    for outs, douts in zip(cumulative, deltas):
        texts = [o.outputs[0].text for o in outs]
        assert len(outs) > 1 and all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert len(outs[-1].outputs[0].token_ids) == 24 and outs[-1].outputs[0].finish_reason == "length"
        assert "".join(o.outputs[0].text for o in douts) == texts[-1]
        assert sum((o.outputs[0].token_ids for o in douts), []) == outs[-1].outputs[0].token_ids
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].text == cumulative[0][-1].outputs[0].text


@pytest.mark.timeout(300)
def test_readme_example_runs_as_written(capsys) -> None:
    """The README's asyncio example, executed verbatim: three streams through asyncio.gather."""
    import ast
    import re
    from pathlib import Path
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(import asyncio\nfrom pagedserve import AsyncLLMEngine.*?)```", readme, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    texts = ast.literal_eval(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(texts) == 3 and all(isinstance(t, str) for t in texts) and any(texts), texts


@pytest.mark.timeout(600)
def test_64_concurrent_streams_match_llm_generate_and_are_batched() -> None:
    """64 requests of the shared workload (outputs capped at 16 tokens, greedy) streamed at once give the
    token ids LLM.generate gives; the scheduler ran them batched, many sequences per step. In fp32: with
    bf16 matmuls (`--dtype auto` on a bf16 CPU) a token depends on which steps its rows shared."""
    exact = {**SMALL, "dtype": "float32"}
    reqs = load_workload(limit=64, max_tokens_cap=16)
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    offline = LLM(None, **exact).generate([r.prompt_token_ids for r in reqs], params, use_tqdm=False)
    want = [o.outputs[0].token_ids for o in offline]

    async def main():
        async with engine_for(**exact) as engine:
            async def stream(i: int) -> list[int]:
                last = None
                async for last in engine.generate(reqs[i].prompt_token_ids, params[i], f"w{i}"):
                    pass
                return last.outputs[0].token_ids
            got = await asyncio.gather(*(stream(i) for i in range(len(reqs))))
            total = sum(len(t) for t in got)
            stats = await latest_stats(engine, lambda v: v["generation_tokens"] >= total)
            return got, stats
    got, stats = asyncio.run(main())
    assert got == want
    assert stats["num_step_seqs"] / stats["num_steps"] > 16, stats   # one at a time would be 1


@pytest.mark.timeout(300)
def test_cancelled_streams_free_every_block(tiny_model) -> None:
    """Of 32 streams, 8 break out of their loop, 8 are cancelled as tasks and 4 are aborted with
    engine.abort(request_id) (their streams end with finish_reason "abort"), after a few outputs; once the
    other 12 finish, the scheduler holds no request and the KV cache is empty."""
    folder = str(tiny_model("llama"))

    async def main():
        async with engine_for(folder, dtype="float32", **SMALL) as engine:
            started = [asyncio.Event() for _ in range(32)]

            async def stream(i: int) -> int | str:
                n, out = 0, None
                sp = SamplingParams(temperature=0, max_tokens=400 if i < 20 else 40, ignore_eos=True)
                async for out in engine.generate(f"stream {i} says", sp, f"c{i}"):
                    n += 1
                    if n == 3:
                        started[i].set()
                        if i < 8:
                            break
                return out.outputs[0].finish_reason if 16 <= i < 20 else n
            tasks = [asyncio.create_task(stream(i)) for i in range(32)]
            await asyncio.gather(*(e.wait() for e in started))
            for t in tasks[8:16]:
                t.cancel()
            for i in range(16, 20):
                await engine.abort(f"c{i}")
            results = await asyncio.gather(*tasks, return_exceptions=True)
            stats = await latest_stats(engine, lambda v: v["num_requests"] == 0)
            return results, stats
    results, stats = asyncio.run(main())
    assert results[:8] == [3] * 8
    assert all(isinstance(r, asyncio.CancelledError) for r in results[8:16])
    assert results[16:20] == ["abort"] * 4
    assert results[20:] == [40] * 12
    assert stats["running"] + stats["waiting"] + stats["swapped"] == 0, stats
    assert stats["kv_cache_usage"] == 0 and stats["num_free_blocks"] == stats["num_blocks"], stats
    assert stats["generation_tokens"] < 20 * 400 / 2, stats   # the cut ones stopped early


@pytest.mark.timeout(300)
def test_killed_worker_fails_every_open_stream_within_5_s(tiny_model) -> None:
    folder = str(tiny_model("llama"))

    async def main():
        async with engine_for(folder, dtype="float32", **SMALL) as engine:
            started = [asyncio.Event() for _ in range(6)]

            async def stream(i: int):
                sp = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
                async for _ in engine.generate(f"never ending {i}", sp, f"k{i}"):
                    started[i].set()
            tasks = [asyncio.create_task(stream(i)) for i in range(6)]
            await asyncio.gather(*(e.wait() for e in started))
            os.kill(engine._procs.procs[1].pid, signal.SIGKILL)      # procs: scheduler, then the worker
            async with asyncio.timeout(5):
                results = await asyncio.gather(*tasks, return_exceptions=True)
            with pytest.raises(EngineDeadError):
                await engine.check_health()
            with pytest.raises(EngineDeadError):
                async for _ in engine.generate("after", SamplingParams(max_tokens=2)):
                    pass
            return results
    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
