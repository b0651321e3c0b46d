"""The gateway exporter: nginx access-log lines in, Prometheus text out; the real process over
real UDP and HTTP."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from llmstack import promtext
from llmstack.observability import config

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "images" / "gateway-exporter" / "gateway_exporter.py"
gateway_exporter = config.gateway_exporter()

# nginx ends these lines with a space.
STUB_STATUS = "Active connections: 3 \nserver accepts handled requests\n 10 10 42 \nReading: 0 Writing: 2 Waiting: 1 \n"


def log_line(**fields) -> str:
    entry = {
        "time": "2026-12-03T08:00:00+00:00",
        "request_id": "x",
        "key_owner": "alice",
        "method": "POST",
        "route": "/v1/chat/completions",
        "status": 200,
        "bytes_sent": 512,
        "request_length": 300,
        "request_time": 0.250,
        "upstream_status": "200",
        "upstream_connect_time": "0.001",
        "upstream_header_time": "0.010",
        "upstream_response_time": "0.248",
        "model": "",
        "prompt_tokens": "",
        "completion_tokens": "",
        "refusal": "",
        "remote_addr": "10.0.0.1",
        "user_agent": "test",
    }
    entry.update(fields)
    return "<190>Dec  3 08:00:00 gateway: " + json.dumps(entry)


def sample(lines: list[str], prefix: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix)]
    assert values, f"no sample {prefix}"
    return sum(values)


def test_counts_requests_by_route_status_and_owner():
    metrics = gateway_exporter.GatewayMetrics()
    assert metrics.observe_line(log_line())
    assert metrics.observe_line(
        log_line(status=401, key_owner="", upstream_header_time="", upstream_response_time="", request_time=0.0)
    )
    assert metrics.observe_line(log_line(route="other", status=404, upstream_response_time="-"))
    assert metrics.observe_line(log_line(route="/" + "x" * 100, status=404, upstream_response_time="-"))
    first = metrics.exposition()
    # New label sets are exported at 0 first, so Prometheus' rate() sees their first step.
    assert sample(first, 'gateway_requests_total{route="other"') == 0
    lines = metrics.exposition()
    assert (
        sample(
            lines, 'gateway_requests_total{route="/v1/chat/completions",method="POST",status="200",key_owner="alice"}'
        )
        == 1
    )
    assert (
        sample(
            lines, 'gateway_requests_total{route="/v1/chat/completions",method="POST",status="401",key_owner="none"}'
        )
        == 1
    )
    # nginx names unknown paths "other"; a route name longer than nginx.conf's is folded there too.
    assert sample(lines, 'gateway_requests_total{route="other"') == 2


def test_known_label_sets_count_at_once():
    metrics = gateway_exporter.GatewayMetrics()
    metrics.observe_line(log_line())
    metrics.exposition()
    metrics.observe_line(log_line())
    metrics.observe_line(log_line())
    assert sample(metrics.exposition(), 'gateway_requests_total{route="/v1/chat/completions"') == 3


def test_added_latency_is_request_minus_upstream_time():
    metrics = gateway_exporter.GatewayMetrics()
    metrics.observe_line(log_line(request_time=0.250, upstream_response_time="0.248"))
    lines = metrics.exposition()
    assert abs(sample(lines, 'gateway_added_latency_seconds_sum{route="/v1/chat/completions"}') - 0.002) < 1e-9
    assert sample(lines, 'gateway_added_latency_seconds_bucket{route="/v1/chat/completions",le="0.0025"}') == 1
    assert sample(lines, 'gateway_added_latency_seconds_bucket{route="/v1/chat/completions",le="0.001"}') == 0
    assert sample(lines, 'gateway_upstream_header_duration_seconds_count{route="/v1/chat/completions"}') == 1


def test_several_upstream_tries_are_summed():
    assert gateway_exporter.upstream_seconds("0.004, 0.002") == 0.006
    assert gateway_exporter.upstream_seconds("0.5 : 0.25") == 0.75
    assert gateway_exporter.upstream_seconds("-") is None
    assert gateway_exporter.upstream_seconds("") is None


def test_garbage_is_counted_not_fatal():
    metrics = gateway_exporter.GatewayMetrics()
    assert not metrics.observe_line("<190>Dec  3 gateway: not json")
    assert not metrics.observe_line('{"route": "/v1/models"}')
    assert sample(metrics.exposition(), 'gateway_log_lines_total{result="invalid"}') == 2


def scraped(metrics, times: int = 2) -> list[promtext.Sample]:
    """The exposition as Prometheus reads it, after `times` scrapes (new label sets show 0 at the
    first); parsed with prometheus_client's parser, so it is valid text format too."""
    for _ in range(times - 1):
        metrics.exposition()
    return promtext.parse("\n".join(metrics.exposition()) + "\n")


def values(samples: list[promtext.Sample], name: str, *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(s.labels[label] for label in labels): s.value for s in promtext.select(samples, name)}


def usage_line(owner: str, prompt: str, completion: str, model: str = "tiny-qwen3", **fields) -> str:
    return log_line(key_owner=owner, model=model, prompt_tokens=prompt, completion_tokens=completion, **fields)


def test_tokens_are_counted_by_key_owner_and_model():
    metrics = gateway_exporter.GatewayMetrics()
    for line in (
        usage_line("alice", "12", "30"),
        usage_line("alice", "8", "2"),
        usage_line("bob", "5", "64"),
        usage_line("bob", "7", "1", model="org/other-model:v2"),
    ):
        assert metrics.observe_line(line)
    first = promtext.parse("\n".join(metrics.exposition()) + "\n")
    assert promtext.total(first, "gateway_prompt_tokens_total") == 0, "new label sets show 0 at first"
    samples = scraped(metrics, times=1)
    assert values(samples, "gateway_prompt_tokens_total", "key_owner", "model") == {
        ("alice", "tiny-qwen3"): 20,
        ("bob", "tiny-qwen3"): 5,
        ("bob", "org/other-model:v2"): 7,
    }
    assert values(samples, "gateway_completion_tokens_total", "key_owner", "model") == {
        ("alice", "tiny-qwen3"): 32,
        ("bob", "tiny-qwen3"): 64,
        ("bob", "org/other-model:v2"): 1,
    }
    # Known label sets count at once.
    metrics.observe_line(usage_line("alice", "1", "1"))
    samples = promtext.parse("\n".join(metrics.exposition()) + "\n")
    assert promtext.total(samples, "gateway_prompt_tokens_total", key_owner="alice") == 21


def test_tokens_are_added_only_from_decimal_digits():
    metrics = gateway_exporter.GatewayMetrics()
    for prompt, completion in (("", ""), ("-", "-"), ("12.5", "3e2"), ("-4", "+4"), ("١٢", "²"), (" 7", "7 ")):
        assert metrics.observe_line(usage_line("alice", prompt, completion))
    assert metrics.observe_line(log_line(key_owner="alice"))  # no usage fields in the line at all
    samples = scraped(metrics)
    assert promtext.select(samples, "gateway_prompt_tokens_total") == []
    assert promtext.select(samples, "gateway_completion_tokens_total") == []
    assert promtext.total(samples, "gateway_requests_total") == 7
    # One usage field present: both series exist (a panel adds them), the other counts nothing.
    metrics.observe_line(usage_line("alice", "9", ""))
    samples = scraped(metrics)
    assert values(samples, "gateway_prompt_tokens_total", "key_owner") == {("alice",): 9}
    assert values(samples, "gateway_completion_tokens_total", "key_owner") == {("alice",): 0}


def test_model_names_are_bounded():
    metrics = gateway_exporter.GatewayMetrics()
    for model in ("", "x" * 200, 'a"b', "with space", "new\nline", "{{model}}", "-leading-dash"):
        metrics.observe_line(usage_line("alice", "1", "1", model=model))
    for index in range(1000):
        metrics.observe_line(usage_line("alice", "1", "1", model=f"model-{index}"))
    models = values(scraped(metrics), "gateway_prompt_tokens_total", "model")
    assert models[("none",)] == 1, "no model in the answer"
    assert len(models) == gateway_exporter.MAX_MODELS + 2, "the first MAX_MODELS names, 'none' and 'other'"
    assert models[("other",)] == 6 + 1000 - gateway_exporter.MAX_MODELS
    assert sum(models.values()) == 1007


def test_refusals_are_counted_by_key_owner_and_reason():
    metrics = gateway_exporter.GatewayMetrics()
    for owner, refusal, status in (
        ("", "missing_api_key", 401),
        ("", "invalid_api_key", 401),
        ("capped", "n_cap", 400),
        ("capped", "n_cap", 400),
        ("budget", "tokens_per_minute", 429),
        ("alice", "rate_limited", 429),
        ("", "credentials_in_query", 400),
        ("alice", "made_up_reason", 400),
        ("alice", "x" * 500, 400),
        ("alice", "", 200),
    ):
        metrics.observe_line(log_line(key_owner=owner, refusal=refusal, status=status))
    refusals = values(scraped(metrics), "gateway_refusals_total", "key_owner", "reason")
    assert refusals == {
        ("none", "missing_api_key"): 1,
        ("none", "invalid_api_key"): 1,
        ("capped", "n_cap"): 2,
        ("budget", "tokens_per_minute"): 1,
        ("alice", "rate_limited"): 1,
        ("none", "credentials_in_query"): 1,
        ("alice", "other"): 2,
    }


def test_every_refusal_the_gateway_names_is_a_known_reason():
    """The codes nginx's gateway sets in $gateway_refusal (njs and templates) are counted as
    themselves; the contract's list is among them."""
    njs = (REPO_ROOT / "nginx" / "njs" / "gateway.js").read_text()
    templates = "".join(path.read_text() for path in (REPO_ROOT / "nginx").rglob("*.template"))
    codes = set(re.findall(r"refuse\(r, \d+, '(\w+)'", njs)) | set(re.findall(r"overCap\(r, '(\w+)'", njs))
    codes |= set(re.findall(r"set \$gateway_refusal (\w+);", templates))
    assert codes, "no refusal codes found in nginx/"
    assert codes <= gateway_exporter.REFUSAL_REASONS, sorted(codes - gateway_exporter.REFUSAL_REASONS)
    for reason in gateway_exporter.REFUSAL_REASONS:
        assert gateway_exporter.refusal_label(reason) == reason


def test_a_thousand_invented_methods_make_at_most_one_more_series():
    metrics = gateway_exporter.GatewayMetrics()
    metrics.observe_line(log_line(method="POST", route="other", status=405))
    before = len(promtext.select(scraped(metrics), "gateway_requests_total"))
    for index in range(1000):
        metrics.observe_line(log_line(method=f"M{index:04d}ETHOD", route="other", status=405))
    samples = scraped(metrics)
    requests = values(samples, "gateway_requests_total", "method")
    assert len(requests) <= before + 1
    assert requests == {("POST",): 1, ("other",): 1000}


def test_methods_outside_the_standard_ones_fold_into_other():
    for method in ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        assert gateway_exporter.method_label(method) == method
    for method in ("get", "PROPFIND", "TRACE", "CONNECT", "", "POST ", "X" * 10_000):
        assert gateway_exporter.method_label(method) == "other"


def test_routes_of_another_shape_fold_into_other():
    metrics = gateway_exporter.GatewayMetrics()
    for route in ("/v1/models", "/v1/models/{id}", "/prometheus/", "other"):
        assert gateway_exporter.route_label(route) == route
    for route in ("", "v1/models", "/" + "x" * 100, "/v1/a b", '/v1/"quoted"', "/v1/\n", "/v1/ü"):
        assert gateway_exporter.route_label(route) == "other", route
        metrics.observe_line(log_line(route=route, status=404))
    assert values(scraped(metrics), "gateway_requests_total", "route") == {("other",): 7}


def test_the_exporter_declares_every_name_it_writes():
    metrics = gateway_exporter.GatewayMetrics()
    metrics.observe_line(usage_line("alice", "3", "4", refusal=""))
    metrics.observe_line(log_line(key_owner="", refusal="missing_api_key", status=401))
    text = "\n".join(metrics.exposition() + gateway_exporter.stub_status_exposition("http://127.0.0.1:1/")) + "\n"
    written = {sample.name for sample in promtext.parse(text)}
    declared = gateway_exporter.GatewayMetrics.metric_names()
    assert written <= declared, sorted(written - declared)
    assert {"gateway_prompt_tokens_total", "gateway_completion_tokens_total", "gateway_refusals_total"} <= declared
    assert set(gateway_exporter.STUB_STATUS_METRICS) <= declared


def test_stub_status_is_parsed():
    figures = gateway_exporter.parse_stub_status(STUB_STATUS)
    assert figures == {
        "active": 3,
        "accepted": 10,
        "handled": 10,
        "requests": 42,
        "reading": 0,
        "writing": 2,
        "waiting": 1,
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_process_receives_syslog_and_serves_metrics():
    http_port, syslog_port = free_port(), free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            str(SCRIPT),
            "--listen-port",
            str(http_port),
            "--syslog-port",
            str(syslog_port),
            "--stub-status-url",
            "http://127.0.0.1:1/",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline, "exporter did not start"
                time.sleep(0.1)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
            for _ in range(3):
                sender.sendto(log_line(status=429).encode(), ("127.0.0.1", syslog_port))
        deadline = time.monotonic() + 5
        while True:
            response = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=2)
            lines = response.read().decode().splitlines()
            if any(
                line.startswith("gateway_requests_total{") and 'status="429"' in line and line.endswith(" 3")
                for line in lines
            ):
                break
            assert time.monotonic() < deadline, "the syslog lines were not counted"
            time.sleep(0.1)
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert "nginx_up 0" in lines  # nothing answers on the stub_status URL here
    finally:
        process.terminate()
        process.wait(timeout=5)


def test_bad_usage_is_one_line_and_exit_2():
    result = subprocess.run([sys.executable, str(SCRIPT), "--listen-port", "70000"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "must be a port number" in result.stderr


def gateway_locations() -> dict[str, str]:
    """nginx location -> the route name it logs, over the gateway's templates."""
    found = {}
    for path in (REPO_ROOT / "nginx" / "templates").rglob("*.template"):
        for location, body in re.findall(
            r"^ *location ([^@{\n][^{\n]*?) \{(.*?)\n *\}", path.read_text(), flags=re.DOTALL | re.MULTILINE
        ):
            route = re.search(r"set \$gateway_route (\S+);", body)
            found[location.strip()] = route.group(1) if route else ""
    return found


def logged_routes(location: str, route: str) -> list[str]:
    """The route names a location can log: "/v1/$name" expands to each alternative of the
    location's (?<name>a|b) group."""
    route = route.strip('"')
    variable = re.search(r"\$(\w+)", route)
    if not variable:
        return [route]
    group = re.search(rf"\(\?<{variable.group(1)}>([\w|]+)\)", location)
    assert group, f"location {location}: cannot expand {route}"
    return [route.replace(variable.group(0), word) for word in group.group(1).split("|")]


def test_the_route_allowlist_is_nginx_s_only():
    """Every location that proxies names its route for the access log; the exporter keeps no list."""
    locations = gateway_locations()
    api = {location: route for location, route in locations.items() if re.match(r"(= |~ \^)/v1/", location)}
    exact = {location: route for location, route in api.items() if location.startswith("= ")}
    assert len(exact) >= 3 and all(route == location.removeprefix("= ") for location, route in exact.items()), exact
    assert all(route.strip('"').startswith("/v1/") for route in api.values()), api
    for location, route in locations.items():
        if location.startswith(("= /v1/", "~ ^/v1/", "/")):
            assert route or location == "/", f"location {location} logs no route name"
    gateway = (REPO_ROOT / "nginx" / "templates" / "gateway.conf.template").read_text()
    assert re.search(r"^    set \$gateway_route other;", gateway, flags=re.MULTILINE), "the server-wide default"
    assert '"route":"$gateway_route"' in (REPO_ROOT / "nginx" / "nginx.conf").read_text()
    assert "/v1/" not in SCRIPT.read_text(), "the exporter must not keep its own route list"


def test_every_route_nginx_logs_is_kept_as_it_is():
    """The exporter folds only what nginx.conf cannot log: each real route name passes unchanged."""
    names = {"other"}
    for location, route in gateway_locations().items():
        if route:
            names.update(logged_routes(location, route))
    assert {"/v1/models/{id}", "/v1/embeddings", "/v1/chat/completions", "/prometheus/"} <= names, names
    for name in names:
        assert gateway_exporter.route_label(name) == name


def test_healthcheck_reports_the_running_exporter(tmp_path):
    http_port, syslog_port = free_port(), free_port()
    check = [sys.executable, str(SCRIPT), "--healthcheck", "--listen-port", str(http_port)]
    down = subprocess.run(check, capture_output=True, text=True, timeout=10)
    assert down.returncode == 1 and "unhealthy" in down.stderr and "Traceback" not in down.stderr
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--listen-port", str(http_port), "--syslog-port", str(syslog_port)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 10
        while subprocess.run(check, capture_output=True, timeout=10).returncode != 0:
            assert time.monotonic() < deadline, "the health check never passed"
            time.sleep(0.1)
    finally:
        process.terminate()
        process.wait(timeout=5)


def test_the_port_is_defined_once():
    assert "default=METRICS_PORT" in SCRIPT.read_text()
    prometheus = (REPO_ROOT / "prometheus" / "prometheus.yml").read_text()
    assert f'"gateway-exporter:{gateway_exporter.METRICS_PORT}"' in prometheus
