"""The committed planner-vs-vLLM comparison (docs/kv-planner-vs-vllm.json) stays true to the planner.

vLLM's figures in the JSON come from vLLM itself (benchmarks/kv_planner_vs_vllm.py, in the vllm-cpu
image); these tests recompute the planner's side now, so a planner change that moves its figures
away from vLLM's, or a config added to tests/data without a re-run, fails here instead of leaving
a stale table in docs/.
"""

import json

import pytest

from llmstack.kv.vllm_compare import (
    CONFIG_DIR,
    DEFAULT_JSON,
    DEFAULT_MARKDOWN,
    planner_figures,
    render_markdown,
)

RESULT = json.loads(DEFAULT_JSON.read_text())
LEVEL1 = RESULT["level1"]
SETTINGS = LEVEL1["settings"]


def test_every_config_is_compared_at_every_length():
    compared = {(row["config"], row["max_model_len"]) for row in LEVEL1["rows"]}
    lengths = {row["max_model_len"] for row in LEVEL1["rows"]}
    expected = {(path.name, length) for path in CONFIG_DIR.glob("*.json") for length in lengths}
    assert len(lengths) >= 2
    assert compared == expected


@pytest.mark.parametrize("row", LEVEL1["rows"], ids=lambda row: f"{row['config']}@{row['max_model_len']}")
def test_planner_still_gives_the_committed_figures(row):
    now = planner_figures(
        CONFIG_DIR / row["config"],
        SETTINGS["kv_space_gib"],
        row["max_model_len"],
        SETTINGS["block_size"],
        SETTINGS["max_num_batched_tokens"],
    )
    committed = row["planner"]
    assert (now["tokens"], now["num_blocks"], now["block_size"]) == (
        committed["tokens"],
        committed["num_blocks"],
        committed["block_size"],
    )


@pytest.mark.parametrize("row", LEVEL1["rows"], ids=lambda row: f"{row['config']}@{row['max_model_len']}")
def test_planner_matches_vllm_under_its_assumptions(row):
    """Prefix caching off (Mamba cache mode 'none'), one batch in flight: the planner's model."""
    assert row["planner"]["tokens"] == row["vllm"]["tokens"]
    assert row["planner"]["num_blocks"] == row["vllm"]["num_blocks"]


@pytest.mark.parametrize("row", RESULT["real_starts"], ids=lambda row: row["config"])
def test_real_start_comparison_is_current(row):
    now = planner_figures(
        CONFIG_DIR / row["config"],
        row["kv_space_gib"],
        row["max_model_len"],
        row["block_size"],
        row["max_num_batched_tokens"],
        row["dtype"],
    )
    assert now["tokens"] == row["planner"]["tokens"]
    assert f"KV cache size: {row['vllm']['tokens']:,} tokens" in row["log_line"]


def test_markdown_is_generated_from_the_json():
    assert DEFAULT_MARKDOWN.read_text() == render_markdown(RESULT)
