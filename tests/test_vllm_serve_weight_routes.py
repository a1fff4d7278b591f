"""vLLM's own weight routes on a `vllm serve` that hwsync's middleware serves are closed.

vLLM's dev-mode routes (``VLLM_SERVER_DEV_MODE=1``, which ``trl vllm-serve`` sets) write weights, adapters and the
weight version with no authentication: the weight-transfer verbs, ``/weight_checker`` (``reset``),
``/collective_rpc``, runtime LoRA loading. Behind hwsync's back they would leave its version, stale flag and checks
describing weights the engine no longer holds (``/start_weight_update`` + ``/finish_weight_update`` alone drop the
served adapter: vLLM resets LoRA state after every session). While hwsync serves the engine they answer 403 naming
the authenticated way, unless the server was started with ``HWSYNC_VLLM_WEIGHT_ROUTES=open``.

* the middleware alone: every weight route refused, every other route passed, the switch, a bad value;
* a real ``vllm serve`` (vLLM's API server with hwsync's flags and hwsync's weight-transfer backend selected, dev
  mode on): after an authenticated sync every weight route is refused, the engine keeps its version and serves the
  trainer's policy, and the next authenticated sync goes through.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]


def _call(middleware: Any, path: str) -> int:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request"}

    asyncio.run(middleware({"type": "http", "path": path, "app": None}, receive, send))
    if not sent:
        return 200
    assert "HWSYNC_VLLM_WEIGHT_ROUTES=open" in json.loads(sent[1]["body"])["error"]["message"]
    return int(sent[0]["status"])


def _middleware(monkeypatch: pytest.MonkeyPatch, value: str | None) -> tuple[Any, list[str]]:
    import threading

    from hwsync.server.vllm_api import ServedEngine, SyncMiddleware

    if value is None:
        monkeypatch.delenv("HWSYNC_VLLM_WEIGHT_ROUTES", raising=False)
    else:
        monkeypatch.setenv("HWSYNC_VLLM_WEIGHT_ROUTES", value)
    passed: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        passed.append(scope["path"])

    mw = SyncMiddleware(app)
    engine = ServedEngine.__new__(ServedEngine)
    engine.syncing, engine.stale_reason = threading.Event(), None
    mw.engine, mw.server = engine, object()
    return mw, passed


def test_the_middleware_closes_every_weight_route_and_only_those(monkeypatch: pytest.MonkeyPatch) -> None:
    from hwsync.integrations.vllm_serve import WEIGHT_ROUTES

    mw, passed = _middleware(monkeypatch, None)
    for route in WEIGHT_ROUTES:
        assert _call(mw, route) == 403, route
    assert _call(mw, "/update_weights/") == 403  # a trailing slash is the same route
    others = ["/v1/completions", "/health", "/v1/models", "/get_world_size", "/is_paused", "/sleep", "/wake_up"]
    for route in others:
        assert _call(mw, route) == 200, route
    assert passed == others
    opened, passed = _middleware(monkeypatch, "open")
    assert [_call(opened, r) for r in WEIGHT_ROUTES] == [200] * len(WEIGHT_ROUTES)
    assert passed == list(WEIGHT_ROUTES)


def test_a_bad_switch_value_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from hwsync.common.errors import OptionError

    with pytest.raises(OptionError, match="HWSYNC_VLLM_WEIGHT_ROUTES='ajar'.*'closed'.*'open'"):
        _middleware(monkeypatch, "ajar")


def _post(port: int, path: str, body: dict[str, Any]) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, reply.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, (e.read() or b"").decode(errors="replace")


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_weight_routes_cannot_write_behind_hwsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hwsync.testing import require_vllm

    require_vllm()
    import importlib.util

    if importlib.util.find_spec("vllm.distributed.weight_transfer") is None:
        pytest.skip("this vLLM has no weight-transfer API (and no such routes)")
    sys.path.insert(0, str(ROOT / "examples"))
    import trl_grpo_tiny_moe as job

    import hwsync
    from hwsync.server.vllm_api import serve_args
    from hwsync.testing.trainer import lora_trainer, perturb

    if not job.has_gpu():
        for key, value in {**job.CPU_ENV, "CUDA_VISIBLE_DEVICES": ""}.items():
            monkeypatch.setenv(key, os.environ.get(key, value))
    monkeypatch.delenv("HWSYNC_VLLM_WEIGHT_ROUTES", raising=False)
    model_dir, _ = job.prepare(tmp_path)
    token, address = secrets.token_hex(16), f"127.0.0.1:{job.free_port()}"
    monkeypatch.setenv("HWSYNC_SERVER", address)
    monkeypatch.setenv("HWSYNC_TOKEN", token)
    port = job.free_port()
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "256",
        "--enforce-eager",
        "--dtype",
        "bfloat16" if job.has_gpu() else "float32",
        "--num-gpu-blocks-override",
        "64",
        "--weight-transfer-config",
        json.dumps({"backend": "hwsync"}),
        *serve_args(max_lora_rank=8),
    ]
    with job.vllm_server(model_dir, port, tmp_path / "vllm-serve.log", {}, command=command):
        engine = hwsync.connect(address, token)
        model = lora_trainer(model_dir, ["q_proj", "v_proj"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
        atol = None if job.has_gpu() else 1e-4
        report = hwsync.sync(engine, model)
        assert report.lora_request is not None
        version = engine.state()["version"]
        attacks = {
            "/init_weight_transfer_engine": {"init_info": {"protocol": 1}},
            "/start_weight_update": {},
            "/update_weights": {"update_info": {"manifest": "{}", "buckets": [[0.0]]}},
            "/finish_weight_update": {},
            "/update_weight_version": {"new_version": "999"},
            "/weight_checker": {"action": "reset"},
            "/collective_rpc": {"method": "reset_weights"},
            "/v1/unload_lora_adapter": {"lora_name": report.lora_request.lora_name},
        }
        for route, body in attacks.items():
            status, text = _post(port, route, body)
            assert status == 403 and "HWSYNC_VLLM_WEIGHT_ROUTES" in text, (route, status, text[:300])
        state = engine.state()
        assert state["version"] == version and not state["stale"]
        hwsync.verify(engine, model, PROMPTS, atol=atol)  # still the trainer's weights and adapter, exactly
        perturb(model, 1)
        hwsync.sync(engine, model)  # the authenticated way still goes through
        hwsync.verify(engine, model, PROMPTS, atol=atol)
