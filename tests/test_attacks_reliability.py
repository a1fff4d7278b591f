"""Issue 39's attacks and faults, on one real vLLM CPU engine served in this process (tiny Qwen3-MoE).

A token holder's oversized bucket, a prefix-cache reset that raises, non-finite weights, one deadline per trainer
call and the smaller holes (a lone surrogate in a token, IPv6 loopback, empty and gapped manifests, huge control
frames, a user's ``LoRARequest`` under hwsync's adapter id). Each test failed on the code before its fix.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_attacks import receive_in_thread  # the engine's side of a sync over a data plane, in a thread

import hwsync
from hwsync.common.errors import HwsyncError, StaleEngineError, SyncError
from hwsync.testing import patched_llm
from hwsync.testing.trainer import lora_trainer, perturb

pytestmark = pytest.mark.vllm

TOKEN = "reliability suite: a test token of 40+ chars"
PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]
ENGINE = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
BUCKET_MB = 0.25


@pytest.fixture(scope="module")
def llm(tiny_qwen3_moe_dir: Path) -> Iterator[Any]:
    with patched_llm(tiny_qwen3_moe_dir, **ENGINE) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(llm: Any) -> Iterator[Any]:
    with hwsync.serve(llm, "127.0.0.1:0", TOKEN, timeout_s=60) as s:
        yield s


@pytest.fixture(scope="module")
def remote(server: Any) -> Iterator[Any]:
    handle = hwsync.connect(server.address, TOKEN, timeout_s=30)
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def model(tiny_qwen3_moe_dir: Path) -> Any:
    m = lora_trainer(tiny_qwen3_moe_dir)
    perturb(m, 100, base=True, lora_scale=0.2, base_scale=0.05)
    return m


def _tokens(llm: Any) -> list[list[int]]:
    """Greedy tokens for :data:`PROMPTS` through hwsync (plain ``generate``: it reads vLLM's prefix cache)."""
    from vllm import SamplingParams

    outs = hwsync.generate(
        llm,
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, detokenize=False),
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def _logprobs(llm: Any) -> list[float]:
    from vllm import SamplingParams

    outs = hwsync.generate(
        llm,
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, detokenize=False),
    )
    return [next(iter(lp.values())).logprob for o in outs for lp in o.outputs[0].logprobs]


# -- 2. a prefix-cache reset that raises ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mode,raised", [("colocate", RuntimeError), ("colocate", KeyboardInterrupt), ("server", RuntimeError)]
)
def test_a_reset_that_raises_leaves_the_engine_stale(
    llm: Any,
    remote: Any,
    model: Any,
    tiny_qwen3_moe_dir: Path,
    mode: str,
    raised: type,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's ``reset_prefix_cache`` raises on its first call (a ``RuntimeError``, a Ctrl-C landing there) after
    the weights were written: the sync raises that error and the engine is stale (it reported ``stale=False`` and
    served the new weights over the old weights' cached KV)."""
    hwsync.sync(llm, model, strategy="full", bucket_mb=BUCKET_MB)
    _tokens(llm)  # the prompts' KV is in the prefix cache
    m1 = lora_trainer(tiny_qwen3_moe_dir)
    perturb(m1, 7, base=True, lora_scale=0.2, base_scale=0.05)
    original = llm.reset_prefix_cache
    calls = [0]

    def reset(*args: Any, **kwargs: Any) -> bool:
        calls[0] += 1
        if calls[0] == 1:
            raise raised("injected: the reset was interrupted")
        return bool(original(*args, **kwargs))

    monkeypatch.setattr(llm, "reset_prefix_cache", reset)
    target = remote if mode == "server" else llm
    with pytest.raises((raised, SyncError), match="injected: the reset was interrupted"):
        hwsync.sync(target, m1, strategy="full", bucket_mb=BUCKET_MB)
    monkeypatch.undo()
    assert hwsync.as_engine(llm).state()["stale"]
    with pytest.raises(StaleEngineError, match="reset raised"):
        _tokens(llm)
    hwsync.sync(llm, model, strategy="full", bucket_mb=BUCKET_MB)  # a complete sync recovers
    assert not hwsync.as_engine(llm).state()["stale"]
    _tokens(llm)


# -- 1. a bucket larger than its manifest, a rendezvous without the token --------------------------------------------
def _own_data_plane(timeout_s: float) -> tuple[socket.socket, Any, Any]:
    """A store of our own and a 2-rank data-plane spec on it (the trainer's side of a sync, without the trainer)."""
    import datetime
    import secrets

    import torch.distributed as dist

    from hwsync.common.protocol import group_prefix
    from hwsync.common.transport.base import LinkSpec

    sock = socket.create_server(("127.0.0.1", 0))
    store = dist.TCPStore(
        "127.0.0.1",
        sock.getsockname()[1],
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=sock.fileno(),
        use_libuv=True,
        timeout=datetime.timedelta(seconds=20),
    )
    return sock, store, LinkSpec("127.0.0.1", store.port, group_prefix(secrets.token_bytes(32)), 2, timeout_s)


def _engine_receives(llm: Any, model: Any, spec: Any, key: bytes) -> tuple[Any, threading.Thread, list[Any]]:
    """The engine's side of one sync of ``model`` over ``spec`` (data key ``key``), in a thread."""
    from hwsync.common.wire import Strategy
    from hwsync.trainer.api import SyncPlan, SyncRequest

    engine = hwsync.as_engine(llm)
    plan = SyncPlan.make(engine, model, SyncRequest(Strategy.FULL, BUCKET_MB))
    manifest = plan.manifest.with_version(engine.state()["version"] + 1, None)
    thread, result = receive_in_thread(engine, manifest, spec, key, daemon=True)
    return manifest, thread, result


@pytest.mark.parametrize("extra", [4096, -4096, 1 << 30], ids=["4 KiB longer", "4 KiB shorter", "1 GiB longer"])
def test_a_bucket_of_another_size_is_refused_not_a_crash(llm: Any, model: Any, extra: int) -> None:
    """A token holder (it has the sync's data key) sends a first bucket ``extra`` bytes off the manifest's size: gloo
    aborted the engine process (``op.preamble.length <= op.nbytes``, exit 134); now the frame's length is checked
    before a byte of it is read, and the sync is refused with nothing applied."""
    from hwsync.common.backend import open_link
    from hwsync.common.transport.buckets import TRAILER_BYTES

    hwsync.sync(llm, model, strategy="full", bucket_mb=BUCKET_MB)
    before = hwsync.as_engine(llm).state()
    sock, store, spec = _own_data_plane(10.0)
    key = b"K" * 32
    manifest, thread, result = _engine_receives(llm, model, spec, key)
    link = open_link(store, spec, 0, torch.device("cpu"), key)
    size = max(b.nbytes for b in manifest.buckets) + TRAILER_BYTES
    if extra == 1 << 30:  # announce 1 GiB more, send nothing of it
        from hwsync.common.cpu.framed import _LEN

        link._peers[0].sendall(_LEN.pack(size + extra))
    else:
        with contextlib.suppress(OSError):  # the engine closed the connection before taking the whole frame
            link.broadcast(torch.zeros(size + extra, dtype=torch.uint8), 0).wait()
    thread.join(30)
    link.close()
    sock.close()
    assert result and isinstance(result[0], SyncError), result
    assert "refused unread" in str(result[0]) or extra < 0, result[0]
    after = hwsync.as_engine(llm).state()
    assert not after["stale"] and after["version"] == before["version"], after
    assert _tokens(llm)


def test_the_data_plane_rendezvous_needs_the_token(llm: Any, model: Any) -> None:
    """A process without the sync's secret wins rank 0 of the rendezvous (it rewrote the store, or got there first):
    the engine worker refuses it before reading a byte from it, and the impostor learns nothing (it reads no bucket:
    the trainer's side refuses peers that cannot prove the secret)."""
    from hwsync.common.backend import open_link

    hwsync.sync(llm, model, strategy="full", bucket_mb=BUCKET_MB)
    before = hwsync.as_engine(llm).state()
    sock, store, spec = _own_data_plane(4.0)
    _, thread, result = _engine_receives(llm, model, spec, b"K" * 32)
    with pytest.raises(SyncError, match="did not join"):
        open_link(store, spec, 0, torch.device("cpu"), b"impostor without the key!")  # as rank 0
    thread.join(30)
    sock.close()
    assert result and isinstance(result[0], SyncError), result
    assert "cannot prove the sync's secret" in str(result[0]), result[0]
    after = hwsync.as_engine(llm).state()
    assert not after["stale"] and after["version"] == before["version"], after


# -- 3. NaN / Inf weights ---------------------------------------------------------------------------------------------
def _poisoned(path: Path, value: float) -> Any:
    m = lora_trainer(path)
    perturb(m, 100, base=True, lora_scale=0.2, base_scale=0.05)
    with torch.no_grad():
        dict(m.named_parameters())[
            next(n for n, _ in m.named_parameters() if "layers.0." in n and "v_proj" in n and "lora" not in n)
        ].fill_(value)
    return m


@pytest.mark.parametrize("mode,value", [("colocate", float("nan")), ("server", float("inf"))])
def test_non_finite_weights_are_never_served(
    llm: Any, remote: Any, model: Any, tiny_qwen3_moe_dir: Path, mode: str, value: float
) -> None:
    """A diverged step (layer 0's ``v_proj`` NaN or +Inf) is refused: the engine is stale, serves nothing of it,
    and the next complete sync serves exactly what the good weights served before (the NaN used to linger in reused
    KV blocks for a few calls)."""
    hwsync.sync(llm, model, strategy="full", bucket_mb=BUCKET_MB)
    good = (_tokens(llm), _logprobs(llm))
    target = remote if mode == "server" else llm
    with pytest.raises(SyncError, match="NaN or infinite values in bucket"):
        hwsync.sync(target, _poisoned(tiny_qwen3_moe_dir, value), strategy="full", bucket_mb=BUCKET_MB)
    assert hwsync.as_engine(llm).state()["stale"]
    with pytest.raises(StaleEngineError, match="NaN or infinite"):
        _tokens(llm)
    hwsync.sync(target, model, strategy="full", bucket_mb=BUCKET_MB)
    for _ in range(3):
        assert _tokens(llm) == good[0]
        assert _logprobs(llm) == pytest.approx(good[1], abs=1e-5)


def test_nan_weights_poison_reused_kv_blocks(
    llm: Any, model: Any, tiny_qwen3_moe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why NaN outlived the next complete sync (the check turned off to see it): after serving NaN weights and a
    complete good sync, outputs differ from the good weights' until the KV cache tensors are zeroed -- the reset
    frees the blocks, their stale NaN stays and reaches attention; zeroed, the outputs are right at once."""
    from hwsync.common.finite import FiniteFlags

    hwsync.sync(llm, model, strategy="full", bucket_mb=BUCKET_MB)
    good = _logprobs(llm)
    monkeypatch.setattr(FiniteFlags, "non_finite", lambda self: [])
    hwsync.sync(llm, _poisoned(tiny_qwen3_moe_dir, float("nan")), strategy="full", bucket_mb=BUCKET_MB)
    _logprobs(llm)  # NaN into the KV blocks these prompts use
    hwsync.sync(llm, model, strategy="full", bucket_mb=BUCKET_MB)
    monkeypatch.undo()
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    assert any(bool(t.isnan().any()) for t in runner.kv_caches), "no NaN left in the KV cache"
    wrong = _logprobs(llm)
    assert wrong != pytest.approx(good, abs=1e-5, nan_ok=True)
    for t in runner.kv_caches:
        t.zero_()
    assert _logprobs(llm) == pytest.approx(good, abs=1e-5)


# -- 4. one deadline per trainer call ---------------------------------------------------------------------------------
def test_one_deadline_per_sync(llm: Any, server: Any, model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine stalls before joining the data plane: the trainer's ``sync`` with ``timeout_s=5`` returns within
    its 5 s (it took one timeout for the data plane, then another for the reply: ~2x)."""
    from hwsync.common.transport.plane import ReceivingEnd

    original = ReceivingEnd.join
    release = threading.Event()

    def stalled(*args: Any, **kwargs: Any) -> Any:
        release.wait(30)
        return original(*args, **kwargs)

    monkeypatch.setattr(ReceivingEnd, "join", stalled)
    handle = hwsync.connect(server.address, TOKEN, timeout_s=5)
    t0 = time.monotonic()
    with pytest.raises(HwsyncError):
        hwsync.sync(handle, model, strategy="full", bucket_mb=BUCKET_MB)
    took = time.monotonic() - t0
    release.set()
    monkeypatch.undo()
    handle.close()
    with hwsync.as_engine(llm).lock:  # the engine's side finishes (refused: the trainer left)
        pass
    assert took < 5 + 1.5, took


# -- small items ------------------------------------------------------------------------------------------------------
def test_a_token_with_a_lone_surrogate_is_refused_as_a_token() -> None:
    from hwsync.common.tokens import check_token

    token = "a strong-looking token of 40 characters \ud800"
    with pytest.raises(SyncError, match="lone surrogate"):
        check_token(token)
    with pytest.raises(SyncError, match="lone surrogate"):
        hwsync.connect("127.0.0.1:9", token)


def test_ipv6_loopback_is_loopback(llm: Any, caplog: pytest.LogCaptureFixture) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with caplog.at_level("WARNING", logger="hwsync.server"), hwsync.serve(llm, "[::1]:0", TOKEN) as s:
        assert s.address == f"[::1]:{s.port}"
        handle = hwsync.connect(s.address, TOKEN, timeout_s=20)
        assert handle.state()["version"] >= 0
        handle.close()
    assert "not loopback" not in caplog.text


def test_empty_and_gapped_manifests_are_refused(llm: Any, model: Any) -> None:
    import json

    from hwsync.common.wire import Manifest, Strategy
    from hwsync.trainer.api import SyncPlan, SyncRequest

    plan = SyncPlan.make(hwsync.as_engine(llm), model, SyncRequest(Strategy.FULL, BUCKET_MB))
    doc = json.loads(plan.manifest.to_json())
    empty = {**doc, "specs": [], "buckets": []}
    with pytest.raises(SyncError, match="no tensors"):
        Manifest.from_json(json.dumps(empty))
    gapped = json.loads(json.dumps(doc))
    bucket = next(b for b in gapped["buckets"] if len(b[1]) >= 2)
    bucket[2][-1] += 64  # a gap before the last tensor, the bucket grown to match
    bucket[3] += 64
    with pytest.raises(SyncError, match="gap between tensors"):
        Manifest.from_json(json.dumps(gapped))


def test_huge_control_frames_are_admitted_one_budget_at_a_time(server: Any) -> None:
    """Authenticated peers start control frames near the 256 MB limit at once: the first is admitted (its size
    reserved before it is read), the others are refused unread and their connections dropped (three such frames
    used to take the server to 1.66 GB)."""
    from hwsync.common.protocol import _LEN, MAX_FRAME, client_handshake

    socks = []
    for _ in range(3):
        sock = socket.create_connection((server.host, server.port))
        client_handshake(sock, TOKEN, server.address, 10)  # authenticated, welcomed
        sock.sendall(_LEN.pack(MAX_FRAME - 1024) + b"\0" * 32 + b"x" * 1024)  # a frame begun, never finished
        socks.append(sock)
        time.sleep(0.3)
    closed = []
    for sock in socks:
        sock.settimeout(5)
        try:
            closed.append(sock.recv(1) == b"")
        except TimeoutError:
            closed.append(False)
        except OSError:
            closed.append(True)
        sock.close()
    assert closed == [False, True, True], closed


def test_a_user_adapter_under_hwsyncs_id_is_refused(
    llm: Any, model: Any, tiny_qwen3_moe_dir: Path, tmp_path: Path
) -> None:
    """A user's ``LoRARequest`` with hwsync's adapter id (26739) was served hwsync's adapter silently; now one
    error names the fix, and hwsync's own generation still works."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from hwsync.engine.vllm.applier import LORA_INT_ID

    lora = lora_trainer(tiny_qwen3_moe_dir, ["q_proj", "k_proj", "v_proj", "o_proj"])
    perturb(lora, 5, lora_scale=0.2)
    hwsync.sync(llm, lora, strategy="adapter", bucket_mb=BUCKET_MB)
    lora.save_pretrained(tmp_path / "mine")
    mine = LoRARequest("mine", LORA_INT_ID, str(tmp_path / "mine"))
    with pytest.raises(Exception, match="another lora_int_id"):
        llm.generate(
            [{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2), lora_request=mine, use_tqdm=False
        )
    assert _tokens(llm)
    hwsync.sync(llm, model, strategy="full", bucket_mb=BUCKET_MB)
