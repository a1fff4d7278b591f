"""vllm_ascend: processed-layout loaders and the wiring around post-load processing and wake-up (no vLLM needed).

vllm-ascend cannot be installed on a CPU machine (its sdist needs CANN, its modules import ``torch_npu`` at
top level), so the patch's targets are missing here and its probe says so. The patch against vllm-ascend's
*released* functions on a live vLLM engine is ``tests/test_vllm_ascend_released_code_on_cpu.py``; this module keeps
the checks that also run without vLLM (the transformers-4.57 job runs tests/test_patches*.py):

* :func:`hwsync.common.npu.ascend_layouts.processed_weight_loader` on CPU tensors against ``hwsync.common.layouts``
  (TP/EP slices) and, with vLLM installed, against vLLM's own ``RoutedExperts.weight_loader`` on a live layer;
* the patch's real replacement functions wrapped around hand-written *reproductions* (stand-ins) of the released steps
  (vllm-ascend v0.23.0 ``process_weights_after_loading`` lines 112-118 and ``NPUWorker.wake_up`` lines 251-270:
  transpose into a new ``nn.Parameter``), applied to a stand-in experts layer that exposes what vLLM's
  ``RoutedExperts`` exposes (``moe_config``, ``expert_map``, a checkpoint-orientation ``weight_loader``).

Not covered here: FRACTAL_NZ detection (needs an NPU tensor) and the real vllm-ascend classes.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

import hwsync.patches as patches
from hwsync.common.errors import LayoutError
from hwsync.common.layouts import (
    ExpertLayout,
    ExpertSharding,
    copy_expert_shard_,
    fuse_experts,
    w2_from_fused,
    w13_from_fused,
)
from hwsync.common.npu import ascend_layouts as al
from hwsync.testing import make_llm, require_vllm

PATCH = patches.get("vllm_ascend")
PROCESS_TARGET, WAKE_TARGET = PATCH.targets[0][1], PATCH.targets[1]
PRE, PROC = ExpertLayout.PREPROCESSED, ExpertLayout.PROCESSED


def test_probe_says_target_missing_without_vllm_ascend():
    if importlib.util.find_spec("vllm_ascend") is not None:
        pytest.skip("vllm_ascend is installed here")
    result = PATCH.probe()
    assert result.state == patches.TARGET_MISSING and "vllm_ascend" in result.reason
    assert patches.apply(["vllm_ascend"]) == [] and not PATCH.active


class StandInExperts(torch.nn.Module):
    """What vllm-ascend's post-processing sees of vLLM's RoutedExperts: sharding attributes, w13/w2 in the
    preprocessed layout with vLLM's Parameter attributes, and a loader writing checkpoint orientation."""

    def __init__(self, sharding: ExpertSharding, inter: int, hidden: int) -> None:
        super().__init__()
        self.sharding = sharding
        par = SimpleNamespace(
            tp_size=sharding.tp_size, tp_rank=sharding.tp_rank, ep_size=sharding.ep_size, ep_rank=sharding.ep_rank
        )
        self.moe_config = SimpleNamespace(
            num_experts=sharding.num_experts, num_logical_experts=sharding.num_experts, moe_parallel_config=par
        )
        self.expert_map = None if sharding.expert_map is None else torch.tensor(sharding.expert_map)
        n, i_tp = sharding.num_local_experts, inter // sharding.tp_size
        for name, shape in (("w13_weight", (n, 2 * i_tp, hidden)), ("w2_weight", (n, hidden, i_tp))):
            param = torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
            param.weight_loader = self.weight_loader
            param.quant_method = "tensor"  # any other attribute vLLM sets must survive too
            self.register_parameter(name, param)

    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        ok = copy_expert_shard_(param.data, loaded_weight, shard_id, expert_id, self.sharding, PRE)
        return ok if return_success else None


def released_process_weights_after_loading(method, layer):
    """vllm-ascend v0.23.0 AscendUnquantizedFusedMoEMethod.process_weights_after_loading, ND path."""
    layer.w13_weight = torch.nn.Parameter(layer.w13_weight.data.transpose(1, 2).contiguous(), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(layer.w2_weight.data.transpose(1, 2).contiguous(), requires_grad=False)


def released_wake_up(worker, tags=None):
    """vllm-ascend v0.23.0 NPUWorker.wake_up, the MoE re-transposition loop (shape guesses included)."""
    hidden = worker.hidden_size
    model = worker.model_runner.model
    if tags is None or "weights" in tags:
        for name, param in model.named_parameters():
            parent = model.get_submodule(".".join(name.split(".")[:-1]))
            if ("w2_weight" in name and param.shape[2] == hidden) or (
                "w13_weight" in name and param.shape[1] == hidden
            ):
                setattr(parent, name.split(".")[-1], torch.nn.Parameter(param.transpose(1, 2), requires_grad=False))


def _experts(num_experts, inter, hidden, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(num_experts, inter, hidden, generator=gen) for _ in range(2))
    down = torch.randn(num_experts, hidden, inter, generator=gen)
    return gate, up, down


def _load_all(layer, gate, up, down):
    """What a model's load_weights does: one loader call per expert tensor, through the Parameter's loader."""
    for e in range(gate.shape[0]):
        for shard, name, tensor in (
            ("w1", "w13_weight", gate[e]),
            ("w3", "w13_weight", up[e]),
            ("w2", "w2_weight", down[e]),
        ):
            param = getattr(layer, name)
            param.weight_loader(param, tensor, f"experts.{e}.{name}", shard, e)


@pytest.mark.parametrize(
    "sharding",
    [
        ExpertSharding(6),
        ExpertSharding(6, tp_size=2, tp_rank=1),
        ExpertSharding.with_placement(6, ep_size=2, ep_rank=1, placement="round_robin", tp_size=2, tp_rank=0),
    ],
    ids=["tp1", "tp2", "ep2-round-robin-tp2"],
)
def test_processed_loader_writes_the_transposed_vllm_layout(sharding):
    inter, hidden = 64, 32
    gate, up, down = _experts(6, inter, hidden)
    gate_up, down_f = fuse_experts(gate, up, down)
    want13 = w13_from_fused(gate_up, sharding, PRE).transpose(1, 2)
    want2 = w2_from_fused(down_f, sharding, PRE).transpose(1, 2)
    w13 = torch.full(want13.shape, float("nan"))
    w2 = torch.full(want2.shape, float("nan"))
    loader = al.processed_weight_loader(layer=None, sharding=sharding)
    local = set(sharding.local_experts)
    for e in range(6):
        for shard, dst, src in (("w1", w13, gate[e]), ("w3", w13, up[e]), ("w2", w2, down[e])):
            assert loader(dst, src, "w", shard, e, return_success=True) == (e in local)
    torch.testing.assert_close(w13, want13, rtol=0, atol=0)
    torch.testing.assert_close(w2, want2, rtol=0, atol=0)


def test_processed_loader_refuses_what_it_cannot_place():
    loader = al.processed_weight_loader(layer=None, sharding=ExpertSharding(2))
    w13 = torch.zeros(2, 8, 8)
    with pytest.raises(LayoutError, match="per-expert weight matrices"):
        loader(w13, torch.zeros(2, 8, 4), "experts.w13_weight", "w1", 0)  # a full 3-D stack
    with pytest.raises(LayoutError, match="per-expert weight matrices"):
        loader(w13, torch.zeros(8, 4), "experts.w13_bias", "w1", 0)


def _wired():
    process = PATCH.replacement(released_process_weights_after_loading, PROCESS_TARGET)
    wake = PATCH.replacement(released_wake_up, WAKE_TARGET)
    return process, wake


def test_processing_keeps_a_layout_aware_loader():
    inter, hidden = 64, 32
    sharding = ExpertSharding(4, tp_size=2, tp_rank=1)
    layer = StandInExperts(sharding, inter, hidden)
    process, _ = _wired()

    # unpatched, the released processing leaves Parameters a later load_weights cannot use
    bare = StandInExperts(sharding, inter, hidden)
    released_process_weights_after_loading(None, bare)
    assert not hasattr(bare.w13_weight, "weight_loader")

    process(None, layer)
    assert al.expert_layout(layer) is PROC and layer.w13_weight.shape == (4, hidden, inter)
    assert layer.w2_weight.quant_method == "tensor"
    gate, up, down = _experts(4, inter, hidden, seed=1)
    _load_all(layer, gate, up, down)  # a weight sync after processing, through the Parameters' loaders
    gate_up, down_f = fuse_experts(gate, up, down)
    torch.testing.assert_close(layer.w13_weight, w13_from_fused(gate_up, sharding, PROC), rtol=0, atol=0)
    torch.testing.assert_close(layer.w2_weight, w2_from_fused(down_f, sharding, PROC), rtol=0, atol=0)
    held = layer.w13_weight
    process(None, layer)  # a framework re-running the post-load step after its load: skipped, not transposed again
    assert layer.w13_weight is held
    torch.testing.assert_close(layer.w13_weight, w13_from_fused(gate_up, sharding, PROC), rtol=0, atol=0)


def _worker(model, hidden):
    return SimpleNamespace(model_runner=SimpleNamespace(model=model), hidden_size=hidden)


def test_wake_up_keeps_processed_experts_and_their_loader():
    inter, hidden = 64, 32
    sharding = ExpertSharding(4)
    model = torch.nn.Module()
    model.experts = layer = StandInExperts(sharding, inter, hidden)
    process, wake = _wired()
    process(None, layer)
    held = layer.w13_weight, layer.w2_weight
    wake(_worker(model, hidden))  # the released wake_up transposes them back; hwsync puts the processed ones back
    assert (layer.w13_weight, layer.w2_weight) == held and al.expert_layout(layer) is PROC
    gate, up, down = _experts(4, inter, hidden, seed=2)
    _load_all(layer, gate, up, down)
    gate_up, down_f = fuse_experts(gate, up, down)
    process(None, layer)  # the framework re-runs post-load processing after the sync: nothing to redo
    torch.testing.assert_close(layer.w13_weight, w13_from_fused(gate_up, sharding, PROC), rtol=0, atol=0)
    torch.testing.assert_close(layer.w2_weight, w2_from_fused(down_f, sharding, PROC), rtol=0, atol=0)


def test_wake_up_shape_guess_misfire_is_undone():
    inter = hidden = 32  # I == H: released wake_up also "transposes back" a preprocessed w2
    sharding = ExpertSharding(4)
    model = torch.nn.Module()
    model.experts = layer = StandInExperts(sharding, inter, hidden)
    gate, up, down = _experts(4, inter, hidden, seed=3)
    _load_all(layer, gate, up, down)
    before = layer.w2_weight.detach().clone()
    _, wake = _wired()

    bare_model = torch.nn.Module()
    bare_model.experts = bare = StandInExperts(sharding, inter, hidden)
    _load_all(bare, gate, up, down)
    released_wake_up(_worker(bare_model, hidden))
    assert not torch.equal(bare.w2_weight, before)  # unpatched: the preprocessed w2 got transposed

    wake(_worker(model, hidden))  # a second wake-up without processing in between
    assert al.expert_layout(layer) is PRE
    torch.testing.assert_close(layer.w2_weight, before, rtol=0, atol=0)
    assert layer.w2_weight.weight_loader == layer.weight_loader


@pytest.mark.vllm
def test_processed_loader_equals_vllms_loader_transposed_on_a_live_layer(tiny_qwen3_moe_dir):
    """Against vLLM's own RoutedExperts.weight_loader (TP=EP=1 here), on scratch tensors: the engine is untouched."""
    require_vllm()
    llm = make_llm(tiny_qwen3_moe_dir, skip_tokenizer_init=True)
    model = llm.apply_model(lambda m: m)[0]
    name, layer = next((n, m) for n, m in model.named_modules() if type(m).__name__ == "RoutedExperts")
    loader = al.processed_weight_loader(layer)  # sharding read from the live layer
    pre13, pre2 = torch.zeros_like(layer.w13_weight), torch.zeros_like(layer.w2_weight)
    proc13, proc2 = pre13.transpose(1, 2).contiguous(), pre2.transpose(1, 2).contiguous()
    e_num, i2, hidden = pre13.shape
    gate, up, down = _experts(e_num, i2 // 2, hidden, seed=4)
    for e in range(e_num):
        for shard, pre, proc, src in (
            ("w1", pre13, proc13, gate[e]),
            ("w3", pre13, proc13, up[e]),
            ("w2", pre2, proc2, down[e]),
        ):
            weight_name = f"{name}.{'w2' if shard == 'w2' else 'w13'}_weight"  # vLLM dispatches on the name
            assert layer.weight_loader(pre, src, weight_name, shard, e, return_success=True) is True
            assert loader(proc, src, weight_name, shard, e, return_success=True) is True
    torch.testing.assert_close(proc13, pre13.transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(proc2, pre2.transpose(1, 2), rtol=0, atol=0)
    assert pre13.abs().sum() > 0 and pre2.abs().sum() > 0


def test_experts_moved_into_lists_are_refused_not_written_nowhere():
    """Fused MC2 with dynamic EPLB (released code) deletes w13/w2 and keeps per-expert lists: a sync must refuse."""
    layer = StandInExperts(ExpertSharding(2), 32, 32)

    def fused_mc2_eplb(method, layer):  # reproduction of the released branch (stand-in)
        layer.w13_weight_list = [w.clone() for w in layer.w13_weight.data.transpose(1, 2).unbind(0)]
        layer.w2_weight_list = [w.clone() for w in layer.w2_weight.data.transpose(1, 2).unbind(0)]
        del layer.w13_weight, layer.w2_weight

    PATCH.replacement(fused_mc2_eplb, PROCESS_TARGET)(None, layer)
    with pytest.raises(LayoutError, match="per-expert lists"):
        al.expert_layout(layer)
    model = torch.nn.Module()
    model.experts = layer
    assert al.before_wake_up(model) == []
