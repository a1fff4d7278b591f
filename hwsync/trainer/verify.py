"""Does the engine serve the trainer's policy? Exact content checks plus a logprob gate per platform and dtype.

A fixed logprob tolerance cannot tell a broken sync from GPU numerics (a correct sync differs from the trainer by up
to ~0.5 in fp32 with TF32 fused MoE and ~2 in bf16), so :func:`check` gathers two kinds of evidence (docs/verify.md):

* **content** (exact, no numerics): the engine's receiver state against the trainer's last sync, and fingerprints
  (:mod:`hwsync.common.fingerprint`) of what the engine's kernels read -- base weights, LoRA slots, the installed
  adapter -- read back through the sync plan and compared with the trainer's tensors;
* **logprobs**: engine vs trainer over prompt + greedy tokens (one helper computes the trainer's,
  :func:`token_logprobs`, one reads the engine's, :func:`engine_logprobs`), summarized by mean, 90th percentile and
  mean |Δ probability| against the gate of the engine's device/dtype (:data:`GATES`).

:func:`verify` raises :class:`~hwsync.common.errors.VerifyError` naming each failed check and its fix.
"""

from __future__ import annotations

import logging
import math
import sys
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hwsync.common.errors import OptionError, SyncError, UnsupportedSetupError, VerifyError
from hwsync.common.gate import LOOSEST, Gate
from hwsync.common.target import EngineQueries
from hwsync.common.wire import TensorSpec, dtype_name
from hwsync.engine.vllm.outputs import engine_logprobs  # the engine half of the pair, re-exported
from hwsync.trainer.api import SyncedPlan, SyncPlan, as_queries, last_plan
from hwsync.trainer.payload import Payload

logger = logging.getLogger("hwsync")

__all__ = [
    "GATES",
    "NUMERICS_FACTOR",
    "RECURRENT_16BIT",
    "Agreement",
    "Check",
    "Gate",
    "Spread",
    "VerifyReport",
    "agreement",
    "as_vllm_loads",
    "check",
    "decoder_layers",
    "engine_logprobs",
    "gate_for",
    "has_linear_attention",
    "numerics_spread",
    "parse_gate",
    "rounding_unit",
    "spread_ratio",
    "token_logprobs",
    "trainer_gate",
    "verify",
]


def _scores(model: nn.Module, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Under ``model`` (eval mode, no grad, fp32 log-softmax): for t >= 1 the logprob of ``ids[t]`` given
    ``ids[:t]``, the argmax token there, and its logprob (on the CPU)."""
    device = next(model.parameters()).device
    x = torch.as_tensor(list(ids), dtype=torch.long, device=device).unsqueeze(0)
    was_training = model.training
    model.eval()
    for m in model.modules():
        # bitsandbytes (0.50) repacks a 4-bit layer's weight in place for a bf16 CPU kernel at its first eval-mode,
        # no-grad forward on a CPU with AVX512-BF16 (hwsync.trainer.merged.repacked_for_cpu): checking the trainer must
        # not change how it computes. The flag only decides that repack (dropout lives in other modules)
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.training = True
    try:
        with torch.no_grad():
            logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
    finally:
        model.train(was_training)
    logp = torch.log_softmax(logits, -1)
    best, arg = logp.max(-1)
    return logp.gather(1, x[0, 1:, None])[:, 0].cpu(), arg.cpu(), best.cpu()


def token_logprobs(model: nn.Module, ids: Sequence[int]) -> torch.Tensor:
    """The trainer's fp32 logprob of each ``ids[t]`` (t >= 1) given ``ids[:t]``, aligned with
    :func:`engine_logprobs` (``model``: any transformers causal LM, PEFT-wrapped too; eval mode, no grad)."""
    return _scores(model, ids)[0]


@dataclass(frozen=True)
class Agreement:
    """How closely an engine follows the trainer on some prompts (see :func:`agreement`)."""

    max_abs_diff: float
    """Max |Δ logprob| over every prompt token and greedy-generated token."""
    where: str
    tokens: int
    """Number of logprobs compared."""
    greedy_mismatches: tuple[str, ...]
    """Generated positions where the engine's greedy token is not the trainer's argmax (and not a near-tie)."""
    mean_abs_diff: float = 0.0
    """Mean |Δ logprob| over the same tokens."""
    p90_abs_diff: float = 0.0
    """90th percentile of |Δ logprob| (robust to the few near-tie routing flips of bf16 MoE kernels)."""
    mean_prob_diff: float = 0.0
    """Mean |Δ probability| of the same tokens (verl's rollout-vs-trainer gate)."""
    sequences: tuple[tuple[tuple[int, ...], torch.Tensor], ...] = field(default=(), compare=False, repr=False)
    """Each prompt's token ids (prompt + the engine's greedy tokens) with the trainer's logprobs of them: what
    :func:`numerics_spread` perturbs."""


def agreement(
    target: Any,
    model: nn.Module,
    prompt_token_ids: Sequence[Sequence[int]],
    *,
    max_tokens: int = 4,
    tie: float = 2e-4,
    batch: bool = True,
) -> Agreement:
    """Run ``prompt_token_ids`` through the engine (greedy, ``max_tokens`` new tokens) and through ``model`` on the
    engine's own ids; compare logprobs everywhere and the greedy choice at each generated position (a trainer
    argmax that beats the engine's token by at most ``tie`` counts as a tie, not a mismatch)."""
    if not prompt_token_ids or any(len(p) < 1 for p in prompt_token_ids):
        raise VerifyError("verify needs at least one non-empty prompt (a list of token-id lists)")
    engine = as_queries(target)
    worst, where, count = 0.0, "", 0
    mismatches: list[str] = []
    diffs: list[torch.Tensor] = []
    pdiffs: list[torch.Tensor] = []
    # batch=False: one prompt per engine call (vLLM 0.32 with enable_lora computes prompt logprobs through the LoRA
    # logits processor with one LoRA index per request, which only broadcasts over a single request's tokens)
    outputs = (
        engine.logprobs(prompt_token_ids, max_tokens)
        if batch
        else [engine.logprobs([p], max_tokens)[0] for p in prompt_token_ids]
    )
    sequences = []
    for prompt, (ids, values) in zip(prompt_token_ids, outputs):
        ref, arg, best = _scores(model, ids)
        sequences.append((tuple(ids), ref))
        got = torch.tensor(values, dtype=torch.float32)
        if got.shape != ref.shape:
            raise VerifyError(f"engine returned {got.numel()} logprobs for {len(ids)} tokens")
        diff = (got - ref).abs()
        count += diff.numel()
        diffs.append(diff)
        pdiffs.append((got.exp() - ref.exp()).abs())
        if diff.numel() and (float(diff.max()) > worst or not where or diff.isnan().any()):
            worst = float("nan") if diff.isnan().any() else max(worst, float(diff.max()))
            where = f"prompt of {len(prompt)} tokens, position {int(diff.nan_to_num(float('inf')).argmax()) + 1}"
        for t in range(len(prompt) - 1, len(ids) - 1):
            token = ids[t + 1]
            if int(arg[t]) != token and float(best[t] - ref[t]) > tie:
                mismatches.append(
                    f"after {ids[: t + 1]}: engine chose {token}, trainer {int(arg[t])} "
                    f"(logprob {float(best[t]):.4f} vs {float(ref[t]):.4f})"
                )
    every = torch.cat(diffs) if diffs else torch.zeros(0)
    if not every.numel():
        return Agreement(worst, where, count, tuple(mismatches), sequences=tuple(sequences))
    return Agreement(
        worst,
        where,
        count,
        tuple(mismatches),
        float(every.mean()),
        float(torch.quantile(every.double(), 0.9)),
        float(torch.cat(pdiffs).mean()),
        tuple(sequences),
    )


# ---------------------------------------------------------------------------------------------------------------
# how far numerics alone move this model: the scale the logprob evidence is read against
# ---------------------------------------------------------------------------------------------------------------
NUMERICS_FACTOR = 4.0
"""The logprob gap is decisive only beyond this multiple of the model's own numerics spread (:func:`numerics_spread`)
-- and beyond the platform's gate. Measured on an H200 (docs/verify.md): a healthy bf16 engine's mean |Δ| is
1.37x / 1.41x / 1.43x the spread at 4 / 24 / 48 layers of Qwen3-30B-A3B shapes (p90 at most 1.35x), so 4x leaves a
~2.8x margin for noise in a two-prompt sample."""


@dataclass(frozen=True)
class Spread:
    """How far the trainer's own logprobs move when every decoder layer's output is rounded differently by one unit
    of the engine's precision (what another kernel's accumulation order does): mean, 90th percentile, max and mean
    |Δ probability| over the check's tokens."""

    mean_abs: float
    p90_abs: float
    mean_prob: float
    max_abs: float
    unit: float
    """The relative perturbation per element (the engine dtype's machine epsilon; TF32's for fp32 on GPUs)."""


def rounding_unit(device_type: str, dtype: str) -> float:
    """One unit of the engine's precision: its dtype's epsilon, TF32's (2^-10) for fp32 off the CPU, where vLLM's
    fused-MoE Triton matmuls run in TF32."""
    if dtype in ("float32", "fp32"):
        return 2.0**-10 if device_type != "cpu" else float(torch.finfo(torch.float32).eps)
    if dtype == "float16":
        return float(torch.finfo(torch.float16).eps)
    return float(torch.finfo(torch.bfloat16).eps)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the longest ``ModuleList`` named ``layers`` (transformers' convention, PEFT-wrapped
    too)."""
    best: list[nn.Module] = []
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers" and len(m) > len(best):
            best = list(m)
    return best


def numerics_spread(
    model: nn.Module,
    sequences: Sequence[tuple[Sequence[int], torch.Tensor]],
    unit: float,
    seeds: Sequence[int] = (1, 2),
) -> Spread | None:
    """The trainer's own sensitivity to rounding, on the check's tokens: its forward with each decoder layer's output
    multiplied by ``1 + unit * N(0, 1)`` (fixed seeds), against its plain logprobs ``sequences`` holds. A healthy
    engine differs from the trainer by other kernels' rounding, compounded through the same layers, so its gap is
    of this size at any depth; a model whose routing amplifies rounding (random weights, 48 layers) has a large
    spread, a trained one a small spread. ``None`` when the model has no ``layers`` to perturb."""
    layers = decoder_layers(model)
    if not layers or not sequences:
        return None
    state = {"seed": 0}

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        h = output[0] if isinstance(output, tuple) else output
        if not isinstance(h, torch.Tensor) or not h.is_floating_point():
            return output
        state["seed"] += 1
        g = torch.Generator(device=h.device).manual_seed(state["seed"])
        noise = torch.randn(h.shape, generator=g, device=h.device, dtype=torch.float32)
        h = (h.float() * (1 + unit * noise)).to(h.dtype)
        return (h, *output[1:]) if isinstance(output, tuple) else h

    stats: list[tuple[float, float, float, float]] = []
    handles = [layer.register_forward_hook(hook) for layer in layers]
    try:
        for seed in seeds:
            diffs, pdiffs = [], []
            for i, (ids, ref) in enumerate(sequences):
                state["seed"] = seed * 1_000_003 + i * 10_007
                got = _scores(model, ids)[0]
                diffs.append((got - ref).abs())
                pdiffs.append((got.exp() - ref.exp()).abs())
            d = torch.cat(diffs).double()
            if not d.numel():
                return None
            stats.append(
                (float(d.mean()), float(torch.quantile(d, 0.9)), float(torch.cat(pdiffs).mean()), float(d.max()))
            )
    finally:
        for h in handles:
            h.remove()
    worst = [max(s[k] for s in stats) for k in range(4)]
    return Spread(worst[0], worst[1], worst[2], worst[3], unit=unit)


# ---------------------------------------------------------------------------------------------------------------
# the verdict: exact content checks + a statistical logprob gate per (device, dtype)
# ---------------------------------------------------------------------------------------------------------------
class _Gates(Mapping[tuple[str, str], Gate]):
    """(device type, dtype) -> gate, read from each device's backend (:attr:`hwsync.common.backend.Backend.
    verify_gates`: measured per platform, docs/verify.md), so a new device brings its own."""

    def _all(self) -> dict[tuple[str, str], Gate]:
        from hwsync.common.backend import known_backends

        out: dict[tuple[str, str], Gate] = {}
        for backend in known_backends().values():
            for dtype, gate in backend.verify_gates.items():
                out.setdefault((backend.device_type, dtype), gate)
        return out

    def __getitem__(self, key: tuple[str, str]) -> Gate:
        return self._all()[key]

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


GATES: Mapping[tuple[str, str], Gate] = _Gates()
"""Per (device type, dtype), from the device backends. The exact content checks carry the fine-grained detection
everywhere; this gate catches what fingerprints cannot see (a kernel fed the right tensor in the wrong layout, an
unreadable module) and gross numeric faults. Override per call with ``gate=`` or process-wide with
``HWSYNC_VERIFY_GATE=mean,p90,prob[,max]``."""


def parse_gate(text: str, var: str = "HWSYNC_VERIFY_GATE") -> Gate:
    """``"mean,p90,prob"`` or ``"mean,p90,prob,max"`` -> :class:`Gate` (one clear error naming ``var``)."""
    try:
        parts = [float(x) for x in text.split(",")]
        if len(parts) not in (3, 4) or not all(math.isfinite(p) and p > 0 for p in parts):
            raise ValueError
    except ValueError:
        raise OptionError(
            f"{var}={text!r}: expected 'mean,p90,prob' or 'mean,p90,prob,max' (positive numbers: "
            "mean |Δ logprob|, its 90th percentile, mean |Δ probability|, max |Δ logprob|; e.g. "
            "0.5,0.8,0.05)"
        ) from None
    return Gate(parts[0], parts[1], parts[2], max_abs=parts[3] if len(parts) == 4 else None)


RECURRENT_16BIT = Gate(mean_abs=0.8, p90_abs=2.0, mean_prob=0.05)
"""The gate of a 16-bit engine serving a model with linear-attention (Gated-DeltaNet) layers: the trainer's and the
engine's chunked recurrences round their state at different points, and one near-tie expert-routing flip moves the
mean of a short sample further than in attention-only models. CUDA bf16, tiny Qwen3.5-MoE, H200 (vLLM 0.32, 60
healthy syncs over full/adapter/hybrid): healthy max mean 0.543 (once; the others <= 0.35), p90 <= 1.56, mean |Δp|
<= 0.025, with every fingerprint exact. The mean limit is 1.5x that maximum; p90 and mean |Δp| keep the 16-bit
limits."""


def gate_for(device_type: str, dtype: str, recurrent: bool = False) -> Gate:
    """The gate of one platform/dtype (``HWSYNC_VERIFY_GATE`` wins; unknown pairs get the loosest gate);
    ``recurrent``: the model has linear-attention layers (:data:`RECURRENT_16BIT` in 16 bits)."""
    env = _env_gate()
    if env:
        return parse_gate(env)
    dev = "cpu" if device_type == "cpu" else "cuda" if device_type in ("cuda", "rocm", "hip") else device_type
    key = (
        dev,
        "float32" if dtype in ("float32", "fp32") else "bfloat16" if dtype in ("bfloat16", "float16") else dtype,
    )
    gate = GATES.get(key, LOOSEST)
    if recurrent and key[1] == "bfloat16" and gate.mean_abs < RECURRENT_16BIT.mean_abs:
        return RECURRENT_16BIT
    return gate


def trainer_gate(device_type: str, dtype: str, model: nn.Module) -> Gate:
    """:func:`gate_for` the engine's platform and dtype, for this trainer: one whose forward runs in bf16 against an
    fp32 engine (a 4-bit trainer on bitsandbytes' bf16 CPU kernel: :func:`hwsync.trainer.merged.four_bit_matmul_dtype`)
    is judged by the bf16 gate."""
    from hwsync.trainer.merged import four_bit_matmul_dtype

    if dtype in ("float32", "fp32") and four_bit_matmul_dtype(model) == "bfloat16":
        dtype = "bfloat16"
    return gate_for(device_type, dtype, has_linear_attention(model))


def has_linear_attention(model: nn.Module) -> bool:
    """Whether the trainer's model has linear-attention layers (Qwen3.5, Qwen3-Next: ``layer_types``)."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    return "linear_attention" in (getattr(config, "layer_types", None) or ())


@dataclass(frozen=True)
class Check:
    """One check of :func:`check`: its measured value against its limit (``ok`` is ``value <= limit``)."""

    name: str
    """``state``, ``base content``, ``adapter slots``, ``adapter content``, ``logprobs``."""
    ok: bool
    value: float
    limit: float
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class VerifyReport:
    """Every check of one :func:`check` call; ``failed`` lists the ones that did not pass."""

    checks: tuple[Check, ...]
    agreement: Agreement
    gate: Gate
    skipped: tuple[str, ...] = ()
    """Checks that could not run here, with why (e.g. content checks on a remote engine)."""
    weak: tuple[str, ...] = ()
    """Evidence reported but not decisive (a logprob gap beyond the platform's gate within the model's numerics)."""
    spread: Spread | None = None
    """The model's own numerics spread the logprob check was read against (``None``: the gate alone)."""

    @property
    def failed(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.ok)

    @property
    def ok(self) -> bool:
        return not self.failed

    def metric(self, name: str) -> float | None:
        return next((c.value for c in self.checks if c.name == name), None)

    def message(self) -> str:
        if self.ok:
            return (
                "verify passed: "
                + "; ".join(f"{c.name} {c.detail}" for c in self.checks)
                + "".join(f"; not run: {why}" for why in self.skipped)
                + "".join(f"; weak evidence: {why}" for why in self.weak)
            )
        lines = [f"verify failed {len(self.failed)} check(s):"]
        lines += [f"  - {c.name}: {c.detail}. Fix: {c.fix}" for c in self.failed]
        return "\n".join(lines)


_SYNC_AGAIN = "run hwsync.sync(engine, model) again before generating"
KV_ASLEEP = (
    "logprobs: part of the engine sleeps, so vLLM's scheduler is paused (sleep mode: ms-swift and TRL wake the KV "
    "cache after the sync); a trainer integration checks the rollout's own logprobs instead"
)
"""Why a check ran no logprobs while vLLM's KV cache slept (the content checks still ran)."""
_HINT = (
    "the engine does not compute what the trainer computes: check the sync strategy, the hwsync patches "
    "(`hwsync doctor`) and dtypes; if the content checks pass, the engine's kernels diverge from the trainer "
    "(raise the gate for this platform with gate= / HWSYNC_VERIFY_GATE only after checking the numbers)"
)


def _last_synced(engine: Any, model: nn.Module) -> SyncedPlan | None:
    """The trainer's last sync of ``model`` into ``engine`` (for a sharded trainer whose rank 0 holds the engine:
    rank 0's, on every rank)."""
    if isinstance(engine, _OnRank0):
        synced: SyncedPlan | None = engine.ask(lambda e: _synced(last_plan(e, model)))
        return synced
    return _synced(last_plan(engine, model))


def as_vllm_loads(b: torch.Tensor, scaling: float, dtype: torch.dtype) -> torch.Tensor:
    """LoRA B with its scaling folded in as vLLM's own loading of the trainer's saved adapter holds it: vLLM's
    ``LoRALayerWeights.optimize`` (``lora_b *= scaling``) on B cast to the LoRA dtype (``from_lora_tensors``). Where
    vLLM is not importable (a server-mode trainer) the same two steps, written out. Independent of the fold a sync
    uses (:func:`hwsync.common.lora_formats.fold_scaling`), so a sync that folds in another order fails the content
    check."""
    t = b.to(dtype=dtype, copy=True)
    try:
        from vllm.lora.lora_weights import LoRALayerWeights
    except Exception:  # noqa: BLE001 - no (working) vLLM in this process
        return t if scaling == 1 else t.mul_(scaling)
    weights: Any = LoRALayerWeights(
        "hwsync.trainer.verify",
        int(t.shape[-1]),
        1,
        None,  # type: ignore[arg-type]
        t,
        scaling=scaling,
    )
    out: torch.Tensor = weights.optimize().lora_b
    return out


def _synced(plan: SyncPlan | None) -> SyncedPlan | None:
    return plan.synced() if plan is not None else None


def reference_tensors(
    model: nn.Module, plan: SyncPlan | SyncedPlan, cache: dict[Any, Any] | None = None
) -> tuple[Payload, Iterator[tuple[TensorSpec, torch.Tensor]]]:
    """``(payload, (spec, tensor) pairs)``: every tensor a from-scratch sync of ``plan``'s strategy would send now
    (merged view for merged names, W0 for frozen ones, LoRA A/B with the scaling folded by vLLM's own code,
    :func:`as_vllm_loads`), lazily, as the engine should hold them;
    planned from the engine's description ``plan`` was made from (no new round trip)."""
    synced = plan.synced() if isinstance(plan, SyncPlan) else plan
    payload = synced.reference_payload(model, fold=as_vllm_loads, cache=cache)
    return payload, _pairs(model, payload)


def _pairs(model: nn.Module, payload: Any) -> Iterator[tuple[Any, torch.Tensor]]:
    """``(spec, tensor)`` over the payload; a sharded model's tensors are read group by group inside its gathers,
    as a sync reads them (a collective: every rank iterates to the end, also when the caller stops early)."""
    from hwsync.common import gather

    if payload.produce_sharded is None:
        yield from zip(payload.specs, payload.produce())
        return
    schedules = gather.exchange(payload.schedule) if gather.collective() else [payload.schedule]
    if any(s != schedules[0] for s in schedules):
        raise VerifyError(
            "the trainer's ranks planned different gather schedules for the check (different engines "
            "or strategies per rank): verify with the same engine setup on every rank"
        )
    steps = gather.run_groups(model, payload.schedule)
    try:
        yield from zip(payload.specs, payload.produce_sharded(steps))
    finally:
        gather.drain(steps)


def _expected(
    model: nn.Module, plan: SyncedPlan, seed: int, only: set[str] | None = None, cache: dict[Any, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, torch.dtype]]:
    """(fingerprint request for the engine, its LoRA part, trainer fingerprints) over :func:`reference_tensors`,
    each fingerprinted as it travels (wire dtype). ``only``: the base tensors to fingerprint (all by default; the
    request still names every base tensor: the engine resolves the whole list once)."""
    from hwsync.common.fingerprint import dot, probe
    from hwsync.common.wire import dtype_name

    payload, pairs = reference_tensors(model, plan, cache)
    want: dict[str, tuple[float, float, float]] = {}
    dtypes: dict[str, torch.dtype] = {}
    base: list[Any] = []
    lora_keys: list[str] = []
    lora_shapes: list[list[int]] = []
    with torch.no_grad():
        for spec, t in pairs:
            if not t.is_floating_point():
                continue
            dtypes[spec.name] = spec.dtype
            if spec.kind != "lora":
                base.append([spec.name, list(spec.shape), dtype_name(spec.dtype)])
                if only is not None and spec.name not in only:
                    continue
            t = t.to(spec.dtype)
            want[spec.name] = dot(t, probe(spec.name, spec.shape, seed, t.device, spec.dtype))
            if spec.kind == "lora":
                lora_keys.append(spec.name)
                lora_shapes.append(list(spec.shape))
    lora_req = {"keys": lora_keys, "shapes": lora_shapes, "meta": payload.lora_meta or {}} if lora_keys else None
    request = {"seed": seed, "base": base, "lora": lora_req}
    if only is not None:
        request["only"] = sorted(only)
    return request, lora_req or {}, want, dtypes


def _reference_cache(engine: Any, model: nn.Module) -> dict[Any, Any] | None:
    """Where the check's reference payload is kept between checks: on an engine handle that lives across checks
    (not a sharded trainer's per-check view of rank 0's engine)."""
    from hwsync.trainer.payload import model_uuid

    if isinstance(engine, _OnRank0):
        return None
    caches: dict[str, dict[Any, Any]] = engine.checks.setdefault("references", {})
    return caches.setdefault(model_uuid(model), {})


def _fingerprint_choice(
    engine: Any, model: nn.Module, plan: SyncedPlan, whole_base: bool
) -> tuple[set[str] | None, str, _BaseMemo | None, int]:
    """The base tensors a fingerprint check reads (``None``: all), how they were chosen, the memo they came from
    and the engine's ``base_writes`` then: the same turns as the colocated comparison (:class:`_BaseMemo`), for an
    engine handle that lives across checks (not a sharded trainer's per-check view of rank 0's engine, whose ranks
    must agree: those read the whole base)."""
    cache = _reference_cache(engine, model)
    if cache is None:
        return None, "whole", None, 0
    payload = plan.reference_payload(model, fold=as_vllm_loads, cache=cache)
    specs = [s for s in payload.specs if s.kind != "lora" and s.dtype.is_floating_point]
    memo = _base_memo(engine, model, specs)
    base_writes = int(engine.state().get("base_writes", 0))
    chosen, how = memo.choose(specs, base_writes, whole_base)
    return chosen, how, memo, base_writes


def _fp_scores(
    got: Mapping[str, Any], want: Mapping[str, Any], dtypes: Mapping[str, torch.dtype], ulps: int | None = None
) -> dict[str, tuple[float, float]]:
    """name -> (excess over the allowance, <= 1 passes; relative error) for every fingerprint both sides have."""
    from hwsync.common.fingerprint import ULPS, excess

    out = {}
    for n, v in got.items():
        if isinstance(v, str) or n not in want:
            continue
        out[n] = (
            excess(v, want[n], dtypes[n], ULPS if ulps is None else ulps),
            abs(v[0] - want[n][0]) / max(want[n][1], abs(v[1]), 1e-300),
        )
    return out


BASE_ROUNDS = 16
"""An unchanged base (no base write since it was last checked whole) is re-read in turns: each check takes the next
1/16 of its tensors, or as many as fill :data:`BASE_SAMPLE_BYTES`, whichever is more -- every base tensor at least
once every 16 checks, a small base whole every time."""
BASE_SAMPLE_BYTES = 2 << 30
_BATCH_BYTES = 4 << 30
"""Reference tensors handed to a colocated engine per comparison: merged ones are computed for the check, so a
48-layer model's are not all held at once."""
LORA_BATCH_BYTES = 512 << 20
"""The trainer's LoRA tensors as vLLM's loading folds them are copies made for the check: compared in batches of this
size (the engine's writer still sees the whole adapter's structure), so the check never holds a second adapter (at
48 layers r32 that copy did not fit beside an AdamW trainer and the engine on one H200)."""


@dataclass
class _BaseMemo:
    """What checks proved of one engine's base for one model: the engine's ``base_writes`` when it was last read
    whole (-1: never), the base's tensors then, and where the next turn of an unchanged base starts."""

    base_writes: int
    names: tuple[str, ...]
    cursor: int = 0

    def choose(self, specs: Sequence[TensorSpec], base_writes: int, whole: bool) -> tuple[set[str], str]:
        """The base tensors this check reads, and how they were chosen (for the report). ``whole=False``: in turn
        even after a base write (a trainer integration's per-step check; its periodic full check reads it whole)."""
        changed = self.base_writes != base_writes
        if whole and changed:
            return set(self.names), "whole (written since it was last checked)"
        n = len(self.names)
        take, size = 0, 0
        per_round = -(-n // BASE_ROUNDS)
        while take < n and (take < per_round or size < BASE_SAMPLE_BYTES):
            size += specs[(self.cursor + take) % n].nbytes
            take += 1
        chosen = {self.names[(self.cursor + i) % n] for i in range(take)}
        how = (
            "whole"
            if take >= n
            else f"{take} of {n} in turn "
            f"({'written since last checked whole' if changed else 'unchanged since checked whole'}"
            f"; every one within {-(-n // take)} checks)"
        )
        return chosen, how

    def passed(self, base_writes: int, read: int, whole: bool) -> None:
        """A check found the tensors it read equal to the trainer's: the base is proved at ``base_writes`` when it
        read all of it, else the next turn starts after what it read."""
        if whole:
            self.base_writes, self.cursor = base_writes, 0
        else:
            self.cursor = (self.cursor + read) % max(1, len(self.names))


def _base_memo(engine: Any, model: nn.Module, specs: Sequence[TensorSpec]) -> _BaseMemo:
    """The memo of ``model``'s base on ``engine``'s handle; a new one (never read whole) for a new set of tensors."""
    from hwsync.trainer.payload import model_uuid

    memos: dict[str, _BaseMemo] = engine.checks.setdefault("verified base", {})
    names = tuple(s.name for s in specs)
    memo = memos.get(model_uuid(model))
    if memo is None or memo.names != names:
        memo = memos[model_uuid(model)] = _BaseMemo(-1, names)
    return memo


def _compared(engine: Any, model: nn.Module, plan: SyncedPlan, whole_base: bool = True) -> dict[str, Any] | None:
    """The colocated content check: the trainer's reference tensors (:func:`reference_tensors`) handed to the
    engine's worker in this process, compared there element by element (:func:`hwsync.engine.vllm.fingerprint.compare`).
    ``None`` where that cannot run (the caller falls back to fingerprints)."""
    payload = plan.reference_payload(model, fold=as_vllm_loads, cache=_reference_cache(engine, model))
    if payload.produce_sharded is not None:
        return None  # a sharded trainer's tensors exist only inside their gathers: fingerprinted as they pass
    base_specs = [s for s in payload.specs if s.kind != "lora" and s.dtype.is_floating_point]
    memo = _base_memo(engine, model, base_specs)
    chosen, how = memo.choose(base_specs, engine.state().get("base_writes", 0), whole_base)
    spec_list = [[s.name, list(s.shape), dtype_name(s.dtype)] for s in base_specs]
    merged: dict[str, Any] = {"base": {}, "lora": None, "state": None}
    batch: dict[str, torch.Tensor] = {}
    lora: dict[str, torch.Tensor] = {}
    lora_specs = [s for s in payload.specs if s.kind == "lora" and s.dtype.is_floating_point]
    structure = {
        "keys": [s.name for s in lora_specs],
        "shapes": [list(s.shape) for s in lora_specs],
        "meta": payload.lora_meta or {},
    }
    size = lora_size = lora_seen = 0

    def flush(lora_part: Any) -> bool:
        got = engine.compare({"specs": spec_list, "base": dict(batch), "lora": lora_part})
        if got is None:
            return False
        merged["base"].update(got["base"])
        merged["state"] = merged["state"] or got
        if lora_part is not None:
            merged["lora"] = _merge_lora(merged["lora"], got["lora"])
        batch.clear()
        return True

    def lora_part(last: bool) -> dict[str, Any]:
        part = {"tensors": dict(lora), **structure, "first": merged["lora"] is None, "last": last}
        lora.clear()
        return part

    with torch.no_grad():
        for spec, t in zip(payload.specs, payload.produce()):
            if not t.is_floating_point():
                continue
            if spec.kind == "lora":
                lora[spec.name] = t.to(spec.dtype)
                lora_size += spec.nbytes
                lora_seen += 1
                if lora_size >= LORA_BATCH_BYTES and lora_seen < len(lora_specs):  # the last batch runs the oracle
                    if not flush(lora_part(last=False)):
                        return None
                    lora_size = 0
            elif spec.name in chosen:
                batch[spec.name] = t.to(spec.dtype)
                size += spec.nbytes
                if size >= _BATCH_BYTES:
                    if not flush(None):
                        return None
                    size = 0
        if not flush(lora_part(last=True) if lora or merged["lora"] is not None else None):
            return None
    got = dict(merged["state"])
    got.update(
        base=merged["base"],
        lora=merged["lora"],
        base_how=how,
        base_read=len(chosen),
        base_total=len(base_specs),
        base_memo=memo,
    )
    return got


def _merge_lora(before: Any, got: Any) -> Any:
    """The engine's answers for the batches of one adapter, as one: a reason (str) wins; counts add up."""
    if before is None or isinstance(before, str):
        return got if before is None else before
    if isinstance(got, str):
        return got
    out = dict(before)
    out["differ"] = {**before["differ"], **{k: before["differ"].get(k, 0) + n for k, n in got["differ"].items()}}
    out["bad_slots"] = before["bad_slots"] + [b for b in got["bad_slots"] if b not in before["bad_slots"]]
    out["oracle"] = before["oracle"] + got["oracle"]
    out["proven"] = got.get("proven", before.get("proven"))
    out["traced_slots"] = before["traced_slots"] or got["traced_slots"]
    return out


def _state_check(got: Mapping[str, Any], plan: SyncedPlan, lora_expected: bool) -> Check:
    """Not stale, at the trainer's version, serving the adapter the trainer installed."""
    from hwsync.common.wire import Strategy

    problems = []
    if got["stale"]:
        problems.append("the engine is stale (an interrupted sync left part of the weights written)")
    if got["version"] != plan.version:
        problems.append(
            f"the engine is at v{got['version']}, the trainer's last sync of this model left "
            f"v{plan.version} (another sync or a restart since)"
        )
    if lora_expected:
        from hwsync.engine.vllm.applier import LORA_INT_ID

        lid = plan.lora_int_id if plan.lora_int_id is not None else LORA_INT_ID
        if got["lora_int_id"] is None:
            problems.append(f"no adapter is installed (the trainer's last sync installed adapter id {lid})")
        elif got["lora_int_id"] != lid:
            problems.append(
                f"the engine serves adapter id {got['lora_int_id']}, the trainer's last sync installed "
                f"id {lid} (stale adapter id)"
            )
    elif plan.strategy is Strategy.FULL and got["lora_int_id"] is not None:
        problems.append(f"the engine still serves adapter id {got['lora_int_id']} over merged weights")
    return Check(
        "state",
        not problems,
        float(len(problems)),
        0.0,
        "; ".join(problems) or f"v{got['version']}, adapter {got['lora_int_id']}",
        _SYNC_AGAIN,
    )


_BASE_FIX = (
    "the engine's weights are not the trainer's (not written, wrong layout, a skipped post-load step, or an "
    f"older step): {_SYNC_AGAIN}; if it persists, check the hwsync patches with `hwsync doctor` and report "
    "it with that output"
)
_ADAPTER_FIX = (
    "the installed adapter is not what vLLM's own loading of the trainer's current adapter holds (older "
    f"step, scaling, its rounding order, or layout): {_SYNC_AGAIN}"
)
_SLOTS_FIX = f"the kernels read other LoRA weights than the installed adapter: {_SYNC_AGAIN}"


def _compared_checks(got: Mapping[str, Any], plan: SyncedPlan) -> list[Check]:
    """The checks of a colocated comparison (:func:`_compared`)."""
    lora_expected = got["lora"] is not None
    checks = [_state_check(got, plan, lora_expected)]
    base = got["base"]
    unreadable = {n: v for n, v in base.items() if isinstance(v, str)}
    scores = {n: float(v) for n, v in base.items() if not isinstance(v, str)}
    if scores:
        bad = sorted(
            (n for n, x in scores.items() if not x <= 1.0),
            key=lambda n: -scores[n] if scores[n] == scores[n] else -math.inf,
        )
        worst = max(scores.values(), key=lambda x: math.inf if x != x else x)
        read = f"{got['base_read']} of {got['base_total']} base tensors read ({got['base_how']})"
        detail = (
            f"{len(bad)} of {len(scores)} tensor(s) differ from the trainer's, e.g. {bad[0]} ({scores[bad[0]]:.3g}"
            f" x the allowance of a few last bits); {read}"
            if bad
            else f"{len(scores)} tensors equal the trainer's element by element"
            f"{'' if worst == 0 else f' (largest deviation {worst:.2g} x the allowance)'}; {read}"
        )
        if unreadable:
            detail += f"; {len(unreadable)} not readable here, e.g. {next(iter(unreadable.values()))}"
        checks.append(Check("base content", not bad, worst if worst == worst else math.inf, 1.0, detail, _BASE_FIX))
    lora = got["lora"]
    if lora_expected:
        if isinstance(lora, str):
            checks.append(Check("adapter content", False, math.inf, 0.0, lora, _SYNC_AGAIN))
            return checks
        bad_slots = lora["bad_slots"]
        how = (
            f"every traced slot block compared; the traced layout of {lora.get('proven', 0)} of "
            f"{lora['modules']} modules proven by vLLM's own set_lora ({lora['oracle']} in this check)"
            if lora["traced_slots"]
            else f"vLLM's own set_lora re-run on all {lora['oracle']} modules"
        )
        checks.append(
            Check(
                "adapter slots",
                not bad_slots,
                float(len(bad_slots)),
                0.0,
                f"{len(bad_slots)} LoRA slot(s) differ from the installed adapter, e.g. {bad_slots[0]}"
                if bad_slots
                else f"every LoRA slot holds the installed adapter ({how})",
                _SLOTS_FIX,
            )
        )
        differ = {k: n for k, n in lora["differ"].items() if n}
        total = sum(differ.values())
        checks.append(
            Check(
                "adapter content",
                not differ,
                float(total),
                0.0,
                f"{len(differ)} of {len(lora['differ'])} LoRA tensor(s) differ from the trainer's ({total} of the "
                f"views vLLM's adapter holds of them), e.g. {next(iter(differ))}"
                if differ
                else f"{len(lora['differ'])} LoRA tensors equal, bit for bit, what vLLM's own loading of the trainer's "
                "adapter holds (scaling folded by vLLM's code)",
                _ADAPTER_FIX,
            )
        )
    return checks


def _content_checks(
    engine: Any, model: nn.Module, seed: int, info: Any, whole_base: bool = True
) -> tuple[list[Check], list[str]]:
    """The exact checks. Every early return depends only on what every rank of a sharded trainer sees alike (the
    plan, the engine kind, its worker count), so either all ranks gather the reference tensors or none does."""
    plan = _last_synced(engine, model)
    if plan is None:
        return [], ["content: this model was never synced to this engine through hwsync.sync (no trainer plan)"]
    if info.workers > 1:  # each worker holds a TP shard, the trainer's tensors are whole
        return [], [f"content: the engine runs {info.workers} workers (tensor parallel shards): logprob gate only"]
    if getattr(engine, "compare", None) is not None:
        got = _compared(engine, model, plan, whole_base)
        if got is not None:
            checks = _compared_checks(got, plan)
            base = got["base"]
            if all(not isinstance(v, str) and v <= 1.0 for v in base.values()) and checks[0].ok:
                got["base_memo"].passed(got["base_writes"], got["base_read"], got["base_read"] >= got["base_total"])
            return checks, []
    fp = getattr(engine, "fingerprints", None)
    if fp is None:
        return [], [f"content: {type(engine).__name__} cannot read fingerprints back (logprob gate only)"]
    only, how, memo, base_writes = _fingerprint_choice(engine, model, plan, whole_base)
    request, lora_req, want, dtypes = _expected(model, plan, seed, only, _reference_cache(engine, model))
    got = fp(request)
    if got is None:
        return [], ["content: the engine runs with several workers (tensor parallel): logprob gate only"]
    checks = [_state_check(got, plan, bool(lora_req))]
    # 2. base content
    base = got.get("base") or {}
    unreadable = {n: v for n, v in base.items() if isinstance(v, str)}
    scores = _fp_scores(base, want, dtypes)
    if scores:
        worst = max(scores, key=lambda n: scores[n][0])
        bad = [n for n, (x, _) in scores.items() if not x <= 1.0]
        detail = (
            f"{len(bad)} of {len(scores)} tensor(s) differ from the trainer's, e.g. {worst} (relative "
            f"fingerprint error {scores[worst][1]:.3g})"
            if bad
            else f"{len(scores)} tensors equal the trainer's (max relative fingerprint error "
            f"{max(r for _, r in scores.values()):.1e})"
        )
        if unreadable:
            detail += f"; {len(unreadable)} not readable here, e.g. {next(iter(unreadable.values()))}"
        detail += f"; base read: {how}"
        checks.append(Check("base content", not bad, scores[worst][0], 1.0, detail, _BASE_FIX))
        if not bad and checks[0].ok and memo is not None and only is not None:
            memo.passed(got.get("base_writes", base_writes), len(only), len(only) >= len(memo.names))
    # 3./4. adapter
    if lora_req:
        lora = got.get("lora")
        if isinstance(lora, str) or lora is None:
            checks.append(Check("adapter content", False, float("inf"), 1.0, str(lora), _SYNC_AGAIN))
        else:
            bad_slots = lora["bad_slots"]
            checks.append(
                Check(
                    "adapter slots",
                    not bad_slots,
                    float(len(bad_slots)),
                    0.0,
                    f"{len(bad_slots)} LoRA slot(s) differ from the installed adapter, e.g. {bad_slots[0]}"
                    if bad_slots
                    else "every LoRA slot holds the installed adapter",
                    _SLOTS_FIX,
                )
            )
            lscores = _fp_scores(lora["tensors"], want, dtypes, ulps=0)  # copies of what was sent: exact
            worst = max(lscores, key=lambda k: lscores[k][0])
            bad = [k for k, (x, _) in lscores.items() if not x <= 1.0]
            checks.append(
                Check(
                    "adapter content",
                    not bad,
                    lscores[worst][0],
                    1.0,
                    f"{len(bad)} of {len(lscores)} LoRA tensor(s) differ from the trainer's, e.g. {worst} (relative "
                    f"fingerprint error {lscores[worst][1]:.3g})"
                    if bad
                    else f"{len(lscores)} LoRA tensors equal, bit for bit, what vLLM's own loading of the trainer's "
                    "adapter holds (scaling folded by vLLM's code)",
                    _ADAPTER_FIX,
                )
            )
    return checks, []


def check(
    target: Any,
    model: nn.Module,
    prompt_token_ids: Sequence[Sequence[int]],
    *,
    max_tokens: int = 4,
    gate: Gate | None = None,
    atol: float | None = None,
    content: bool = True,
    seed: int = 0,
    batch: bool = True,
    logprobs: bool = True,
    whole_base: bool = True,
    spread: bool | None = None,
) -> VerifyReport:
    """Run every check and return the report (nothing raised for a failed check; see :func:`verify`).

    ``target`` as for :func:`hwsync.sync`: an engine that spans several (``hwsync.connect([a, b])``) has each
    checked, every check's detail naming its engine. A sharded trainer (FSDP2 / ZeRO-3) calls this on every rank
    with the same prompts: each rank passes its engine (colocate), or rank 0 passes it and the others ``None``
    (server mode): then only rank 0 queries the engine and its answers are shared (:class:`_OnRank0`).

    * **Content** (exact, no numerics; engines driven in this process through :func:`hwsync.sync`): the engine's
      state (not stale, at the trainer's version, serving the adapter id the trainer installed), then what its
      kernels read (base weights, LoRA slots, the installed adapter) against the trainer's tensors: element by
      element where the engine's worker is in this process, by fingerprints (:mod:`hwsync.common.fingerprint`)
      otherwise. Only what can have changed is read whole: the base after a base write, an unchanged base in turns
      (:data:`BASE_ROUNDS`), the adapter every time. ``whole_base=False`` reads the base in turns even after a
      base write (a trainer integration's per-step check between its periodic whole ones).
    * **Logprobs** (``logprobs=False`` skips them): engine vs trainer over prompt + greedy tokens; mean |Δ|, its 90th
      percentile and mean |Δp| against the gate of this device/dtype (:data:`GATES`) and against the model's own
      numerics spread (:func:`numerics_spread`): decisive only beyond both, weak evidence (``report.weak``) beyond
      the gate alone. An explicit ``gate`` applies alone. The spread is measured where the gap is beyond the gate
      (``spread=True``: always, e.g. to read rollouts against it; ``report.spread``). ``atol`` adds the strict gate
      of earlier versions: max |Δ| <= atol and every greedy token the trainer's argmax (CPU fp32 only).
    """
    engine = _engine_for(target, model)
    parts = _parts(engine)
    reports = [
        _check_one(
            p,
            model,
            prompt_token_ids,
            max_tokens=max_tokens,
            gate=gate,
            atol=atol,
            content=content,
            seed=seed,
            batch=batch,
            logprobs=logprobs,
            whole_base=whole_base,
            spread=spread,
        )
        for p in parts
    ]
    if len(reports) == 1:
        return reports[0]
    return _combined(reports, [_address(p) for p in parts])


def _check_one(
    engine: EngineQueries,
    model: nn.Module,
    prompt_token_ids: Sequence[Sequence[int]],
    *,
    max_tokens: int,
    gate: Gate | None,
    atol: float | None,
    content: bool,
    seed: int,
    batch: bool,
    logprobs: bool = True,
    whole_base: bool = True,
    spread: bool | None = None,
) -> VerifyReport:
    checks: list[Check] = []
    skipped: list[str] = []
    info = engine.describe()
    if content:
        got, why = _content_checks(engine, model, seed, info, whole_base)
        checks += got
        skipped += why
    explicit = gate is not None or bool(_env_gate())
    g = gate or trainer_gate(info.device_type, info.dtype, model)
    if not logprobs:  # asked for content alone (not a check that could not run: nothing in `skipped`)
        return VerifyReport(tuple(checks), Agreement(0.0, "", 0, ()), g, tuple(skipped))
    if engine.state().get("asleep"):  # vLLM's scheduler waits for the KV cache (ms-swift, TRL: woken after the sync)
        skipped.append(KV_ASLEEP)
        return VerifyReport(tuple(checks), Agreement(0.0, "", 0, ()), g, tuple(skipped))
    a = agreement(engine, model, prompt_token_ids, max_tokens=max_tokens, tie=2 * atol if atol else 2e-4, batch=batch)
    # the spread costs a few trainer forwards: measured where it can change the verdict (the gap beyond the gate),
    # or where the caller keeps it (a trainer integration reads its rollouts against it)
    wanted = spread if spread is not None else _gate_ratio(a, g) > 1.0
    measured = (
        numerics_spread(model, a.sequences, rounding_unit(info.device_type, info.dtype))
        if wanted and not explicit and atol is None
        else None
    )
    check_, weak, measured = _logprob_check(a, g, measured, f"on {info.device_type} {info.dtype}")
    checks.append(check_)
    if atol is not None:
        checks.append(
            Check(
                "max |Δ logprob|",
                a.max_abs_diff <= atol,
                a.max_abs_diff,
                atol,
                f"max |Δ logprob| = {a.max_abs_diff:.3g} > atol {atol:g} ({a.where})"
                if not a.max_abs_diff <= atol
                else f"max {a.max_abs_diff:.3g} <= atol {atol:g}",
                _HINT,
            )
        )
        if a.greedy_mismatches:
            checks.append(
                Check(
                    "greedy tokens",
                    False,
                    float(len(a.greedy_mismatches)),
                    0.0,
                    f"greedy tokens differ at {len(a.greedy_mismatches)} position(s), e.g. {a.greedy_mismatches[0]}",
                    _HINT,
                )
            )
    return VerifyReport(tuple(checks), a, g, tuple(skipped), weak=weak, spread=measured)


def _logprob_check(
    a: Agreement, g: Gate, spread: Spread | None, where: str
) -> tuple[Check, tuple[str, ...], Spread | None]:
    """The logprob check: decisive (fails) only beyond the platform's gate **and** beyond :data:`NUMERICS_FACTOR`
    times the model's own numerics spread; beyond the gate alone it is weak evidence, reported with its numbers.
    An explicit gate (``gate=``, ``HWSYNC_VERIFY_GATE``) or ``atol`` is the caller's decision: applied alone."""
    stats = (
        f"mean |Δ| {a.mean_abs_diff:.3g} (<= {g.mean_abs:g}), p90 {a.p90_abs_diff:.3g} (<= {g.p90_abs:g}), "
        f"mean |Δp| {a.mean_prob_diff:.3g} (<= {g.mean_prob:g}), max {a.max_abs_diff:.3g} over {a.tokens} "
        f"tokens {where}"
    )
    ratio = _gate_ratio(a, g)
    value = ratio
    weak: tuple[str, ...] = ()
    if spread is not None:
        k = NUMERICS_FACTOR
        against = spread_ratio(a.mean_abs_diff, a.p90_abs_diff, spread)
        stats += (
            f"; the model's own numerics spread (each layer rounded by {spread.unit:.2g}): mean "
            f"{spread.mean_abs:.3g}, p90 {spread.p90_abs:.3g}, mean |Δp| {spread.mean_prob:.3g} "
            f"({against * k:.2g}x it)"
        )
        value = min(ratio, against)
        if ratio > 1 >= against:
            weak = (
                f"logprobs: beyond the platform's gate ({stats}) but within {k:g}x what this model's own "
                "numerics produce: not evidence of another policy at this depth (the content checks decide)",
            )
    return Check("logprobs", value <= 1.0, value, 1.0, stats, _HINT), weak, spread


def _gate_ratio(a: Agreement, g: Gate) -> float:
    """The largest ratio of a logprob statistic to its gate (<= 1: within it; NaN: infinite)."""
    return _nan_inf(
        max(
            a.mean_abs_diff / g.mean_abs,
            a.p90_abs_diff / g.p90_abs,
            a.mean_prob_diff / g.mean_prob,
            a.max_abs_diff / g.max_abs if g.max_abs else 0.0,
        )
    )


def spread_ratio(mean: float, p90: float, spread: Spread) -> float:
    """How far a logprob gap (mean and 90th percentile of |Δ logprob|) is from :data:`NUMERICS_FACTOR` times the
    model's numerics spread (<= 1: within it, i.e. not evidence of another policy; NaN: infinite). |Δp| is not
    compared: the engine's greedy tokens are its own likeliest ones, so |Δp| on them is large beside the trainer's
    perturbed copy of itself (H200, 48 layers: spread |Δp| 0.007-0.03 against a healthy engine's 0.12-0.16, while
    mean |Δ| was 1.2-1.4x its spread at 4 to 48 layers)."""
    k, tiny = NUMERICS_FACTOR, 1e-12
    return _nan_inf(max(mean / (k * max(spread.mean_abs, tiny)), p90 / (k * max(spread.p90_abs, tiny))))


def _nan_inf(x: float) -> float:
    return float("inf") if x != x else x


def _env_gate() -> str:
    """``HWSYNC_VERIFY_GATE`` as set ("" when unset): an explicit gate, applied alone."""
    from hwsync.common.config import read

    return str(read("HWSYNC_VERIFY_GATE"))


def _combined(reports: Sequence[VerifyReport], addresses: Sequence[str]) -> VerifyReport:
    """One report over several engines: every engine's checks (named as usual, their details naming the engine);
    the agreement of the engine farthest from the trainer."""
    import dataclasses

    checks = tuple(
        dataclasses.replace(c, detail=f"engine {a}: {c.detail}") for r, a in zip(reports, addresses) for c in r.checks
    )
    skipped = tuple(f"engine {a}: {why}" for r, a in zip(reports, addresses) for why in r.skipped)
    worst = max(
        (r.agreement for r in reports), key=lambda a: math.inf if a.max_abs_diff != a.max_abs_diff else a.max_abs_diff
    )
    return VerifyReport(checks, worst, reports[0].gate, skipped)


def _parts(engine: EngineQueries) -> list[EngineQueries]:
    parts = getattr(engine, "parts", None)
    return list(parts()) if parts is not None else [engine]


def _address(engine: EngineQueries) -> str:
    if isinstance(engine, _OnRank0):
        return str(engine.ask(lambda e: getattr(e, "address", "")))
    return str(getattr(engine, "address", ""))


def _engine_for(target: Any, model: nn.Module) -> EngineQueries:
    """``target`` as an engine handle; for a sharded trainer whose rank 0 alone passes one (server mode: the other
    ranks pass ``None``), an :class:`_OnRank0` on every rank. Collective for sharded models on several ranks."""
    from hwsync.common import gather

    if not (gather.collective() and gather.is_sharded(model)):
        if target is None:
            raise OptionError(
                "hwsync.verify(None, model) is for the ranks without an engine of a sharded (FSDP2 / "
                "ZeRO-3) trainer whose rank 0 holds it; here there is nothing to check: pass the engine"
            )
        return as_queries(target)
    engine, error = None, None
    try:
        engine = as_queries(target) if target is not None else None
    except Exception as e:  # noqa: BLE001 - every rank hears of it before anyone waits in a collective
        error = e
    seen = gather.exchange((target is not None, None if error is None else f"{type(error).__name__}: {error}"))
    failed = next(((r, why) for r, (_, why) in enumerate(seen) if why), None)
    if failed is not None:
        if error is not None:
            raise error
        raise SyncError(f"hwsync.verify failed on rank {failed[0]} ({failed[1]}); every rank stops")
    holders = [r for r, (has, _) in enumerate(seen) if has]
    if len(holders) == len(seen):
        assert engine is not None
        return engine  # colocate: every rank checks its own engine (or its worker of one TP engine)
    if holders != [0]:
        raise UnsupportedSetupError(
            f"hwsync.verify from a sharded trainer: ranks {holders} passed an engine, the others None. Either every "
            "rank passes its engine (colocate), or rank 0 alone does (server mode: the other ranks pass None)"
        )
    return _OnRank0(engine)


class _OnRank0(EngineQueries):
    """The engine of a sharded trainer whose rank 0 alone holds it (server mode), as every rank sees it.

    Each query runs on rank 0 and its answer -- or its error -- is broadcast (:func:`hwsync.common.gather.rank0_value`),
    so every rank takes the same path through :func:`check`: the same content gathers, the same trainer forwards on
    the engine's token ids, the same verdict. Queries only (a collective: every rank makes each call)."""

    mode = "server"

    def __init__(self, inner: EngineQueries | None) -> None:
        super().__init__()
        self.inner = inner  # rank 0's handle; None on the other ranks
        has = self.ask(lambda e: getattr(e, "fingerprints", None) is not None)
        self.fingerprints = self._fingerprints if has else None

    def ask(self, fn: Any) -> Any:
        """``fn(engine)`` on rank 0, its result (or error) on every rank."""
        from hwsync.common.errors import decode_error, encode_error
        from hwsync.common.gather import rank0_value

        out: Any = None
        error: BaseException | None = None
        if self.inner is not None:
            try:
                out = ("ok", fn(self.inner))
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                error, out = e, ("error", encode_error(e))
        out = rank0_value(out)
        if error is not None:
            raise error
        if out is None:
            raise SyncError("internal: rank 0 holds no engine for hwsync.verify")
        if out[0] == "error":
            raise decode_error(out[1])
        return out[1]

    def describe(self, lora_paths: Sequence[str] = (), base: Mapping[str, Sequence[int]] | None = None) -> Any:
        return self.ask(lambda e: e.describe(lora_paths, base))

    def state(self) -> dict[str, Any]:
        got: dict[str, Any] = self.ask(lambda e: e.state())
        return got

    def logprobs(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
        got: list[tuple[list[int], list[float]]] = self.ask(lambda e: e.logprobs(prompts, max_tokens))
        return got

    def _fingerprints(self, request: dict[str, Any]) -> Any:
        return self.ask(lambda e: e.fingerprints(request))

    def parts(self) -> list[EngineQueries]:
        count = self.ask(lambda e: len(_parts(e)))
        if count == 1:
            return [self]
        inner: list[EngineQueries | None] = list(_parts(self.inner)) if self.inner is not None else [None] * count
        return [_OnRank0(p) for p in inner]


def verify(
    target: Any,
    model: nn.Module,
    prompt_token_ids: Sequence[Sequence[int]],
    *,
    atol: float | None = None,
    max_tokens: int = 4,
    gate: Gate | None = None,
    content: bool = True,
    logprobs: bool = True,
) -> float:
    """Does the engine serve ``model``? Raises :class:`~hwsync.common.errors.VerifyError` naming every failed check and
    its fix (:func:`check` lists them), :class:`~hwsync.common.errors.StaleEngineError` on a stale engine; returns the
    max |Δ logprob| (for logs: on GPUs it is noise-dominated, the checks are what decide).

    Two kinds of evidence, so GPU numerics do not false-alarm and a broken sync does not pass:

    * exact content fingerprints (:mod:`hwsync.common.fingerprint`): the engine's state and what its kernels read,
      against the trainer's tensors, read back through the sync plan; no tolerance beyond float64 summation order;
    * a logprob gate per device/dtype (:data:`GATES`): mean, 90th percentile and mean |Δp| of engine vs trainer.

    ``atol`` restores the strict check of earlier versions on top (max |Δ| <= atol, greedy tokens equal): use it
    only where the engine computes like the trainer (vLLM's CPU build in fp32).
    """
    report = check(
        target, model, prompt_token_ids, max_tokens=max_tokens, gate=gate, atol=atol, content=content, logprobs=logprobs
    )
    for why in report.weak:
        logger.warning("hwsync.verify: %s", why)
    if not report.ok:
        legacy = next((c for c in report.failed if c.name == "max |Δ logprob|"), None)
        head = f"engine and trainer disagree: {legacy.detail}. " if legacy is not None else ""
        raise VerifyError(head + report.message())
    return report.agreement.max_abs_diff


class _CallableModule(types.ModuleType):
    """``hwsync.verify`` is this module once imported (Python binds submodules on their package): calling it is
    calling :func:`verify`, so ``hwsync.verify(engine, model, prompts)`` works whatever was imported first."""

    def __call__(self, *args: Any, **kwargs: Any) -> float:
        return verify(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
