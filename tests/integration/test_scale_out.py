"""Several vLLM replicas behind the router (issue 16), through the published gateway port, on the
CPU stack with two replicas (tests/stack.py): both serve; the cache-aware policy (the default) keeps
a prompt prefix on one replica; a replica killed with `docker kill` costs no request that had not
started, and comes back into rotation by itself after `docker start`.

Which replica served is read from each replica's own counters (vLLM's /metrics, read inside its
container). Containers are killed and started with plain docker: compose would act on the services
that depend on the replica too. Every wait polls against a generous deadline (2 loaded cores)."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import time
import uuid
from collections.abc import Callable

import pytest
import requests

from llmstack import promtext
from llmstack.sse import iter_sse_data

MODEL = "tiny-qwen3"
REPLICAS = ["vllm", "vllm-2"]
ROUTER_METRICS = "http://127.0.0.1:29000/metrics"


def per_replica(stack, metric: str) -> dict[str, float]:
    return {replica: stack.replica_metric(replica, metric) for replica in stack.replicas}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {replica: after[replica] - before[replica] for replica in before}


def container(stack, service: str) -> str:
    container_id = stack.compose_command("ps", "-a", "--quiet", service).stdout.strip()
    assert container_id, f"no {service} container"
    return container_id


def started_at(stack, service: str) -> str:
    """The container's id and start time: both change when it is recreated or restarted."""
    container_id = container(stack, service)
    command = ["docker", "inspect", "--format", "{{.State.StartedAt}}", container_id]
    return container_id + " " + subprocess.run(command, capture_output=True, text=True, check=True, timeout=60).stdout


def router_metrics(stack) -> list[promtext.Sample]:
    code = (
        "import sys, urllib.request; "
        f"sys.stdout.write(urllib.request.urlopen({ROUTER_METRICS!r}, timeout=10).read().decode())"
    )
    return promtext.parse(stack.exec("router", "python3", "-c", code))


def worker_health(stack) -> dict[str, float]:
    """The router's view: worker URL -> 1 in rotation, 0 out."""
    return {
        sample.labels["worker"]: sample.value
        for sample in router_metrics(stack)
        if sample.name == "vllm_router_worker_health"
    }


def prefix_decisions(stack) -> dict[str, float]:
    """The cache_aware policy's decisions by outcome (prefix_hit, prefix_miss, missing_tokens, ...)."""
    decisions: dict[str, float] = {}
    for sample in router_metrics(stack):
        if sample.name == "vllm_router_prefix_routing_decisions_total":
            outcome = sample.labels["outcome"]
            decisions[outcome] = decisions.get(outcome, 0.0) + sample.value
    return decisions


def wait_for(what: str, check: Callable[[], bool], timeout: float, interval: float = 2) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(interval)


def complete(stack, prompt: str, max_tokens: int = 4, owner: str = "alice") -> requests.Response:
    return requests.post(
        stack.url("/v1/completions"),
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True},
        headers=stack.auth(owner),
        timeout=120,
    )


def stream(stack, prompt: str, max_tokens: int = 8, owner: str = "bob") -> tuple[int, bool, int]:
    """A streamed completion: (status, whether it ended with [DONE], tokens its usage counted)."""
    payload = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    done, tokens = False, 0
    with requests.post(
        stack.url("/v1/completions"), json=payload, headers=stack.auth(owner), stream=True, timeout=120
    ) as response:
        if response.status_code != 200:
            return response.status_code, False, 0
        for _, data in iter_sse_data(response.iter_content(chunk_size=None)):
            if data == b"[DONE]":
                done = True
            elif (event := json.loads(data)).get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return 200, done, tokens


def distinct_prompts(count: int) -> list[str]:
    """Prompts that share no prefix (cache_aware then spreads them by load and cache size)."""
    return [f"{uuid.uuid4().hex} {i} tell me something" for i in range(count)]


def test_two_replicas_serve_behind_the_router(stack):
    assert stack.replicas == REPLICAS
    config = json.loads(stack.compose_command("config", "--format", "json").stdout)["services"]
    assert config["router"]["environment"]["ROUTER_WORKER_URLS"] == "http://vllm:8000 http://vllm-2:8000"
    assert config["router"]["environment"]["ROUTER_POLICY"] == "cache_aware"
    # Each replica binds its OpenMP threads to its own core (2 cores here), not both to core 0.
    binds = {r: config[r]["environment"]["VLLM_CPU_OMP_THREADS_BIND"] for r in REPLICAS}
    assert binds == {"vllm": "0", "vllm-2": "1"}
    # Prometheus finds every replica under one name on the backend network.
    for replica in REPLICAS:
        networks = json.loads(
            subprocess.run(
                ["docker", "inspect", "--format", "{{json .NetworkSettings.Networks}}", container(stack, replica)],
                capture_output=True,
                text=True,
                check=True,
                timeout=60,
            ).stdout
        )
        backend = next(settings for name, settings in networks.items() if name.endswith("_backend"))
        assert "vllm-replicas" in backend["Aliases"], (replica, backend["Aliases"])
    assert worker_health(stack) == {"http://vllm:8000": 1, "http://vllm-2:8000": 1}


def test_both_replicas_serve_requests(stack):
    before = per_replica(stack, "vllm:request_success_total")
    prompts = distinct_prompts(16)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        statuses = [r.status_code for r in pool.map(lambda p: complete(stack, p, 16), prompts)]
    assert statuses == [200] * len(prompts)
    served = delta(before, per_replica(stack, "vllm:request_success_total"))
    assert sum(served.values()) == len(prompts), served
    assert all(count > 0 for count in served.values()), served


def test_cache_aware_routing_keeps_a_prefix_on_one_replica(stack):
    """Requests sharing a long prefix all go to the replica that has it cached: the router says it
    chose by the prefix (not by a tie), that replica's own prefix cache hits, the other one sees
    none of them."""
    prefix = f"{uuid.uuid4().hex} " + " ".join(f"rule{i} says be brief." for i in range(120))
    requests_sent = 8
    served_before = per_replica(stack, "vllm:request_success_total")
    hits_before = per_replica(stack, "vllm:prefix_cache_hits_total")
    queries_before = per_replica(stack, "vllm:prefix_cache_queries_total")
    decisions_before = prefix_decisions(stack)
    for i in range(requests_sent):
        assert complete(stack, f"{prefix} Question {i}: why?").status_code == 200
    served = delta(served_before, per_replica(stack, "vllm:request_success_total"))
    hits = delta(hits_before, per_replica(stack, "vllm:prefix_cache_hits_total"))
    queries = delta(queries_before, per_replica(stack, "vllm:prefix_cache_queries_total"))
    chosen = max(served, key=lambda replica: served[replica])
    other = next(replica for replica in served if replica != chosen)
    assert served == {chosen: requests_sent, other: 0}, served
    assert queries[other] == 0 and hits[other] == 0, (queries, hits)
    # All but the first request find the prefix (hundreds of tokens) in that replica's cache.
    assert hits[chosen] / queries[chosen] > 0.6, (hits, queries)
    decisions = prefix_decisions(stack)
    decided = {k: v - decisions_before.get(k, 0.0) for k, v in decisions.items()}
    # The router matched every request after the first against its tree of sent prompts.
    assert decided.get("prefix_hit", 0) >= requests_sent - 1, decided
    assert decided.get("missing_tokens", 0) == 0, decided


@pytest.mark.destructive
def test_a_killed_replica_costs_no_unstarted_request_and_comes_back(stack):
    """docker kill on one replica: every request sent after it (streamed or not) is answered 200 in
    full, the router takes the replica out of rotation, and after docker start it comes back into
    rotation with nothing restarted by hand."""
    victim = "vllm-2"
    victim_url = "http://vllm-2:8000"
    victim_id = container(stack, victim)
    # An earlier destructive test may have restarted the replicas: both in rotation first.
    wait_for("both replicas in rotation", lambda: set(worker_health(stack).values()) == {1}, 420, interval=5)
    others_before = {s: started_at(stack, s) for s in ("router", "nginx")}
    subprocess.run(["docker", "kill", victim_id], check=True, capture_output=True, timeout=60)
    try:
        # Requests right after the kill, before the router's health checks notice: its retries send
        # them to the live replica. Then until it has taken the dead one out.
        results: list[tuple[int, bool, int]] = []
        # Unrelated prompts, and one short prompt many clients send: the policy may keep picking the
        # dead replica for it, and the router must still get it answered.
        prompts = [p if i % 3 else "Hello" for i, p in enumerate(distinct_prompts(24))]

        def one(index: int) -> tuple[int, bool, int]:
            if index % 2:
                return stream(stack, prompts[index])
            answer = complete(stack, prompts[index], 8)
            tokens = answer.json()["usage"]["completion_tokens"] if answer.status_code == 200 else 0
            return answer.status_code, answer.status_code == 200, tokens

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results += pool.map(one, range(len(prompts)))
        wait_for("the router taking the killed replica out", lambda: worker_health(stack)[victim_url] == 0, 60)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results += pool.map(one, range(8))
        assert results == [(200, True, 8)] * len(results), results
    finally:
        subprocess.run(["docker", "start", victim_id], check=True, capture_output=True, timeout=60)
    # The replica loads its model again (a minute or two here); the router's checks bring it back.
    wait_for("the router taking the replica back", lambda: worker_health(stack)[victim_url] == 1, 420, interval=5)
    before = stack.replica_metric(victim, "vllm:request_success_total")

    def victim_serves() -> bool:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            statuses = [r.status_code for r in pool.map(lambda p: complete(stack, p), distinct_prompts(8))]
        assert statuses == [200] * 8, statuses
        return stack.replica_metric(victim, "vllm:request_success_total") > before

    wait_for("the started replica serving again", victim_serves, 120, interval=1)
    # Neither the router nor the gateway was restarted or recreated for this.
    assert {s: started_at(stack, s) for s in ("router", "nginx")} == others_before
