"""vllm-ascend's RELEASED code (the 0.23.0.post1 sdist) run on CPU against hwsync's Ascend loaders and patch.

NOT hardware validation: nothing here touches an Ascend NPU, CANN, torch_npu or HCCL. What it shows is that hwsync's
layout handling is right for the code vllm-ascend actually ships, driven through a real vLLM engine.

Released upstream code executed unchanged (extracted from the sdist with ``ast`` at test time, compiled under its
own file name, run with the explicit globals listed below; nothing of it is copied into this repository):

* ``AscendUnquantizedFusedMoEMethod.process_weights_after_loading`` (``vllm_ascend/ops/fused_moe/fused_moe.py``)
* ``NPUWorker.wake_up`` (``vllm_ascend/worker/worker.py``)
* ``maybe_trans_nz`` and ``_should_trans_nz`` (``vllm_ascend/utils.py``: the NZ decision the processing calls)

Real, not stood in: vLLM 0.32 (CPU build) engine, its Qwen3-MoE model and ``RoutedExperts`` layers with vLLM's own
``weight_loader``; vLLM's ``UnquantizedFusedMoEMethod`` (the released method's ``super(UnquantizedFusedMoEMethod,
self)`` and ``_maybe_pad_weight`` resolve to it); vLLM's layerwise ``reload_weights``; ``hwsync.sync`` and its
receiver; the transformers trainer model; hwsync's patch replacements (``PATCH.replacement``: exactly what
``hwsync.patches`` installs on the vllm-ascend targets).

Stand-ins, every one (``STAND_INS`` below is the machine-checked list: a released function that reads a global not
provided here fails the test):

* ``torch_npu``: a module whose ``npu_format_cast`` raises. These paths never request NZ (``weight_nz_mode=0``,
  ``enable_fused_mc2=0``); a call would fail the test instead of silently passing. The PyPI ``torch-npu`` cannot
  stand in: without CANN ``import torch_npu`` fails (``libhccl.so`` missing; see docs/ascend.md).
* ``get_ascend_config()``: ``SimpleNamespace(enable_fused_mc2=0, weight_nz_mode=0,
  enable_sleep_mode_extra_cleanup=False)``; the real one needs ``init_ascend_config`` on vllm-ascend's platform.
* ``is_310p()``: ``False`` (the real one asks the SoC through torch_npu).
* ``ACL_FORMAT_FRACTAL_NZ``: 29, the value vllm_ascend.utils defines.
* ``CaMemAllocator``: records ``wake_up(tags)``; the real one is CANN's memory pool (``vllm_ascend_C``).
* the ``NPUWorker`` instance (``self`` of ``wake_up``): carries the real engine's ``vllm_config`` and
  ``model_runner`` and ``_sleep_saved_buffers = {}``; a real NPUWorker needs NPU devices.
* the ``AscendUnquantizedFusedMoEMethod`` class: a subclass of vLLM's real ``UnquantizedFusedMoEMethod`` whose
  ``process_weights_after_loading`` is the released function (the released module imports torch_npu and vLLM 0.23
  APIs at top level); it is swapped in as the live layers' ``quant_method`` class. Its ``__init__`` (which only
  reads ``dynamic_eplb`` from the config) is not run.
* TP/EP shards: a shallow copy of a live ``RoutedExperts`` given vLLM's own ``FusedMoEParallelConfig`` and
  ``ExpertMapManager`` for that (tp, ep) rank, so vLLM's real ``weight_loader`` writes the rank's shard (a
  multi-process TP/EP engine does not fit two CPU cores).

Upstream code NOT run here: the MoE forward (``npu_grouped_matmul``), ``npu_format_cast`` (FRACTAL_NZ), the fused-MC2
dynamic-EPLB per-expert lists, CaMem's memory moves, ``NPUWorker.sleep``.
"""

from __future__ import annotations

import ast
import builtins
import copy
import dataclasses
import hashlib
import importlib.util
import os
import sys
import tarfile
from collections.abc import Callable, Iterator
from functools import cache, lru_cache
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

import hwsync
import hwsync.patches as patches
from hwsync.common.layouts import ExpertLayout, ExpertSharding
from hwsync.common.npu import ascend_layouts as al
from hwsync.testing import make_llm, make_tiny_moe, on_cpu, require_vllm

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not on_cpu(),
        reason="this module drives vLLM's CPU build (fp32, exact layouts compared bit for "
        "bit); a CUDA vLLM's engine keeps its layers on the GPU in its own kernels' layout, and the "
        "layout math itself is platform-independent (covered here in CPU CI)",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm_ascend") is not None,
        reason="vllm-ascend is installed: this module drives vLLM's CPU build with vllm-ascend's code "
        "lifted from its sdist; the npu job tests the installed stack instead",
    ),
]

VERSION = "0.23.0.post1"
SHA256 = "a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1"  # same pin as ci/fetch-vllm-ascend.sh
ROOT = f"vllm_ascend-{VERSION}"
PATCH = patches.get("vllm_ascend")
PROCESS_TARGET = PATCH.targets[0][1]  # vllm_ascend.ops.fused_moe.fused_moe: the released module path
WAKE_TARGET = PATCH.targets[1]
PROC, PRE = ExpertLayout.PROCESSED, ExpertLayout.PREPROCESSED


# ------------------------------------------------------------------------------------------------ the released code
def _sdist() -> Path:
    path = Path(
        os.environ.get("HWSYNC_VLLM_ASCEND_SDIST")
        or Path(sys.prefix) / "hwsync-cache" / "vllm-ascend" / f"vllm_ascend-{VERSION}.tar.gz"
    )
    if not path.is_file():
        reason = f"vllm-ascend {VERSION} sdist not at {path}: run `bash ci/fetch-vllm-ascend.sh` (ci/install.sh does)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {reason}", pytrace=False)
        pytest.skip(reason)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == SHA256, f"{path} is not the pinned vllm-ascend {VERSION} sdist (sha256 {digest})"
    return path


@cache
def _member(path: Path, member: str) -> str:
    with tarfile.open(path) as tf:
        f = tf.extractfile(f"{ROOT}/{member}")
        assert f is not None, member
        return f.read().decode()


def _function_node(source: str, qualname: str) -> ast.FunctionDef:
    scope: list[ast.stmt] = ast.parse(source).body
    *owners, name = qualname.split(".")
    for owner in owners:
        scope = next(n.body for n in scope if isinstance(n, ast.ClassDef) and n.name == owner)
    return next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)


def _global_reads(node: ast.FunctionDef) -> set[str]:
    """Names the function body reads that it does not bind itself (its module globals)."""
    bound = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            bound.add(n.id)
    loads = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return loads - bound - set(dir(builtins))


def released(member: str, qualname: str, env: dict[str, Any]) -> Callable[..., Any]:
    """The released ``qualname`` of ``member``, compiled from the sdist with ``env`` as its only globals."""
    node = _function_node(_member(_sdist(), member), qualname)
    missing = _global_reads(node) - set(env)
    assert not missing, f"{qualname} reads globals this test does not provide: {sorted(missing)}"
    namespace = dict(env)
    exec(compile(ast.Module(body=[node], type_ignores=[]), f"{ROOT}/{member}", "exec"), namespace)  # noqa: S102
    fn = namespace[node.name]
    fn.__qualname__ = qualname
    return fn


class _NoTorchNpu(ModuleType):
    """Stand-in for torch_npu: these paths must never cast to FRACTAL_NZ."""

    def npu_format_cast(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("npu_format_cast called: an NZ path was taken on a test that configured NZ off")


class _CaMemAllocator:
    """Stand-in for vllm_ascend.device_allocator.camem.CaMemAllocator: records what wake_up asks of it."""

    calls: list[Any] = []

    @classmethod
    def get_instance(cls) -> _CaMemAllocator:
        return cls()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(tags)


ASCEND_CONFIG = SimpleNamespace(enable_fused_mc2=0, weight_nz_mode=0, enable_sleep_mode_extra_cleanup=False)
STAND_INS = {
    "torch_npu": _NoTorchNpu("torch_npu"),
    "get_ascend_config": lambda: ASCEND_CONFIG,
    "is_310p": lambda: False,
    "ACL_FORMAT_FRACTAL_NZ": 29,
    "CaMemAllocator": _CaMemAllocator,
}


@lru_cache(maxsize=1)
def released_code() -> SimpleNamespace:
    """The three released steps, each with exactly the globals it reads (real torch / vLLM, stand-ins above)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    utils = "vllm_ascend/utils.py"
    nz_env = {"torch": torch, **{k: STAND_INS[k] for k in ("get_ascend_config", "is_310p")}}
    should_trans_nz = released(utils, "_should_trans_nz", nz_env)
    maybe_trans_nz = released(
        utils,
        "maybe_trans_nz",
        {
            "torch": torch,
            "_should_trans_nz": should_trans_nz,
            "torch_npu": STAND_INS["torch_npu"],
            "ACL_FORMAT_FRACTAL_NZ": STAND_INS["ACL_FORMAT_FRACTAL_NZ"],
        },
    )
    process = released(
        "vllm_ascend/ops/fused_moe/fused_moe.py",
        "AscendUnquantizedFusedMoEMethod.process_weights_after_loading",
        {
            "torch": torch,
            "UnquantizedFusedMoEMethod": UnquantizedFusedMoEMethod,
            "maybe_trans_nz": maybe_trans_nz,
            **{k: STAND_INS[k] for k in ("torch_npu", "get_ascend_config", "ACL_FORMAT_FRACTAL_NZ")},
        },
    )
    wake_up = released(
        "vllm_ascend/worker/worker.py",
        "NPUWorker.wake_up",
        {"torch": torch, **{k: STAND_INS[k] for k in ("get_ascend_config", "CaMemAllocator")}},
    )
    return SimpleNamespace(process=process, wake_up=wake_up, base=UnquantizedFusedMoEMethod)


def ascend_method_class(*, patched: bool) -> type:
    """vLLM's UnquantizedFusedMoEMethod with vllm-ascend's released post-load step (wrapped by hwsync's patch)."""
    code = released_code()
    step = PATCH.replacement(code.process, PROCESS_TARGET) if patched else code.process
    return type("AscendUnquantizedFusedMoEMethod", (code.base,), {"process_weights_after_loading": step})


def wake_up(worker: Any, tags: list[str] | None = None, *, patched: bool) -> None:
    code = released_code()
    (PATCH.replacement(code.wake_up, WAKE_TARGET) if patched else code.wake_up)(worker, tags)


def _released_source(member: str, qualname: str) -> str:
    source = _member(_sdist(), member)
    return ast.get_source_segment(source, _function_node(source, qualname)) or ""


def test_released_steps_are_the_ones_hwsync_handles():
    """Guards the premise: the released code transposes into new Parameters and guesses wake_up from shapes."""
    process = _released_source(
        "vllm_ascend/ops/fused_moe/fused_moe.py", "AscendUnquantizedFusedMoEMethod.process_weights_after_loading"
    )
    assert "layer.w13_weight = torch.nn.Parameter(w13_data" in process and ".transpose(1, 2).contiguous()" in process
    wake = _released_source("vllm_ascend/worker/worker.py", "NPUWorker.wake_up")
    assert "param.shape[2] == hidden_size" in wake and "param.shape[1] == hidden_size" in wake
    code = released_code()
    assert code.process.__code__.co_filename.endswith("vllm_ascend/ops/fused_moe/fused_moe.py")
    assert code.wake_up.__code__.co_filename.endswith("vllm_ascend/worker/worker.py")


def test_released_nz_decision_keeps_nd_for_fp32_and_nz_mode_0():
    """maybe_trans_nz (released) leaves the experts ND on these paths; NZ mode 2 on bf16 would cast (stand-in)."""
    code = released_code()
    nz = code.process.__globals__["maybe_trans_nz"]
    weight = torch.zeros(2, 4, 4)
    assert nz(weight) is weight and nz(weight.bfloat16()).dtype == torch.bfloat16
    ASCEND_CONFIG.weight_nz_mode = 2
    try:
        with pytest.raises(AssertionError, match="npu_format_cast called"):
            nz(weight.bfloat16())
        assert nz(weight) is weight  # fp32 never goes NZ
    finally:
        ASCEND_CONFIG.weight_nz_mode = 0


# ------------------------------------------------------------------------------------------------ the live engine
SHAPES = {"I=2H": 128, "I=H": 64, "2I=H": 32}  # moe_intermediate_size with hidden_size 64: general and both squares


@pytest.fixture(scope="module", params=list(SHAPES), ids=list(SHAPES))
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """A real vLLM engine on a tiny Qwen3-MoE; its MoE layers' quant method becomes vllm-ascend's (released)."""
    require_vllm()
    inter = SHAPES[request.param]
    path = make_tiny_moe(tmp_path_factory.mktemp(f"ascend_{request.param}"), "qwen3_moe", moe_intermediate_size=inter)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: multi-threaded weight copies spin
    llm = make_llm(path, skip_tokenizer_init=True, worker_extension_cls="hwsync.vllm.HwsyncWorkerExtension")
    worker = llm.llm_engine.model_executor.driver_worker.worker
    model = worker.model_runner.model
    layers = {n: m for n, m in model.named_modules() if type(m).__name__ == "RoutedExperts"}
    assert layers and all(m.w13_weight.shape[1] == 2 * inter for m in layers.values())
    created = {n: (m.w13_weight, m.w2_weight, m.quant_method.__class__) for n, m in layers.items()}
    yield SimpleNamespace(
        llm=llm, worker=worker, model=model, layers=layers, created=created, path=path, inter=inter, hidden=64
    )
    torch.set_num_threads(threads)
    del llm


def _trainer(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _trainer_experts(trainer: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Layer index -> (gate_up [E, 2I, H], down [E, H, I]) of the trainer (transformers-5 fused experts)."""
    out = {}
    for name, mod in trainer.named_modules():
        if hasattr(mod, "gate_up_proj") and hasattr(mod, "down_proj") and name.endswith("mlp.experts"):
            out[name.split(".")[2]] = (mod.gate_up_proj.detach(), mod.down_proj.detach())
    assert out
    return out


def _layer_index(name: str) -> str:
    return name.split(".")[2]  # model.layers.<i>.mlp.experts.routed_experts


def _perturb_experts(trainer: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if ".mlp.experts." in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def _expert_checkpoint(trainer: Any) -> list[tuple[str, torch.Tensor]]:
    """The trainer's experts under HF checkpoint names (what a colocated framework hands to model.load_weights)."""
    weights = []
    for idx, (gate_up, down) in _trainer_experts(trainer).items():
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            prefix = f"model.layers.{idx}.mlp.experts.{e}"
            weights += [
                (f"{prefix}.gate_proj.weight", gate_up[e, :inter]),
                (f"{prefix}.up_proj.weight", gate_up[e, inter:]),
                (f"{prefix}.down_proj.weight", down[e]),
            ]
    return weights


def _start_like_vllm_ascend(eng: SimpleNamespace, trainer: Any, *, patched: bool) -> None:
    """Engine start on Ascend: experts loaded by vLLM's loaders (checkpoint layout), then the released post-load
    step. Restores the Parameters vLLM created (a previous test may have processed them), loads the trainer's
    experts through their vLLM loader, swaps in the released quant method and runs it."""
    cls = ascend_method_class(patched=patched)
    for name, layer in eng.layers.items():
        w13, w2, _ = eng.created[name]
        layer.w13_weight, layer.w2_weight = w13, w2
        for obj in (layer, w13, w2):
            obj.__dict__.pop("hwsync_expert_layout", None)
        layer.quant_method.__class__ = cls
    eng.model.load_weights(_expert_checkpoint(trainer))
    for layer in eng.layers.values():
        layer.quant_method.process_weights_after_loading(layer)


def _assert_processed_equal(eng: SimpleNamespace, trainer: Any) -> None:
    experts = _trainer_experts(trainer)
    for name, layer in eng.layers.items():
        gate_up, down = experts[_layer_index(name)]
        assert al.expert_layout(layer) is PROC, name
        assert layer.w13_weight.shape == (gate_up.shape[0], eng.hidden, 2 * eng.inter)
        torch.testing.assert_close(layer.w13_weight, gate_up.transpose(1, 2), rtol=0, atol=0, msg=name)
        torch.testing.assert_close(layer.w2_weight, down.transpose(1, 2), rtol=0, atol=0, msg=name)


def _worker_standin(eng: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(
        vllm_config=eng.worker.vllm_config, model_runner=eng.worker.model_runner, _sleep_saved_buffers={}
    )


def _sync(eng: SimpleNamespace, trainer: Any, via: str) -> None:
    if via == "hwsync.sync":  # hwsync's receiver: vLLM's layerwise reload_weights re-runs the post-load step
        report = hwsync.sync(eng.llm, trainer, strategy="full")
        assert report.strategy == "full"
    else:  # verl / sglang colocate on Ascend: raw load_weights, then the framework re-runs the post-load step
        eng.model.load_weights(_expert_checkpoint(trainer))
        for layer in eng.layers.values():
            layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("via", ["hwsync.sync", "load_weights+process"])
def test_sync_wake_up_sync_keeps_the_processed_layout_exact(engine, via):
    """Sync into experts the released code processed, released wake_up, sync again: the engine holds the trainer's
    experts in the processed layout, bit for bit, in every shape case (I == H and 2I == H included)."""
    trainer = _trainer(engine.path)
    _start_like_vllm_ascend(engine, trainer, patched=True)
    _assert_processed_equal(engine, trainer)

    _perturb_experts(trainer, seed=1)
    _sync(engine, trainer, via)
    _assert_processed_equal(engine, trainer)

    held = {n: (m.w13_weight, m.w2_weight) for n, m in engine.layers.items()}
    _CaMemAllocator.calls.clear()
    wake_up(_worker_standin(engine), None, patched=True)
    assert _CaMemAllocator.calls == [None]  # the released wake_up ran to its end
    assert all((m.w13_weight, m.w2_weight) == held[n] for n, m in engine.layers.items())
    _assert_processed_equal(engine, trainer)

    _perturb_experts(trainer, seed=2)
    _sync(engine, trainer, via)
    _assert_processed_equal(engine, trainer)
    for layer in engine.layers.values():  # loaders survive every step: a raw load_weights still lands right
        assert getattr(layer.w13_weight.weight_loader, "hwsync_processed_loader", False)


def test_released_code_alone_loses_the_loader_and_transposes_on_wake_up(engine):
    """Why the patch exists, shown on the released code itself (no hwsync wrapper)."""
    trainer = _trainer(engine.path)
    _start_like_vllm_ascend(engine, trainer, patched=False)
    layer = next(iter(engine.layers.values()))
    assert layer.w13_weight.shape[1] == engine.hidden and not hasattr(layer.w13_weight, "weight_loader")
    with pytest.raises(AttributeError, match="weight_loader"):
        engine.model.load_weights(_expert_checkpoint(trainer))  # a colocated sync after the post-load step

    processed = layer.w13_weight
    wake_up(_worker_standin(engine), None, patched=False)
    assert layer.w13_weight is not processed and layer.w13_weight.shape == (
        processed.shape[0],
        2 * engine.inter,
        engine.hidden,
    )
    assert not hasattr(layer.w13_weight, "weight_loader")
    # a second wake_up (sleep/wake without a sync in between) guesses from shapes again: in a square case it
    # transposes experts that are already in checkpoint layout
    w13, w2 = layer.w13_weight.detach().clone(), layer.w2_weight.detach().clone()
    wake_up(_worker_standin(engine), None, patched=False)
    square_w2, square_w13 = engine.inter == engine.hidden, 2 * engine.inter == engine.hidden
    torch.testing.assert_close(layer.w2_weight, w2.transpose(1, 2) if square_w2 else w2, rtol=0, atol=0)
    torch.testing.assert_close(layer.w13_weight, w13.transpose(1, 2) if square_w13 else w13, rtol=0, atol=0)
    if square_w2 or square_w13:
        assert not torch.equal(w2 if square_w2 else w13, (w2 if square_w2 else w13).transpose(1, 2))
    for name, m in engine.layers.items():  # leave the engine's layers as created for the next test
        m.quant_method.__class__ = engine.created[name][2]


def test_patched_wake_up_is_a_no_op_on_layouts_in_every_shape(engine):
    """Repeated wake_ups (sleep/wake without sync) and a wake_up on a preprocessed layer change nothing."""
    trainer = _trainer(engine.path)
    _start_like_vllm_ascend(engine, trainer, patched=True)
    for _ in range(2):
        wake_up(_worker_standin(engine), ["weights"], patched=True)
        _assert_processed_equal(engine, trainer)
    wake_up(_worker_standin(engine), ["kv_cache"], patched=True)
    _assert_processed_equal(engine, trainer)


# ------------------------------------------------------------------------------------------------ TP / EP shards
SHARDS = {
    "tp2-rank1": dict(tp=2, tp_rank=1, ep=1, ep_rank=0, placement="linear"),
    "ep2-rank1-linear": dict(tp=1, tp_rank=0, ep=2, ep_rank=1, placement="linear"),
    "tp2-rank0-ep2-rank1-round_robin": dict(tp=2, tp_rank=0, ep=2, ep_rank=1, placement="round_robin"),
}


def _shard_view(
    live: Any, eng: SimpleNamespace, method_cls: type, *, tp: int, tp_rank: int, ep: int, ep_rank: int, placement: str
) -> Any:
    """A live RoutedExperts as rank (tp_rank, ep_rank) of a TP x EP engine would hold it: vLLM's own parallel config
    and ExpertMapManager, fresh w13/w2 of the shard's shape carrying vLLM's real weight_loader (stand-in: see top)."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager

    par = dataclasses.replace(
        live.moe_config.moe_parallel_config, tp_size=tp, tp_rank=tp_rank, ep_size=ep, ep_rank=ep_rank, use_ep=ep > 1
    )
    old = live.expert_map_manager
    manager = ExpertMapManager(
        max_num_batched_tokens=old.max_num_batched_tokens,
        top_k=old.top_k,
        global_num_experts=old.global_num_experts,
        num_redundant_experts=0,
        num_expert_group=2 if placement == "round_robin" else None,
        moe_parallel_config=par,
        placement_strategy=placement,
        enable_eplb=False,
    )
    assert manager.placement_strategy == placement
    shard = copy.copy(live)
    shard.__dict__.update(_parameters={}, _buffers=dict(live._buffers), _modules=dict(live._modules))
    shard.quant_method = copy.copy(live.quant_method)
    shard.quant_method.__class__ = method_cls
    shard.moe_config = dataclasses.replace(live.moe_config, moe_parallel_config=par)
    shard.expert_map_manager = manager
    shard.update_expert_map_info()  # vLLM's own: local_num_experts, the _expert_map buffer
    n, i_tp = manager.local_num_experts, eng.inter // tp
    for name, shape in (("w13_weight", (n, 2 * i_tp, eng.hidden)), ("w2_weight", (n, eng.hidden, i_tp))):
        param = torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
        param.weight_loader = shard.weight_loader  # what vLLM's create_weights attaches
        shard.register_parameter(name, param)
    return shard


def _random_experts(num: int, inter: int, hidden: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(num, inter, hidden, generator=gen),
        torch.randn(num, inter, hidden, generator=gen),
        torch.randn(num, hidden, inter, generator=gen),
    )


_CALLS = (("w1", "w13_weight", 0), ("w3", "w13_weight", 1), ("w2", "w2_weight", 2))


def _load_through_params(shard: Any, experts: tuple[torch.Tensor, ...]) -> list[bool]:
    """What model.load_weights does for each expert tensor: the Parameter's own weight_loader."""
    written = []
    for e in range(experts[0].shape[0]):
        for shard_id, pname, k in _CALLS:
            param = getattr(shard, pname)
            written.append(
                bool(param.weight_loader(param, experts[k][e], f"experts.{pname}", shard_id, e, return_success=True))
            )
    return written


def _vllm_reference(shard: Any, experts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
    """The shard in checkpoint layout as vLLM's own RoutedExperts.weight_loader writes it (the oracle)."""
    n, hidden = shard.w13_weight.shape[0], shard.moe_config.hidden_dim
    i_tp = shard.w2_weight.numel() // (n * hidden)
    pre = {
        "w13_weight": torch.full((n, 2 * i_tp, hidden), float("nan")),
        "w2_weight": torch.full((n, hidden, i_tp), float("nan")),
    }
    written = []
    for e in range(experts[0].shape[0]):
        for shard_id, pname, k in _CALLS:
            written.append(
                bool(
                    type(shard).weight_loader(
                        shard, pre[pname], experts[k][e], f"experts.{pname}", shard_id, e, return_success=True
                    )
                )
            )
    return pre["w13_weight"], pre["w2_weight"], written


@pytest.mark.parametrize("case", list(SHARDS))
def test_tp_ep_shards_sync_wake_up_sync_through_released_code(engine, case):
    """Per TP/EP rank: vLLM's loader, the released post-load step, a sync through hwsync's processed loader, the
    released wake_up, another sync: the shard equals vLLM's own shard of the trainer's experts, transposed."""
    live = next(iter(engine.layers.values()))
    shard = _shard_view(live, engine, ascend_method_class(patched=True), **SHARDS[case])
    model = torch.nn.Module()
    model.experts = shard  # what wake_up walks (named_parameters / get_submodule)
    num = live.moe_config.num_experts
    sharding = ExpertSharding.from_vllm(shard)
    assert (sharding.tp_size, sharding.tp_rank, sharding.ep_size, sharding.ep_rank) == tuple(
        SHARDS[case][k] for k in ("tp", "tp_rank", "ep", "ep_rank")
    )

    v0 = _random_experts(num, engine.inter, engine.hidden, seed=10)
    _load_through_params(shard, v0)  # engine start: vLLM's loader, checkpoint layout
    ref13, ref2, _ = _vllm_reference(shard, v0)
    shard.quant_method.process_weights_after_loading(shard)  # released, wrapped by hwsync's patch
    assert al.expert_layout(shard) is PROC
    torch.testing.assert_close(shard.w13_weight, ref13.transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(shard.w2_weight, ref2.transpose(1, 2), rtol=0, atol=0)

    for seed, between in ((11, "wake_up"), (12, "process")):
        v = _random_experts(num, engine.inter, engine.hidden, seed=seed)
        written = _load_through_params(shard, v)  # a sync: hwsync's processed-layout loader
        ref13, ref2, vllm_written = _vllm_reference(shard, v)
        assert written == vllm_written and any(written) and (not all(written)) == (SHARDS[case]["ep"] > 1)
        if between == "wake_up":
            held = (shard.w13_weight, shard.w2_weight)
            wake_up(
                SimpleNamespace(
                    vllm_config=engine.worker.vllm_config,
                    model_runner=SimpleNamespace(model=model),
                    _sleep_saved_buffers={},
                ),
                None,
                patched=True,
            )
            assert (shard.w13_weight, shard.w2_weight) == held
        else:  # a framework re-running the post-load step after its load: nothing to do on processed experts
            shard.quant_method.process_weights_after_loading(shard)
        assert al.expert_layout(shard) is PROC
        torch.testing.assert_close(shard.w13_weight, ref13.transpose(1, 2), rtol=0, atol=0)
        torch.testing.assert_close(shard.w2_weight, ref2.transpose(1, 2), rtol=0, atol=0)
