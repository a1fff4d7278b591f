"""Supported vLLM versions: stated once (``hwsync.common.capabilities.SUPPORTED_VLLM`` = the ``vllm`` extra), printed by
``hwsync doctor``, and enforced with one clear error where hwsync attaches to an engine -- before anything touches
vLLM internals that older releases lack (vLLM 0.25 otherwise fails deep inside a sync with ``AttributeError:
'WeightsMapper' object has no attribute 'get_rename_mapper'``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hwsync
from hwsync import cli
from hwsync.common.capabilities import SUPPORTED_VLLM, check_vllm_supported, vllm_support
from hwsync.common.errors import HwsyncError, UnsupportedVersionError
from hwsync.testing import close_llm, make_llm, require_vllm

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("0.30.0", True),
        ("0.30.0+cpu", True),
        ("0.31.0", True),
        ("0.32.0", True),
        ("0.32.1", True),
        ("0.33.0", True),
        ("0.33.0rc1", True),
        ("0.33.1.dev12+g1234abc", True),
        ("0.29.9", False),
        ("0.25.0", False),
        ("0.34.0", False),
        ("0.34.0.dev3+gabc", False),
        ("1.0.0", False),
    ],
)
def test_supported_range(version: str, ok: bool) -> None:
    support = vllm_support(version)
    assert (support["supported"], support["range"], support["version"]) == (ok, SUPPORTED_VLLM, version)
    if ok:
        check_vllm_supported(version)
    else:
        with pytest.raises(UnsupportedVersionError) as err:
            check_vllm_supported(version)
        msg = str(err.value)
        assert f"vLLM {version} is not supported" in msg and f"pip install 'vllm{SUPPORTED_VLLM}'" in msg
        assert isinstance(err.value, HwsyncError) and "\n" not in msg


def test_unparseable_version_is_refused_with_the_range() -> None:
    with pytest.raises(UnsupportedVersionError, match=r"unparseable version 'main'.*vllm>=0\.30"):
        check_vllm_supported("main")


def test_pyproject_extra_states_the_same_range() -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == [f"vllm{SUPPORTED_VLLM}"]


def test_doctor_prints_the_range_and_the_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor", "--no-vllm"]) == 0
    out = capsys.readouterr().out
    support = vllm_support()
    verdict = (
        "supported"
        if support["supported"]
        else "not installed"
        if support["version"] is None
        else f"NOT SUPPORTED: pip install 'vllm{SUPPORTED_VLLM}'"
    )
    assert f"  vllm range    {SUPPORTED_VLLM} ({verdict})\n" in out


@pytest.mark.vllm
def test_unsupported_vllm_is_refused_at_engine_attach(
    tiny_qwen3_moe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real engine, a vLLM that says it is 0.25: hwsync.sync refuses before touching the engine."""
    require_vllm()
    import vllm
    from transformers import AutoModelForCausalLM

    llm = make_llm(tiny_qwen3_moe_dir, skip_tokenizer_init=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir, dtype=torch.float32)
        real = vllm.__version__
        assert vllm_support()["supported"], f"the installed vLLM {real} is outside {SUPPORTED_VLLM}"
        monkeypatch.setattr(vllm, "__version__", "0.25.0")
        with pytest.raises(
            UnsupportedVersionError,
            match=rf"vLLM 0\.25\.0 is not supported: hwsync needs "
            rf"vllm{SUPPORTED_VLLM.replace('.', '[.]')}",
        ):
            hwsync.sync(llm, model)
        assert "_hwsync_engine" not in llm.__dict__  # nothing attached, nothing sent
        monkeypatch.setattr(vllm, "__version__", real)
        assert hwsync.sync(llm, model).strategy == "full"
    finally:
        close_llm(llm)
