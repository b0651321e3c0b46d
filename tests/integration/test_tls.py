"""HTTPS at the gateway with the certificate the set-up made (self-signed), as a user's clients
see it: curl and the official openai SDK with the CA file; plain HTTP only on localhost."""

from __future__ import annotations

import json
import ssl
import subprocess

import openai
import pytest
import requests

MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def ca_file(stack):
    return str(stack.workdir / "secrets" / "tls_certificate")


def test_curl_trusts_the_gateway_with_the_ca_file(stack, ca_file):
    url = f"https://localhost:{stack.https_port}/v1/models"
    answered = subprocess.run(
        [
            "curl",
            "-sS",
            "--fail-with-body",
            "--cacert",
            ca_file,
            url,
            "-H",
            f"Authorization: Bearer {stack.keys['alice']}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert answered.returncode == 0, answered.stderr
    assert json.loads(answered.stdout)["data"][0]["id"] == MODEL
    untrusted = subprocess.run(["curl", "-sS", url], capture_output=True, text=True, timeout=30)
    assert untrusted.returncode == 60, untrusted.stderr  # certificate not trusted without the CA file


def test_the_openai_sdk_streams_over_https(stack, ca_file):
    client = openai.OpenAI(
        base_url=f"https://127.0.0.1:{stack.https_port}/v1",
        api_key=stack.keys["alice"],
        http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=ca_file)),
        max_retries=0,
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content) >= 1
    with pytest.raises(openai.APIConnectionError):
        openai.OpenAI(base_url=f"https://127.0.0.1:{stack.https_port}/v1", api_key="x", max_retries=0).models.list()


def test_plain_http_is_published_on_localhost_only(stack):
    config = json.loads(stack.compose_command("config", "--format", "json").stdout)
    ports = {p["target"]: p for p in config["services"]["nginx"]["ports"]}
    assert ports[8080]["host_ip"] == "127.0.0.1"
    assert requests.get(f"http://127.0.0.1:{stack.port}/healthz", timeout=10).status_code == 200
