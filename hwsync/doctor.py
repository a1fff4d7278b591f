"""``hwsync doctor``: what hwsync sees here — backend, devices, versions, sync strategies, patches.

The first thing to run (and to paste into a bug report): it answers "which strategy will
``auto`` pick on this machine, and why" and "which upstream bugs does hwsync patch here".
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from hwsync.cli import command
from hwsync.common.capabilities import environment_report

__all__ = ["doctor_report", "format_report"]


def _patch_rows() -> dict[str, Any]:
    try:
        import hwsync.patches as patches
    except ImportError as e:
        return {"registered": False, "reason": f"hwsync.patches not importable ({e})", "patches": []}
    status = getattr(patches, "status", None)
    if status is None:
        return {"registered": False, "reason": "hwsync.patches has no status()", "patches": []}
    try:
        rows = [
            {"name": str(p.name), "target": str(p.target), "state": str(p.state), "reason": str(p.reason)}
            for p in status()
        ]
    except Exception as e:  # noqa: BLE001 - a failing probe is reported, doctor still exits 0
        return {"registered": True, "error": f"{type(e).__name__}: {e}", "patches": []}
    return {"registered": bool(rows), "patches": rows}


def doctor_report(*, probe_vllm: bool = True) -> dict[str, Any]:
    """:func:`~hwsync.common.capabilities.environment_report` plus the patch table."""
    from hwsync.common.gather import SUPPORTED_PARALLELISM

    report = environment_report(probe_vllm=probe_vllm)
    report["patches"] = _patch_rows()
    report["parallelism"] = {side: dict(rows) for side, rows in SUPPORTED_PARALLELISM.items()}
    return report


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]


def _yes(ok: bool) -> str:
    return "yes" if ok else "no"


def format_report(report: dict[str, Any]) -> str:
    """Plain-text rendering of :func:`doctor_report` (stable, grep-able, no colours)."""
    out = [f"hwsync {report['hwsync']} doctor  (python {report['python']}, {report['platform']})", ""]

    sel = report["backend"]
    out.append("Backend")
    if sel.get("name") is None:
        rows = [["selected", f"none: {sel.get('error')}"]]
    else:
        how = f"from $HWSYNC_BACKEND={sel['override']}" if sel.get("override") else "auto-detected"
        rows = [["selected", f"{sel['name']} (torch.distributed: {sel['dist_backend']}), {how}"]]
        rows += [["device" if i == 0 else "", d] for i, d in enumerate(sel["devices"])]
    rows += [
        [name, "available" if b["available"] else f"unavailable: {b['reason']}"]
        for name, b in report["backends"].items()
    ]
    out += _table(rows)
    out.append("")

    out.append("Versions")
    rows = [[k, v or "not installed"] for k, v in report["versions"].items()]
    support = report.get("vllm_support")
    if support is not None:
        state = (
            "supported"
            if support["supported"]
            else (
                "not installed"
                if support["version"] is None
                else f"NOT SUPPORTED: pip install 'vllm{support['range']}'"
            )
        )
        rows.append(["vllm range", f"{support['range']} ({state})"])
    out += _table(rows)
    out.append("")

    out += _ascend_lines(report.get("ascend"))

    out.append("Sync strategies")
    caps, strat = report["vllm"], report["strategies"]
    if caps.get("probed") is False:
        rows = [["vLLM", "not probed (--no-vllm)"]]
    elif not caps["installed"]:
        rows = [["vLLM", "not installed: pip install 'hwsync[vllm]'"]]
    else:
        lora, moe = caps["lora"], caps["moe_lora"]
        moe_line = "available" if moe["supported"] else f"unavailable on {caps['device_type']}: {moe['reason']}"
        rows = [
            ["vLLM platform", f"{caps['platform']} ({caps['device_type']})"],
            ["vLLM LoRA kernels", ("available: " if lora["supported"] else "unavailable: ") + lora["reason"]],
            ["vLLM MoE LoRA kernels", f"{moe_line} -> {strat.get('auto')}"],
        ]
        if caps.get("error"):
            rows.append(["probe error", caps["error"]])
        rows += [
            [name, f"{_yes(strat[name]['supported'])}: {strat[name]['reason']}"]
            for name in ("full", "adapter", "hybrid")
        ]
    rows.append(["auto", f"{strat.get('auto')} ({strat.get('auto_reason')})"])
    out += _table(rows)
    out.append("")

    parallelism = report.get("parallelism") or {}
    if parallelism:
        out.append("Parallelism")
        rows = [[f"{side}: {name}", what] for side, table in parallelism.items() for name, what in table.items()]
        out += _table(rows)
        out.append("")

    patches = report["patches"]
    out.append("Patches")
    if patches.get("error"):
        out += _table([["error", patches["error"]]])
    elif not patches["patches"]:
        out.append("  patches: none registered")
    else:
        # Targets and reasons are long: one aligned line per patch, details indented below it.
        width = max(len(p["name"]) for p in patches["patches"])
        states = max(len(p["state"]) for p in patches["patches"])
        for p in patches["patches"]:
            out.append(f"  {p['name'].ljust(width)}  {p['state'].ljust(states)}  {p['reason']}")
            for target in p["target"].split(", "):
                out.append(f"  {'':{width}}  {'':{states}}  target: {target}")
    return "\n".join(out)


def _ascend_lines(ascend: dict[str, Any] | None) -> list[str]:
    if not ascend:
        return []
    cann, nz = ascend["cann"], ascend["nz_mode"]
    if not (cann["version"] or ascend["torch_npu"] or ascend["vllm_ascend"]):
        return ["Ascend", "  not installed (no CANN toolkit, torch-npu or vllm-ascend)", ""]
    rows = [
        ["CANN", f"{cann['version']} ({cann['source']})" if cann["version"] else cann["reason"]],
        ["torch-npu", ascend["torch_npu"] or "not installed"],
        ["vllm-ascend", ascend["vllm_ascend"] or "not installed"],
        ["NZ mode", f"{nz['value']} ({nz['source']}): {nz['meaning']}"],
    ]
    return ["Ascend", *_table(rows), ""]


@command("doctor", help="show backend, devices, versions, supported sync strategies and patches")
def doctor(args: argparse.Namespace) -> int:
    report = doctor_report(probe_vllm=not args.no_vllm)
    print(json.dumps(report, indent=2, sort_keys=False) if args.json else format_report(report))
    return 0


@doctor.configure
def _(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--no-vllm", action="store_true", help="do not import vLLM (faster; no strategy probe)")
