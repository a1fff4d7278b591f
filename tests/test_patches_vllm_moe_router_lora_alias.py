"""``vllm_moe_router_lora_alias``: the MoE runner computes the router logits through the router's LoRA wrapper.

On CUDA vLLM 0.32 wraps the experts (``FusedMoEWithLoRA``) before it reaches the runner's alias of the router, so the
alias is re-pointed on the experts' wrapper and the runner keeps the raw router: a router LoRA is built and ignored
(the GPU matrix's all-linear cell). vLLM's CPU build never wraps experts, so the bug cannot happen here; these tests
check the probe on the installed vLLM's source, the rewire on a module tree, and -- on a real CPU engine serving a
router LoRA -- that the runner holding the raw router (the state the bug leaves) serves the trainer without its router
LoRA, and that the patch's rewire brings the engine back to the trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch import nn

PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]


class _Wrapper(nn.Module):
    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base_layer = base


def _block() -> tuple[nn.Module, nn.Module, nn.Module]:
    """``mlp.gate`` (the router), ``mlp.experts`` (its wrapper around a runner that holds the router too)."""
    router = nn.Linear(4, 2)
    runner = nn.Module()
    runner.gate = router
    mlp = nn.Module()
    mlp.gate = _Wrapper(router)
    mlp.experts = _Wrapper(runner)  # the experts' LoRA wrapper: the runner is its base layer now
    model = nn.Module()
    model.mlp = mlp
    model.lm_head = router  # tied-style sharing: left alone, as upstream does
    return model, mlp.gate, runner


def test_the_runner_gets_the_routers_wrapper_and_nothing_else_moves() -> None:
    from hwsync.patches.vllm_moe_router_lora_alias import rewire_aliases

    model, wrapper, runner = _block()
    fixed = rewire_aliases(model, [wrapper, model.mlp.experts])
    assert fixed == ["mlp.experts.base_layer.gate"]
    assert runner.gate is wrapper and wrapper.base_layer is not wrapper  # the wrapper keeps its own base layer
    assert isinstance(model.lm_head, nn.Linear)
    assert rewire_aliases(model, [wrapper, model.mlp.experts]) == []  # idempotent


def test_probe_reads_the_installed_vllm() -> None:
    import hwsync.patches as patches
    from hwsync.testing import require_vllm

    require_vllm()
    import inspect

    from vllm.lora.model_manager import LoRAModelManager

    source = inspect.getsource(LoRAModelManager._create_lora_modules)
    want = "applies" if "get_submodule(_parent_module(" in source and "existing_wrapper" in source else "not needed"
    assert patches.get("vllm_moe_router_lora_alias").check().state == want


def test_a_runner_left_with_the_raw_router_is_repaired(tiny_qwen3_moe_dir: Path) -> None:
    import hwsync
    from hwsync.engine.vllm.applier import lora_manager_of
    from hwsync.patches.vllm_moe_router_lora_alias import rewire_aliases
    from hwsync.testing import on_cpu, patched_llm, require_vllm
    from hwsync.testing.trainer import lora_trainer, perturb

    require_vllm()
    if not on_cpu():
        pytest.skip("the CPU check: a bf16 GPU engine cannot tell a router LoRA from bf16 noise by logprobs")
    model = lora_trainer(tiny_qwen3_moe_dir, ["q_proj", "v_proj", "gate"])
    perturb(model, 1)
    with patched_llm(
        tiny_qwen3_moe_dir, enable_lora=True, max_lora_rank=8, lora_target_modules=["qkv_proj", "o_proj", "gate"]
    ) as llm:
        hwsync.sync(llm, model, strategy="adapter")
        hwsync.verify(llm, model, PROMPTS, atol=1e-4)

        def runners(m: Any) -> list[tuple[nn.Module, nn.Module]]:
            out = []
            for layer in m.model.layers:
                for sub in layer.mlp.modules():
                    gate = sub._modules.get("gate")
                    if sub is not layer.mlp and gate is not None:
                        out.append((sub, gate))
            return out

        held = llm.apply_model(runners)[0]
        assert held and all(hasattr(g, "base_layer") for _, g in held)  # every runner computes through the wrapper
        wrapper_of = {id(r): g for r, g in held}
        for runner, gate in held:  # the state vLLM 0.32 leaves where it wraps the experts
            runner._modules["gate"] = gate.base_layer
        with pytest.raises(hwsync.HwsyncError):  # the router's LoRA is ignored: not the trainer's policy
            hwsync.verify(llm, model, PROMPTS, atol=1e-4)
        manager = lora_manager_of(llm.llm_engine.model_executor.driver_worker.worker)
        fixed = llm.apply_model(lambda m: rewire_aliases(m, manager.modules.values()))[0]
        assert len(fixed) == len(held) and all(runner._modules["gate"] is wrapper_of[id(runner)] for runner, _ in held)
        hwsync.verify(llm, model, PROMPTS, atol=1e-4)
