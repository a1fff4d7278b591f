"""hwsync.trl without an engine: the options (the ms-swift plugin's), the engine settings it asks TRL for, what it
refuses before any engine is built, the scoped patch, and the vLLM server's flags (the middleware itself:
tests/test_vllm_serve_middleware.py, which needs no TRL).

Needs TRL 1.16 (its own venv: ``ci/run-trl.sh``); elsewhere the module skips, saying why.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

trl = pytest.importorskip("trl", reason="hwsync.trl needs TRL (HWSYNC_WITH_TRL=1 bash ci/install.sh; ci/run-trl.sh)")
if tuple(int(x) for x in trl.__version__.split(".")[:2]) < (1, 16):
    pytest.skip(
        f"hwsync.trl is made for trl 1.16 (installed: {trl.__version__}); ci/run-trl.sh runs it",
        allow_module_level=True,
    )

pytestmark = pytest.mark.trl


def test_options_are_the_ms_swift_plugins():
    """One home: the TRL integration reads the same SyncOptions (same variables, same defaults)."""
    import hwsync.integrations.options
    import hwsync.trl

    assert hwsync.trl.SyncOptions is hwsync.integrations.options.SyncOptions
    assert hwsync.trl.SyncOptions.from_env({}) == hwsync.trl.SyncOptions()
    opts = hwsync.trl.SyncOptions.from_env({"HWSYNC_STRATEGY": "Adapter", "HWSYNC_VERIFY_EVERY": "2"})
    assert (opts.strategy, opts.verify_every, opts.verify_prompts) == ("adapter", 2, 2)


@pytest.mark.parametrize("r,pattern,want", [(8, {}, 8), (4, {}, 8), (12, {}, 16), (8, {"experts": 40}, 64)])
def test_engine_settings_size_lora_serving_for_the_adapter(r, pattern, want):
    from peft import LoraConfig

    from hwsync.integrations.trl._trainer import engine_settings_for

    cfg = LoraConfig(r=r, rank_pattern=pattern, target_modules=["q_proj"])
    from hwsync.integrations.options import SyncOptions

    opts = SyncOptions()
    assert engine_settings_for("m", cfg, None, opts, None) == {
        "enable_lora": True,
        "max_lora_rank": want,
        "max_loras": 1,
    }
    # full: merged weights, no LoRA serving; no adapter: nothing to serve; engine_kwargs win
    full = SyncOptions(strategy="full")
    assert engine_settings_for("m", cfg, None, full, None) == {}
    assert engine_settings_for("m", None, None, opts, {"enforce_eager": True}) == {"enforce_eager": True}
    assert engine_settings_for("m", cfg, None, opts, {"max_lora_rank": 64})["max_lora_rank"] == 64


def test_a_four_bit_trainer_gets_an_unquantized_engine():
    """QLoRA: hwsync sends the dequantized base once and the adapter after; vLLM takes no in-memory weights into a
    bitsandbytes engine, so TRL's quantization='bitsandbytes' is replaced."""
    from transformers import BitsAndBytesConfig

    from hwsync.integrations.options import SyncOptions
    from hwsync.integrations.trl._trainer import engine_settings_for

    q = BitsAndBytesConfig(load_in_4bit=True)
    assert engine_settings_for("m", None, q, SyncOptions(), None) == {"quantization": None}
    model = SimpleNamespace(config=SimpleNamespace(quantization_config={"load_in_4bit": True}))
    assert engine_settings_for(model, None, None, SyncOptions(), None) == {"quantization": None}


def test_lora_rank_beyond_vllms_largest_is_refused():
    from peft import LoraConfig

    from hwsync.common.errors import OptionError
    from hwsync.integrations.trl._trainer import lora_rank_for_vllm

    with pytest.raises(OptionError, match="512"):
        lora_rank_for_vllm(LoraConfig(r=1024, target_modules=["q_proj"]))


@pytest.mark.parametrize(
    "over,env,match",
    [
        ({"vllm_mode": "server"}, {}, "HWSYNC_SERVER and HWSYNC_TOKEN.*trl vllm-serve"),
        ({"vllm_mode": "server"}, {"HWSYNC_SERVER": "127.0.0.1:29555"}, "HWSYNC_TOKEN"),
    ],
)
def test_setups_hwsync_cannot_sync_are_refused_before_any_engine(over, env, match, monkeypatch):
    from hwsync.common.errors import HwsyncError
    from hwsync.integrations.options import SyncOptions
    from hwsync.integrations.trl._trainer import _check_config

    config = SimpleNamespace(**{"vllm_enable_sleep_mode": False, "vllm_mode": "colocate", **over})
    with pytest.raises(HwsyncError, match=match):
        _check_config(config, SyncOptions.from_env(env))
    _check_config(SimpleNamespace(vllm_enable_sleep_mode=False, vllm_mode="colocate"), SyncOptions())
    _check_config(
        SimpleNamespace(vllm_enable_sleep_mode=True, vllm_mode="colocate"), SyncOptions()
    )  # level 2: refilled


def test_patch_applies_to_trl_1_16_and_only_inside_the_block():
    """TRL 1.16 builds its engine without LoRA: the probe says so. Held, the patch hands TRL's LLM(...) call hwsync's
    settings and turns the NCCL communicator off -- only within engine_settings; afterwards both are TRL's again."""
    import trl.generation.vllm_client as client_mod
    import trl.generation.vllm_generation as gen_mod

    import hwsync.patches as patches
    from hwsync.patches.trl_vllm_generation import TrlVllmGenerationPatch, engine_settings

    patch = patches.get("trl_vllm_generation")
    assert patch.probe().state == "applies", patch.probe()
    assert patch.opt_in  # never installed by hwsync.patches.apply() / the vLLM plugin
    original_llm, original_comm = gen_mod.LLM, client_mod.VLLMClient.init_communicator
    with engine_settings({"enable_lora": True}), patch.scoped():
        assert gen_mod.LLM is not original_llm
    assert gen_mod.LLM is original_llm and client_mod.VLLMClient.init_communicator is original_comm

    calls: list[dict[str, Any]] = []
    llm = TrlVllmGenerationPatch._llm(lambda **kw: calls.append(kw))
    llm(model="m", quantization="bitsandbytes")
    with engine_settings({"enable_lora": True, "quantization": None}):
        llm(model="m", quantization="bitsandbytes")
    assert calls == [
        {"model": "m", "quantization": "bitsandbytes"},
        {"model": "m", "quantization": None, "enable_lora": True},
    ]
    joined: list[str] = []
    comm = TrlVllmGenerationPatch._communicator(lambda client, device=0: joined.append(device))
    with engine_settings({}):
        assert comm(object(), device="cpu") is None
    comm(object(), device="cuda")
    assert joined == ["cuda"]


def test_serve_args_are_vllm_serve_flags():
    from hwsync.trl import serve_args

    args = serve_args(max_lora_rank=16)
    assert args[args.index("--max-lora-rank") + 1] == "16" and "--enable-lora" in args
    assert args[args.index("--worker-extension-cls") + 1] == "hwsync.vllm.HwsyncWorkerExtension"
    assert args[args.index("--middleware") + 1] == "hwsync.server.vllm_api.SyncMiddleware"
