"""hwsync's middleware in `vllm serve` (``hwsync.server.vllm_api.SyncMiddleware``): what it lets through.

* Generation: 503 while a sync runs (TRL's client retries), 409 with the reason after a sync failed half-way (the
  engine stale), through once a complete sync landed; other routes always pass. Without ``HWSYNC_SERVER`` it fails
  at startup.
* vLLM's own weight routes are closed while hwsync serves the engine. vLLM's dev-mode routes
  (``VLLM_SERVER_DEV_MODE=1``, which ``trl vllm-serve`` sets) write weights, adapters and the weight version with no
  authentication: the weight-transfer verbs, ``/weight_checker`` (``reset``), ``/collective_rpc``, runtime LoRA
  loading. Behind hwsync's back they would leave its version, stale flag and checks describing weights the engine no
  longer holds (``/start_weight_update`` + ``/finish_weight_update`` alone drop the served adapter: vLLM resets LoRA
  state after every session). While hwsync serves the engine they answer 403 naming the authenticated way, unless the
  server was started with ``HWSYNC_VLLM_WEIGHT_ROUTES=open``: checked on the middleware alone (every weight route
  refused, every other route passed, the switch, a bad value) and on a real ``vllm serve`` (vLLM's API server with
  hwsync's flags and hwsync's weight-transfer backend selected, dev mode on: after an authenticated sync every weight
  route is refused, the engine keeps its version and serves the trainer's policy, and the next authenticated sync
  goes through).
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
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]


def _call(middleware: Any, path: str) -> tuple[int, dict[str, Any] | None]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request"}

    asyncio.run(middleware({"type": "http", "path": path, "app": None}, receive, send))
    if not sent:
        return 200, None
    return sent[0]["status"], json.loads(sent[1]["body"])


def _middleware(monkeypatch: pytest.MonkeyPatch, routes: str | None = None) -> tuple[Any, Any, list[str]]:
    """The middleware over an app that records what reached it, serving a stand-in engine (no sync running, not
    stale); ``routes``: ``HWSYNC_VLLM_WEIGHT_ROUTES`` (``None``: unset)."""
    import threading

    from hwsync.server.vllm_api import ServedEngine, SyncMiddleware

    if routes is None:
        monkeypatch.delenv("HWSYNC_VLLM_WEIGHT_ROUTES", raising=False)
    else:
        monkeypatch.setenv("HWSYNC_VLLM_WEIGHT_ROUTES", routes)
    passed: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        passed.append(scope["path"])

    mw = SyncMiddleware(app)
    engine = ServedEngine.__new__(ServedEngine)
    engine.syncing, engine.stale_reason = threading.Event(), None
    mw.engine, mw.server = engine, object()
    return mw, engine, passed


def test_middleware_holds_generation_while_syncing_and_refuses_it_while_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    mw, engine, passed = _middleware(monkeypatch)
    assert _call(mw, "/v1/completions") == (200, None)
    engine.syncing.set()
    status, body = _call(mw, "/v1/completions")
    assert status == 503 and "in progress" in body["error"]["message"]
    assert _call(mw, "/health") == (200, None)  # not a generation route
    engine.syncing.clear()
    engine.stale_reason = "RuntimeError: optimizer blew up"
    status, body = _call(mw, "/v1/chat/completions")
    assert status == 409 and "optimizer blew up" in body["error"]["message"] and "stale" in body["error"]["message"]
    engine.stale_reason = None
    assert _call(mw, "/inference/v1/generate") == (200, None)
    assert passed == ["/v1/completions", "/health", "/inference/v1/generate"]


def test_middleware_without_server_address_fails_at_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    from hwsync.common.errors import OptionError
    from hwsync.server.vllm_api import SyncMiddleware

    monkeypatch.delenv("HWSYNC_SERVER", raising=False)
    monkeypatch.delenv("HWSYNC_TOKEN", raising=False)
    mw = SyncMiddleware(None)
    with pytest.raises(OptionError, match="HWSYNC_SERVER and HWSYNC_TOKEN.*vLLM server"):
        mw._start(SimpleNamespace(state=SimpleNamespace()))


def _refused(middleware: Any, path: str) -> bool:
    status, body = _call(middleware, path)
    return status == 403 and body is not None and "HWSYNC_VLLM_WEIGHT_ROUTES=open" in body["error"]["message"]


def test_the_middleware_closes_every_weight_route_and_only_those(monkeypatch: pytest.MonkeyPatch) -> None:
    from hwsync.integrations.vllm_serve import WEIGHT_ROUTES

    mw, _, passed = _middleware(monkeypatch)
    for route in WEIGHT_ROUTES:
        assert _refused(mw, route), route
    assert _refused(mw, "/update_weights/")  # a trailing slash is the same route
    others = ["/v1/completions", "/health", "/v1/models", "/get_world_size", "/is_paused", "/sleep", "/wake_up"]
    for route in others:
        assert _call(mw, route) == (200, None), route
    assert passed == others
    opened, _, passed = _middleware(monkeypatch, "open")
    assert [_call(opened, r) for r in WEIGHT_ROUTES] == [(200, None)] * len(WEIGHT_ROUTES)
    assert passed == list(WEIGHT_ROUTES)


def test_a_bad_switch_value_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from hwsync.common.errors import OptionError

    with pytest.raises(OptionError, match="HWSYNC_VLLM_WEIGHT_ROUTES='ajar'.*'closed'.*'open'"):
        _middleware(monkeypatch, "ajar")


def post(port: int, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST ``body`` as JSON to a local server's ``path``: status and JSON reply (``{}`` when it has none)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


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
            status, reply = post(port, route, body)
            message = reply.get("error", {}).get("message", "")
            assert status == 403 and "HWSYNC_VLLM_WEIGHT_ROUTES" in message, (route, status, reply)
        state = engine.state()
        assert state["version"] == version and not state["stale"]
        hwsync.verify(engine, model, PROMPTS, atol=atol)  # still the trainer's weights and adapter, exactly
        perturb(model, 1)
        hwsync.sync(engine, model)  # the authenticated way still goes through
        hwsync.verify(engine, model, PROMPTS, atol=atol)
