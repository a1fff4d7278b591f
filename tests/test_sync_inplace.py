"""hwsync's fast paths equal vLLM's own paths, buffer for buffer, on a real engine.

* Base weights written in place (:mod:`hwsync.engine.vllm.direct`) leave every parameter exactly as vLLM's own
  ``reload_weights`` of the same tensors leaves it.
* An adapter rewritten in place (:mod:`hwsync.engine.vllm.lora_slots`) leaves every LoRA slot buffer exactly as vLLM's
  own construction + activation of the same adapter leaves it (``LoRAModel.from_lora_tensors``, packing, ``set_lora``).

On vLLM's CPU build the CPU kernels repack linears and experts, so base weights stay on vLLM's reload there (the
report says why) and adapters cover attention; on CUDA the same tests exercise in-place experts and expert LoRA.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hwsync
from hwsync.testing import make_llm, require_vllm
from hwsync.testing.trainer import lora_trainer, perturb

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
CUDA = torch.cuda.is_available()
DTYPE = torch.bfloat16 if CUDA else torch.float32


@pytest.fixture(scope="module")
def llm(tiny_qwen3_moe_dir: Path) -> Iterator[Any]:
    require_vllm()
    from hwsync.engine import vllm_plugin

    vllm_plugin.register()
    kwargs: dict[str, Any] = dict(enable_lora=True, max_lora_rank=8, max_loras=2, dtype=str(DTYPE)[6:])
    if CUDA:
        kwargs.update(gpu_memory_utilization=0.2, num_gpu_blocks_override=256)  # GPU blocks hold 16 tokens
    else:
        kwargs["lora_target_modules"] = ["qkv_proj", "o_proj"]
    yield make_llm(tiny_qwen3_moe_dir, **kwargs)


def _model(path: Path, lora: bool) -> Any:
    targets = (ATTN, EXPERTS if CUDA else None) if lora else (None, None)
    return lora_trainer(path, *targets, dtype=DTYPE, lora_dropout=0.0).to("cuda" if CUDA else "cpu")


def _runner(llm: Any) -> Any:
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def _logprobs(llm: Any, lora_request: Any) -> list[list[float]]:
    from vllm import SamplingParams

    from hwsync.trainer.verify import engine_logprobs

    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, lora_request=lora_request, use_tqdm=False)
    return [engine_logprobs(o)[1] for o in outs]


def test_base_written_in_place_equals_vllm_reload(llm: Any, tiny_qwen3_moe_dir: Path) -> None:
    from hwsync.engine.vllm.applier import vllm_reload
    from hwsync.trainer.merged import merged_named_weights

    model = _model(tiny_qwen3_moe_dir, lora=False)
    first = hwsync.sync(llm, model, strategy="full")
    assert "proven writable in place" in first.path or "through vLLM's reload" in first.path, first.path
    perturb(model, 1, base=True)
    second = hwsync.sync(llm, model, strategy="full")
    print(second.line())
    if CUDA:  # unquantized linears and Triton MoE read their parameters as stored
        assert " 0 through vLLM's reload" in second.path, second.path
    live = {n: p.detach().clone() for n, p in _runner(llm).get_model().named_parameters()}
    ours = _logprobs(llm, None)
    vllm_reload(_runner(llm), list(merged_named_weights(model)))
    llm.reset_prefix_cache()
    theirs = {n: p.detach() for n, p in _runner(llm).get_model().named_parameters()}
    different = [n for n in live if not torch.equal(live[n], theirs[n])]
    assert not different, f"in-place writes differ from vLLM's reload in {different[:5]}"
    assert ours == _logprobs(llm, None)


def _slot_buffers(llm: Any, lid: int) -> dict[str, torch.Tensor]:
    """Every LoRA buffer of every wrapped module at ``lid``'s slot (cloned)."""
    wm = _runner(llm).lora_manager._adapter_manager
    slot = wm.lora_index_to_id.index(lid)
    out: dict[str, torch.Tensor] = {}
    for name, module in wm.modules.items():
        for attr, value in vars(module).items():
            if not attr.endswith("_stacked") and attr != "adapter_enabled":
                continue
            tensors = value if isinstance(value, (tuple, list)) else (value,)
            if attr == "lora_a_stacked" and isinstance(value, list):  # per-expert views of the w13/w2 buffers
                continue
            for i, t in enumerate(tensors):
                if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] > slot:
                    out[f"{name}.{attr}[{i}]"] = t[slot].detach().clone()
    return out


def test_adapter_rewritten_in_place_equals_vllm_activation(
    llm: Any, tiny_qwen3_moe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adapter hwsync builds from vLLM's traced layout, and rewrites in place, leaves every slot buffer exactly
    as vLLM's own construction + activation of the same tensors (``HWSYNC_DIRECT=0``: vLLM's path only)."""
    model = _model(tiny_qwen3_moe_dir, lora=True)
    perturb(model, 2)
    installed = hwsync.sync(llm, model, strategy="adapter")
    assert "adapter: built from vLLM's traced layout" in installed.path, installed.path
    built = _slot_buffers(llm, installed.lora_request.lora_int_id)
    with monkeypatch.context() as m:  # the same tensors built by vLLM's construction, in the other slot
        m.setenv("HWSYNC_DIRECT", "0")
        first = hwsync.sync(llm, model, strategy="adapter", lora_int_id=installed.lora_request.lora_int_id + 100)
    assert "adapter: built by vLLM" in first.path, first.path
    by_vllm = _slot_buffers(llm, first.lora_request.lora_int_id)
    assert built.keys() == by_vllm.keys() and built
    assert not [k for k in built if not torch.equal(built[k], by_vllm[k])], "the first install differs from vLLM's"
    again = hwsync.sync(llm, model, strategy="adapter")  # back to hwsync's own id (the reference replaced it)
    assert "adapter: built from vLLM's traced layout" in again.path, again.path
    perturb(model, 3)
    rewritten = hwsync.sync(llm, model, strategy="adapter")
    print(rewritten.line())
    assert "adapter: rewritten in place" in rewritten.path, rewritten.path
    lid = rewritten.lora_request.lora_int_id
    ours, ours_out = _slot_buffers(llm, lid), _logprobs(llm, rewritten.lora_request)
    with monkeypatch.context() as m:
        m.setenv("HWSYNC_DIRECT", "0")
        reference = hwsync.sync(llm, model, strategy="adapter", lora_int_id=lid + 1)  # a new id: vLLM builds it
    assert "adapter: built by vLLM" in reference.path, reference.path
    theirs = _slot_buffers(llm, lid + 1)
    assert ours.keys() == theirs.keys() and ours
    different = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not different, (
        f"slot buffers differ from vLLM's activation in {different[:6]} (max |Δ| "
        f"{max(float((ours[k].float() - theirs[k].float()).abs().max()) for k in different):.3g})"
    )
    assert ours_out == _logprobs(llm, reference.lora_request)


def test_direct_off_applies_to_a_cached_plan(
    llm: Any, tiny_qwen3_moe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``HWSYNC_DIRECT=0`` set after the plan was made (and proven) still routes every write through vLLM's own
    path: on an H100 the cached plan kept writing in place, so an injected post-processing failure never fired."""
    base = _model(tiny_qwen3_moe_dir, lora=False)
    for step in range(2):
        perturb(base, 10 + step, base=True)
        hwsync.sync(llm, base, strategy="full")
    proven = hwsync.sync(llm, base, strategy="full")
    model = _model(tiny_qwen3_moe_dir, lora=True)
    for step in range(2):
        perturb(model, 20 + step)
        adapter = hwsync.sync(llm, model, strategy="adapter")
    assert "adapter: rewritten in place" in adapter.path, adapter.path
    monkeypatch.setenv("HWSYNC_DIRECT", "0")
    perturb(base, 12, base=True)
    off = hwsync.sync(llm, base, strategy="full")
    assert "base: 0 in place" in off.path, (proven.path, off.path)
    perturb(model, 22)
    off = hwsync.sync(llm, model, strategy="adapter")
    assert "adapter: built by vLLM" in off.path, off.path


def test_steady_syncs_read_through_the_first_syncs_fold_buffers(
    llm: Any, tiny_qwen3_moe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first adapter sync that carries the base is followed by a steady plan (only the adapter): that plan reads
    the LoRA factors through the same reader and fold buffers as the first sync, so the engine's slot writes recorded
    at the install (one graph on a GPU) replay from the second sync on, instead of being recorded again then (an
    H200 run: second sync 114 ms vs 17 ms steady at 48 layers, before); and the engine validated it at the end of
    the first sync, so no later sync pays that either."""
    from hwsync.engine.vllm.worker import receiver_of
    from hwsync.trainer.api import as_engine, last_plan

    applier = receiver_of(llm.llm_engine.model_executor.driver_worker.worker).applier

    model = _model(tiny_qwen3_moe_dir, lora=True)  # a new model: the first sync carries its base
    perturb(model, 4)
    first = hwsync.sync(llm, model, strategy="adapter")
    assert "base weights sent" in first.reason, first.reason
    plan = last_plan(as_engine(llm), model)
    assert plan is not None and not plan.payload.includes_base  # the steady plan
    (reader,) = plan.payload.lora_readers.values()  # already there: the first sync's
    kept = [t.data_ptr() for t in reader.read(plan.info.lora_dtype and getattr(torch, plan.info.lora_dtype))]
    validated: list[Any] = []
    real = applier.validate
    monkeypatch.setattr(applier, "validate", lambda manifest: validated.append(manifest) or real(manifest))
    for seed in (5, 6):
        perturb(model, seed)
        hwsync.sync(llm, model, strategy="adapter")
        steady = last_plan(as_engine(llm), model)
        assert steady is plan and list(steady.payload.lora_readers.values()) == [reader]
    assert [t.data_ptr() for t in reader.read(plan.info.lora_dtype and getattr(torch, plan.info.lora_dtype))] == kept
    assert validated == []  # the steady plan was validated when it was made
    # vLLM's adapter holds views of the kept fold buffers where the engine's dtype is theirs (here: every B, whose
    # scaling is folded): the adapter is held once, not twice; what is left is copied (A: the parameter itself)
    from hwsync.common.lora_formats import kept_buffer
    from hwsync.engine.vllm.applier import lora_manager_of

    buffers = [t for t in reader.read(plan.info.lora_dtype and getattr(torch, plan.info.lora_dtype)) if kept_buffer(t)]
    assert buffers, "no kept fold buffer: the test's adapter folds no scaling"
    storages = {t.untyped_storage().data_ptr() for t in buffers}
    lid = as_engine(llm).state()["lora_int_id"]
    installed = lora_manager_of(llm.llm_engine.model_executor.driver_worker.worker).get_adapter(lid)
    held = [
        t
        for w in installed.loras.values()
        for f in ("lora_a", "lora_b")
        for t in (getattr(w, f) if isinstance(getattr(w, f), list) else [getattr(w, f)])
        if t is not None
    ]
    shared = [t for t in held if t.untyped_storage().data_ptr() in storages]
    assert shared and len(shared) < len(held), (len(shared), len(held))
    hwsync.verify(llm, model, PROMPTS)  # raises where the engine's adapter is not what the trainer holds
