"""Engine-own references: what vLLM serves when *vLLM itself* loads the weights a sync delivered.

On a GPU, vLLM and transformers do not compute the same logprobs (fused-MoE Triton matmuls run in TF32; LoRA kernels
need bf16), so "engine == trainer within 1e-4" cannot hold there even after a perfect sync. What does hold, exactly,
is the statement hwsync makes: the synced engine serves what the same engine serves when vLLM loads the same weights
through its own paths. :class:`EngineReference` builds that yardstick for the strategy the engine last synced:

* ``full``: a fresh engine, same engine arguments, started from a checkpoint of the merged view ``W0 + ΔW`` written by
  transformers' ``save_pretrained``;
* ``adapter``: a fresh engine on ``W0`` plus the trainer's adapter from PEFT's ``save_pretrained`` as a ``LoRARequest``
  (on an engine with ``enable_mixed_moe_lora_format=True`` as PEFT wrote it, ``is_3d_lora_weight=True``; on the
  default 2-D MoE-LoRA engine rewritten per expert exactly as vLLM's own ``_convert_3d_to_2d_moe_lora`` splits it);
* ``hybrid``: a fresh engine on ``W0`` with the modules the engine serves no LoRA on merged in, plus the adapter of
  the rest from disk.

The fresh engines live in a separate process (one per :class:`EngineReference`, started on first use): vLLM's
in-process shutdown tears down process-wide distributed state the synced engine still needs, and a LoRA request vLLM
refuses inside an in-process engine can leave the engine stuck. The latest engine is kept and reused while its
checkpoint is unchanged (adapter syncs), so only syncs that change base weights start a new one; a request identical
to an earlier one (the same content-addressed checkpoint, adapter bytes, engine arguments and prompts) gets that
earlier answer without an engine (:meth:`EngineReference._answer_key`).

:func:`assert_serves` is what converted tests call: on vLLM's CPU build it is exactly ``hwsync.verify`` (engine vs
trainer, ``atol``); elsewhere it compares the engine with its reference (``EXACT_ATOL``). Adapters compare
bit-exactly whatever their scalings (rsLoRA, rank/alpha patterns): hwsync folds each scaling into B in vLLM's own
rounding order (:func:`hwsync.common.lora_formats.fold_scaling`; the matrix of configurations:
``tests/test_lora_configs.py``). :func:`write_adapter` writes what ``save_pretrained`` wrote, with the two config fields
vLLM refuses although they change nothing on the served base rewritten (an init that rewrote the base, a ``bias`` that
trained none).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import tempfile
import traceback
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from .engine import on_cpu

__all__ = [
    "EXACT_ATOL",
    "EngineReference",
    "ReferenceMismatch",
    "assert_serves",
    "bit_exact",
    "compared_with_reference",
    "compare_logprobs",
    "experts",
    "peft_moe_lora_to_2d",
    "write_adapter",
    "write_checkpoint",
]

_CONTENT_ADDRESSED = re.compile(r"ckpt-[0-9a-f]{16}")
"""A checkpoint directory :func:`write_checkpoint` named after the digest of its content."""

EXACT_ATOL = 1e-6
"""Largest |Δ logprob| accepted between a synced engine and its engine-own reference (measured: 0.0)."""

Logprobs = list[tuple[list[int], list[float]]]


class ReferenceMismatch(AssertionError):
    """The synced engine does not serve what vLLM serves from the same weights (or the reference failed)."""


def experts(name: str) -> bool:
    """Selects MoE expert tensors (trainer or PEFT adapter names)."""
    return ".mlp.experts" in name


def hybrid_merged_by(target: Any, model: Any) -> Callable[[str], bool]:
    """Selects the tensors (trainer or PEFT adapter names) a ``hybrid`` sync of ``model`` into ``target`` merges, as
    hwsync decides it for that engine (the modules it reports unservable as LoRA and their companions: the whole
    experts block, the other parts of a packed projection) -- the same decision the sync took, on any platform,
    instead of a guess from the platform (which cannot know, e.g., that MiniMax-M2's ``mlp.experts`` match no vLLM
    LoRA wrapper, or that vLLM cannot pack the Transformers backend's experts)."""
    from hwsync.trainer.api import as_engine, describe_for
    from hwsync.trainer.payload import companions, merged_names
    from hwsync.trainer.strategy import choose

    info, lora = describe_for(as_engine(target), model)  # a model hybrid cannot sync: choose raises why
    names = merged_names(model)
    merged = companions(choose("hybrid", lora, info).unservable, names, info.packed_modules_mapping)
    modules = tuple(sorted({n.rpartition(".")[0] + "." for n in merged}))

    def pick(name: str) -> bool:
        if name in merged:
            return True
        key = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        return ".lora_" in key and key.startswith(modules)

    return pick


def _has_tensors(adapter: Path) -> bool:
    from safetensors import safe_open

    with safe_open(str(Path(adapter) / "adapter_model.safetensors"), "pt") as f:
        return bool(list(f.keys()))


# ---------------------------------------------------------------------------------------------------------------
# what vLLM loads from disk
# ---------------------------------------------------------------------------------------------------------------
def _base_weights(model: Any) -> dict[str, Any]:
    """Trainer runtime name -> ``W0`` (LoRA factors left out; first of duplicate spellings wins; a 4-bit QLoRA base
    dequantized, as :func:`hwsync.trainer.merged.plain_weight` sends it)."""
    from hwsync.trainer.merged import plain_weight, strip_peft_name

    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        if ".lora_" in name or "lora_magnitude_vector" in name:
            continue
        clean = strip_peft_name(name)
        if clean not in out:
            out[clean] = plain_weight(model, name, p)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    persistent = set(base.state_dict(keep_vars=True))
    for name, b in base.named_buffers():  # persistent buffers are checkpoint tensors too (LFM2-MoE's expert_bias)
        if name in persistent and name not in out:
            out[name] = b
    return out


def _plain_config(model: Any) -> Any:
    """The trainer's config without its quantization: the ``config.json`` a written checkpoint carries."""
    import copy

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = copy.deepcopy(base.config)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    return config


def _plain_model(config: Any) -> Any:
    """An unquantized, weightless (``meta``) instance of the model class of ``config`` (:func:`_plain_config`): what
    writes the checkpoint. (``save_pretrained`` of a quantized or PEFT-wrapped model writes its own state instead of
    the one given.)"""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def write_checkpoint(model: Any, root: Path, merged: Callable[[str], bool] | bool = True, dtype: Any = None) -> Path:
    """Save the weights a sync delivers as a transformers checkpoint under ``root``; return its directory.

    ``merged`` selects the tensors taken from the merged view ``W0 + ΔW``
    (:func:`hwsync.trainer.merged.merged_named_weights`, the values ``full``/``hybrid`` send; dequantized for QLoRA
    bases); the others are the base ``W0``. ``dtype`` casts floating tensors (e.g. bf16, as the engine will hold them).
    The directory is named after a digest of the config and the tensors, so an unchanged model maps to the same
    directory (and the same reference engine). The config is part of the key: two families can hold the very same
    tensors (the family matrix's tiny DeepSeek-V3 and GLM-4-MoE-lite do, bit for bit), and a directory keyed by tensors
    alone served the other family's architecture.
    """
    import torch

    from hwsync.trainer.merged import merged_named_weights

    pick = (lambda _n: merged) if isinstance(merged, bool) else merged
    weights = _base_weights(model)
    for name, t in merged_named_weights(model, include=pick):
        weights[name] = t
    if dtype is not None:
        weights = {n: t.to(dtype) if t.is_floating_point() else t for n, t in weights.items()}
    config = _plain_config(model)
    # the trainer's generation config too: its eos ids are the engine's stop tokens (the tiny models stop on two; a
    # checkpoint with config.json's one made the reference decode past <|endoftext|> where the engine stopped)
    generation = getattr(model, "generation_config", None)
    digest = hashlib.sha1(config.to_json_string(use_diff=False).encode())
    if generation is not None:
        digest.update(generation.to_json_string(use_diff=False).encode())
    for name in sorted(weights):
        t = weights[name].detach().to("cpu").contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    out = Path(root) / f"ckpt-{digest.hexdigest()[:16]}"
    if not (out / "config.json").exists():
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".ckpt-"))
        _plain_model(config).save_pretrained(
            tmp, state_dict={n: t.detach().to("cpu").contiguous() for n, t in weights.items()}
        )
        if generation is not None:
            with contextlib.suppress(ValueError):  # one transformers refuses to save as invalid: config.json's eos
                generation.save_pretrained(tmp)
        tmp.rename(out)
    return out


def peft_moe_lora_to_2d(
    tensors: Mapping[str, Any], num_experts: int, gate_up_interleaved: bool = False, in_out: Collection[str] = ()
) -> dict[str, Any]:
    """PEFT's fused 3-D expert LoRA (``experts.base_layer.lora_{A,B}`` = gate_up, ``experts.lora_{A,B}`` = down) as
    vLLM's 2-D per-expert keys (``experts.{e}.{gate,up,down}_proj.lora_{A,B}.weight``), split exactly as vLLM's
    ``LoRAModelManager._convert_3d_to_2d_moe_lora`` does: A rows expert-major ``(E, r, in)``, B columns rank-major
    ``(out, r, E)``, gate/up halves of the gate_up output (interleaved for GPT-OSS). Other tensors pass through.
    ``in_out``: owners (the key prefix before ``.experts``) whose experts PEFT adapted as ``[E, out, in]`` while they
    are stored ``[E, in, out]`` (transformers' Llama 4): there PEFT's ``B A`` is the transposed linear ΔW, so each
    expert's linear factors are ``Bᵀ`` (A) and ``Aᵀ`` (B)."""
    out: dict[str, Any] = {}
    pairs: dict[str, dict[str, Any]] = {}
    for key, t in tensors.items():
        if ".experts.base_layer.lora_" in key:
            owner, rest = key.split(".experts.base_layer.", 1)
            pairs.setdefault(owner, {})["gu_" + rest[len("lora_") :][0]] = t
        elif ".experts.lora_" in key:
            owner, rest = key.split(".experts.", 1)
            pairs.setdefault(owner, {})["d_" + rest[len("lora_") :][0]] = t
        else:
            out[key] = t
    for owner, p in pairs.items():
        if set(p) != {"gu_A", "gu_B", "d_A", "d_B"}:
            raise ValueError(f"{owner}.experts: expected gate_up and down LoRA pairs, got {sorted(p)}")
        e = num_experts
        gu_a = p["gu_A"].reshape(e, -1, p["gu_A"].shape[-1])
        gu_b = p["gu_B"].reshape(p["gu_B"].shape[0], -1, e).permute(2, 0, 1)
        d_a = p["d_A"].reshape(e, -1, p["d_A"].shape[-1])
        d_b = p["d_B"].reshape(p["d_B"].shape[0], -1, e).permute(2, 0, 1)
        if owner in in_out:
            gu_a, gu_b = gu_b.transpose(1, 2), gu_a.transpose(1, 2)
            d_a, d_b = d_b.transpose(1, 2), d_a.transpose(1, 2)
        half = gu_b.shape[1] // 2
        gate_b, up_b = (gu_b[:, ::2], gu_b[:, 1::2]) if gate_up_interleaved else (gu_b[:, :half], gu_b[:, half:])
        for i in range(e):
            pre = f"{owner}.experts.{i}"
            # own storage each (gate and up share A; safetensors refuses shared storage)
            out[f"{pre}.gate_proj.lora_A.weight"] = gu_a[i].clone()
            out[f"{pre}.gate_proj.lora_B.weight"] = gate_b[i].clone()
            out[f"{pre}.up_proj.lora_A.weight"] = gu_a[i].clone()
            out[f"{pre}.up_proj.lora_B.weight"] = up_b[i].clone()
            out[f"{pre}.down_proj.lora_A.weight"] = d_a[i].clone()
            out[f"{pre}.down_proj.lora_B.weight"] = d_b[i].clone()
    return out


def _peft_in_out_owners(model: Any) -> set[str]:
    """Key owners (``base_model.model....feed_forward``) of the experts PEFT adapted as ``[E, out, in]`` although
    their gate_up/down shapes say ``[E, in, out]`` (:func:`peft_moe_lora_to_2d` ``in_out``)."""
    from peft.tuners.lora.layer import ParamWrapper

    from hwsync.common.lora_formats import experts_stored_in_out

    owners = set()
    for path, layer in model.named_modules():
        if (
            isinstance(layer, ParamWrapper)
            and layer._did_swap_in_out_features
            and experts_stored_in_out(layer.get_base_layer()) is True
            and ".experts" in path
        ):
            owners.add(path[: path.index(".experts")])
    return owners


def write_adapter(
    model: Any,
    out: Path,
    *,
    drop: Callable[[str], bool] | None = None,
    moe_format: str = "3d",
    num_experts: int | None = None,
    rows: Mapping[str, Any] | None = None,
) -> Path:
    """The trainer's active adapter as PEFT's ``save_pretrained`` writes it, into ``out``.

    ``drop(key)`` removes tensors (the modules a hybrid sync merges instead). ``moe_format="2d"`` rewrites fused
    expert LoRA per expert (:func:`peft_moe_lora_to_2d`) for engines without ``enable_mixed_moe_lora_format``.
    ``rows`` (module path -> row index): B rows reordered as the engine's loader reorders that module's base weight
    (what hwsync delivers for Llama 4's q/k, :attr:`hwsync.common.lora_layout.LoraLayout.row_orders`).
    """
    from safetensors.torch import load_file, save_file

    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    tmp = Path(tempfile.mkdtemp(prefix=".adapter-", dir=out.parent))
    active = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapter[0]
    model.save_pretrained(tmp, selected_adapters=[active])
    src = tmp if (tmp / "adapter_config.json").exists() else tmp / active
    tensors = load_file(str(src / "adapter_model.safetensors"))
    if drop is not None:
        tensors = {k: v for k, v in tensors.items() if not drop(k)}
    for key in list(tensors) if rows else ():
        module = key.removeprefix("base_model.model.").removesuffix(".lora_B.weight")
        if key.endswith(".lora_B.weight") and module in rows:  # type: ignore[operator]
            tensors[key] = tensors[key][rows[module]]  # type: ignore[index]
    config = json.loads((src / "adapter_config.json").read_text())
    if moe_format == "2d" and any(".experts." in k and ".experts.0." not in k for k in tensors):
        if num_experts is None:
            num_experts = int(getattr(model.config, "num_experts", 0) or model.config.num_local_experts)
        _per_expert_patterns(config, tensors, num_experts)
        tensors = peft_moe_lora_to_2d(tensors, num_experts, in_out=_peft_in_out_owners(model))
    _served_as_is(config, model, tensors)
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    shutil.rmtree(tmp)
    return out


def _per_expert_patterns(config: dict[str, Any], tensors: Mapping[str, Any], num_experts: int) -> None:
    """The rank/alpha of PEFT's fused expert LoRA (``rank_pattern``/``alpha_pattern`` keys match
    ``experts.gate_up_proj`` / ``experts.down_proj``, as vLLM's ``get_rank_and_scaling`` matches its 3-D keys)
    written as explicit patterns of the per-expert 2-D keys :func:`peft_moe_lora_to_2d` makes, first in each pattern:
    the 2-D adapter carries the scalings vLLM applies to the 3-D one."""
    from hwsync.common.lora_formats import pattern_value

    rp, ap = dict(config.get("rank_pattern") or {}), dict(config.get("alpha_pattern") or {})
    if not rp and not ap:
        return
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    for key in tensors:
        for marker, pname, parts in (
            (".experts.base_layer.lora_A", "gate_up_proj", ("gate_proj", "up_proj")),
            (".experts.lora_A", "down_proj", ("down_proj",)),
        ):
            if marker not in key:
                continue
            owner = key.split(marker)[0].removeprefix("base_model.model.") + ".experts"
            r, a = pattern_value(rp, f"{owner}.{pname}"), pattern_value(ap, f"{owner}.{pname}")
            for e in range(num_experts):
                for part in parts:
                    name = re.escape(f"{owner}.{e}.{part}")
                    if r is not None:
                        ranks[name] = int(r)
                    if a is not None:
                        alphas[name] = float(a)
    config["rank_pattern"] = {**ranks, **rp}
    config["alpha_pattern"] = {**alphas, **ap}


def _served_as_is(config: dict[str, Any], model: Any, tensors: Mapping[str, Any]) -> None:
    """Config fields vLLM's own loader refuses although they change nothing about these tensors on this base:
    ``init_lora_weights`` of an init that rewrote the base (PiSSA, OLoRA, ...: the checkpoint served is the trainer's
    residual base, which is what vLLM's refusal asks for: "set init_lora_weights to true if the served base model
    already contains the modified weights"); ``bias`` when the adapter saved no bias tensor (it trained none)."""
    from hwsync.common.lora_formats import base_init

    if base_init(config) is not None:
        config["init_lora_weights"] = True
    if config.get("bias", "none") != "none" and not any(k.endswith(".bias") for k in tensors):
        config["bias"] = "none"


def compare_logprobs(got: Logprobs, want: Logprobs, what: str = "engine vs reference") -> float:
    """Max |Δ logprob| of two engines' answers on the same prompts; raises :class:`ReferenceMismatch` when their
    greedy tokens differ (both engines run the same greedy decode, so different tokens are a difference of weights)."""
    worst = 0.0
    for i, ((ids_g, vals_g), (ids_w, vals_w)) in enumerate(zip(got, want, strict=True)):
        if ids_g != ids_w:
            raise ReferenceMismatch(f"{what}: prompt {i} decodes to different tokens: {ids_g} vs {ids_w}")
        for v_g, v_w in zip(vals_g, vals_w, strict=True):
            d = abs(v_g - v_w)
            if not d <= worst:  # also NaN
                worst = float("nan") if d != d else d
    return worst


# ---------------------------------------------------------------------------------------------------------------
# the reference process
# ---------------------------------------------------------------------------------------------------------------
def _serve(conn: Any, threads: int) -> None:
    """Reference process: build/keep a fresh engine per checkpoint, answer greedy logprob requests."""
    import torch

    torch.set_num_threads(threads)  # the same as the synced engine's process: CPU results depend on it
    from hwsync.engine import vllm_plugin
    from hwsync.testing.engine import close_llm, make_llm, register_in_process

    vllm_plugin.register()  # what VLLM_PLUGINS=hwsync does: e.g. MoE + enable_lora on vLLM's CPU build
    os.environ["VLLM_PLUGINS"] = "hwsync"  # ... and in the engine's worker processes (mp executor, TP > 1)
    llm: Any = None
    key: tuple[str, str] | None = None
    while True:
        msg = conn.recv()
        if msg is None:
            break
        try:
            want = (msg["checkpoint"], json.dumps(msg["engine"], sort_keys=True, default=str))
            if key != want:
                if llm is not None:
                    close_llm(llm)
                    llm = None
                register_in_process(msg["checkpoint"])  # vLLM would inspect a new architecture in a subprocess
                llm, key = make_llm(msg["checkpoint"], **msg["engine"]), want
            from vllm import SamplingParams
            from vllm.lora.request import LoRARequest

            request = None
            if msg.get("adapter"):
                request = LoRARequest(
                    f"reference-{msg['lora_id']}",
                    msg["lora_id"],
                    msg["adapter"],
                    is_3d_lora_weight=bool(msg.get("is_3d")),
                )
            params = SamplingParams(
                max_tokens=msg["max_tokens"], temperature=0.0, logprobs=0, prompt_logprobs=0, detokenize=False
            )
            outs = llm.generate(
                [{"prompt_token_ids": list(p)} for p in msg["prompts"]], params, lora_request=request, use_tqdm=False
            )
            result = []
            for o in outs:
                comp = o.outputs[0]
                ids = list(o.prompt_token_ids) + list(comp.token_ids)
                vals = [pos[t].logprob for pos, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
                vals += [pos[t].logprob for pos, t in zip(comp.logprobs, comp.token_ids)]
                result.append((ids, vals))
            if request is not None:
                llm.llm_engine.remove_lora(request.lora_int_id)
            conn.send(("ok", result))
        except BaseException:  # noqa: BLE001  (reported to the test process, which raises it)
            conn.send(("error", traceback.format_exc()))
    if llm is not None:
        close_llm(llm)


class EngineReference:
    """vLLM's own loading of the weights a sync delivered, in a separate process (see the module docstring).

    ``engine_kwargs`` are the synced engine's :func:`~hwsync.testing.make_llm` arguments (``worker_extension_cls``
    is dropped: the reference engine is plain vLLM). ``hybrid_merged`` selects the trainer tensors a ``hybrid`` sync
    merges (default: hwsync's own decision for the checked engine, :func:`hybrid_merged_by`). ``checkpoint_dtype``
    casts the written checkpoints. ``base_checkpoint``: the directory an ``adapter`` reference engine starts from
    instead of a checkpoint of the trainer's ``W0`` (e.g. the pre-quantized checkpoint a 4-bit engine serves).
    ``daemon=False`` lets the reference engine start worker processes (``distributed_executor_backend="mp"``, tensor
    parallel); :meth:`close` (or the context manager) must then stop it. :meth:`configure` points the same process
    at another engine's arguments (one reference process for many models, e.g. the family matrix).
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        hybrid_merged: Callable[[str], bool] | None = None,
        checkpoint_dtype: Any = None,
        base_checkpoint: str | os.PathLike[str] | None = None,
        timeout_s: float = 600.0,
        daemon: bool = True,
        **engine_kwargs: Any,
    ) -> None:
        self.checkpoint_dtype = checkpoint_dtype
        self.base_checkpoint = Path(base_checkpoint) if base_checkpoint is not None else None
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.engine: dict[str, Any] = {}
        self.hybrid_merged = hybrid_merged
        self.adapter_rows: Mapping[str, Any] | None = None
        self.configure(hybrid_merged=hybrid_merged, **engine_kwargs)
        self.timeout_s = timeout_s
        self.daemon = daemon
        self._proc: Any = None
        self._conn: Any = None
        self._lora_id = 1000
        self.engines_started = 0
        self._answers: dict[str, Logprobs] = {}
        self.answers_reused = 0
        """Checks answered from an earlier identical request (see :meth:`_answer_key`) without an engine."""

    def configure(
        self,
        *,
        hybrid_merged: Callable[[str], bool] | None = None,
        adapter_rows: Mapping[str, Any] | None = None,
        **engine_kwargs: Any,
    ) -> EngineReference:
        """Compare with an engine of these arguments from now on (same process; its engine is rebuilt on the next
        check). ``adapter_rows``: see :func:`write_adapter` ``rows``."""
        self.engine = {k: v for k, v in engine_kwargs.items() if k not in ("worker_extension_cls", "model")}
        self.engine.setdefault("skip_tokenizer_init", True)
        self.hybrid_merged = hybrid_merged
        self.adapter_rows = adapter_rows
        return self

    # -- what the engine should serve ------------------------------------------------------------------------------
    @property
    def moe_format(self) -> str:
        """``"3d"`` on an engine that takes PEFT's fused expert LoRA (``enable_mixed_moe_lora_format``), else
        ``"2d"``."""
        return "3d" if self.engine.get("enable_mixed_moe_lora_format") else "2d"

    def serves_expert_lora(self) -> bool:
        """Whether the engine serves LoRA on MoE experts (a platform with MoE-LoRA kernels, experts targeted)."""
        if on_cpu() or not self.engine.get("enable_lora"):
            return False
        from hwsync.common.capabilities import vllm_capabilities

        targets = self.engine.get("lora_target_modules")
        return bool(vllm_capabilities()["moe_lora"]["supported"]) and (not targets or "experts" in targets)

    def logprobs(
        self, model: Any, strategy: str, prompts: Sequence[Sequence[int]], max_tokens: int = 4, *, engine: Any = None
    ) -> Logprobs:
        """Greedy logprobs of a fresh engine fed, by vLLM's own loaders, the weights ``strategy`` syncs of ``model``
        (into ``engine``: for ``hybrid``, what it merges is hwsync's decision for that engine, :func:`hybrid_merged_by`,
        unless ``hybrid_merged`` was given)."""
        if strategy not in ("full", "adapter", "hybrid"):
            raise ValueError(f"no reference for strategy {strategy!r}")
        peft = getattr(model, "peft_config", None)
        dtype = self.checkpoint_dtype
        if strategy == "full" or not peft:
            return self._ask(write_checkpoint(model, self.workdir, True, dtype), None, prompts, max_tokens)
        merged = self.hybrid_merged
        if strategy == "hybrid" and merged is None:
            if engine is None:  # no guess from the platform: it kept MiniMax-M2's expert LoRA, which hwsync merges
                raise ValueError(
                    "a hybrid reference needs the synced engine (engine=...: what hwsync merged there) "
                    "or hybrid_merged=..."
                )
            merged = hybrid_merged_by(engine, model)
        pick: Callable[[str], bool] = merged if strategy == "hybrid" and merged is not None else (lambda _n: False)
        if strategy == "adapter" and self.base_checkpoint is not None:
            ckpt = self.base_checkpoint
        else:
            ckpt = write_checkpoint(model, self.workdir, pick, dtype)
        written = write_adapter(
            model, self.workdir / "adapter", drop=pick, moe_format=self.moe_format, rows=self.adapter_rows
        )
        # hybrid merged every adapted module: the engine serves no adapter
        return self._ask(ckpt, written if _has_tensors(written) else None, prompts, max_tokens)

    def check(
        self,
        target: Any,
        model: Any,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int = 4,
        atol: float = EXACT_ATOL,
        strategy: str | None = None,
    ) -> float:
        """Max |Δ logprob| between the synced engine ``target`` and its reference for ``strategy`` (default: the one
        it last synced); raises :class:`ReferenceMismatch` above ``atol`` or when greedy tokens differ."""
        from hwsync.trainer.api import as_queries

        engine = as_queries(target)
        strategy = strategy or engine.state().get("strategy") or "full"
        got = engine.logprobs(prompts, max_tokens)
        want = self.logprobs(model, strategy, prompts, max_tokens, engine=engine)
        worst = compare_logprobs(got, want, f"{strategy} sync")
        if not worst <= atol:
            raise ReferenceMismatch(
                f"{strategy} sync: the engine serves max |Δ logprob| = {worst:.3g} away from "
                f"vLLM's own loading of the same weights (atol {atol:g})"
            )
        return worst

    def diff(
        self,
        target: Any,
        model: Any,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int = 4,
        strategy: str | None = None,
    ) -> float:
        """Like :meth:`check` but only measures: ``inf`` when the greedy tokens differ (benchmarks report it)."""
        try:
            return self.check(target, model, prompts, max_tokens=max_tokens, atol=float("inf"), strategy=strategy)
        except ReferenceMismatch:
            return float("inf")

    # -- the process -----------------------------------------------------------------------------------------------
    def _ask(
        self, checkpoint: Path, adapter: Path | None, prompts: Sequence[Sequence[int]], max_tokens: int
    ) -> Logprobs:
        key = self._answer_key(checkpoint, adapter, prompts, max_tokens)
        if key is not None and key in self._answers:
            self.answers_reused += 1
            return [(list(ids), list(vals)) for ids, vals in self._answers[key]]
        if self._proc is None or not self._proc.is_alive():
            self._start()
        self._lora_id += 1
        msg = {
            "checkpoint": str(checkpoint),
            "engine": self.engine,
            "prompts": [list(p) for p in prompts],
            "max_tokens": max_tokens,
            "adapter": str(adapter) if adapter else None,
            "lora_id": self._lora_id,
            "is_3d": self.moe_format == "3d",
        }
        if self._last_checkpoint != str(checkpoint):
            self.engines_started += 1
            self._last_checkpoint = str(checkpoint)
        self._conn.send(msg)
        if not self._conn.poll(self.timeout_s):
            self.close()
            raise ReferenceMismatch(f"the reference engine did not answer within {self.timeout_s:.0f} s (stopped it)")
        status, payload = self._conn.recv()
        if status != "ok":
            self.close()
            # the exception first (a report cut to one line keeps it), then the whole traceback
            lines = [ln for ln in str(payload).splitlines() if ln.strip()]
            raise ReferenceMismatch(f"the reference engine failed: {lines[-1].strip() if lines else '?'}\n{payload}")
        if key is not None:
            self._answers[key] = [(list(ids), list(vals)) for ids, vals in payload]
        return payload

    def _answer_key(
        self, checkpoint: Path, adapter: Path | None, prompts: Sequence[Sequence[int]], max_tokens: int
    ) -> str | None:
        """What determines a fresh engine's answer, as a key (``None``: not memoized): the checkpoint -- only one
        :func:`write_checkpoint` wrote, whose directory name is the digest of its config and tensors --, the bytes of
        every adapter file, the engine arguments, the prompts. The same key is the same weights loaded by vLLM's own
        loaders into an engine of the same arguments: a fresh engine answers it as the first one did (greedy, same
        batch; the exactness checks rely on that determinism), so the answer is kept instead of starting it again."""
        if not _CONTENT_ADDRESSED.fullmatch(Path(checkpoint).name):
            return None
        digest = hashlib.sha1(Path(checkpoint).name.encode())
        if adapter is not None:
            for f in sorted(Path(adapter).rglob("*")):
                if f.is_file():
                    digest.update(str(f.relative_to(adapter)).encode() + b"\0" + f.read_bytes())
        digest.update(
            json.dumps(
                [self.engine, self.moe_format, [list(p) for p in prompts], max_tokens], sort_keys=True, default=str
            ).encode()
        )
        return digest.hexdigest()

    _last_checkpoint: str | None = None

    def _start(self) -> None:
        import torch

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve, args=(child, torch.get_num_threads()), daemon=self.daemon, name="hwsync-reference-engine"
        )
        self._proc.start()
        child.close()
        self._last_checkpoint = None

    def close(self) -> None:
        """Stop the reference process (also done at interpreter exit: it is a daemon)."""
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if proc is None:
            return
        try:
            if proc.is_alive():
                conn.send(None)
                proc.join(timeout=60)
        except (OSError, EOFError, BrokenPipeError):
            pass
        if proc.is_alive():
            proc.kill()
            proc.join()

    def __enter__(self) -> EngineReference:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def compared_with_reference(i: int, n: int, path: str, previous_path: str | None) -> bool:
    """Whether sync ``i`` (0-based) of a sequence of ``n`` syncs of one trainer into one engine needs vLLM's own
    loading as its yardstick: the first (plan, first writes), the second (the first steady sync: in-place rewrites),
    the last, and every sync whose report names another path (``SyncReport.path``) than the sync before it (a
    strategy or writer switch). The others repeat the path of a compared sync with new values: :func:`bit_exact`
    checks them (and a sync it cannot vouch for is compared with the reference after all)."""
    return i <= 1 or i == n - 1 or path != previous_path


def bit_exact(target: Any, model: Any, prompts: Sequence[Sequence[int]], strategy: str) -> bool:
    """``hwsync.verify.check`` of ``target`` (an engine in this process) against ``model`` after a ``strategy`` sync:
    raises :class:`ReferenceMismatch` when it fails; True only when its content comparison ran completely and found
    every compared tensor bit-equal to the trainer's -- nothing skipped, the content check the strategy writes
    present (``base content`` for ``full``, ``adapter content`` otherwise), every content check at deviation 0 (not
    merely within its last-bits allowance) with no tensor unreadable here (e.g. repacked on load). False: the caller
    compares this sync with vLLM's own loading instead."""
    from hwsync.trainer.verify import check

    verdict = check(target, model, prompts)
    if not verdict.ok:
        raise ReferenceMismatch(f"{strategy} sync: hwsync.verify fails: {verdict.message()}")
    if verdict.skipped:
        return False
    content = [c for c in verdict.checks if c.name in ("base content", "adapter content")]
    need = "base content" if strategy == "full" else "adapter content"
    return any(c.name == need for c in content) and all(
        c.ok and c.value == 0 and "not readable" not in c.detail for c in content
    )


def assert_serves(
    target: Any,
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    atol: float = 1e-4,
    max_tokens: int = 4,
    reference: EngineReference | None = None,
) -> float:
    """The check converted tests make after a sync; returns the max |Δ logprob| it measured.

    On vLLM's CPU build: ``hwsync.verify(target, model, prompts, atol=atol, max_tokens=max_tokens)``, unchanged (the
    engine equals the trainer). Elsewhere (GPUs: TF32 fused MoE, bf16 LoRA): ``reference.check`` -- the engine equals
    vLLM's own loading of the same weights within :data:`EXACT_ATOL`.
    """
    if on_cpu():
        import hwsync

        return hwsync.verify(target, model, prompts, atol=atol, max_tokens=max_tokens)
    if reference is None:
        raise ValueError(
            "off vLLM's CPU build an engine cannot match transformers within atol: pass "
            "reference=EngineReference(...) (the engine's own loading of the same weights)"
        )
    return reference.check(target, model, prompts, max_tokens=max_tokens)
