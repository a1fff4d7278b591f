"""What ``hwsync doctor`` reports about an Ascend stack: CANN, torch-npu, vllm-ascend versions and the NZ mode.

Read from files, package metadata and the environment only -- nothing is imported (torch_npu fails to import without
CANN, and vllm-ascend imports vLLM), so the report also explains a broken install.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["ascend_environment", "cann_version", "nz_mode"]

_TOOLKIT_DEFAULT = "/usr/local/Ascend/ascend-toolkit/latest"
_NZ_MEANING = {
    0: "off: experts stay ND (what sleep mode, wake_up and hwsync's in-place writes need)",
    1: "quantized weights only: unquantized BF16/FP16 experts stay ND, but vllm-ascend 0.23's wake_up refuses "
    "any NZ mode; set weight_nz_mode=0 for RL with sleep mode",
    2: "BF16/FP16 weights too: processed experts are FRACTAL_NZ, which hwsync refuses to write; set weight_nz_mode=0",
}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cann_version(environ: dict[str, str] | None = None) -> dict[str, str | None]:
    """CANN toolkit version from its install info (``ASCEND_TOOLKIT_HOME`` / ``ASCEND_HOME_PATH`` as set by
    ``set_env.sh``, else the default install path): ``{"version": ..., "source": file}`` or a reason."""
    env = os.environ if environ is None else environ
    homes = [env.get("ASCEND_TOOLKIT_HOME"), env.get("ASCEND_HOME_PATH"), _TOOLKIT_DEFAULT]
    for home in filter(None, homes):
        root = Path(home)
        arch = f"{platform.machine()}-linux"
        for info in (root / arch / "ascend_toolkit_install.info", root / "ascend_toolkit_install.info"):
            version = _read_key(info, "version")
            if version:
                return {"version": version, "source": str(info)}
        running = _read_key(root / "version.cfg", "runtime_running_version")  # "[7.1.0.3.220:8.0.RC1]"
        if running:
            return {"version": running.strip("[]").rpartition(":")[2] or running, "source": str(root / "version.cfg")}
    return {
        "version": None,
        "source": None,
        "reason": "no CANN toolkit found (source /usr/local/Ascend/ascend-toolkit/set_env.sh)",
    }


def _read_key(path: Path, key: str) -> str | None:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        name, sep, value = line.partition("=")
        if sep and name.strip() == key:
            return value.strip().strip('"') or None
    return None


def nz_mode(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """vllm-ascend's weight NZ mode as a new engine would take it from the environment (``VLLM_ASCEND_ENABLE_NZ``,
    default 1); an engine's ``additional_config={"weight_nz_mode": ...}`` overrides it and is not visible here."""
    env = os.environ if environ is None else environ
    raw = env.get("VLLM_ASCEND_ENABLE_NZ")
    try:
        value = 1 if raw is None else int(raw)
    except ValueError:
        return {"value": raw, "source": "VLLM_ASCEND_ENABLE_NZ", "meaning": "not an integer: vllm-ascend fails"}
    return {
        "value": value,
        "source": "default" if raw is None else "VLLM_ASCEND_ENABLE_NZ",
        "meaning": _NZ_MEANING.get(value, "unknown mode"),
        "ok_for_sync": value == 0,
        "override": "additional_config weight_nz_mode (per engine) wins over this",
    }


def ascend_environment() -> dict[str, Any]:
    """The Ascend part of ``hwsync doctor --json``."""
    return {
        "cann": cann_version(),
        "torch_npu": _version("torch-npu") or _version("torch_npu"),
        "vllm_ascend": _version("vllm-ascend") or _version("vllm_ascend"),
        "nz_mode": nz_mode(),
        "visible_devices": os.environ.get("ASCEND_RT_VISIBLE_DEVICES"),
    }
