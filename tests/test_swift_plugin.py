"""hwsync's ms-swift plugin without a training run: options, install / uninstall, refusals, summary table.

Importing :mod:`hwsync.integrations.swift` installs the plugin process-wide, so the module fixture uninstalls it again
at the end; the test that ms-swift is untouched without the plugin runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.swift


@pytest.fixture(scope="module")
def plugin():
    import hwsync.integrations.swift as plugin

    yield plugin
    plugin.uninstall()


# ------------------------------------------------------------------------------------------------------ options
def test_options_defaults_and_values(plugin):
    assert plugin.SwiftOptions.from_env({}) == plugin.SwiftOptions()
    opts = plugin.SwiftOptions.from_env(
        {
            "HWSYNC_STRATEGY": "Hybrid",
            "HWSYNC_BUCKET_MB": "16",
            "HWSYNC_VERIFY_EVERY": "0",
            "HWSYNC_VERIFY_ATOL": "1e-3",
            "HWSYNC_VERIFY_PROMPTS": "3",
            "HWSYNC_METRICS": "/tmp/m.jsonl",
        }
    )
    assert opts == plugin.SwiftOptions("hybrid", 16.0, 0, 1e-3, 3, "/tmp/m.jsonl")
    # unset atol: hwsync.verify's content checks + the platform's logprob gate (a healthy bf16 GPU run passes)
    assert plugin.SwiftOptions().verify_atol is None and plugin.SwiftOptions().verify_gate is None
    from hwsync.trainer.verify import Gate

    gate = plugin.SwiftOptions.from_env({"HWSYNC_VERIFY_GATE": "0.5,0.8,0.05"}).verify_gate
    assert gate == Gate(mean_abs=0.5, p90_abs=0.8, mean_prob=0.05)


def test_server_lists_one_address_per_rollout_engine(plugin):
    """``swift rollout --vllm_data_parallel_size N``: HWSYNC_SERVER lists N addresses, engine k serves on the k-th,
    the trainer connects to all of them."""
    from hwsync.common.errors import UnsupportedSetupError
    from hwsync.integrations.swift._server import rollout_address

    opts = plugin.SwiftOptions.from_env({"HWSYNC_SERVER": "127.0.0.1:29555, 10.0.0.2:29555", "HWSYNC_TOKEN": "t"})
    assert opts.servers == ["127.0.0.1:29555", "10.0.0.2:29555"]
    assert [rollout_address(opts, k, 2) for k in range(2)] == opts.servers
    with pytest.raises(UnsupportedSetupError, match="lists 2 address.*runs 3 data-parallel.*one host:port per engine"):
        rollout_address(opts, 0, 3)
    one = plugin.SwiftOptions.from_env({"HWSYNC_SERVER": "127.0.0.1:29555"})
    assert one.servers == ["127.0.0.1:29555"] and rollout_address(one, 0, 1) == "127.0.0.1:29555"
    with pytest.raises(UnsupportedSetupError, match="lists 1 address"):
        rollout_address(one, 1, 2)


@pytest.mark.parametrize(
    "var,value",
    [
        ("HWSYNC_SERVER", "127.0.0.1"),
        ("HWSYNC_SERVER", "127.0.0.1:1,127.0.0.1"),
        ("HWSYNC_SERVER", "127.0.0.1:1,127.0.0.1:1"),
        ("HWSYNC_STRATEGY", "fastest"),
        ("HWSYNC_BUCKET_MB", "0"),
        ("HWSYNC_BUCKET_MB", "lots"),
        ("HWSYNC_VERIFY_EVERY", "-1"),
        ("HWSYNC_VERIFY_EVERY", "1.5"),
        ("HWSYNC_VERIFY_ATOL", "nan"),
        ("HWSYNC_VERIFY_PROMPTS", "0"),
        ("HWSYNC_VERIFY_GATE", "0.5"),
        ("HWSYNC_VERIFY_GATE", "0.5,0.8,-1"),
        ("HWSYNC_VERIFY_GATE", "a,b,c"),
    ],
)
def test_options_refuse_bad_values_naming_the_variable(plugin, var, value):
    from hwsync.common.errors import HwsyncError

    with pytest.raises(plugin.OptionError, match=var) as err:
        plugin.SwiftOptions.from_env({var: value})
    assert isinstance(err.value, HwsyncError)


# ------------------------------------------------------------------------------------------------------ install
def test_install_routes_grpo_through_hwsync_and_uninstall_restores(plugin):
    from swift.rlhf_trainers import GRPOTrainer
    from swift.trainers import TrainerFactory

    import hwsync.patches as patches

    grpo = SimpleNamespace(rlhf_type="grpo")
    plugin.install()
    plugin.install()  # idempotent
    assert plugin.installed()
    cls = TrainerFactory.get_trainer_cls(grpo)
    assert cls.__name__ == "HwsyncGRPOTrainer" and issubclass(cls, GRPOTrainer)
    assert TrainerFactory.get_trainer_cls(SimpleNamespace(rlhf_type="dpo")).__name__ == "DPOTrainer"
    active = {p.name for p in patches.registered() if p.installed}

    plugin.uninstall()
    assert not plugin.installed()
    assert TrainerFactory.get_trainer_cls(grpo) is GRPOTrainer
    assert not active & {p.name for p in patches.registered() if p.installed}, "uninstall left hwsync patches on"

    # an entry someone else put there after us is theirs: uninstall must not clobber it
    plugin.install()
    TrainerFactory.TRAINER_MAPPING["grpo"] = "somewhere.else.Trainer"
    try:
        plugin.uninstall()
        assert TrainerFactory.TRAINER_MAPPING["grpo"] == "somewhere.else.Trainer"
    finally:
        TrainerFactory.TRAINER_MAPPING["grpo"] = "swift.rlhf_trainers.GRPOTrainer"


def test_ms_swift_untouched_without_the_plugin():
    """A fresh interpreter that never imports hwsync.integrations.swift builds ms-swift's own trainer, unpatched."""
    code = (
        "import json, sys; from swift.trainers import TrainerFactory; import hwsync.patches as p; "
        "print(json.dumps([TrainerFactory.TRAINER_MAPPING['grpo'], any(x.installed for x in p.registered()), "
        "any(m.startswith('hwsync.integrations.swift') for m in sys.modules)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["swift.rlhf_trainers.GRPOTrainer", False, False]


def test_plugin_file_is_what_swift_imports(plugin):
    """``--external_plugins`` gets a file path; importing it must install hwsync and leave sys.path clean."""

    from swift.utils import import_external_file

    path = Path(plugin.__file__).parent / "plugin.py"
    plugin.uninstall()
    import_external_file(str(path))
    try:
        assert plugin.installed()
        assert str(path.parent) not in sys.path
    finally:
        plugin.uninstall()


# ------------------------------------------------------------------------------------------------------ refusals
def _setup(**over):
    args = SimpleNamespace(sleep_level=0, use_vllm=True)
    base = dict(
        args=args,
        _is_fsdp2=False,
        is_fsdp_enabled=False,
        is_deepspeed_enabled=False,
        rollout_enable_lora=True,
        vllm_mode="colocate",
        vllm_tensor_parallel_size=1,
    )
    for key, value in over.items():
        if key in ("sleep_level",):
            setattr(args, key, value)
        else:
            base[key] = value
    return base


@pytest.mark.parametrize(
    "over,strategy,match",
    [
        ({"_is_fsdp2": True, "vllm_mode": "server"}, "auto", "HWSYNC_SERVER and HWSYNC_TOKEN"),
        ({"rollout_enable_lora": False}, "hybrid", "--vllm_enable_lora true"),
        ({"rollout_enable_lora": False}, "adapter", "--vllm_enable_lora true"),
    ],
)
def test_trainer_refuses_setups_it_cannot_sync(plugin, over, strategy, match):
    from hwsync.common.errors import HwsyncError
    from hwsync.integrations.swift._trainer import HwsyncGRPOTrainer

    fake = SimpleNamespace(**_setup(**over), hwsync_options=plugin.SwiftOptions(strategy=strategy))
    with pytest.raises(HwsyncError, match=match):
        HwsyncGRPOTrainer._hwsync_check_setup(fake)
    ok = SimpleNamespace(**_setup(), hwsync_options=plugin.SwiftOptions(strategy=strategy))
    HwsyncGRPOTrainer._hwsync_check_setup(ok)
    level2 = SimpleNamespace(**_setup(sleep_level=2), hwsync_options=plugin.SwiftOptions(strategy=strategy))
    HwsyncGRPOTrainer._hwsync_check_setup(level2)  # --sleep_level 2: the next sync refills (test_sleep_refill.py)


@pytest.mark.parametrize(
    "over",
    [
        {"_is_fsdp2": True, "is_fsdp_enabled": True},
        {"vllm_tensor_parallel_size": 2},
        {"_is_fsdp2": True, "is_fsdp_enabled": True, "vllm_tensor_parallel_size": 2},
    ],
)
def test_trainer_takes_sharded_and_tp_setups_with_the_check(plugin, over):
    """FSDP2 and TP engines sync (hwsync.common.gather, the worker keeps its shard) and are checked after the sync
    (every rank scores rank 0's prompts), in colocate and in server mode (there rank 0 alone queries the engine: tested
    for real in tests/test_server_sharded.py)."""
    from hwsync.common.errors import HwsyncError
    from hwsync.integrations.swift._trainer import HwsyncGRPOTrainer

    checked = SimpleNamespace(**_setup(**over), hwsync_options=plugin.SwiftOptions(strategy="auto"))
    HwsyncGRPOTrainer._hwsync_check_setup(checked)
    if over.get("_is_fsdp2"):
        credentials = {"server": "127.0.0.1:29555,127.0.0.1:29556", "token": "a test token, strong enough: 32+"}
        served = SimpleNamespace(
            **_setup(**over, vllm_mode="server"), hwsync_options=plugin.SwiftOptions(**credentials)
        )
        HwsyncGRPOTrainer._hwsync_check_setup(served)
    fsdp1 = SimpleNamespace(**_setup(is_fsdp_enabled=True), hwsync_options=plugin.SwiftOptions(verify_every=0))
    with pytest.raises(HwsyncError, match="FSDP1"):
        HwsyncGRPOTrainer._hwsync_check_setup(fsdp1)


# ------------------------------------------------------------------------------------------------------ summary
def test_summary_pairs_each_step_with_the_sync_that_served_it(plugin):
    records = [
        {
            "event": "sync",
            "step": 0,
            "strategy": "hybrid",
            "reason": "why",
            "mb": 0.9,
            "seconds": 0.3,
            "verify_max_abs_dlogp": 3e-6,
            "policy_shift": 0.0,
        },
        {"event": "step", "step": 1, "reward": -0.25, "rollout_max_abs_dlogp": 4e-6},
        {
            "event": "sync",
            "step": 1,
            "strategy": "hybrid",
            "mb": 0.43,
            "seconds": 0.08,
            "verify_max_abs_dlogp": None,
            "policy_shift": None,
        },
        {"event": "step", "step": 2, "reward": 0.5, "rollout_max_abs_dlogp": None},
    ]
    lines = plugin.format_summary(records).splitlines()
    assert lines[0].split()[:3] == ["step", "reward", "strategy"]
    assert lines[2].split() == ["1", "-0.250", "hybrid", "0.900", "300", "3.0e-06", "4.0e-06", "0.0e+00"]
    assert lines[3].split() == ["2", "0.500", "hybrid", "0.430", "80", "-", "-", "-"]
    assert lines[-1] == "strategy: hybrid (why)"


# ------------------------------------------------------------------------------------------------------ patches
@pytest.mark.vllm
def test_swift_rollout_cpu_patch_lets_swift_rollout_start_on_cpu(plugin):
    """Without the patch ms-swift refuses one CPU engine (it counts CUDA/NPU/MUSA devices only); with it, it
    accepts engines of one worker (tp = 1, any dp: one process per data-parallel engine) and still refuses what
    vLLM's CPU build cannot run in-process (tp > 1)."""
    from swift.arguments.deploy_args import RolloutArguments

    import hwsync.patches as patches
    import hwsync.patches.swift_rollout  # noqa: F401
    from hwsync.testing import on_cpu

    if not on_cpu():
        pytest.skip("swift rollout's device count is only wrong on vLLM's CPU build")

    one = SimpleNamespace(vllm_data_parallel_size=1, vllm_tensor_parallel_size=1)
    dp2 = SimpleNamespace(vllm_data_parallel_size=2, vllm_tensor_parallel_size=1)
    tp2 = SimpleNamespace(vllm_data_parallel_size=1, vllm_tensor_parallel_size=2)
    patch = patches.get("swift_rollout_cpu")
    assert patch.probe(refresh=True).state == patches.APPLIES, patch.probe().reason
    with pytest.raises(ValueError, match="local_device_count"):
        RolloutArguments._check_device_count(one)
    with patch:
        RolloutArguments._check_device_count(one)
        RolloutArguments._check_device_count(dp2)
        with pytest.raises(ValueError, match="local_device_count"):
            RolloutArguments._check_device_count(tp2)
    with pytest.raises(ValueError, match="local_device_count"):  # undone on exit
        RolloutArguments._check_device_count(one)


def test_swift_rollout_serve_patch_only_when_server_mode_is_asked(plugin, monkeypatch):
    from swift.pipelines.infer.rollout import SwiftRolloutDeploy

    import hwsync.patches as patches
    import hwsync.patches.swift_rollout  # noqa: F401

    patch = patches.get("swift_rollout_serve")
    original = SwiftRolloutDeploy.__dict__["get_infer_engine"]
    try:
        with monkeypatch.context() as env:
            env.delenv("HWSYNC_SERVER", raising=False)
            assert patch.probe(refresh=True).state == patches.NOT_NEEDED
            with patch:  # not needed -> nothing patched
                assert SwiftRolloutDeploy.__dict__["get_infer_engine"] is original
            env.setenv("HWSYNC_SERVER", "127.0.0.1:29555")
            assert patch.probe(refresh=True).state == patches.APPLIES
            with patch:
                wrapper = SwiftRolloutDeploy.__dict__["get_infer_engine"]
                assert wrapper is not original and isinstance(wrapper, staticmethod)
        assert SwiftRolloutDeploy.__dict__["get_infer_engine"] is original
    finally:
        patch.probe(refresh=True)  # the cached probe must reflect this process's real environment again


def test_served_rollout_engine_stays_in_the_worker_process(plugin, monkeypatch):
    """vLLM's GPU default moves the engine core into a child process, out of hwsync's server's reach (seen on an
    H100: swift rollout exited before serving); server mode keeps it in-process, and refuses an explicit 1."""
    from hwsync.common.errors import UnsupportedSetupError
    from hwsync.integrations.swift._server import keep_engine_in_process

    monkeypatch.delenv("HWSYNC_SERVER", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    keep_engine_in_process()  # not server mode: vLLM's default stays
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    monkeypatch.setenv("HWSYNC_SERVER", "127.0.0.1:29555")
    monkeypatch.setenv("HWSYNC_TOKEN", "t" * 32)
    keep_engine_in_process()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(UnsupportedSetupError, match="VLLM_ENABLE_V1_MULTIPROCESSING=1 moves vLLM's engine core"):
        keep_engine_in_process()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_install_leaves_every_opt_in_patch_alone(plugin, monkeypatch):
    """Opt-in is a property of the patch (``Patch.opt_in``; ms-swift's own server patches: ``integration="swift"``):
    a new opt-in patch, here one whose probe applies, is not installed by the plugin; TRL's, the sleep watch and the
    LoRA guards neither."""
    import types

    import hwsync.patches as patches
    from hwsync.patches import _base

    module = types.ModuleType("hwsync_test_opt_in_target")
    module.f = lambda: "original"
    monkeypatch.setitem(sys.modules, module.__name__, module)

    class NewOptIn(patches.Patch):
        name = "test_new_opt_in"
        targets = (f"{module.__name__}:f",)
        opt_in = True

        def check(self):
            return patches.ProbeResult(patches.APPLIES, "test")

        def replacement(self, original, target):
            return lambda: "patched"

    monkeypatch.setitem(_base._REGISTRY, NewOptIn.name, NewOptIn())
    monkeypatch.delenv("HWSYNC_SERVER", raising=False)
    plugin.uninstall()
    try:
        plugin.install()
        assert module.f() == "original"
        installed = {p.name for p in patches.registered() if p.installed}
        assert not installed & {p.name for p in patches.registered() if p.opt_in}, installed
    finally:
        plugin.uninstall()
    assert module.f() == "original"
