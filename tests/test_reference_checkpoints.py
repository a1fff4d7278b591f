"""``hwsync.testing.reference.write_checkpoint``: the directory a reference engine starts from is keyed by what the
engine loads, the config as well as the tensors (no vLLM needed).

Regression: the family matrix's tiny DeepSeek-V3 and GLM-4-MoE-lite checkpoints hold the very same tensors (same
shapes, same seed), so a directory keyed by the tensors alone was shared: whichever family ran first in a reference
process wrote ``config.json``, and the other family's syncs were checked against an engine of the wrong
architecture (GLM-4-MoE-lite was recorded as "unexplained, order-dependent").
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hwsync.testing.families import make_family_checkpoint
from hwsync.testing.reference import write_checkpoint


def _architecture(ckpt: Path) -> str:
    return json.loads((ckpt / "config.json").read_text())["architectures"][0]


def test_families_with_the_same_tensors_get_their_own_checkpoints(tmp_path: Path) -> None:
    models = {}
    for family in ("deepseek_v3", "glm4_moe_lite"):
        src = make_family_checkpoint(tmp_path / family, family)
        models[family] = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    a, b = (load_file(str(tmp_path / f / "model.safetensors")) for f in models)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # what made them collide

    root = tmp_path / "reference"
    root.mkdir()
    ckpt = {family: write_checkpoint(model, root) for family, model in models.items()}
    assert ckpt["deepseek_v3"] != ckpt["glm4_moe_lite"]
    assert _architecture(ckpt["deepseek_v3"]) == "DeepseekV3ForCausalLM"
    assert _architecture(ckpt["glm4_moe_lite"]) == "Glm4MoeLiteForCausalLM"


def test_a_config_change_alone_is_another_checkpoint_and_the_same_model_reuses_its_own(tmp_path: Path) -> None:
    src = make_family_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    root = tmp_path / "reference"
    root.mkdir()
    first = write_checkpoint(model, root)
    assert write_checkpoint(model, root) == first  # unchanged model: same directory, same reference engine

    model.config.rms_norm_eps = model.config.rms_norm_eps * 10  # no tensor changes, the engine computes otherwise
    other = write_checkpoint(model, root)
    assert other != first
    assert json.loads((other / "config.json").read_text())["rms_norm_eps"] == model.config.rms_norm_eps


def test_the_checkpoint_stops_where_the_trainer_stops(tmp_path: Path) -> None:
    """The trainer's generation config travels with the reference checkpoint: its eos ids are the engine's stop
    tokens (the tiny models stop on <|im_end|> and <|endoftext|>; config.json names one). Without it the reference
    engine decoded past <|endoftext|> where the engine under test stopped (the GPU LoRA-config matrix, 2026-11-28)."""
    from hwsync.testing import make_tiny_moe

    src = make_tiny_moe(tmp_path / "tiny", "qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    root = tmp_path / "reference"
    root.mkdir()
    out = write_checkpoint(model, root)
    want = json.loads((src / "generation_config.json").read_text())["eos_token_id"]
    assert isinstance(want, list) and len(want) == 2
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == want
