"""Every container of the running stack is hardened as README.md "Hardening" says: read from
`docker inspect`, so a compose change that drops a setting fails here."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

# Containers that keep root, and why (README.md "Hardening"). Everything else runs unprivileged.
ROOT_ALLOWED = {
    "vllm": "the Hugging Face cache volume belongs to root in vLLM's image",
    "locust-master": "writes result files into the host's results folder",
    "locust-worker": "the same image and settings as the master",
}
# Capabilities a container may add back (none on the CPU path).
CAPABILITIES_ALLOWED: dict[str, set[str]] = {"dcgm-exporter": {"CAP_SYS_ADMIN", "SYS_ADMIN"}}


def inspect_all(stack) -> dict[str, dict]:
    ids = stack.compose_command("ps", "-q").stdout.split()
    output = subprocess.run(["docker", "inspect", *ids], capture_output=True, text=True, check=True).stdout
    return {c["Config"]["Labels"]["com.docker.compose.service"]: c for c in json.loads(output)}


@pytest.fixture(scope="module")
def containers(stack) -> dict[str, dict]:
    found = inspect_all(stack)
    assert {"vllm", "vllm-2", "router", "nginx", "prometheus", "gateway-exporter"} <= set(found), sorted(found)
    return found


def test_no_container_keeps_a_capability_or_can_gain_privileges(containers):
    for service, container in containers.items():
        host = container["HostConfig"]
        assert host["CapDrop"] and "ALL" in host["CapDrop"], service
        assert set(host["CapAdd"] or []) <= CAPABILITIES_ALLOWED.get(service, set()), (service, host["CapAdd"])
        assert "no-new-privileges:true" in (host["SecurityOpt"] or []), service
        assert not host["Privileged"], service


def test_root_filesystems_are_read_only(containers):
    for service, container in containers.items():
        assert container["HostConfig"]["ReadonlyRootfs"], service


def test_memory_and_process_limits_are_set(containers):
    for service, container in containers.items():
        host = container["HostConfig"]
        assert host["Memory"] > 0, service
        assert host["PidsLimit"] and host["PidsLimit"] > 0, service


def test_only_the_listed_containers_run_as_root(containers):
    for service, container in containers.items():
        user = container["Config"]["User"]
        # The vLLM replicas beyond the first (vllm-2, ...) are copies of vllm.
        if service in ROOT_ALLOWED or re.fullmatch(r"vllm-\d+", service):
            continue
        assert user and user.split(":")[0] not in ("", "0", "root"), (service, user)


def test_processes_really_run_as_their_user(stack, containers):
    """The user nginx's workers and the exporter run as, read from /proc inside the container."""
    for service in ("nginx", "router", "gateway-exporter", "prometheus"):
        uids = stack.exec(service, "sh", "-c", "cat /proc/[0-9]*/status | grep '^Uid:' | sort -u")
        assert uids.strip(), service
        for line in uids.strip().splitlines():
            assert line.split()[1] != "0", (service, line)
