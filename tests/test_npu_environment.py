"""``hwsync doctor``'s Ascend section: CANN version from the toolkit's install files, the NZ mode, the JSON keys.

The CANN layouts are written here as the toolkit lays them out (``<home>/<arch>-linux/ascend_toolkit_install.info``,
``<home>/version.cfg``); no CANN is installed on this machine.
"""

from __future__ import annotations

import json
import platform

from hwsync.common.capabilities import environment_report
from hwsync.common.npu.environment import cann_version, nz_mode
from hwsync.doctor import format_report


def test_cann_version_from_install_info_then_version_cfg(tmp_path):
    arch = tmp_path / "toolkit" / f"{platform.machine()}-linux"
    arch.mkdir(parents=True)
    (arch / "ascend_toolkit_install.info").write_text("package_name=Ascend-cann-toolkit\nversion=8.2.RC1\n")
    found = cann_version({"ASCEND_TOOLKIT_HOME": str(tmp_path / "toolkit")})
    assert found == {"version": "8.2.RC1", "source": str(arch / "ascend_toolkit_install.info")}

    other = tmp_path / "home"
    other.mkdir()
    (other / "version.cfg").write_text("# version: 1.0\nruntime_running_version=[7.7.0.1.238:8.1.RC1]\n")
    assert cann_version({"ASCEND_HOME_PATH": str(other)})["version"] == "8.1.RC1"
    missing = cann_version({"ASCEND_TOOLKIT_HOME": str(tmp_path / "nowhere")})
    if missing["version"] is None:  # (unless this machine has CANN at the default path)
        assert "set_env.sh" in missing["reason"]


def test_nz_mode_default_and_override():
    assert nz_mode({})["value"] == 1 and nz_mode({})["source"] == "default"
    off = nz_mode({"VLLM_ASCEND_ENABLE_NZ": "0"})
    assert off["value"] == 0 and off["ok_for_sync"] is True
    assert "refuses to write" in nz_mode({"VLLM_ASCEND_ENABLE_NZ": "2"})["meaning"]
    assert "not an integer" in nz_mode({"VLLM_ASCEND_ENABLE_NZ": "x"})["meaning"]


def test_doctor_report_carries_the_ascend_section():
    """What `hwsync doctor --json` prints is environment_report() plus the patch table (tests/test_doctor.py)."""
    report = environment_report(probe_vllm=False)
    ascend = json.loads(json.dumps(report))["ascend"]
    assert set(ascend) >= {"cann", "torch_npu", "vllm_ascend", "nz_mode"}
    assert set(ascend["nz_mode"]) >= {"value", "source", "meaning"}
    text = format_report({**report, "patches": {"patches": []}})
    assert "\nAscend\n" in text
