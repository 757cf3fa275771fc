"""vLLM's metric names on a real server: each appears on /metrics with its model_name label and moves as a
workload runs (a burst that queues, fills the KV cache and preempts, plus a repeated prompt that hits the
prefix cache), and every series vLLM's Grafana dashboard queries is there."""
from __future__ import annotations

import threading

import pytest

from tests.server_utils import run_server, wait_until
from tests.test_server_e2e import metric, request, scrape

pytestmark = pytest.mark.e2e
MODEL = "tiny"

GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:gpu_cache_usage_perc"]
COUNTERS = ["vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
            "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:request_success_total"]
HISTOGRAMS = ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
              "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
              "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens",
              "vllm:request_params_n", "vllm:request_params_max_tokens", "vllm:iteration_tokens_total"]
# Every series the PromQL of vLLM's Grafana dashboard asks for (examples/online_serving/prometheus_grafana/
# grafana.json at vllm-project/vllm 004f771f), each selected by {model_name="$model_name"}
DASHBOARD = ["vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
             "vllm:e2e_request_latency_seconds_count", "vllm:time_per_output_token_seconds_bucket",
             "vllm:time_per_output_token_seconds_sum", "vllm:time_per_output_token_seconds_count",
             "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
             "vllm:time_to_first_token_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
             "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
             "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
             "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
             "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
             "vllm:request_max_num_generation_tokens_sum"]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    # 24 blocks of 16 hold 384 tokens: two sequences of 250 cannot both fit, so the burst preempts
    with run_server(str(tiny_model("llama")), "--served-model-name", MODEL, "--num-gpu-blocks-override", "24",
                    "--max-model-len", "256", "--max-num-seqs", "2", "--swap-space", "0", "--num-threads", "1",
                    log_dir=tmp_path_factory.mktemp("vllm-metrics-logs")) as s:
        yield s


def complete(server, prompt: str, max_tokens: int) -> None:
    status, _, body = request(server, "POST", "/v1/completions", {"model": MODEL, "prompt": prompt,
                                                                 "max_tokens": max_tokens, "ignore_eos": True},
                              timeout=120)
    assert status == 200, body


def labelled(samples: dict[str, float], name: str) -> bool:
    return any(k.startswith(name + "{") and f'model_name="{MODEL}"' in k for k in samples)


def test_vllm_metric_names_appear_and_move(server):
    before = scrape(server)
    shared = "The history of the paged attention kernel begins with a simple observation about memory " * 2
    complete(server, shared, 4)
    complete(server, shared, 4)                          # the second hits the first's cached blocks
    burst = [threading.Thread(target=complete, args=(server, f"Request {i} asks for a long answer.", 230))
             for i in range(4)]
    for t in burst:
        t.start()
    def busy_now():
        m = scrape(server)
        return m if (metric(m, "vllm:num_requests_running") >= 1 and metric(m, "vllm:num_requests_waiting") >= 1
                     and metric(m, "vllm:kv_cache_usage_perc") > 0) else None

    def all_counted():
        m = scrape(server)
        return m if (metric(m, "vllm:num_requests_running") == 0 and metric(m, "vllm:request_success_total")
                     >= metric(before, "vllm:request_success_total") + 6) else None
    busy = wait_until(busy_now, 60, "the burst shows running, waiting and KV usage")
    for t in burst:
        t.join(timeout=120)
    after = wait_until(all_counted, 30, "the burst has finished and been counted")
    assert metric(busy, "vllm:gpu_cache_usage_perc") == metric(busy, "vllm:kv_cache_usage_perc") > 0
    for name in GAUGES:
        assert labelled(busy, name), name
    for name in COUNTERS:
        assert labelled(after, name) and metric(after, name) > metric(before, name), name
    for name in HISTOGRAMS:
        assert labelled(after, name + "_bucket"), name
        assert metric(after, name + "_count") > metric(before, name + "_count"), name
    n_success = after[f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}}']
    assert n_success >= 6
    # the pagedserve: family carries the same values
    assert metric(after, "pagedserve:generation_tokens_total") == metric(after, "vllm:generation_tokens_total")
    for series in DASHBOARD:
        assert labelled(after, series), series
