"""``hwsync doctor`` and the CLI command registry."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hwsync import cli
from hwsync.common.backend import get_backend
from hwsync.common.capabilities import environment_report, package_versions


def test_doctor_text_without_vllm_probe(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor", "--no-vllm"]) == 0
    out = capsys.readouterr().out
    backend = get_backend()
    assert f"selected  {backend.name} (torch.distributed: {backend.dist_backend})" in out
    for section in ("Backend", "Versions", "Sync strategies", "Patches"):
        assert f"\n{section}\n" in out
    assert re.search(rf"\n  torch +{re.escape(torch.__version__)}\n", out)
    for name in ("cpu", "cuda", "npu"):
        assert f"\n  {name} " in out  # every built-in backend is listed with its availability


def test_doctor_json_is_complete_and_truthful(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor", "--json", "--no-vllm"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"]["name"] == get_backend().name
    assert report["backend"]["device_count"] == get_backend().device_count() >= 1
    assert report["versions"]["torch"] == torch.__version__
    assert set(report["versions"]) >= {"torch", "transformers", "peft", "vllm", "vllm_ascend", "torch_npu", "ms-swift"}
    assert report["backends"]["cpu"]["available"] is True
    for name, b in report["backends"].items():
        assert (b["reason"] is None) == b["available"], name


@pytest.mark.vllm
def test_strategy_support_is_read_from_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    from hwsync.testing import require_vllm

    require_vllm()
    from vllm.platforms import current_platform

    report = environment_report()
    caps, strategies = report["vllm"], report["strategies"]
    assert caps["installed"] and "error" not in caps, caps
    assert caps["device_type"] == current_platform.device_type
    assert strategies["full"]["supported"] is True
    if current_platform.is_cpu():
        # vLLM's CPU build serves LoRA on linear layers but has no fused-MoE LoRA kernel.
        assert caps["lora"]["supported"] is True
        assert caps["moe_lora"] == {
            "supported": False,
            "reason": "PunicaWrapperCPU does not implement add_lora_fused_moe",
        }
        assert strategies["auto"] == "hybrid" and strategies["adapter"]["supported"] is False
    assert cli.main(["doctor"]) == 0
    text_report = capsys.readouterr().out
    assert re.search(rf"\n  auto +{strategies['auto']} \(", text_report)
    if current_platform.is_cpu():
        assert (
            "vLLM MoE LoRA kernels  unavailable on cpu: PunicaWrapperCPU does not implement "
            "add_lora_fused_moe -> hybrid" in text_report
        )


def test_vllm_absence_is_reported_not_fatal() -> None:
    if package_versions()["vllm"] is not None:
        pytest.skip("vLLM is installed here; its presence is covered by test_strategy_support_is_read_from_vllm")
    report = environment_report()
    assert report["vllm"]["installed"] is False
    assert report["strategies"]["auto"] is None
    assert "pip install 'hwsync[vllm]'" in report["strategies"]["full"]["reason"]


def test_patches_section_matches_the_patch_registry(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        from hwsync.patches import status
    except ImportError:
        status = None
    assert cli.main(["doctor", "--no-vllm"]) == 0
    out = capsys.readouterr().out.split("\nPatches\n", 1)[1]
    rows = list(status()) if status is not None else []
    if not rows:
        assert out.strip() == "patches: none registered"
    for p in rows:
        line = next(line for line in out.splitlines() if line.split()[:1] == [p.name])
        assert f" {p.state} " in line and p.reason in line
        for target in p.target.split(", "):
            assert f"target: {target}" in out


def test_python_dash_m_doctor_json_exits_zero() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hwsync", "doctor", "--json", "--no-vllm"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["backend"]["name"] == get_backend().name


def test_console_script_is_installed() -> None:
    script = shutil.which("hwsync", path=str(Path(sys.executable).parent)) or shutil.which("hwsync")
    if script is None:
        pytest.skip("hwsync is not pip-installed (no console script next to this python)")
    proc = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("hwsync "), proc.stderr


def test_command_registry_adds_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    @cli.command("echo-test", help="test command")
    def echo(args: argparse.Namespace) -> int:
        print(f"echo {args.word}")
        return 3

    @echo.configure
    def _(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("word")

    try:
        assert cli.main(["echo-test", "hi"]) == 3
        assert capsys.readouterr().out == "echo hi\n"
    finally:
        cli._COMMANDS.pop("echo-test")


def test_broken_command_module_does_not_break_doctor(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "COMMAND_MODULES", (*cli.COMMAND_MODULES, "hwsync_no_such_module"))
    assert cli.main(["doctor", "--no-vllm"]) == 0
    captured = capsys.readouterr()
    assert "Backend" in captured.out
    assert "command module hwsync_no_such_module failed to load: ModuleNotFoundError" in captured.err


def test_no_subcommand_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "doctor" in capsys.readouterr().out


def test_env_override_shows_in_doctor(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HWSYNC_BACKEND", "cpu")
    assert cli.main(["doctor", "--no-vllm"]) == 0
    assert "selected  cpu (torch.distributed: gloo), from $HWSYNC_BACKEND=cpu" in capsys.readouterr().out
    monkeypatch.setenv("HWSYNC_BACKEND", "nope")
    assert cli.main(["doctor", "--no-vllm"]) == 0  # doctor reports a bad override, it does not crash
    assert "selected  none: unknown hwsync backend 'nope'" in capsys.readouterr().out


def test_plugin_path_points_at_the_swift_plugin_without_importing_it() -> None:
    code = (
        "import sys; from hwsync.cli import main; rc = main(['plugin-path']); "
        "assert 'swift' not in sys.modules and 'hwsync.integrations.swift' not in sys.modules, "
        "'plugin-path imported ms-swift'; "
        "sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    path = Path(proc.stdout.strip())
    assert path.name == "plugin.py" and path.parent.name == "swift" and path.is_file()
    assert "hwsync.integrations.swift" in path.read_text()  # the file ms-swift imports installs hwsync's plugin
