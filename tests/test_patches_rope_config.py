"""rope_config on the installed transformers: 4.x has no target, 5.0 raises on a list, 5.19 accepts one.

The same file runs in the main venv (transformers 5.19: "not needed") and in ci/run-old-transformers.sh
(4.57: "target missing"; with HWSYNC_OLD_TRANSFORMERS=5.0.0: "applies", fixed by the patch).
"""

from __future__ import annotations

import pytest
from packaging.version import Version

import hwsync.patches as patches

transformers = pytest.importorskip("transformers")
TF = Version(transformers.__version__)
PATCH = patches.get("rope_config")
KEY = "ignore_keys_at_rope_validation"


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
    )


def _expected_state() -> str | None:
    if TF < Version("5"):
        return patches.TARGET_MISSING
    if TF < Version("5.1"):
        return patches.APPLIES
    if TF >= Version("5.19"):
        return patches.NOT_NEEDED
    return None  # releases in between: not pinned here; the tests below still check consistency


def test_probe_matches_the_installed_version():
    result = PATCH.probe()
    expected = _expected_state()
    assert expected is None or result.state == expected, result
    if result.state == patches.TARGET_MISSING:
        assert "convert_rope_params_to_dict" in result.reason


def test_nothing_is_patched_unless_it_applies():
    from transformers import PretrainedConfig

    before = PretrainedConfig.__dict__.get("convert_rope_params_to_dict")
    applied = patches.apply(["rope_config"])
    try:
        assert ("rope_config" in applied) == (PATCH.probe().state == patches.APPLIES)
        if "rope_config" not in applied:
            assert PretrainedConfig.__dict__.get("convert_rope_params_to_dict") is before
    finally:
        patches.remove_all()
    assert PretrainedConfig.__dict__.get("convert_rope_params_to_dict") is before


def test_list_ignore_keys_without_and_with_the_patch():
    state = PATCH.probe().state
    if state == patches.TARGET_MISSING:
        from transformers import PretrainedConfig

        assert not hasattr(PretrainedConfig, "convert_rope_params_to_dict")
        return
    if state == patches.APPLIES:
        with pytest.raises(TypeError):
            _config().convert_rope_params_to_dict(**{KEY: ["mrope_section"]})
    else:
        _config().convert_rope_params_to_dict(**{KEY: ["mrope_section"]})  # fixed upstream: no error
    with PATCH.scoped(force=True):
        _config().convert_rope_params_to_dict(**{KEY: ["mrope_section"]})
    assert not PATCH.active


def test_the_wrapper_hands_the_original_a_set():
    if PATCH.probe().state == patches.TARGET_MISSING:
        pytest.skip(f"transformers {TF} has no convert_rope_params_to_dict: {PATCH.probe().reason}")
    seen = []
    original = PATCH.original()

    def spy(config, *args, **kwargs):  # observes the call the wrapper makes; the real method still runs
        seen.append(kwargs.get(KEY))
        return original(config, *args, **kwargs)

    wrapper = PATCH.replacement(spy, PATCH.targets[0])
    wrapper(_config(), **{KEY: ["mrope_section", "mrope_interleaved"]})
    wrapper(_config(), **{KEY: {"mrope_section"}})
    assert seen == [{"mrope_section", "mrope_interleaved"}, {"mrope_section"}]
