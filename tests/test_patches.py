"""The patch mechanism (scopes, installs, probes, composition, registry) and the ledger.

Targets are small modules built here: the mechanism patches attributes of any module, so these tests exercise
exactly the code real patches use, without importing transformers / PEFT / vLLM.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

import hwsync.patches as patches
from hwsync.common.errors import HwsyncError, PatchError
from hwsync.patches import (
    APPLIES,
    NOT_NEEDED,
    TARGET_MISSING,
    Patch,
    PatchWarning,
    ProbeResult,
)

README = Path(patches.__file__).with_name("README.md")


@pytest.fixture
def target_module():
    """A throwaway importable module with a function, a class with an inherited method and a classmethod."""
    mod = types.ModuleType("hwsync_patch_target")

    def double(x):
        return 2 * x

    class Base:
        def greet(self):
            return "base"

        @classmethod
        def make(cls):
            return cls.__name__

        @staticmethod
        def static():
            return "static"

    class Child(Base):
        pass

    mod.double, mod.Base, mod.Child = double, Base, Child
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def make_patch(state=APPLIES, targets=("hwsync_patch_target:double",), factory=None):
    calls = {"probe": 0, "built": 0}

    class _P(Patch):
        name = "test_patch"
        upstream = "https://example.invalid/issue"

        def check(self):
            calls["probe"] += 1
            return ProbeResult(state, "test")

        def replacement(self, original, target):
            calls["built"] += 1
            if factory is not None:
                return factory(original, target)

            @functools.wraps(original)
            def wrapper(*a, **k):
                return ("patched", original(*a, **k))

            return wrapper

    _P.targets = targets
    return _P(), calls


def test_scope_patches_and_restores_the_exact_object(target_module):
    p, _ = make_patch()
    original = target_module.double
    with p:
        assert target_module.double(3) == ("patched", 6)
        assert p.active and not p.installed
    assert target_module.double is original
    assert not p.active


def test_scope_restores_when_the_body_raises(target_module):
    p, _ = make_patch()
    original = target_module.double
    with pytest.raises(ZeroDivisionError), p:
        assert target_module.double(1) == ("patched", 2)
        raise ZeroDivisionError
    assert target_module.double is original and not p.active


def test_double_install_patches_once_and_nested_scopes_count(target_module):
    p, calls = make_patch()
    original = target_module.double
    assert p.install() and p.install()
    assert calls["built"] == 1 and target_module.double(1) == ("patched", 2)  # not ("patched", ("patched", 2))
    with p:
        with p.scoped():
            assert calls["built"] == 1
        assert target_module.double is not original  # still held by install() and the outer scope
    assert p.uninstall() and not p.uninstall()
    assert target_module.double is original and calls["built"] == 1


def test_install_outlives_scopes_and_scope_outlives_uninstall(target_module):
    p, _ = make_patch()
    original = target_module.double
    with p:
        p.install()
    assert target_module.double is not original
    with p:
        p.uninstall()
        assert target_module.double is not original
    assert target_module.double is original


def test_inherited_method_is_unshadowed_not_copied(target_module):
    Child, Base = target_module.Child, target_module.Base
    p, _ = make_patch(targets=("hwsync_patch_target:Child.greet",))
    with p:
        assert "greet" in Child.__dict__ and Child().greet() == ("patched", "base")
        assert Base().greet() == "base"
    assert "greet" not in Child.__dict__ and Child.greet is Base.greet


def test_classmethod_and_staticmethod_are_restored_raw(target_module):
    Base = target_module.Base
    raw_cm, raw_sm = Base.__dict__["make"], Base.__dict__["static"]

    def factory(original, target):
        func = original.__func__
        if isinstance(original, classmethod):
            return classmethod(lambda cls: ("patched", func(cls)))
        return staticmethod(lambda: ("patched", func()))

    p, _ = make_patch(targets=("hwsync_patch_target:Base.make", "hwsync_patch_target:Base.static"), factory=factory)
    with p:
        assert Base.make() == ("patched", "Base") and Base.static() == ("patched", "static")
    assert Base.__dict__["make"] is raw_cm and Base.__dict__["static"] is raw_sm


def test_not_needed_and_missing_targets_patch_nothing(target_module):
    original = target_module.double
    p, calls = make_patch(state=NOT_NEEDED)
    with p:
        assert target_module.double is original and not p.active
    assert not p.install() and not p.installed and calls["built"] == 0

    missing, calls = make_patch(targets=("hwsync_patch_target:nope",))
    assert missing.probe().state == TARGET_MISSING and "nope" in missing.probe().reason
    assert calls["probe"] == 0  # the probe proper never runs on a missing target
    assert not missing.install()
    with pytest.raises(PatchError, match="nope"):
        missing.install(force=True)

    nomodule, _ = make_patch(targets=("hwsync_no_such_module_xyz:f",))
    assert (
        nomodule.probe().state == TARGET_MISSING
        and nomodule.probe().reason == "hwsync_no_such_module_xyz is not installed"
    )


def test_force_applies_against_the_probe_and_probe_is_cached(target_module):
    p, calls = make_patch(state=NOT_NEEDED)
    with p.scoped(force=True):
        assert target_module.double(2) == ("patched", 4)
    p.probe(), p.probe()
    assert calls["probe"] == 1
    p.probe(refresh=True)
    assert calls["probe"] == 2


def test_probe_reads_the_original_while_installed(target_module):
    seen = []

    class _P(Patch):
        name = "reads_original"
        targets = ("hwsync_patch_target:double",)

        def check(self):
            seen.append(self.original()(1))
            return ProbeResult(APPLIES, "")

        def replacement(self, original, target):
            return lambda x: -1

    p = _P()
    with p.scoped(force=True):
        p.probe(refresh=True)
    assert seen == [2]


def test_someone_patching_on_top_is_left_in_place_with_a_warning(target_module):
    p, _ = make_patch()
    original = target_module.double
    p.install()

    def theirs(x):
        return "theirs"

    target_module.double = theirs
    with pytest.warns(PatchWarning, match="replaced after hwsync patched it"):
        p.uninstall()
    assert target_module.double is theirs and p.shadowed == ["hwsync_patch_target:double"]
    target_module.double = original


def test_someone_patching_before_us_is_wrapped_and_restored(target_module):
    def theirs(x):
        return "theirs"

    target_module.double = theirs
    p, _ = make_patch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with p:
            assert target_module.double(1) == ("patched", "theirs")
    assert target_module.double is theirs


def test_multi_target_apply_is_atomic(target_module):
    original = target_module.double

    def factory(original, target):
        if target.endswith("greet"):
            raise RuntimeError("cannot build this one")
        return lambda *a: "patched"

    p, _ = make_patch(targets=("hwsync_patch_target:double", "hwsync_patch_target:Base.greet"), factory=factory)
    with pytest.raises(PatchError, match="nothing was left patched"):
        p.install(force=True)
    assert target_module.double is original and not p.active and "greet" in target_module.Base.__dict__


def test_alternative_targets_take_the_first_that_exists(target_module):
    p, _ = make_patch(targets=(("hwsync_patch_target:moved_here", "hwsync_patch_target:double"),))
    assert p.probe().state == APPLIES
    with p:
        assert target_module.double(1) == ("patched", 2)
    assert "moved_here | hwsync_patch_target:double" in p.target


def test_a_raising_probe_patches_nothing(target_module):
    class _P(Patch):
        name = "raising_probe"
        targets = ("hwsync_patch_target:double",)

        def check(self):
            raise RuntimeError("boom")

    p = _P()
    assert p.probe().state == NOT_NEEDED and "probe error" in p.probe().reason
    assert not p.install()


def test_registry_api():
    assert set(patches.names()) == {
        "rope_config",
        "peft_moe_regex",
        "mtp_config",
        "vllm_cpu_moe_lora",
        "vllm_cpu_moe_prepack",
        "vllm_cpu_mamba_conv",
        "vllm_reload_partial_loader",
        "vllm_cpu_lora_logits",
        "vllm_transformers_backend",
        "vllm_lora_expert_spellings",
        "vllm_offline_failed_requests",
        "vllm_moe_router_lora_alias",
        "vllm_sleep_watch",
        "vllm_weight_transfer_lora_reset",
        "vllm_lora_manager_guards",
        "vllm_ascend",
        "swift_rollout_cpu",
        "swift_rollout_serve",
        "trl_vllm_generation",
    }
    assert patches.get("mtp_config").name == "mtp_config"
    with pytest.raises(PatchError, match="known:"):
        patches.get("nope")
    with pytest.raises(HwsyncError):
        patches.apply(["rope_config", "nope"])
    assert not any(p.active for p in map(patches.get, patches.names()))  # nothing applied by the failed call


def test_disable_env_keeps_apply_from_installing(monkeypatch):
    monkeypatch.setenv(patches.DISABLE_ENV, "all")
    assert patches.apply() == []
    assert not any(patches.get(n).installed for n in patches.names())


def test_importing_patches_imports_no_target():
    code = (
        "import sys, hwsync.patches as p; p.names(); "
        "print(sorted(m for m in ('torch', 'transformers', 'peft', 'vllm', 'vllm_ascend', 'swift', 'trl') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


FIELDS = ("Target", "Why", "How", "Upstream", "Remove when")


def _ledger_rows() -> dict[str, dict[str, str]]:
    """Each patch's section of the ledger (``### `name` ``) as its fields (``**Target.** ...``), in the file's order."""
    rows: dict[str, dict[str, str]] = {}
    text = README.read_text().split("\n## The patches\n", 1)[1]
    for section in re.split(r"^### ", text, flags=re.M)[1:]:
        head, _, body = section.partition("\n")
        fields = re.split(r"^\*\*(" + "|".join(FIELDS) + r")\.\*\*", body, flags=re.M)
        rows[head.strip().strip("`")] = {k: " ".join(v.split()) for k, v in zip(fields[1::2], fields[2::2])}
    return rows


def test_the_ledger_index_lists_every_section_in_order():
    index = re.findall(r"^- \[`([a-z0-9_]+)`\]\(#\1\)", README.read_text(), flags=re.M)
    assert index == list(_ledger_rows()), "the list at the top of hwsync/patches/README.md and the sections disagree"


def test_ledger_has_one_complete_section_per_registered_patch():
    rows = _ledger_rows()
    assert set(rows) == set(patches.names()), "hwsync/patches/README.md and the registry disagree"
    assert list(rows) == patches.names(), "keep the ledger in registration order (hwsync doctor's order)"
    for name, row in rows.items():
        p = patches.get(name)
        for column in FIELDS:
            assert row.get(column), f"ledger section {name!r} has no {column!r}"
        for entry in p.targets:
            for spec in (entry,) if isinstance(entry, str) else entry:
                assert spec.split(":")[1] in row["Target"], f"ledger section {name!r} does not name {spec}"
        assert p.upstream in row["Upstream"]
        assert re.search(r"https://", row["Upstream"])


def test_a_second_copy_of_the_same_patch_does_not_wrap_twice(target_module):
    """hwsync imported twice (two registries) must still patch once, and each copy undoes only its own."""
    first, _ = make_patch()
    second = type(first)()
    original = target_module.double
    assert first.install() and second.install()
    assert target_module.double(1) == ("patched", 2)
    assert second.original()(1) == ("patched", 2)  # what it found there: the first copy's wrapper
    second.uninstall()
    assert target_module.double(1) == ("patched", 2)
    first.uninstall()
    assert target_module.double is original


def test_opt_in_patches_are_left_out_of_a_plain_apply(monkeypatch):
    """apply() with no names (what every vLLM process runs via hwsync.engine.vllm_plugin) must not touch ms-swift."""
    opt_in = {p.name for p in patches.registered() if p.opt_in}
    assert {
        "swift_rollout_cpu",
        "swift_rollout_serve",
        "trl_vllm_generation",
        "vllm_sleep_watch",
        "vllm_weight_transfer_lora_reset",
    } <= opt_in
    chosen = {p.name for p in patches.select(None)}
    assert not chosen & opt_in
    assert {p.name for p in patches.select(sorted(opt_in))} == opt_in  # by name they are selectable


def test_opt_in_is_a_property_of_each_patch_read_by_every_process_wide_install(monkeypatch):
    """``hwsync.patches.apply()``, the vLLM plugin and ms-swift's plugin install no opt-in patch: a new opt-in patch
    needs no list kept in sync anywhere (it used to be a skip list in ``hwsync.integrations.swift._install``)."""
    from hwsync.engine.vllm_plugin import engine_patches

    monkeypatch.delenv(patches.DISABLE_ENV, raising=False)
    opt_in = {p.name for p in patches.registered() if p.opt_in}
    assert {"vllm_lora_manager_guards", "trl_vllm_generation", "vllm_sleep_watch", "swift_rollout_serve"} <= opt_in
    assert not opt_in & set(engine_patches())
    assert {p.name for p in patches.registered() if p.integration == "swift"} == {
        "swift_rollout_cpu",
        "swift_rollout_serve",
    }
    assert all(p.opt_in for p in patches.registered() if p.integration)  # an integration's patches are opt-in
