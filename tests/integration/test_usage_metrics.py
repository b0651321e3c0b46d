"""Usage accounting on the real CPU stack: tokens per API key, counted by the gateway from the usage
of vLLM's answers (streamed or not, whether or not the client asked for usage), add up exactly.

Two keys send a mix of chat and completion requests, streamed with and without
stream_options.include_usage and not streamed. Then, over that run:
- the gateway's access log names each request's usage as the client received it (or, for a stream
  without usage, as the same request without streaming reports it);
- per key owner, the increase of gateway_prompt_tokens_total and gateway_completion_tokens_total in
  Prometheus is the sum of that usage;
- over both keys, it is exactly the increase of vLLM's own vllm:prompt_tokens_total and
  vllm:generation_tokens_total (read from vLLM itself).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import pytest
import requests

from llmstack import sse
from llmstack.observability import config, panel_queries

OWNERS = ("alice", "bob")
# (endpoint, streamed, stream_options sent by the client or None, max_tokens); every request has
# ignore_eos, so it decodes exactly max_tokens, and the max_tokens differ so that each request
# shows in the sums. The first of each endpoint is not streamed: it gives the prompt's token count.
VARIANTS = (
    (sse.CHAT_COMPLETIONS, False, None, 5),
    (sse.CHAT_COMPLETIONS, True, None, 7),
    (sse.CHAT_COMPLETIONS, True, {"include_usage": True}, 9),
    (sse.CHAT_COMPLETIONS, True, {"include_usage": False}, 11),
    (sse.COMPLETIONS, False, None, 6),
    (sse.COMPLETIONS, True, None, 8),
    (sse.COMPLETIONS, True, {"include_usage": True}, 10),
)
SCRAPE = config.SCRAPE_INTERVAL_SECONDS


@dataclass
class Sent:
    owner: str
    endpoint: str
    streamed: bool
    stream_options: dict | None
    max_tokens: int
    request_id: str
    prompt_tokens: int | None = None
    """From the answer's usage; None where the client got none (a stream that did not ask)."""
    completion_tokens: int | None = None

    @property
    def asked_for_usage(self) -> bool:
        return not self.streamed or bool((self.stream_options or {}).get("include_usage"))


def prometheus_client(stack) -> panel_queries.Prometheus:
    return panel_queries.Prometheus(stack.url("/prometheus"), "admin", stack.passwords["prometheus"])


def by_owner(prometheus: panel_queries.Prometheus, metric: str) -> dict[str, float]:
    result = prometheus.get("/api/v1/query", {"query": f"sum by (key_owner) ({metric})"})["result"]
    return {series["metric"].get("key_owner", ""): float(series["value"][1]) for series in result}


def last_gateway_scrape(prometheus: panel_queries.Prometheus) -> float:
    result = prometheus.get("/api/v1/query", {"query": 'timestamp(up{job="gateway"})'})["result"]
    return float(result[0]["value"][1]) if result else 0.0


def wait_for_scrapes_after(prometheus: panel_queries.Prometheus, moment: float, timeout: float = 60) -> None:
    """Until Prometheus has scraped the exporter twice after `moment`: a label set new since the
    last scrape is exported at 0 once, and its counts join at the next one."""
    deadline = time.monotonic() + timeout
    while last_gateway_scrape(prometheus) < moment + SCRAPE:
        assert time.monotonic() < deadline, f"no scrape of the gateway exporter {SCRAPE} s after the run"
        time.sleep(1)


def vllm_tokens(stack) -> dict[str, float]:
    """vLLM's own counters, read from vLLM; polled until still, as vLLM records a request's
    tokens a moment after its last byte."""
    previous = None
    for _ in range(20):
        current = {
            "prompt": stack.vllm_metric("vllm:prompt_tokens_total"),
            "completion": stack.vllm_metric("vllm:generation_tokens_total"),
        }
        if current == previous:
            return current
        previous = current
        time.sleep(1)
    raise AssertionError(f"vLLM's token counters kept moving: {previous}")


def send(stack, model: str, owner: str, variant: tuple) -> Sent:
    endpoint, streamed, stream_options, max_tokens = variant
    # One prompt per key and endpoint: the streams share the non-streamed request's prompt (vLLM
    # counts a prompt's every token, from its prefix cache or not). The keys' prompts and lengths
    # differ, so tokens counted under the wrong key would show.
    rank = OWNERS.index(owner)
    max_tokens += 3 * rank
    prompt = f"Usage accounting check for {owner} on {endpoint}: count every token of this prompt." * (rank + 1)
    body = sse.build_body(endpoint, model, prompt, [{"role": "user", "content": prompt}], max_tokens, streamed)
    body.pop("stream_options", None)
    if stream_options is not None:
        body["stream_options"] = stream_options
    with requests.post(stack.url(endpoint), json=body, headers=stack.auth(owner), stream=streamed, timeout=120) as r:
        assert r.status_code == 200, r.text
        sent = Sent(owner, endpoint, streamed, stream_options, max_tokens, r.headers["X-Request-Id"])
        if not streamed:
            usage = r.json()["usage"]
        else:
            events = [data for _, data in sse.iter_sse_data(r.iter_content(chunk_size=None))]
            assert events and events[-1].strip() == b"[DONE]", events[-3:]
            chunks = [json.loads(data) for data in events[:-1]]
            with_usage = [chunk for chunk in chunks if chunk.get("usage")]
            if sent.asked_for_usage:
                assert len(with_usage) == 1 and with_usage[0]["choices"] == [], with_usage
                usage = with_usage[0]["usage"]
            else:
                # What the client asked for, unchanged: no usage event the gateway asked for.
                assert not with_usage, f"a usage the client did not ask for: {with_usage}"
                assert all(chunk["choices"] for chunk in chunks), "an event without choices"
                usage = None
    if usage is not None:
        sent.prompt_tokens = usage["prompt_tokens"]
        sent.completion_tokens = usage["completion_tokens"]
        assert sent.completion_tokens == max_tokens, f"ignore_eos: {usage}"
    return sent


def expected_usage(sent: list[Sent]) -> dict[str, tuple[int, int]]:
    """request id -> (prompt, completion tokens): the client's usage, or for a stream that did not
    ask for it, the prompt of the same key and endpoint and its max_tokens (ignore_eos)."""
    prompts: dict[tuple[str, str], int] = {}
    for item in sent:
        if item.prompt_tokens is not None:
            known = prompts.setdefault((item.owner, item.endpoint), item.prompt_tokens)
            assert known == item.prompt_tokens, "the same prompt counted differently"
    return {
        item.request_id: (
            item.prompt_tokens if item.prompt_tokens is not None else prompts[(item.owner, item.endpoint)],
            item.completion_tokens if item.completion_tokens is not None else item.max_tokens,
        )
        for item in sent
    }


@pytest.fixture(scope="module")
def run(stack):
    """The requests, with the gateway's and vLLM's counters before and after."""
    model = requests.get(stack.url("/v1/models"), headers=stack.auth("alice"), timeout=30).json()["data"][0]["id"]
    prometheus = prometheus_client(stack)
    # Whatever ran before is in Prometheus: a scrape after a quiet moment.
    wait_for_scrapes_after(prometheus, time.time() + 1)
    before = {
        "gateway_prompt": by_owner(prometheus, "gateway_prompt_tokens_total"),
        "gateway_completion": by_owner(prometheus, "gateway_completion_tokens_total"),
        "vllm": vllm_tokens(stack),
    }
    sent = [send(stack, model, owner, variant) for variant in VARIANTS for owner in OWNERS]
    vllm_after = vllm_tokens(stack)
    wait_for_scrapes_after(prometheus, time.time() + 1)
    after = {
        "gateway_prompt": by_owner(prometheus, "gateway_prompt_tokens_total"),
        "gateway_completion": by_owner(prometheus, "gateway_completion_tokens_total"),
        "vllm": vllm_after,
    }
    return {"sent": sent, "before": before, "after": after}


def increase(run: dict, name: str, owner: str) -> float:
    return run["after"][name].get(owner, 0.0) - run["before"][name].get(owner, 0.0)


def test_the_access_log_carries_each_answer_s_usage(stack, run):
    expected = expected_usage(run["sent"])
    logged = {entry["request_id"]: entry for entry in stack.nginx_access_log() if entry["request_id"] in expected}
    assert set(logged) == set(expected), "requests missing from the access log"
    wrong = {}
    for request_id, (prompt, completion) in expected.items():
        entry = logged[request_id]
        seen = (entry.get("prompt_tokens"), entry.get("completion_tokens"))
        if seen != (str(prompt), str(completion)) or entry.get("refusal") or not entry.get("model"):
            wrong[request_id] = {
                "expected": (prompt, completion),
                "logged": {
                    k: entry.get(k)
                    for k in ("route", "model", "prompt_tokens", "completion_tokens", "refusal", "status")
                },
            }
    assert not wrong, json.dumps(wrong, indent=1)


def test_per_key_token_counters_equal_the_usage_the_clients_received(run):
    expected = expected_usage(run["sent"])
    for owner in OWNERS:
        mine = [expected[item.request_id] for item in run["sent"] if item.owner == owner]
        prompt, completion = sum(p for p, _ in mine), sum(c for _, c in mine)
        counted = (increase(run, "gateway_prompt", owner), increase(run, "gateway_completion", owner))
        print(
            f"\n{owner}: {len(mine)} requests, usage {prompt} prompt + {completion} completion tokens; "
            f"gateway counters +{counted[0]:g} / +{counted[1]:g}"
        )
        assert counted == (prompt, completion), f"{owner}: counted {counted}, the client's usage {(prompt, completion)}"


def test_token_counters_over_keys_equal_vllm_s_own_exactly(run):
    owners = set(run["after"]["gateway_prompt"]) | set(run["before"]["gateway_prompt"])
    gateway = {
        "prompt": sum(increase(run, "gateway_prompt", owner) for owner in owners),
        "completion": sum(increase(run, "gateway_completion", owner) for owner in owners),
    }
    vllm = {kind: run["after"]["vllm"][kind] - run["before"]["vllm"][kind] for kind in ("prompt", "completion")}
    print(f"\ngateway counters over all keys: {gateway}; vLLM's own counters: {vllm}")
    assert gateway["prompt"] > 0 and gateway["completion"] > 0
    assert gateway == vllm
