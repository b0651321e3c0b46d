"""Where the gateway path's TTFT goes, hop by hop: packets on the stack's Docker bridges.

tshark captures the compose stack's bridges (the frontend network, where Docker's proxy hands the
client's request to nginx; the backend one, where nginx talks to the router and the router to each
vLLM replica) while --requests streamed completions go through the gateway one at a time
(llmstack.sse.ApiClient, as packet_timing.py sends them, --pause between them). Each request's way
is then read from the packets with packet_timing.py's reader (TCP streams rebuilt, HTTP exchanges,
server-sent events), as stamps on one clock:
  nginx in          the request's first packet to nginx (its port, --gateway-port, on a bridge)
  to router         nginx's request to the router (--upstream-port)
  render            the router's tokenizing calls (/v1/completions/render, one to each replica at
                    once; only the cache_aware policy makes them), the first sent to the last
                    response's head
  to vLLM           the router's request to the replica
  vLLM first token  the replica's first content event
  router out        the router's first content event to nginx
  nginx out         nginx's first content event, towards the client
  client            the client's own first content event (its TTFT)
Between two requests (concurrency 1) there must be exactly two completion requests on the upstream
port, nginx's to the router and then the router's to a replica: anything else (a retry, another
client) is an error, not a guess. Each segment is the difference of two consecutive stamps; the
table gives its mean, p50, p99 and max over the requests (llmstack.stats), and vLLM's
time_to_first_token histogram over the same requests (summed over replicas) beside the replica's
own segment: what the histogram leaves out of vLLM is the difference. Run it as root (tshark).
  sudo python3 benchmarks/hop_timing.py --api-key-file secrets/loadtest_api_key
  sudo python3 benchmarks/hop_timing.py --requests 100 --output results/hop_timing.json
  python3 benchmarks/hop_timing.py --render results/hop_timing.json   # tables and chart again
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmstack.bench.gateway_overhead import read_key
from llmstack.bench.gateway_report import fmt, md_table, median_range_of
from llmstack.bench.packet_timing import (
    CaptureError,
    Conversation,
    Exchange,
    add_request_arguments,
    captured_run,
    check_request_arguments,
    completion_exchanges,
    figures,
    gateway_port,
    match,
    ms,
    parse_fields,
    ready_client,
    run_settings,
    save_and_print,
    tshark_version,
    vllm_ttft,
)
from llmstack.cli import (
    StackError,
    UsageError,
    add_output_arguments,
    load_pyplot,
    main_exit,
    parser_from_doc,
    render_saved_run,
    save_chart,
)
from llmstack.sse import RequestRecord
from llmstack.vllm import ComposeStack, add_stack_arguments, stack_from_args

PROG = "hop_timing.py"
RENDER = "/v1/completions/render"
# (key, label): each segment ends at its stamp and starts at the one before it.
SEGMENTS = (
    ("client_to_nginx_ms", "client to nginx (the client's send, Docker's proxy)"),
    ("nginx_ms", "nginx: request in to request out (keys, limits, njs)"),
    ("router_before_vllm_ms", "router: request in to the replica"),
    ("vllm_ms", "vLLM: request in to first token out"),
    ("router_after_vllm_ms", "router: first token in to out"),
    ("nginx_after_ms", "nginx: first token in to out"),
    ("client_read_ms", "nginx's first token to the client's (Docker's proxy, the client's read)"),
)


@dataclass
class Hops:
    """One request's exchanges on each hop: the gateway's, nginx to the router, the router's
    tokenizing calls (none without the cache_aware policy) and the router to the replica."""

    gateway: Exchange
    to_router: Exchange
    renders: list[Exchange]
    to_vllm: Exchange


REQUEST_LINE = re.compile(rb"[A-Z]+ \S+ HTTP/1\.[01]\r\n")


def from_their_start(conversations: dict[int, Conversation]) -> dict[int, Conversation]:
    """The TCP streams whose first captured byte starts a request: a kept-alive connection caught
    in the middle of an answer (a Prometheus scrape, a health check) is none of the requests'."""
    return {stream: c for stream, c in conversations.items() if REQUEST_LINE.match(c.client.data)}


def in_window(exchanges: list[Exchange], start: float, end: float) -> list[Exchange]:
    return [exchange for exchange in exchanges if start <= exchange.request.time < end]


def assign(gateway: list[Exchange], upstream: list[Exchange], renders: list[Exchange]) -> list[Hops]:
    """Each gateway exchange with the upstream ones that started after it and before the next:
    nginx's request to the router, then the router's to a replica (and its render calls, if any)."""
    hops = []
    for number, exchange in enumerate(gateway, 1):
        start = exchange.request.time
        end = gateway[number].request.time if number < len(gateway) else float("inf")
        mine = in_window(upstream, start, end)
        if len(mine) != 2:
            raise CaptureError(
                f"request {number}: {len(mine)} completion requests on the upstream port before the next one, "
                "not 2 (nginx to the router, the router to a replica): a retry, another client, or the wrong port?"
            )
        mine_renders = in_window(renders, start, end)
        for leg in [*mine, *mine_renders]:
            if leg.response is None or not leg.response.complete:
                raise CaptureError(
                    f"request {number} (TCP stream {leg.stream}): the capture holds no whole upstream response"
                )
        for leg in [exchange, *mine]:
            if not leg.content_times:
                raise CaptureError(f"request {number} (TCP stream {leg.stream}): a response without a token")
        hops.append(Hops(exchange, mine[0], mine_renders, mine[1]))
    return hops


def request_row(number: int, record: RequestRecord, hops: Hops) -> dict[str, Any]:
    """One request's stamps (ms from the client's start) and segments (ms)."""
    start = record.started_wall
    stamps = {
        "nginx_in": hops.gateway.request.time,
        "to_router": hops.to_router.request.time,
        "to_vllm": hops.to_vllm.request.time,
        "vllm_first": hops.to_vllm.content_times[0],
        "router_first": hops.to_router.content_times[0],
        "nginx_first": hops.gateway.content_times[0],
    }
    client_first = start + record.ttft if record.ttft is not None else None
    render_sent = min((leg.request.time for leg in hops.renders), default=None)
    render_answered = max((leg.response.head_time for leg in hops.renders if leg.response), default=None)

    def between(later: float | None, earlier: float | None) -> float | None:
        return None if later is None or earlier is None else ms(later - earlier)

    return {
        "request": number,
        "started_wall": start,
        "client_ttft_ms": ms(record.ttft),
        "stamps_ms": {name: ms(when - start) for name, when in stamps.items()},
        "render_calls": len(hops.renders),
        "render_ms": between(render_answered, render_sent),
        "client_to_nginx_ms": between(stamps["nginx_in"], start),
        "nginx_ms": between(stamps["to_router"], stamps["nginx_in"]),
        "router_before_vllm_ms": between(stamps["to_vllm"], stamps["to_router"]),
        "vllm_ms": between(stamps["vllm_first"], stamps["to_vllm"]),
        "router_after_vllm_ms": between(stamps["router_first"], stamps["vllm_first"]),
        "nginx_after_ms": between(stamps["nginx_first"], stamps["router_first"]),
        "client_read_ms": between(client_first, stamps["nginx_first"]),
    }


def summarize(rows: list[dict], vllm: dict | None) -> dict[str, Any]:
    summary: dict[str, Any] = {
        key: figures([row[key] for row in rows if row[key] is not None])
        for key in (*(key for key, _ in SEGMENTS), "render_ms", "client_ttft_ms")
    }
    summary["requests_with_render"] = sum(1 for row in rows if row["render_ms"] is not None)
    hist = (vllm or {}).get("ttft_mean_ms")
    segment = summary["vllm_ms"]["mean"]
    summary["vllm_hist_ttft_mean_ms"] = hist
    summary["vllm_hist_requests"] = (vllm or {}).get("requests")
    # The replica's time on the wire that its histogram does not count (its API server, mostly).
    summary["vllm_outside_hist_ms"] = None if hist is None or segment is None else segment - hist
    return summary


# --- report -----------------------------------------------------------------------------------------


def render(result: dict) -> str:
    env, settings = result["environment"], result["settings"]
    head = (
        f"# Hop timing: {env.get('gateway_url')}, captured on {', '.join(env.get('interfaces') or [])}, "
        f"{env.get('date')}\n\n{len(result.get('requests') or [])} streamed completions of "
        f"{settings.get('max_tokens')} tokens ({settings.get('model')}), one at a time; "
        f"{env.get('packets')} packets with payload, tshark {env.get('tshark_version')}. Each segment in ms."
    )
    return f"{head}\n\n{tables(result)}"


def tables(result: dict) -> str:
    """The tables alone (the docs' generated block): each hop's segment, and vLLM against its histogram."""
    summary = result["summary"]
    client_mean = summary["client_ttft_ms"]["mean"]

    def row(label: str, cell: dict) -> list[str]:
        share = cell["mean"] / client_mean * 100 if cell.get("mean") is not None and client_mean else None
        return [
            label,
            str(cell["n"]),
            fmt(cell["mean"], 2),
            fmt(cell["p50"], 2),
            fmt(cell["p99"], 2),
            fmt(cell["max"], 2),
            "-" if share is None else f"{share:.0f}%",
        ]

    rows = [row(label, summary[key]) for key, label in SEGMENTS]
    rows.insert(3, row("  of which the render calls, first sent to last response head", summary["render_ms"]))
    rows.append(row("client TTFT (the sum)", summary["client_ttft_ms"]))
    hops = md_table(["Segment", "Requests", "mean", "p50", "p99", "max", "share of the TTFT mean"], rows)
    server = md_table(
        ["vLLM (mean, ms)", "Value"],
        [
            ["request in to first token out, on the wire", fmt(summary["vllm_ms"]["mean"], 2)],
            [
                f"its time_to_first_token histogram ({fmt(summary.get('vllm_hist_requests'), 0)} requests)",
                fmt(summary.get("vllm_hist_ttft_mean_ms"), 2),
            ],
            ["outside the histogram (API server, mostly)", fmt(summary.get("vllm_outside_hist_ms"), 2, True)],
        ],
    )
    return f"{hops}\n\n{server}\n"


def settings_table(named: list[tuple[str, list[dict]]]) -> str:
    """Several runs of each setting (e.g. router policies, interleaved): per segment and setting, the
    median and range over the runs of each run's mean and p50."""
    keys = [*SEGMENTS[:3], ("render_ms", "  of which the render calls"), *SEGMENTS[3:]]
    keys.append(("client_ttft_ms", "client TTFT (the sum)"))
    rows = []
    for key, label in keys:
        row = [label.split(" (")[0]]
        for _, runs in named:
            for figure in ("mean", "p50"):
                values = [run["summary"][key][figure] for run in runs if run["summary"][key][figure] is not None]
                row.append(median_range_of(values, 2) if values else "-")
        rows.append(row)
    hist = ["vLLM's TTFT histogram, mean"]
    for _, runs in named:
        values = [value for run in runs if (value := run["summary"]["vllm_hist_ttft_mean_ms"]) is not None]
        hist += [median_range_of(values, 2) if values else "-", ""]
    rows.append(hist)
    headers = ["Segment (ms)"]
    for name, runs in named:
        headers += [f"{name}: mean ({len(runs)} runs)", f"{name}: p50"]
    return md_table(headers, rows)


def chart(result: dict, path: Path) -> None:
    """Each request's TTFT as stacked segments, in request order: where the slow ones lose time."""
    plt = load_pyplot()
    rows = result.get("requests") or []
    fig, axis = plt.subplots(figsize=(12, 5))
    numbers = [row["request"] for row in rows]
    bottom = [0.0] * len(rows)
    for key, label in SEGMENTS:
        heights = [row[key] or 0.0 for row in rows]
        axis.bar(numbers, heights, bottom=bottom, label=label.split(" (")[0], width=0.85)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    hist = result["summary"].get("vllm_hist_ttft_mean_ms")
    if hist is not None:
        axis.axhline(hist, color="black", ls=":", lw=1, label="vLLM's TTFT histogram, mean")
    axis.set(xlabel="request", ylabel="ms from the client's start", title="Where each request's TTFT went, hop by hop")
    axis.legend(fontsize=8, loc="upper left")
    axis.grid(alpha=0.3, axis="y")
    save_chart(plt, fig, path)


# --- the stack's bridges ----------------------------------------------------------------------------


def docker(*args: str) -> str:
    try:
        result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise StackError(f"docker {args[0]}: {err}") from None
    if result.returncode != 0:
        message = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
        raise StackError(f"docker {args[0]} failed: {message}")
    return result.stdout


def stack_bridges(stack: ComposeStack) -> list[str]:
    """The host interfaces of the networks nginx is on (Docker names a bridge br-<12 of its id>)."""
    container = stack.run("ps", "-q", "nginx").strip()
    if not container:
        raise StackError("the stack's nginx is not running (scripts/up.sh, or --interface)")
    networks = docker("inspect", "-f", "{{range .NetworkSettings.Networks}}{{.NetworkID}} {{end}}", container).split()
    bridges = []
    for network in networks:
        name = docker(
            "network", "inspect", "-f", '{{index .Options "com.docker.network.bridge.name"}}', network
        ).strip()
        bridges.append(name if name and name != "<no value>" else f"br-{network[:12]}")
    return bridges


# --- the run ----------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = parser_from_doc(PROG, __doc__)
    add_request_arguments(parser)
    parser.add_argument(
        "--interface",
        action="append",
        help="where tshark captures, repeatable (default: the bridges of the networks nginx is on)",
    )
    parser.add_argument(
        "--gateway-port", type=int, default=8080, help="nginx's plain-HTTP port inside the stack (default: %(default)s)"
    )
    parser.add_argument(
        "--upstream-port",
        type=int,
        default=8000,
        help="the router's and the replicas' port (default: %(default)s)",
    )
    add_output_arguments(parser, "hop_timing")
    add_stack_arguments(parser)
    args = parser.parse_args(argv)
    check_request_arguments(args, 1, "a first token")
    if args.gateway_port == args.upstream_port:
        raise UsageError("--gateway-port and --upstream-port must differ (each names one side of a hop)")
    if args.vllm_url:
        raise UsageError("hop timing needs the compose stack (its router and bridges), not --vllm-url")
    gateway_port(args.gateway_url)  # a plain http:// URL with a valid port
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rendered = render_saved_run(argv, chart, render)
    if rendered is not None:
        return rendered
    args = parse_args(argv)
    key = read_key(args.api_key_file)
    version = tshark_version(args.capture_tool)
    if version is None:
        raise CaptureError(f"cannot run {args.capture_tool} (apt-get install tshark, or --capture-tool)")
    stack = stack_from_args(args)
    assert isinstance(stack, ComposeStack)  # parse_args refused --vllm-url
    interfaces = args.interface or stack_bridges(stack)
    client = ready_client(args, key)
    capture_filter = f"tcp port {args.gateway_port} or tcp port {args.upstream_port}"
    run = captured_run(args, client, interfaces, capture_filter, stack, version)
    text, records = run.text, run.records
    gateway = match(records, completion_exchanges(from_their_start(parse_fields(text, args.gateway_port))))
    upstream_conversations = from_their_start(parse_fields(text, args.upstream_port))
    hops = assign(
        [exchange for _, exchange in gateway],
        completion_exchanges(upstream_conversations),
        completion_exchanges(upstream_conversations, RENDER),
    )
    rows = [request_row(n, record, hop) for n, ((record, _), hop) in enumerate(zip(gateway, hops, strict=True), 1)]
    assert run.before is not None and run.after is not None  # the stack was given
    vllm = vllm_ttft(run.before, run.after)
    result = {
        "command": "python3 benchmarks/hop_timing.py " + shlex.join(argv),
        "environment": {**run.environment(args), "interfaces": interfaces},
        "settings": run_settings(args),
        "vllm": vllm,
        "summary": summarize(rows, vllm),
        "requests": rows,
    }
    save_and_print(result, args, "hop_timing", chart, render)
    return 0


if __name__ == "__main__":
    main_exit(PROG, main)
