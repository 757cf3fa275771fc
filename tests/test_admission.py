"""validate_request: every admission rule alone, as a pure function of the request, the configuration and
the queue's size."""
from __future__ import annotations

import pytest

from common.protocol import EngineRequest
from common.sampling_params import SamplingParams
from scheduler.admission import RequestRejected, validate_request
from scheduler.config import SchedulerConfig

pytestmark = pytest.mark.unit

CFG = SchedulerConfig(max_model_len=64, vocab_size=100, block_size=4, num_blocks=8, max_num_seqs=4,
                      max_waiting_requests=2, max_waiting_tokens=20)


def rejected(prompt: list[int], waiting: tuple[int, int] = (0, 0), **sp) -> RequestRejected:
    with pytest.raises(RequestRejected) as exc:
        validate_request(EngineRequest("r", prompt, SamplingParams(**sp)), CFG, *waiting)
    return exc.value


def test_effective_max_tokens() -> None:
    assert validate_request(EngineRequest("r", [1] * 10, SamplingParams(max_tokens=5)), CFG) == 5
    # no max_tokens: the rest of the context, but the cache (8 blocks of 4 = 32 tokens) is smaller
    assert rejected([1] * 10, max_tokens=None).param == "max_tokens"
    small = SchedulerConfig(max_model_len=16, block_size=4, num_blocks=8)
    assert validate_request(EngineRequest("r", [1] * 10, SamplingParams(max_tokens=None)), small) == 6


@pytest.mark.parametrize("prompt,sp,code,param", [
    ([], {}, 400, "prompt"),
    ([1, 100], {}, 400, "prompt"),
    ([1], {"stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ([1], {"logit_bias": {150: 1.0}}, 400, "logit_bias"),
    ([1], {"n": 5}, 400, "n"),
    ([1] * 64, {}, 400, "prompt"),
    ([1] * 60, {"max_tokens": 5}, 400, "max_tokens"),
    ([1] * 20, {"max_tokens": 20}, 400, "max_tokens"),        # 40 tokens > 32 the cache holds
])
def test_each_rule_refuses_with_its_parameter(prompt, sp, code, param) -> None:
    e = rejected(prompt, **{"max_tokens": 4, **sp})
    assert (e.code, e.param) == (code, param)


def test_a_full_queue_is_429() -> None:
    assert rejected([1] * 4, waiting=(2, 4), max_tokens=4).code == 429          # requests
    assert rejected([1] * 4, waiting=(1, 17), max_tokens=4).code == 429         # tokens: 17 + 4 > 20
    assert validate_request(EngineRequest("r", [1] * 4, SamplingParams(max_tokens=4)), CFG, 1, 16) == 4
