"""Every type that crosses a process boundary during a sync, and its JSON form.

The sync manifest (:class:`Manifest`, made of :class:`TensorSpec` and :class:`Bucket`), what an engine says about
itself (:class:`EngineInfo`) and its sync state (:class:`ReceiverState`). In server mode they travel as JSON (never
pickle) in the control channel's authenticated frames (:mod:`hwsync.common.protocol`); the tensors follow on the
data plane, one flat buffer per :class:`Bucket` plus a sealed trailer (:mod:`hwsync.common.transport.buckets`). A
colocated engine gets the same objects in-process. Whatever arrives as JSON is validated completely here, in
``from_json``, before any other code looks at it: a malformed manifest is refused with one
:class:`~hwsync.common.errors.SyncError` and nothing else runs.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch

from hwsync.common.errors import OptionError, SyncError
from hwsync.common.lora_layout import PER_EXPERT, LoraLayout

__all__ = [
    "ALIGN",
    "Bucket",
    "DtypePolicy",
    "EngineInfo",
    "Manifest",
    "ReceiverState",
    "Strategy",
    "TensorSpec",
    "dtype_from_name",
    "dtype_name",
    "plan_buckets",
]

ALIGN = 16
"""Byte alignment of each dtype run inside a bucket (any dtype can view its slot)."""

Kind = Literal["base", "lora"]
DtypePolicy = Literal["exact", "cast"]
_KINDS = ("base", "lora")
_LAYOUTS = ("checkpoint",)
# dtypes a tensor may travel as: every real torch dtype a checkpoint or adapter can hold
_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        *(
            getattr(torch, n)
            for n in (
                "float8_e4m3fn",
                "float8_e5m2",
                "float8_e4m3fnuz",
                "float8_e5m2fnuz",
                "uint16",
                "uint32",
                "uint64",
            )
            if hasattr(torch, n)
        ),
    )
}


class Strategy(str, enum.Enum):
    """What a sync sends (the rules that pick one live in :mod:`hwsync.trainer.strategy`)."""

    AUTO = "auto"
    """Ask the engine what it can serve and pick one of the three below."""
    FULL = "full"
    """Merged weights ``W0 + ΔW`` of every parameter."""
    ADAPTER = "adapter"
    """LoRA tensors only; the base ``W0`` once."""
    HYBRID = "hybrid"
    """LoRA where the engine serves LoRA, merged weights for the adapted modules it cannot."""

    @classmethod
    def parse(cls, value: str | Strategy) -> Strategy:
        """A caller's ``strategy=`` option; :class:`~hwsync.common.errors.OptionError` naming the choices otherwise."""
        try:
            return cls(str(value.value if isinstance(value, Strategy) else value).lower())
        except ValueError:
            raise OptionError(f"unknown strategy {value!r}; choose one of {[s.value for s in cls]}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = _DTYPES.get(str(name))
    if dt is None:
        raise SyncError(f"unknown dtype {name!r}; sender and receiver run different torch versions?")
    return dt


def _fail(what: str) -> SyncError:
    return SyncError(f"malformed sync manifest: {what}; sender and receiver run different hwsync versions?")


def _strategy(value: Any) -> Strategy:
    """A manifest's strategy (a wire field: a bad one is a malformed manifest, not a caller's option)."""
    try:
        return Strategy.parse(value)
    except OptionError:
        raise _fail(f"strategy {str(value)[:40]!r}") from None


_INT_MAX = (1 << 63) - 1
"""Every integer in a manifest fits a signed 64-bit field (bucket trailers, tensor sizes, vLLM ids)."""


def _int(value: Any, what: str, minimum: int = 0, maximum: int = _INT_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise _fail(f"{what} must be an integer in [{minimum}, {maximum}], got {str(value)[:40]}")
    return value


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a sync: a base weight in trainer naming (``kind="base"``), or one factor of a trainer LoRA module
    (``kind="lora"``, named ``<module>#A`` / ``<module>#B`` by :func:`hwsync.common.lora_formats.wire_name`: experts
    stacked, scaling folded into B)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: Kind = "base"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def to_json(self) -> list[Any]:
        return [self.name, list(self.shape), dtype_name(self.dtype), self.kind]

    @classmethod
    def from_json(cls, obj: Any) -> TensorSpec:
        if not isinstance(obj, list) or len(obj) != 4:
            raise _fail(f"a tensor entry must be [name, shape, dtype, kind], got {str(obj)[:80]}")
        name, shape, dtype, kind = obj
        if not isinstance(name, str) or not name:
            raise _fail(f"tensor name {name!r}")
        if not isinstance(shape, list) or len(shape) > 8:
            raise _fail(f"{name}: shape {shape!r}")
        if kind not in _KINDS:
            raise _fail(f"{name}: kind {kind!r} (one of {_KINDS})")
        if not isinstance(dtype, str):
            raise _fail(f"{name}: dtype {dtype!r}")
        dims = tuple(_int(s, f"{name}: dimension", 0, 1 << 40) for s in shape)
        return cls(name, dims, dtype_from_name(dtype), kind)


@dataclass(frozen=True)
class Bucket:
    """Spec indices carried by one bucket and their byte offsets in its flat buffer (``nbytes`` long; on the data
    plane a trailer follows it: :mod:`hwsync.common.transport.buckets`).

    Inside a bucket, tensors of one dtype sit back to back in one aligned run, so unpacking is pure views.
    """

    index: int
    entries: tuple[int, ...]
    offsets: tuple[int, ...]
    nbytes: int
    is_last: bool

    def to_json(self) -> list[Any]:
        return [self.index, list(self.entries), list(self.offsets), self.nbytes, self.is_last]


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> tuple[Bucket, ...]:
    """Greedy, order-preserving split of ``specs`` into buckets of at most ``bucket_bytes``.

    Order is kept across buckets (the receiver's layer-wise reload completes each layer as soon as its last tensor
    arrives); a tensor larger than ``bucket_bytes`` travels alone in a bucket of its own size.
    """
    if bucket_bytes <= 0:
        raise SyncError(f"bucket size must be positive, got {bucket_bytes} bytes")
    groups: list[list[int]] = []
    used = 0
    for i, spec in enumerate(specs):
        n = spec.nbytes
        if n > bucket_bytes:
            groups.append([i])
            used = bucket_bytes  # close it: the next tensor starts a new bucket
            continue
        if not groups or used + n + ALIGN > bucket_bytes and groups[-1]:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n + ALIGN
    buckets = []
    for b, group in enumerate(groups):
        # dtype runs, first-seen dtype order, stable within a dtype
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in group:
            by_dtype.setdefault(specs[i].dtype, []).append(i)
        entries: list[int] = []
        offsets: list[int] = []
        off = 0
        for run in by_dtype.values():
            off = (off + ALIGN - 1) // ALIGN * ALIGN
            for i in run:
                entries.append(i)
                offsets.append(off)
                off += specs[i].nbytes
        buckets.append(Bucket(b, tuple(entries), tuple(offsets), off, b == len(groups) - 1))
    return tuple(buckets)


def _packed_offsets(specs: Sequence[TensorSpec]) -> tuple[int, ...]:
    """Offsets of ``specs`` packed in order, each new dtype run aligned to :data:`ALIGN` (:func:`plan_buckets`)."""
    out: list[int] = []
    off = 0
    prev: torch.dtype | None = None
    for spec in specs:
        if spec.dtype != prev:
            off = (off + ALIGN - 1) // ALIGN * ALIGN
            prev = spec.dtype
        out.append(off)
        off += spec.nbytes
    return tuple(out)


def _check_buckets(specs: Sequence[TensorSpec], buckets: Sequence[Bucket]) -> None:
    """Every spec in exactly one bucket, at an in-bounds, aligned, non-overlapping offset; indices in order."""
    seen: set[int] = set()
    for b, bucket in enumerate(buckets):
        if bucket.index != b:
            raise _fail(f"bucket #{b} says index {bucket.index}")
        if bucket.is_last != (b == len(buckets) - 1):
            raise _fail(f"bucket {b}: is_last={bucket.is_last} of {len(buckets)} buckets")
        if len(bucket.entries) != len(bucket.offsets):
            raise _fail(f"bucket {b}: {len(bucket.entries)} entries but {len(bucket.offsets)} offsets")
        if not bucket.entries:
            raise _fail(f"bucket {b} carries no tensor")
        spans = []
        for i, off in zip(bucket.entries, bucket.offsets):
            if not 0 <= i < len(specs) or i in seen:
                raise _fail(f"bucket {b}: entry {i} is out of range or carried twice")
            seen.add(i)
            size = specs[i].nbytes
            if off % min(ALIGN, max(1, specs[i].dtype.itemsize)) or off + size > bucket.nbytes:
                raise _fail(f"bucket {b}: {specs[i].name} at byte {off} (+{size}) does not fit {bucket.nbytes} bytes")
            spans.append((off, off + size))
        spans.sort()
        if any(a_end > b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])):
            raise _fail(f"bucket {b}: tensors overlap")
        if bucket.offsets != _packed_offsets([specs[i] for i in bucket.entries]):
            # plan_buckets' layout exactly: back to back, padded only to align a new dtype run (no gap to smuggle
            # bytes in, nothing a receiver would have to skip)
            raise _fail(
                f"bucket {b}: offsets {list(bucket.offsets)[:8]} leave a gap between tensors; expected "
                f"{list(_packed_offsets([specs[i] for i in bucket.entries]))[:8]}"
            )
        if bucket.nbytes != max(end for _, end in spans):
            # the receiver allocates nbytes: a bucket is exactly as large as its tensors (plan_buckets' layout)
            raise _fail(
                f"bucket {b}: says {bucket.nbytes} bytes, its tensors end at byte {max(end for _, end in spans)}"
            )
    total = sum(s.nbytes for s in specs)
    if total > _INT_MAX:
        raise _fail(f"{total} bytes of tensors")
    if len(seen) != len(specs):
        missing = [specs[i].name for i in range(len(specs)) if i not in seen][:3]
        raise _fail(f"{len(specs) - len(seen)} tensor(s) in no bucket, e.g. {missing}")


@dataclass(frozen=True)
class Manifest:
    """Everything about one sync except the tensor data; validated completely on construction from JSON."""

    version: int
    strategy: Strategy
    specs: tuple[TensorSpec, ...]
    buckets: tuple[Bucket, ...]
    lora_meta: Mapping[str, Any] | None = None
    """The LoRA tensors' metadata (``hwsync-lora/1``, :func:`hwsync.common.lora_formats.to_wire`: the adapter's name and
    rank, per module its kind, orientation and row order), from which the receiver builds the LoRA format its engine
    serves; ``None`` when the sync carries no LoRA."""
    lora_base_names: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Trainer name -> shape of each base weight the LoRA adapts: the receiver resolves them (without data) so an
    adapter for a differently shaped model is refused before it is installed."""
    base_key: str | None = None
    """Identity of the base weights this sync leaves on the engine (adapter/hybrid: trainer's W0 set)."""
    layout: str = "checkpoint"
    """Base tensors are in checkpoint (trainer) layout; the receiver's load path converts them."""
    lora_name: str | None = None
    lora_int_id: int | None = None
    """Identity to install the adapter under (``None``: the receiver's default). Frameworks that attach their own
    ``LoRARequest`` to rollouts (ms-swift: ``swift_lora``/111) pass theirs."""
    dtype_policy: DtypePolicy = "exact"
    """``exact``: a tensor whose dtype differs from the engine parameter's is refused; ``cast``: cast on load and
    count the casts in the result. :func:`hwsync.sync` sends the engine's dtypes, so it never needs ``cast``."""
    expect_version: int | None = None
    """The engine version this manifest was planned against (``None``: any). A cached plan sends it so an engine
    changed in between (another sync, a restart) answers :class:`~hwsync.common.errors.PlanChangedError`."""

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, Strategy):
            object.__setattr__(self, "strategy", _strategy(self.strategy))
        if self.strategy is Strategy.AUTO:
            raise _fail("strategy 'auto' is resolved by the sender; a manifest names full, adapter or hybrid")

    @property
    def base_specs(self) -> list[TensorSpec]:
        return [s for s in self.specs if s.kind == "base"]

    @property
    def lora_specs(self) -> list[TensorSpec]:
        return [s for s in self.specs if s.kind == "lora"]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def _body(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy.value,
            "specs": [s.to_json() for s in self.specs],
            "buckets": [b.to_json() for b in self.buckets],
            "lora_meta": self.lora_meta,
            "lora_base_names": {k: list(v) for k, v in self.lora_base_names.items()},
            "base_key": self.base_key,
            "layout": self.layout,
            "lora_name": self.lora_name,
            "lora_int_id": self.lora_int_id,
            "dtype_policy": self.dtype_policy,
        }

    @property
    def digest(self) -> str:
        """Identity of everything but the version numbers: a receiver reuses a validated plan for an equal digest."""
        cached = self.__dict__.get("_digest")
        if cached is None:
            text = json.dumps(self._body(), sort_keys=True, separators=(",", ":"))
            cached = hashlib.sha256(text.encode()).hexdigest()
            object.__setattr__(self, "_digest", cached)
        return cached

    def with_version(self, version: int, expect_version: int | None) -> Manifest:
        """The same sync plan under a new version number (the digest is kept, not recomputed)."""
        m = Manifest(
            **{f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("version", "expect_version")},
            version=version,
            expect_version=expect_version,
        )
        object.__setattr__(m, "_digest", self.digest)
        return m

    def to_json(self) -> str:
        return json.dumps({"version": self.version, "expect_version": self.expect_version, **self._body()})

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        if not isinstance(text, (str, bytes)):
            raise _fail(f"expected JSON text, got a {type(text).__name__}")
        try:
            d = json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:
            raise _fail(f"not JSON ({e})") from None
        if not isinstance(d, dict):
            raise _fail("not a JSON object")
        unknown = set(d) - {"version", "expect_version", *cls(1, Strategy.FULL, (), ())._body()}
        if unknown:
            raise _fail(f"unknown field(s) {sorted(unknown)}")
        specs = d.get("specs")
        buckets = d.get("buckets")
        if not isinstance(specs, list) or not isinstance(buckets, list):
            raise _fail("specs and buckets must be lists")
        spec_objs = tuple(TensorSpec.from_json(s) for s in specs)
        if not spec_objs:
            raise _fail("no tensors: a sync carries at least one")
        if len({s.name for s in spec_objs}) != len(spec_objs):
            raise _fail("a tensor name appears twice")
        bucket_objs = []
        for b in buckets:
            if (
                not isinstance(b, list)
                or len(b) != 5
                or not isinstance(b[1], list)
                or not isinstance(b[2], list)
                or not isinstance(b[4], bool)
            ):
                raise _fail(f"a bucket must be [index, entries, offsets, nbytes, is_last], got {str(b)[:80]}")
            bucket_objs.append(
                Bucket(
                    _int(b[0], "bucket index"),
                    tuple(_int(i, "bucket entry") for i in b[1]),
                    tuple(_int(o, "bucket offset") for o in b[2]),
                    _int(b[3], "bucket size"),
                    b[4],
                )
            )
        _check_buckets(spec_objs, bucket_objs)
        lora_meta = d.get("lora_meta")
        if lora_meta is not None and not isinstance(lora_meta, dict):
            raise _fail("lora_meta must be an object or null")
        if any(s.kind == "lora" for s in spec_objs) and not lora_meta:
            raise _fail("LoRA tensors without their metadata (lora_meta)")
        base_names = d.get("lora_base_names") or {}
        if not isinstance(base_names, dict) or not all(isinstance(v, list) for v in base_names.values()):
            raise _fail("lora_base_names must map names to shapes")
        layout = d.get("layout", "checkpoint")
        if layout not in _LAYOUTS:
            raise _fail(f"layout {layout!r} (one of {_LAYOUTS})")
        policy = d.get("dtype_policy", "exact")
        if policy not in ("exact", "cast"):
            raise _fail(f"dtype_policy {policy!r}")
        for key in ("base_key", "lora_name"):
            if d.get(key) is not None and not isinstance(d[key], str):
                raise _fail(f"{key} must be a string or null")
        lid = d.get("lora_int_id")
        expect = d.get("expect_version")
        return cls(
            version=_int(d.get("version"), "version", 1),
            strategy=_strategy(d.get("strategy", "")),
            specs=spec_objs,
            buckets=tuple(bucket_objs),
            lora_meta=lora_meta,
            lora_base_names={
                str(k): tuple(_int(x, f"{k}: dimension", 0, 1 << 40) for x in v) for k, v in base_names.items()
            },
            base_key=d.get("base_key"),
            layout=layout,
            lora_name=d.get("lora_name"),
            lora_int_id=None if lid is None else _int(lid, "lora_int_id", 1, (1 << 31) - 1),
            dtype_policy=policy,
            expect_version=None if expect is None else _int(expect, "expect_version"),
        )


def _plain(value: Any) -> Any:
    if isinstance(value, LoraLayout):
        return value.to_wire()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class EngineInfo:
    """What the receiving engine says about itself: the facts :mod:`hwsync.trainer.strategy` decides on."""

    engine: str
    dtype: str
    device_type: str = "cpu"
    version: int = 0
    stale: bool = False
    base_key: str | None = None
    lora_enabled: bool = False
    lora_dtype: str | None = None
    max_lora_rank: int | None = None
    lora_reason: str = ""
    moe_lora: bool = False
    moe_lora_reason: str = ""
    lora_layout: LoraLayout = PER_EXPERT
    """How the engine holds LoRA (:mod:`hwsync.common.lora_layout`): computed by the engine, taken by the trainer's
    plan and the converter."""
    packed_modules_mapping: Mapping[str, Sequence[str]] = field(default_factory=dict)
    lora_modules: Sequence[str] = ()
    unservable: Mapping[str, str] = field(default_factory=dict)
    """vLLM LoRA module path -> why the engine cannot serve LoRA there (only for paths the sender asked about)."""
    lora_int_id: int | None = None
    lora_name: str | None = None
    refill: str | None = None
    """Why the engine needs its base again although this trainer sent it (vLLM discarded it: level-2 sleep)."""
    workers: int = 1
    """Engine workers that receive every sync (tensor / pipeline parallel ranks of one engine)."""
    quantization: str | None = None
    """The engine's weight quantization (``bitsandbytes``, ``fp8``, ...), ``None`` when it serves plain weights."""
    kept_dtypes: Mapping[str, str] = field(default_factory=dict)
    """Trainer base name -> the floating dtype the engine keeps its parameter in where that is wider than the model
    dtype (vLLM keeps Mamba2 / Gated-DeltaNet ``A_log`` in fp32 in a bf16 engine): such tensors travel in it (only for
    names the sender asked about)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_layout", LoraLayout.of(self.lora_layout))  # its wire form, or "2d" / "3d"

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EngineInfo:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class ReceiverState:
    """The engine's sync state (one per engine worker; equal on every worker of an engine)."""

    version: int = 0
    stale: bool = False
    strategy: str | None = None
    base_key: str | None = None
    lora_name: str | None = None
    lora_int_id: int | None = None
    last_error: str | None = None
    base_writes: int = 0
    """How many times the base was (or may have been) rewritten: each sync that carried base tensors, and each change
    seen behind hwsync's back. :mod:`hwsync.verify` re-reads the whole base only when this moved."""
    refill: str | None = None
    """Why the next sync must carry the base (vLLM discarded the weights hwsync wrote: level-2 sleep); ``None``."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
