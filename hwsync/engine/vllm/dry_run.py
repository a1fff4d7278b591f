"""Manifest validation before any write: route every tensor through the model's own loader, writing nothing.

A sync's manifest is checked against the live engine as a whole (unknown names, shapes vLLM's loaders reject, layers
that would be only partly rewritten) before the first byte is written, so a refused sync leaves the engine as it
was. See :func:`dry_run_load`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from hwsync.common.errors import ResolutionError
from hwsync.common.wire import TensorSpec

__all__ = ["dry_run_load"]


def dry_run_load(
    model: torch.nn.Module,
    specs: Sequence[TensorSpec],
    name_map: Any = None,
    transformed: set[str] | None = None,
    raw: dict[str, str] | None = None,
) -> tuple[dict[str, str], dict[str, tuple[int, int, set[str]]]]:
    """Route ``specs`` through the model's own ``load_weights``, writing nothing.

    Every layer is swapped, for the duration of the call, to ``meta`` parameters: the checkpoint-format ones vLLM
    recorded for reloading (the same ones ``reload_weights`` restores), plus a ``meta`` copy of every parameter vLLM
    keeps live across a reload (``bias``, ``e_score_correction_bias``: their loaders would otherwise copy into the
    serving engine). Each parameter's weight loader is intercepted: the call is recorded (which trainer name lands
    in which engine parameter) and run on the ``meta`` tensors, counting what it would copy (vLLM's own
    ``CopyCounter``). A loader that cannot run on ``meta`` data (e.g. the packed-QKV bias loader: "Cannot copy out of
    meta tensor") is run again on a zero-filled scratch copy of that one parameter and of the loaded tensor, never on
    the live one. This is exactly the decision the reload makes, so it tells, before any write: which names vLLM
    does not know, which shapes its loaders reject, and which layers would be only partly loaded.
    ``name_map`` (a :class:`hwsync.engine.names.NameMap`) renames trainer names to the spellings vLLM's loader takes.
    Returns (trainer name -> engine layer path, {layer: (elements loaded, elements needed, names)} for partial layers).
    ``transformed`` (optional) collects the trainer names whose tensor reached a weight loader as something other
    than a view of what was yielded: the model's ``load_weights`` computed a new tensor from it (Llama 4 permutes
    q/k for its rotary layout), so what the kernels read is not a re-layout of the trainer's values.

    A name that reaches no weight loader may still be written by the model's ``load_weights`` itself, with a plain
    ``param.copy_`` (GPT-OSS's attention sinks): vLLM's layerwise reload never sees such a write (it lands on the
    ``meta`` stand-in), so a reload leaves the old value in place. With ``name_map``, such names get a second pass:
    their resolved parameters become zero-filled scratch tensors (everything else stays ``meta``), a probe tensor
    goes through ``load_weights``, and the name is accepted only if the model's own code left exactly what
    :meth:`hwsync.engine.names.NameMap.apply` writes from the same probe. Those names are returned in ``raw`` (trainer
    name -> engine parameters), to be written in place by hwsync (:mod:`hwsync.engine.vllm.applier`); any other name no
    loader took is refused. Without ``raw`` they are refused too.
    """
    groups: dict[str, str] = {}
    run = _DryRun(model, groups, transformed)
    skipped = getattr(name_map, "skipped", {})
    routed = name_map.routed() if name_map is not None and hasattr(name_map, "routed") else {}
    try:
        run.load(
            [
                (sp.name, _pieces(name_map, sp.name, torch.empty(sp.shape, dtype=sp.dtype, device="meta")))
                for sp in specs
            ]
        )
    except ResolutionError as e:
        if _per_expert_only(name_map, run.current[0]):  # learned: this model's loader takes no fused experts
            return dry_run_load(model, specs, name_map, transformed, raw)
        if run.current[0] not in routed:
            raise
        raise ResolutionError(
            f"1 problem(s) resolving {len(specs)} trainer tensor(s); nothing was written:\n  - "
            f"{routed[run.current[0]]} (and vLLM's own loader refuses it: {e})"
        ) from e
    for name in routed:  # names only vLLM's loader could place: where it put them
        if run.params_of.get(name):
            name_map.bind_routed(name, run.params_of[name])
    unknown = [sp.name for sp in specs if sp.name not in groups and sp.name not in skipped]
    if any(n in routed for n in unknown):
        notes = [routed[n] for n in unknown if n in routed]
        raise ResolutionError(
            f"{len(notes)} tensor(s) resolve to no engine parameter and vLLM's own loader takes them nowhere either; "
            "nothing was written:\n" + "\n".join(f"  - {x}" for x in notes[:40])
        )
    copied = (
        _raw_copies(model, [sp for sp in specs if sp.name in unknown], name_map)
        if unknown and name_map is not None and raw is not None
        else {}
    )
    unknown = [n for n in unknown if n not in copied]
    if unknown:
        raise ResolutionError(
            f"{len(unknown)} tensor(s) map to no engine parameter, e.g. {unknown[:3]}: vLLM would silently drop them. "
            "Send only weights of the served model (trainer naming), or sync the model vLLM was started with"
        )
    if raw is not None:
        raw.update(copied)
        for name, params in copied.items():
            groups.setdefault(name, params.split(",")[0].rpartition(".")[0])
    by_layer = {id(m): m for m in model.modules()}
    partial = {
        run.path_of.get(lid, "?"): (n, run.needed.get(lid, 0), run.names_of.get(lid, set()))
        for lid, n in run.loaded.items()
        if n < run.needed.get(lid, 0) and lid in by_layer
    }
    return groups, partial


def _per_expert_only(name_map: Any, name: str) -> bool:
    """After vLLM's loader refused ``name`` in the fused spelling its MoE layer advertises (``experts.gate_up_proj``,
    from ``get_expert_mapping(include_fused=True)``), hand every expert tensor over per expert from now on
    (``experts.{e}.gate_proj.weight``, ...): the model's ``load_weights`` may map only per-expert checkpoint names
    (vLLM 0.32's DeepSeek-V2/V3 and GLM-4-MoE-lite use a model-level mapping without fused entries). Returns whether
    anything changed (the dry run then runs again, once)."""
    if name_map is None or name not in getattr(name_map, "entries", {}):
        return False
    ns = name_map.namespace
    targets = name_map.entries[name]
    if not any(t.kind == "experts" for t in targets):
        return False
    fused = {k: g for k, g in ns.expert_groups.items() if g.vllm_fused_gate_up or g.vllm_fused_down}
    if not fused:
        return False
    import dataclasses

    for key, g in fused.items():
        ns.expert_groups[key] = dataclasses.replace(g, vllm_fused_gate_up=None, vllm_fused_down=None)
    ns.__post_init__()  # lookups and the signature follow the groups
    return True


def _pieces(name_map: Any, name: str, t: Tensor) -> list[tuple[str, Tensor]]:
    """``(vLLM spelling, tensor)`` pairs for trainer tensor ``t``, as :meth:`hwsync.engine.names.NameMap.vllm_weights`
    renames."""
    if name_map is None:
        return [(name, t)]
    return [(load_name, fn(t) if fn is not None else t) for load_name, fn in name_map.vllm_checkpoint_names(name)]


class _DryRun:
    """One pass of the model's ``load_weights`` over stand-in parameters (see :func:`dry_run_load`)."""

    def __init__(
        self,
        model: Any,
        groups: dict[str, str],
        transformed: set[str] | None,
        captured: dict[str, list[Tensor]] | None = None,
    ) -> None:
        self.model, self.groups, self.transformed, self.captured = model, groups, transformed, captured
        """The vLLM model (its ``load_weights`` is vLLM's, not a ``torch.nn.Module`` method)."""
        self.path_of = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self.current: list[str] = [""]
        self.source: list[Tensor | None] = [None]
        self.loaded: dict[int, int] = {}
        self.names_of: dict[int, set[str]] = {}
        self.needed: dict[int, int] = {}
        self.params_of: dict[str, set[str]] = {}  # trainer name -> engine parameters its loads reached

    def _stand_in(self, layer: torch.nn.Module, name: str, t: Any, counted: bool) -> int:
        """Register ``t`` as ``layer.name`` with an intercepting loader; the elements a complete load of the layer
        needs from it (0 for tensors vLLM's reload does not count, e.g. e_score_correction_bias)."""
        from hwsync.engine.vllm.compat import tensor_load_numel

        original = getattr(t, "weight_loader", None)
        while original is not None and getattr(original, "__name__", "") == "online_process_loader":  # a past reload
            original = original.__wrapped__
        t.weight_loader = _Intercept(
            layer,
            f"{self.path_of.get(id(layer), '?')}.{name}".lstrip("."),
            original,
            self.current,
            self.loaded if counted else {},
            self.names_of,
            self.groups,
            self.path_of,
        )
        t.weight_loader.source, t.weight_loader.transformed = self.source, self.transformed
        t.weight_loader.captured, t.weight_loader.params_of = self.captured, self.params_of
        layer.register_parameter(name, t)
        return tensor_load_numel(t) if counted else 0

    def load(
        self, weights: Sequence[tuple[str, list[tuple[str, Tensor]]]], scratch: dict[str, Tensor] | None = None
    ) -> None:
        """Swap every layer to stand-ins (``scratch``: live parameter name -> the real tensor to stand in for it
        instead of ``meta``), feed ``weights`` (trainer name, its vLLM spellings) to ``load_weights``, put every
        layer back."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS, SKIP_TENSORS, to_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
        from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers, get_layer_tensors

        from hwsync.engine.vllm.lora_view import checkpoint_names

        scratch = scratch or {}
        stood: set[int] = set()  # scratch stand-ins already registered (not to be wrapped again as "live")

        def meta_or_scratch(layer: torch.nn.Module, name: str, meta: Tensor) -> Tensor:
            real = scratch.get(f"{self.path_of.get(id(layer), '')}.{name}".lstrip("."))
            if real is None:
                return meta
            stand = torch.nn.Parameter(real, requires_grad=False)
            stand.__dict__.update(meta.__dict__)
            stood.add(id(stand))
            return stand

        def feed() -> Iterator[tuple[str, Tensor]]:
            for name, pieces in weights:
                self.current[0] = name
                for load_name, t in pieces:
                    self.source[0] = t
                    yield load_name, t

        saved: list[tuple[torch.nn.Module, dict[str, Any], dict[str, Tensor], set[str]]] = []
        try:
            for layer in self.model.modules():
                params: dict[str, Any]
                params, buffers = get_layer_params_buffers(layer)
                non_persistent = set(layer._non_persistent_buffers_set)
                saved.append((layer, params, buffers, non_persistent))
                r_params, r_buffers = get_layerwise_info(layer).restore_metadata
                for name in set(get_layer_tensors(layer)) | set(r_params) | set(r_buffers):
                    if name not in SKIP_TENSORS and hasattr(layer, name):
                        delattr(layer, name)
                total = 0
                for name, meta in r_params.items():
                    if name not in SKIP_TENSORS:
                        stand = meta_or_scratch(layer, name, to_meta_tensor(restore_layer_refs(meta, layer)))
                        total += self._stand_in(layer, name, stand, name not in SKIP_LOAD_TENSORS)
                for name, meta in r_buffers.items():
                    if name not in SKIP_TENSORS:
                        layer.register_buffer(
                            name, to_meta_tensor(restore_layer_refs(meta, layer)), persistent=name not in non_persistent
                        )
                # Parameters vLLM leaves live across a reload (bias, e_score_correction_bias; or a layer without
                # reload metadata): a meta copy keeps their loaders (and attributes) off the serving tensors.
                for name, p in list(layer._parameters.items()):
                    if p is not None and not p.is_meta and id(p) not in stood:
                        stand = meta_or_scratch(layer, name, to_meta_tensor(p))
                        total += self._stand_in(layer, name, stand, name not in SKIP_LOAD_TENSORS)
                self.needed[id(layer)] = total
            try:
                with torch.no_grad(), checkpoint_names(self.model):  # the names a reload will present (LoRA)
                    self.model.load_weights(feed())
            except _LoaderFailed as e:
                raise ResolutionError(
                    f"{self.current[0]}: the engine cannot load this tensor into {e.param} (loader {e.loader}: "
                    f"{type(e.cause).__name__}: {e.cause}). Check the name (trainer naming: transformers runtime "
                    "names, PEFT prefixes allowed) and the shape against the model vLLM serves"
                ) from e.cause
            except (
                KeyError,
                ValueError,
                AssertionError,
                RuntimeError,
                IndexError,
                TypeError,
                NotImplementedError,
                AttributeError,
            ) as e:
                raise ResolutionError(
                    f"{self.current[0]}: the engine cannot load this tensor ({type(e).__name__}: {e}). Check the "
                    "name (trainer naming: transformers runtime names, PEFT prefixes allowed) and the shape against "
                    "the model vLLM serves"
                ) from e
        finally:
            for layer, params, buffers, non_persistent in saved:
                for name in list(get_layer_tensors(layer)):
                    delattr(layer, name)
                for name, p in params.items():
                    layer.register_parameter(name, p)
                for name, b in buffers.items():
                    layer.register_buffer(name, b, persistent=name not in non_persistent)


def _probe(shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """Distinct, nonzero values exact in every floating dtype (k/256, k = 1..251): where each element lands shows."""
    n = 1
    for d in shape:
        n *= int(d)
    return ((torch.arange(n, dtype=torch.int64) % 251 + 1).to(torch.float32) / 256).to(dtype).reshape(tuple(shape))


def _raw_copies(model: torch.nn.Module, specs: Sequence[TensorSpec], name_map: Any) -> dict[str, str]:
    """The names among ``specs`` (which reached no weight loader) that the model's ``load_weights`` copies into
    their resolved parameters itself, exactly as hwsync's writer would (see :func:`dry_run_load`): name -> live
    parameters (comma-separated)."""
    candidates = [
        sp
        for sp in specs
        if sp.dtype.is_floating_point
        and sp.name in name_map.entries
        and all(tg.kind in ("param", "packed") for tg in name_map.entries[sp.name])
    ]
    if not candidates:
        return {}
    live = {name_map.namespace.params[c].name: t for c, t in name_map.namespace.live.items()}
    params = sorted({tg.param for sp in candidates for tg in name_map.entries[sp.name]})
    if any(p not in live for p in params):
        return {}
    scratch = {p: torch.zeros(live[p].shape, dtype=live[p].dtype, device=live[p].device) for p in params}
    expected = {p: torch.zeros_like(t) for p, t in scratch.items()}
    probes = [(sp.name, _probe(sp.shape, sp.dtype)) for sp in candidates]
    try:
        name_map.apply(probes, expected)
    except ResolutionError:
        return {}
    _DryRun(model, {}, None).load([(name, _pieces(name_map, name, t)) for name, t in probes], scratch)
    out: dict[str, str] = {}
    for sp in candidates:
        targets = [tg.param for tg in name_map.entries[sp.name]]
        if all(bool(expected[p].ne(0).any()) and torch.equal(scratch[p], expected[p]) for p in targets):
            out[sp.name] = ",".join(dict.fromkeys(targets))
    return out


def row_orders(model: torch.nn.Module, specs: Sequence[TensorSpec], name_map: Any) -> dict[str, Tensor | str]:
    """How the model's ``load_weights`` reorders the rows of each of ``specs`` (trainer names whose tensor it
    transforms, see ``transformed`` of :func:`dry_run_load`) before its weight loader sees it: name -> the row index
    ``perm`` with ``loaded = trainer[perm]`` (Llama 4's q/k rotary permutation), or a string saying why it is no row
    reordering. A LoRA delta ``B @ A`` of that weight follows the same reordering as ``B[perm] @ A``.

    Traced on an index-valued probe (``float64``, every element its own flat index) through the same stand-in pass
    as :func:`dry_run_load`: nothing live is touched."""
    out: dict[str, Tensor | str] = {}
    probes: list[tuple[str, list[tuple[str, Tensor]]]] = []
    for sp in specs:
        if len(sp.shape) != 2 or sp.shape[0] * sp.shape[1] >= 1 << 52:
            out[sp.name] = f"{list(sp.shape)}: not a matrix hwsync can trace"
            continue
        probe = torch.arange(sp.shape[0] * sp.shape[1], dtype=torch.float64).reshape(tuple(sp.shape))
        probes.append((sp.name, _pieces(name_map, sp.name, probe)))
    captured: dict[str, list[Tensor]] = {}
    if probes:
        _DryRun(model, {}, None, captured).load(probes)
    for name, _pieces_of in probes:
        rows, cols = (int(x) for x in next(sp.shape for sp in specs if sp.name == name))
        got = captured.get(name, [])
        if len(got) != 1 or tuple(got[0].shape) != (rows, cols) or got[0].dtype != torch.float64:
            out[name] = "the model's loader hands its weight loaders something other than one reordered matrix"
            continue
        perm = (got[0][:, 0] // cols).to(torch.int64)
        expected = torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols)
        if sorted(perm.tolist()) != list(range(rows)) or not torch.equal(got[0], expected[perm]):
            out[name] = "the model's loader computes this weight from the checkpoint (not a reordering of its rows)"
            continue
        out[name] = perm
    return out


class _LoaderFailed(Exception):
    """A weight loader refused a tensor on meta data and on a scratch copy: a real refusal (name, shape, layout)."""

    def __init__(self, param: str, loader: str, cause: BaseException) -> None:
        super().__init__(f"{param}: {loader}: {cause}")
        self.param, self.loader, self.cause = param, loader, cause


def _derived(t: Tensor, src: Tensor | None) -> bool:
    """Whether ``t`` is ``src`` or a view of it (or of the tensor ``src`` is a view of): a pure re-layout."""
    if src is None:
        return False
    roots = {id(src), id(src._base) if src._base is not None else id(src)}
    return id(t) in roots or (t._base is not None and id(t._base) in roots)


class _Intercept:
    """Stands in for one parameter's ``weight_loader`` during a dry run (see :func:`dry_run_load`)."""

    source: list[Tensor | None] = [None]
    transformed: set[str] | None = None
    captured: dict[str, list[Tensor]] | None = None
    params_of: dict[str, set[str]] | None = None

    def __init__(
        self,
        layer: torch.nn.Module,
        param: str,
        original: Any,
        current: list[str],
        loaded: dict[int, int],
        names_of: dict[int, set[str]],
        groups: dict[str, str],
        path_of: dict[int, str],
    ) -> None:
        import inspect

        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        self.layer, self.param, self.current = layer, param, current
        self.loaded, self.names_of, self.groups, self.path_of = loaded, names_of, groups, path_of
        self.original = default_weight_loader if original is None else original
        if not callable(self.original):
            raise ResolutionError(
                f"engine parameter {param} has a weight_loader hwsync cannot call "
                f"({type(self.original).__name__}); it cannot be validated or synced"
            )
        try:
            self.signature = inspect.signature(self.original)
        except (TypeError, ValueError) as e:
            raise ResolutionError(
                f"engine parameter {param}: unknown weight loader {self.name} (no signature: {e}); "
                "hwsync cannot validate a sync into it"
            ) from e
        self.__name__ = getattr(self.original, "__name__", "weight_loader")

    @property
    def name(self) -> str:
        return getattr(self.original, "__qualname__", None) or repr(self.original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from vllm.model_executor.model_loader.reload.meta import get_numel_loaded

        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise _LoaderFailed(self.param, self.name, e) from e
        bound.apply_defaults()
        given = bound.arguments.get("loaded_weight", next(iter(list(bound.arguments.values())[1:2]), None))
        if self.transformed is not None and isinstance(given, Tensor) and not _derived(given, self.source[0]):
            self.transformed.add(self.current[0])
        if self.captured is not None and isinstance(given, Tensor):
            self.captured.setdefault(self.current[0], []).append(given.detach().clone())
        try:
            n, ret = get_numel_loaded(self.original, bound)
        except Exception as on_meta:  # noqa: BLE001  (loaders raise anything on meta data; decided on scratch)
            try:
                n, ret = get_numel_loaded(self.original, _on_scratch(bound))
            except Exception as e:  # noqa: BLE001  (the loader's own refusal, reported with the parameter)
                raise _LoaderFailed(self.param, self.name, e) from on_meta
        key = id(self.layer)
        if self.params_of is not None:
            self.params_of.setdefault(self.current[0], set()).add(self.param)
        self.loaded[key] = self.loaded.get(key, 0) + n
        self.names_of.setdefault(key, set()).add(self.current[0])
        self.groups.setdefault(self.current[0], self.path_of.get(key, "?"))
        return ret


def _on_scratch(bound: Any) -> Any:
    """``bound`` with every meta tensor replaced by a zero-filled CPU tensor of the same shape, class and attributes
    (the parameter itself included): what a loader that needs data runs on. Nothing live is touched."""
    import copy

    def real(value: Any) -> Any:
        if isinstance(value, Tensor) and value.is_meta:
            t = torch.zeros(tuple(value.shape), dtype=value.dtype)
            if type(value) is not Tensor:
                t.__class__ = value.__class__
            t.__dict__ = value.__dict__.copy()
            return t
        return value

    scratch = copy.copy(bound)
    scratch.arguments = {k: real(v) for k, v in bound.arguments.items()}
    return scratch
