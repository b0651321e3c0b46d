"""The routing benchmark's pure parts: its prompts, per-replica counters and verdicts."""

from __future__ import annotations

import itertools

import pytest

from llmstack.bench import routing, routing_workload
from llmstack.cli import UsageError


class WordTokenizer:
    """One token per word: enough to check sizes and shared prefixes."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return text.split()

    def decode(self, ids: list[str]) -> str:
        return " ".join(ids)


def spec(workload: str, **changes) -> dict:
    base = {
        "workload": workload,
        "salt": "t1",
        "seed": 5,
        "requests": 40,
        "system_tokens": 50,
        "question_tokens": 8,
        "output_tokens": 4,
        "replica_kv_tokens": 400,
        "working_set": 1.5,
        "turns": 4,
        "multi_turn_share": 0.4,
    }
    return base | changes


def test_prefix_heavy_prompts_share_system_prompts_sized_to_the_working_set():
    rows, facts = routing_workload.build(spec("prefix-heavy"), WordTokenizer())
    assert len(rows) == 40
    assert facts["distinct_prefixes"] == 12  # 1.5 x 400 tokens / 50 tokens each
    heads = {" ".join(r["prompt"].split()[:50]) for r in rows}
    assert len(heads) <= 12
    assert all(r["output_tokens"] == 4 for r in rows)


def test_a_chat_turn_resends_the_whole_previous_turn():
    rows, facts = routing_workload.build(spec("prefix-heavy"), WordTokenizer())
    turns = [r["prompt"] for r in rows if "chat 0 turn" in r["prompt"]]
    assert len(turns) == facts["turns"]
    for earlier, later in itertools.pairwise(turns):
        assert later.startswith(earlier.removesuffix("\nAssistant:"))


def test_prefix_light_prompts_share_nothing_but_the_run_salt():
    rows, _ = routing_workload.build(spec("prefix-light"), WordTokenizer())
    assert len({" ".join(r["prompt"].split()[:6]) for r in rows}) == 40


def test_runs_with_other_salts_share_no_prefix():
    first, _ = routing_workload.build(spec("prefix-heavy"), WordTokenizer())
    second, _ = routing_workload.build(spec("prefix-heavy", salt="t2"), WordTokenizer())
    assert not {r["prompt"][:20] for r in first} & {r["prompt"][:20] for r in second}


def counters(hits: float, queries: float, done: float) -> str:
    return (
        f'vllm:prefix_cache_hits_total{{engine="0"}} {hits}\n'
        f'vllm:prefix_cache_queries_total{{engine="0"}} {queries}\n'
        f'vllm:request_success_total{{finished_reason="length"}} {done}'
    )


def test_per_replica_figures_come_from_each_replicas_counter_deltas():
    result = {
        "before": {"a": counters(0, 0, 10), "b": counters(100, 200, 5)},
        "after": {"a": counters(300, 400, 30), "b": "# unreachable: refused"},
    }
    rows = routing.per_replica(result)
    assert rows[0] == {"replica": "a", "requests": 20, "hit_rate": 0.75}
    assert rows[1]["requests"] is None


def test_cache_aware_meets_its_target_only_beyond_the_spread():
    def entry(workload: str, policy: str, values: list[float]) -> dict:
        cell = routing.spread(values).as_dict() | {"values": values}
        return {"workload": workload, "level": 8, "policy": policy, "ttft_p50_ms": cell}

    table = [
        entry("prefix-heavy", "round_robin", [100, 104, 98]),
        entry("prefix-heavy", "cache_aware", [50, 52, 55]),
        entry("prefix-light", "round_robin", [20, 21, 19]),
        entry("prefix-light", "cache_aware", [20.5, 21.5, 19.5]),
    ]
    verdicts = {t["target"].split(":")[0]: t for t in routing.targets(table)}
    assert verdicts["prefix-heavy c=8"]["met"] and verdicts["prefix-heavy c=8"]["value"] == pytest.approx(-0.48, 0.01)
    assert verdicts["prefix-light c=8"]["met"]


def test_bad_options_are_usage_errors():
    with pytest.raises(UsageError):
        routing.parse_args(["--policies", "fastest"])
    with pytest.raises(UsageError):
        routing.parse_args(["--levels", "0"])
