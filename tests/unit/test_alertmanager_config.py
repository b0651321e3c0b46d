"""Alertmanager's config (alertmanager/): `amtool check-config` on the committed file and on what
alertmanager/start.sh makes of it with the .env settings, routing, bad settings refused in one line,
and inhibition rules that name alerts Prometheus really has. amtool runs in the locally built
Alertmanager image (Debian's package), so none is needed on the host."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
ALERTMANAGER_DIR = REPO_ROOT / "alertmanager"
CONFIG = ALERTMANAGER_DIR / "alertmanager.yml"
ALERT_RULES = REPO_ROOT / "prometheus" / "rules" / "alerts.yml"
ALERTNAME_MATCHER = re.compile(r'^alertname\s*(=~|=)\s*"([^"]+)"$')


def alertmanager_image() -> str:
    from llmstack.versions import local_images

    return local_images()["alertmanager"]


def in_image(script: str, *env: str) -> subprocess.CompletedProcess:
    """A shell command in the air-gapped Alertmanager image, alertmanager/ mounted where compose
    mounts it, with the given KEY=VALUE settings in its environment."""
    command = ["docker", "run", "--rm", "--network", "none", "-v", f"{ALERTMANAGER_DIR}:/etc/alertmanager:ro"]
    for item in env:
        command += ["-e", item]
    command += ["--entrypoint", "sh", alertmanager_image(), "-c", script]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


# start.sh renders the config, then execs `alertmanager --version`, which only prints and exits.
RENDER = "sh /etc/alertmanager/start.sh --version >/dev/null"


def test_committed_config_is_valid():
    result = in_image("amtool check-config /etc/alertmanager/alertmanager.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_settings_reach_the_rendered_config_and_it_is_valid():
    url = "https://hooks.example.test/alerts?token=a&b=c|d"
    result = in_image(
        f"{RENDER} && amtool check-config /tmp/alertmanager.yml >&2 && cat /tmp/alertmanager.yml"
        " && amtool config routes test --config.file=/tmp/alertmanager.yml alertname=VLLMDown"
        " && cat /tmp/alertmanager-webhook-url",
        f"ALERT_WEBHOOK_URL={url}",
        "ALERT_GROUP_WAIT=5s",
        "ALERT_GROUP_INTERVAL=1m30s",
        "ALERT_REPEAT_INTERVAL=12h",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stderr
    rendered_text, receiver, url_written = result.stdout.rsplit("\n", 3)[:3]
    rendered = yaml.safe_load(rendered_text)
    route = rendered["route"]
    assert (route["group_wait"], route["group_interval"], route["repeat_interval"]) == ("5s", "1m30s", "12h")
    assert receiver == "webhook"
    # The URL (it may hold a token) is in a file of its own, written as given, never in the config.
    assert url_written == url
    assert url not in rendered_text


def test_without_a_webhook_url_alerts_go_to_no_receiver():
    result = in_image(
        f"{RENDER} && amtool config routes test --config.file=/tmp/alertmanager.yml alertname=VLLMDown"
        " && ! test -e /tmp/alertmanager-webhook-url"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "nobody"
    assert "ALERT_WEBHOOK_URL is empty" in result.stderr


def test_defaults_are_the_committed_files_values():
    result = in_image(f"{RENDER} && cat /tmp/alertmanager.yml", "ALERT_WEBHOOK_URL=http://receiver:9000/")
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout) == yaml.safe_load(CONFIG.read_text())


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("ALERT_GROUP_WAIT=30 seconds", "ALERT_GROUP_WAIT='30 seconds' is not a duration"),
        ("ALERT_REPEAT_INTERVAL=4h;rm", "ALERT_REPEAT_INTERVAL='4h;rm' is not a duration"),
        ("ALERT_WEBHOOK_URL=hooks.example.test/x", "ALERT_WEBHOOK_URL must start with http:// or https://"),
    ],
)
def test_bad_settings_stop_the_start_with_one_line(setting, message):
    result = in_image(RENDER, setting)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def alert_names() -> set[str]:
    groups = yaml.safe_load(ALERT_RULES.read_text())["groups"]
    return {rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule}


def matched_alert_names(matchers: list[str], known: set[str]) -> set[str]:
    names: set[str] = set()
    for matcher in matchers:
        found = ALERTNAME_MATCHER.match(matcher)
        if found:
            op, value = found.groups()
            names |= {name for name in known if re.fullmatch(value, name)} if op == "=~" else {value}
    return names


def test_inhibition_names_alerts_that_exist():
    """vLLM or a replica down silences the latency, load and KV cache alerts it causes; a renamed
    alert breaks this."""
    known = alert_names()
    rules = yaml.safe_load(CONFIG.read_text())["inhibit_rules"]
    sources = set().union(*(matched_alert_names(rule["source_matchers"], known) for rule in rules))
    targets = set().union(*(matched_alert_names(rule["target_matchers"], known) for rule in rules))
    assert sources == {"VLLMDown", "VLLMReplicaDown"} and sources <= known
    assert {"VLLMTTFTOverSLO", "VLLMLoadImbalance", "VLLMKVCacheNearlyFull"} <= targets <= known
    # Each regex target matches only whole names that exist (no silent typo).
    for rule in rules:
        for matcher in rule["target_matchers"]:
            for alternative in ALERTNAME_MATCHER.match(matcher).group(2).split("|"):  # type: ignore[union-attr]
                assert alternative in known, alternative
