"""Parsing vLLM's startup log lines (llmstack.vllm) and Prometheus text (llmstack.promtext)."""

from __future__ import annotations

import pytest

from llmstack import promtext
from llmstack.vllm import cache_config_labels, label_number, parse_startup_log

# Lines as vLLM 0.32.0 (CPU build) and the GPU build print them (the GPU lines are the lab's).
CPU_LOG = """\
(APIServer pid=1) INFO 12-03 07:56:08 [api_utils.py:347]  ▄▄ ▄█ █     █     █ ▀▄▀ █  version 0.32.0
(Worker pid=131) INFO 12-03 08:02:18 [base_loader.py:82] Initializing model took 0.566123 seconds
(Worker pid=131) INFO 12-03 08:02:20 [cpu_worker.py:260] Explicitly set (1.0/23.54) GiB for KV cache on node 0.
(EngineCore pid=100) INFO 12-03 08:02:20 [kv_cache_utils.py:2327] CPU KV cache size: 2,097,152 tokens, \
Maximum concurrency for 4,096 tokens per request: 512.00x
"""
GPU_LOG = """\
(Worker pid=9) INFO [gpu_model_runner.py:5150] Model loading took 1.72 GiB memory and 0.720000 seconds
(Worker pid=9) INFO [gpu_worker.py:760] Available KV cache memory: 3.06 GiB
(Worker pid=9) INFO [gpu_worker.py:972] CUDA graph pool memory: 0.42 GiB (actual), 0.45 GiB (estimated)
(EngineCore pid=5) INFO [kv_cache_utils.py:2327] GPU KV cache size: 183,202 tokens, \
Maximum concurrency for 4,096 tokens per request: 44.73x
"""


def test_cpu_startup_log():
    facts = parse_startup_log(CPU_LOG)
    assert facts["vllm_version"] == "0.32.0"
    assert facts["kv_cache_device"] == "CPU"
    assert facts["kv_cache_tokens"] == 2_097_152
    assert facts["max_concurrency"] == 512.0 and facts["max_concurrency_tokens"] == 4096
    assert facts["cpu_kv_gib"] == 1.0 and facts["cpu_total_gib"] == 23.54
    assert facts["model_init_seconds"] == 0.566123
    assert "model_loading_gib" not in facts


def test_gpu_startup_log():
    facts = parse_startup_log(GPU_LOG)
    assert facts["kv_cache_device"] == "GPU"
    assert facts["model_loading_gib"] == 1.72 and facts["model_loading_seconds"] == 0.72
    assert facts["available_kv_gib"] == 3.06
    assert facts["cuda_graph_gib"] == 0.42
    assert facts["kv_cache_tokens"] == 183_202 and facts["max_concurrency"] == 44.73


def test_last_start_wins():
    facts = parse_startup_log(GPU_LOG + GPU_LOG.replace("183,202", "90,000"))
    assert facts["kv_cache_tokens"] == 90_000


def test_prometheus_text_and_info_labels():
    text = """\
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny-qwen3"} 7.0
vllm:num_requests_waiting{engine="0",model_name="tiny-qwen3"} 3.0
vllm:cache_config_info{block_size="128",cache_dtype="auto",kv_cache_memory_bytes="1073741824",\
num_gpu_blocks="16384",num_gpu_blocks_override="None",engine="0"} 1.0
"""
    samples = promtext.parse(text)
    assert promtext.total(samples, "vllm:num_preemptions_total") == 7.0
    assert promtext.total(samples, "vllm:absent") is None
    labels = cache_config_labels(samples)
    assert label_number(labels, "num_gpu_blocks") == 16384
    assert label_number(labels, "num_gpu_blocks_override") is None
    assert labels["cache_dtype"] == "auto"


# vLLM 0.24.0 on an H200 (docs/gpu-results.md): FlashAttention's "version 3" is not vLLM's version.
H200_LOG = """\
(APIServer pid=696) INFO 12-03 11:02:13 [api_utils.py:339]  ▄▄ ▄█ █     █     █ ▀▄▀ █  version 0.24.0
(EngineCore pid=826) INFO 12-03 11:03:11 [flash_attn.py:670] Using FlashAttention version 3
(EngineCore pid=826) INFO 12-03 11:03:12 [model_runner.py:302] Model loading took 1.12 GiB and 2.399512 seconds
(EngineCore pid=826) INFO 12-03 11:03:46 [gpu_worker.py:508] Available KV cache memory: 116.56 GiB
(EngineCore pid=826) INFO 12-03 11:03:46 [kv_cache_utils.py:2146] GPU KV cache size: 1,091,296 tokens
(EngineCore pid=826) INFO [kv_cache_utils.py:2147] Maximum concurrency for 4,096 tokens per request: 266.43x
(EngineCore pid=826) INFO 12-03 11:03:52 [model_runner.py:726] Graph capturing finished in 6 secs, took 0.50 GiB
"""


def test_h200_startup_log():
    facts = parse_startup_log(H200_LOG)
    assert facts["vllm_version"] == "0.24.0"
    assert facts["kv_cache_device"] == "GPU"
    assert facts["model_loading_gib"] == 1.12 and facts["available_kv_gib"] == 116.56
    assert facts["kv_cache_tokens"] == 1_091_296 and facts["max_concurrency"] == 266.43
    assert facts["graph_capture_gib"] == 0.50


HISTOGRAM = """\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.005",model_name="m"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.012
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.001",model_name="m"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.005",model_name="m"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="m"} 2.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="m"} 2.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="m"} 0.001
"""


def test_snapshot_sums_engines_and_keeps_buckets_apart():
    name = "vllm:time_to_first_token_seconds"
    before = promtext.Snapshot.from_text(HISTOGRAM.replace(" 4.0", " 0.0").replace(" 0.012", " 0.0"))
    after = promtext.Snapshot.from_text(HISTOGRAM)
    assert after.get(name + "_count") == 6.0
    assert after.get(promtext.bucket_key(name, "0.001")) == 3.0
    assert after.get(promtext.bucket_key(name, "+Inf")) == 6.0
    assert promtext.bucket_bounds(promtext.parse(HISTOGRAM), name) == [0.001, 0.005]
    # Δcount 4 (engine 0's count went 0 -> 4) and Δsum 0.012: a mean of 3 ms.
    assert before.histogram_mean(after, name) == pytest.approx(0.003)


def test_text_that_is_not_prometheus_format_is_refused():
    with pytest.raises(promtext.MetricsFormatError):
        promtext.parse('vllm:x{le="0.1" 1.0\n')


def test_one_family_is_parsed_alone_with_the_same_values():
    name = "vllm:time_to_first_token_seconds"
    page = HISTOGRAM + 'vllm:num_requests_running{engine="0"} 2.0\n'
    assert promtext.parse_family(page, "vllm:num_requests_running") == promtext.select(
        promtext.parse(page), "vllm:num_requests_running"
    )
    assert promtext.total(promtext.parse_family(page, name), name + "_count") is None
    assert promtext.parse_family(page, "vllm:absent") == []
