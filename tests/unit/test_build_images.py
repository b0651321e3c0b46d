import subprocess
import sys
from pathlib import Path

import pytest

import build_images

SCRIPT = Path(build_images.__file__)


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def test_plan_takes_each_built_image_once_with_its_args():
    config = {"services": {
        "vllm": {"image": "llm-stack/vllm-cpu:1", "build": {"context": "/repo", "dockerfile": "images/vllm/Dockerfile",
                                                             "args": {"BASE_IMAGE": "base:1", "VLLM_DEVICE": "cpu"}}},
        "worker": {"image": "llm-stack/locust:1", "build": {"context": "/repo", "dockerfile": "images/locust/Dockerfile",
                                                             "args": {"BASE_IMAGE": "base:1"}}},
        "master": {"image": "llm-stack/locust:1", "build": {"context": "/repo", "dockerfile": "images/locust/Dockerfile",
                                                             "args": {"BASE_IMAGE": "base:1"}}},
        "grafana": {"image": "grafana/grafana:1"},
    }}
    plan = build_images.plan_builds(config)
    assert [b.image for b in plan] == ["llm-stack/locust:1", "llm-stack/vllm-cpu:1"]
    assert plan[1].args == {"BASE_IMAGE": "base:1", "VLLM_DEVICE": "cpu"}
    assert build_images.base_images(plan) == ["base:1"]


def test_a_build_without_an_image_name_is_refused():
    with pytest.raises(build_images.BuildError, match="no image name"):
        build_images.plan_builds({"services": {"x": {"build": {"context": "."}}}})


@pytest.mark.parametrize("variant, vllm_image", [("cpu", "llm-stack/vllm-cpu:"), ("gpu", "llm-stack/vllm:")])
def test_dry_run_plans_every_locally_built_service_from_the_real_compose_files(variant, vllm_image):
    result = run("--variant", variant, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "base llm-stack/debian:12" in result.stderr
    assert f"vllm -> {vllm_image}" in result.stderr
    assert "nginx -> llm-stack/nginx:" in result.stderr


def test_every_service_has_an_air_gapped_image_or_an_opt_in_profile():
    """A machine with no registry must be able to start the default services from local builds."""
    config = build_images.compose_config(build_images.COMPOSE_FILES["cpu"])
    for name, service in config["services"].items():
        if service.get("profiles"):
            continue
        assert service.get("build") and service["image"].startswith("llm-stack/"), name


def test_bad_arguments_are_one_line_errors(tmp_path):
    missing = run("--ca-cert", str(tmp_path / "nope.crt"))
    assert missing.returncode == 2 and "no such file" in missing.stderr
    unknown = run("--only", "no-such-service", "--dry-run")
    assert unknown.returncode == 1
    assert unknown.stderr.strip() == "build_images: no image to build for service(s): no-such-service"


def test_a_non_pem_ca_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(build_images, "EXTRA_CA_DIR", tmp_path / "staged")
    not_pem = tmp_path / "ca.crt"
    not_pem.write_text("hello")
    with pytest.raises(build_images.BuildError, match="not a PEM certificate"):
        build_images.stage_ca_certificates([not_pem], use_host=False)
    der = tmp_path / "corp.der"
    der.write_bytes(b"\x30\x82\x03\xfd\x30\x82\x02\xe5\xa0\x03\x02\x01\x02\xff\xfe")
    with pytest.raises(build_images.BuildError, match="a DER one\\? convert it: openssl x509 -inform der"):
        build_images.stage_ca_certificates([der], use_host=False)


def test_ca_certificates_are_staged_for_the_build_context(tmp_path, monkeypatch):
    monkeypatch.setattr(build_images, "EXTRA_CA_DIR", tmp_path / "staged")
    pem = tmp_path / "corp.crt"
    pem.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    assert build_images.stage_ca_certificates([pem], use_host=False) == ["corp.crt"]
    assert (tmp_path / "staged" / "00-corp.crt").read_text() == pem.read_text()


def test_progress_bar_shows_steps():
    line = build_images.progress_line("img", 3, 12, started=0)
    assert "[######------------------]" in line and " 3/12" in line


def test_help():
    result = run("--help")
    assert result.returncode == 0 and "mmdebstrap" in result.stdout


def test_build_args_in_both_compose_forms():
    assert build_images.build_args(["A=1", "B=x=y", "C"]) == {"A": "1", "B": "x=y", "C": ""}
    assert build_images.build_args({"A": 1, "B": None}) == {"A": "1", "B": ""}
