"""Fault injection and attacks from the receiver's side, on one real vLLM engine served in this process.

The engine (tiny Qwen3-MoE, ``hwsync.testing.engine_args``) is served with :func:`hwsync.serve` on loopback; trainers
:func:`hwsync.connect` to it from threads of this process, attackers come as raw sockets, a man in the middle, or
another process. After every input the engine must either serve exactly the output of one complete sync, or be
stale and refuse to generate (and then recover with one complete sync): anything else is *half-applied*.

"Serves exactly" compares the engine with itself: greedy tokens and their logprobs for fixed prompts, recorded right
after each complete sync (same weights, same batch -> same numbers on the CPU build).

The module ends with a table (category | inputs tried | refused | accepted | half-applied) and asserts it: every
attack refused, nothing half-applied.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import re
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hwsync
from hwsync.common.errors import HwsyncError, StaleEngineError, SyncError
from hwsync.testing import patched_llm
from hwsync.testing.trainer import lora_trainer, perturb

pytestmark = pytest.mark.vllm

TOKEN = "attack suite: a test token of 40+ chars"
PROMPTS = [[1, 5, 9, 33, 70, 100, 7, 8], [3, 4, 200, 17, 18, 99]]
ENGINE = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
BUCKET_MB = 0.25

COLUMNS = ("inputs tried", "refused", "accepted (valid)", "half-applied")
TABLE: dict[str, list[int]] = {}
ATTACKS = set()  # categories where every input is hostile: all must be refused


def record(category: str, *, refused: bool, half: bool = False, attack: bool = True) -> None:
    row = TABLE.setdefault(category, [0, 0, 0, 0])
    row[0] += 1
    row[1] += int(refused)
    row[2] += int(not refused)
    row[3] += int(half)
    if attack:
        ATTACKS.add(category)


# -- the engine, its server, observations ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_qwen3_moe_dir: Path) -> Iterator[Any]:
    with patched_llm(tiny_qwen3_moe_dir, **ENGINE) as engine:  # + what VLLM_PLUGINS=hwsync does
        yield engine


@pytest.fixture(scope="module")
def server(llm: Any) -> Iterator[Any]:
    with hwsync.serve(llm, "127.0.0.1:0", TOKEN, timeout_s=60) as s:
        yield s


def _perturb(model: Any, seed: int, *, base: bool = False) -> None:
    perturb(model, seed, base=base, lora_scale=0.2, base_scale=0.05)  # large steps: every change is visible


def _snapshot(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _restore(model: Any, snap: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(snap[n])


Obs = tuple[tuple[tuple[int, ...], tuple[float, ...]], ...]


def observe(llm: Any) -> Obs | None:
    """What the engine serves through hwsync (greedy tokens + logprobs), or None when it refuses (stale)."""
    try:
        out = hwsync.as_engine(llm).logprobs(PROMPTS, 4)
    except StaleEngineError:
        return None
    return tuple((tuple(ids), tuple(vals)) for ids, vals in out)


def same(a: Obs | None, b: Obs | None, tol: float = 1e-5) -> bool:
    if a is None or b is None:
        return a is b
    return all(ia == ib and all(abs(x - y) <= tol for x, y in zip(va, vb)) for (ia, va), (ib, vb) in zip(a, b))


def half_applied(llm: Any, *allowed: Obs) -> bool:
    """Neither refusing (stale) nor serving exactly one of ``allowed``."""
    got = observe(llm)
    return got is not None and not any(same(got, a) for a in allowed)


class Baseline:
    """A plain model M0 fully synced (its observation ``sig``) and a LoRA model L0 (``lora_sig`` once synced)."""

    def __init__(self, llm: Any, server: Any, path: Path) -> None:
        self.llm = llm
        self.server = server
        self.remote = hwsync.connect(server.address, TOKEN, timeout_s=30)
        self.model = lora_trainer(path)
        _perturb(self.model, 100, base=True)
        self.path = path
        self.sig = self.restore()

    def restore(self) -> Obs:
        """One complete full sync of M0; the engine then serves exactly ``sig`` (checked from the 2nd call on)."""
        hwsync.sync(self.remote, self.model, strategy="full", bucket_mb=BUCKET_MB)
        got = observe(self.llm)
        assert got is not None
        if hasattr(self, "sig"):
            assert same(got, self.sig), "a complete sync of M0 did not bring back M0's output"
        return got


@pytest.fixture(scope="module")
def base(llm: Any, server: Any, tiny_qwen3_moe_dir: Path) -> Iterator[Baseline]:
    b = Baseline(llm, server, tiny_qwen3_moe_dir)
    yield b
    b.remote.close()


def _worker(llm: Any) -> Any:
    return llm.llm_engine.model_executor.driver_worker.worker


# -- receiver-side failures -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 3, -1], ids=["first", "4th", "last"])
def test_loader_raises_mid_bucket(base: Baseline, monkeypatch: pytest.MonkeyPatch, k: int) -> None:
    from hwsync.engine.vllm.applier import VllmApplier

    original = VllmApplier.load_base

    def failing(self: Any, plan: Any, weights: Any) -> str:
        def gen() -> Iterator[Any]:
            items = iter(weights)
            item = next(items)
            for i in range(1 << 30):
                nxt = next(items, None)
                if i == k or (k == -1 and nxt is None):
                    raise RuntimeError(f"injected: loader fails at tensor {k}")
                yield item
                if nxt is None:
                    return
                item = nxt

        return original(self, plan, gen())

    m1 = lora_trainer(base.path)
    _perturb(m1, 200 + k, base=True)
    monkeypatch.setattr(VllmApplier, "load_base", failing)
    with pytest.raises(SyncError, match="injected: loader fails") as err:
        hwsync.sync(base.remote, m1, strategy="full", bucket_mb=BUCKET_MB)
    monkeypatch.undo()
    assert re.search(r"raised at \S*test_attacks.py:\d+ in gen\)", str(err.value))  # where it came from
    stale = base.remote.state()["stale"]
    assert stale == ("engine is stale" in str(err.value))
    if stale:
        assert observe(base.llm) is None  # refuses: no output from a half-written engine
    record("receiver: loader raises mid-bucket", refused=True, half=half_applied(base.llm, base.sig), attack=False)
    base.restore()


def test_post_processing_raises(base: Baseline, monkeypatch: pytest.MonkeyPatch) -> None:
    """``process_weights_after_loading`` of one layer fails during vLLM's layer-wise reload (and again while the
    receiver puts the layers back)."""
    monkeypatch.setenv("HWSYNC_DIRECT", "0")  # every write through vLLM's reload: post-processing runs
    model = _worker(base.llm).model_runner.model
    victims = [
        m
        for n, m in model.named_modules()
        if ".layers.1." in n
        and getattr(m, "quant_method", None) is not None
        and hasattr(m.quant_method, "process_weights_after_loading")
    ]
    assert victims
    qm = victims[0].quant_method

    def boom(layer: Any) -> None:
        raise RuntimeError("injected: process_weights_after_loading failed")

    m1 = lora_trainer(base.path)
    _perturb(m1, 300, base=True)
    monkeypatch.setattr(qm, "process_weights_after_loading", boom, raising=False)
    with pytest.raises(SyncError, match="engine is stale"):
        hwsync.sync(base.remote, m1, strategy="full", bucket_mb=BUCKET_MB)
    monkeypatch.undo()
    monkeypatch.setenv("HWSYNC_DIRECT", "0")
    assert observe(base.llm) is None
    record("receiver: post-processing raises", refused=True, half=half_applied(base.llm, base.sig), attack=False)
    base.restore()


def test_recover_itself_fails(
    base: Baseline, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The loader fails and restoring the layers fails too: logged, stale, and a complete sync still recovers."""
    import vllm.model_executor.model_loader.reload.layerwise as layerwise

    from hwsync.engine.vllm.applier import VllmApplier

    original = VllmApplier.load_base

    def failing(self: Any, plan: Any, weights: Any) -> str:
        def gen() -> Iterator[Any]:
            for i, item in enumerate(weights):
                if i == 5:
                    raise RuntimeError("injected: loader fails")
                yield item

        return original(self, plan, gen())

    def finalize_fails(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected: finalize fails")

    monkeypatch.setenv("HWSYNC_DIRECT", "0")
    monkeypatch.setattr(VllmApplier, "load_base", failing)
    monkeypatch.setattr(layerwise, "finalize_layerwise_reload", finalize_fails)
    m1 = lora_trainer(base.path)
    _perturb(m1, 400, base=True)
    with caplog.at_level("WARNING", logger="hwsync"), pytest.raises(SyncError, match="engine is stale"):
        hwsync.sync(base.remote, m1, strategy="full", bucket_mb=BUCKET_MB)
    monkeypatch.undo()
    assert "restoring the engine's layers after a failed reload failed too" in caplog.text
    assert observe(base.llm) is None
    record("receiver: recovery fails", refused=True, half=half_applied(base.llm, base.sig), attack=False)
    # layers may hold placeholders now: the recovering sync goes through vLLM's reload only (an in-place write
    # would land in a placeholder; on CUDA every base tensor is otherwise written in place)
    r = hwsync.sync(base.remote, base.model, strategy="full", bucket_mb=BUCKET_MB)
    assert r.path.startswith("base: 0 in place"), r.path
    base.restore()


def _lora_injection(name: str, llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from hwsync.engine.vllm.applier import lora_manager_of
    from hwsync.engine.vllm.lora_slots import SlotWriter

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"injected: {name}")

    from hwsync.engine.vllm.worker import receiver_of

    manager = lora_manager_of(_worker(llm))
    if name == "slot rewrite fails after writing":
        original = SlotWriter.write

        def written_then_fail(self: Any, manager: Any, lora_model: Any, tensors: Any) -> None:
            original(self, manager, lora_model, tensors)  # the new values are in, but the sync fails
            raise RuntimeError(f"injected: {name}")

        monkeypatch.setattr(SlotWriter, "write", written_then_fail)
        return
    monkeypatch.setattr(receiver_of(_worker(llm)).applier, "_slot_writers", {})  # vLLM's construction path
    monkeypatch.setenv("HWSYNC_DIRECT", "0")
    if name == "adapter build fails":
        from vllm.lora.lora_model import LoRAModel

        monkeypatch.setattr(LoRAModel, "from_lora_tensors", classmethod(boom))
    elif name == "add_adapter fails after remove":
        monkeypatch.setattr(manager, "add_adapter", boom)
    elif name == "vLLM cannot pack the adapter":
        from vllm.lora.lora_weights import PackedLoRALayerWeights

        monkeypatch.setattr(PackedLoRALayerWeights, "pack", classmethod(boom))
    elif name == "pin fails after add":
        monkeypatch.setattr(manager, "pin_adapter", boom)
    else:  # pragma: no cover
        raise AssertionError(name)


@pytest.mark.parametrize(
    "injection",
    [
        "slot rewrite fails after writing",
        "adapter build fails",
        "add_adapter fails after remove",
        "pin fails after add",
        "vLLM cannot pack the adapter",
    ],
)
def test_adapter_install_fails(base: Baseline, monkeypatch: pytest.MonkeyPatch, injection: str) -> None:
    lora = lora_trainer(base.path, ATTN)
    _perturb(lora, 500)
    hwsync.sync(base.remote, lora, strategy="adapter", bucket_mb=BUCKET_MB)
    sig_a = observe(base.llm)
    assert sig_a is not None and not same(sig_a, base.sig)
    snap = _snapshot(lora)
    _perturb(lora, 501)
    _lora_injection(injection, base.llm, monkeypatch)
    with pytest.raises(SyncError, match=f"injected: {injection}"):
        hwsync.sync(base.remote, lora, strategy="adapter", bucket_mb=BUCKET_MB)
    monkeypatch.undo()
    state = base.remote.state()
    if injection == "vLLM cannot pack the adapter":  # packed aside first: the previous adapter was never removed
        assert not state["stale"], state
    if not state["stale"]:  # "nothing was applied": then the previous adapter serves, exactly
        assert same(observe(base.llm), sig_a)
    record("receiver: adapter install fails", refused=True, half=half_applied(base.llm, sig_a), attack=False)
    _restore(lora, snap)  # back to the adapter that served: a complete sync brings exactly that back
    hwsync.sync(base.remote, lora, strategy="adapter", bucket_mb=BUCKET_MB)
    assert same(observe(base.llm), sig_a)
    base.restore()


# -- concurrency -----------------------------------------------------------------------------------------------------
def test_two_trainers_at_once(base: Baseline) -> None:
    models = [lora_trainer(base.path), lora_trainer(base.path)]
    for i, m in enumerate(models):
        _perturb(m, 600 + i, base=True)
    remotes = [hwsync.connect(base.server.address, TOKEN, timeout_s=30) for _ in models]
    outcomes: list[tuple[int, BaseException | None]] = []
    lock = threading.Lock()

    def trainer(i: int) -> None:
        for _ in range(3):
            try:
                hwsync.sync(remotes[i], models[i], strategy="full", bucket_mb=BUCKET_MB)
                err = None
            except BaseException as e:  # noqa: BLE001
                err = e
            with lock:
                outcomes.append((i, err))

    threads = [threading.Thread(target=trainer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    final = observe(base.llm)
    errors = [e for _, e in outcomes if e is not None]
    assert all(isinstance(e, HwsyncError) for e in errors), errors
    # the engine serves exactly one trainer's model, whichever synced last
    sigs = []
    for i in range(2):
        hwsync.sync(remotes[i], models[i], strategy="full", bucket_mb=BUCKET_MB)
        sigs.append(observe(base.llm))
    assert not same(sigs[0], sigs[1])
    half = final is None or not any(same(final, s) for s in sigs)
    for _, e in outcomes:
        record("2 trainers at once (syncs)", refused=e is not None, attack=False)
    record("2 trainers at once (final state)", refused=False, half=half, attack=False)
    assert sum(e is None for _, e in outcomes) >= 2  # both got through at least once
    for r in remotes:
        r.close()
    base.restore()


def test_generation_hammering_during_20_syncs(base: Baseline) -> None:
    """Generation through hwsync in a loop while 20 syncs (adapter, and full every 5th) land: every output equals
    the output of exactly one complete sync."""
    lora = lora_trainer(base.path, ATTN)
    plain = lora_trainer(base.path)
    sigs: list[Obs] = [base.sig]
    seen: list[Obs | None] = []
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            seen.append(observe(base.llm))
            time.sleep(0.005)  # the lock is not fair: leave the syncs a way in

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        for step in range(20):
            if step % 5 == 4:
                _perturb(plain, 700 + step, base=True)
                hwsync.sync(base.remote, plain, strategy="full", bucket_mb=BUCKET_MB)
            else:
                _perturb(lora, 700 + step)
                hwsync.sync(base.remote, lora, strategy="adapter", bucket_mb=BUCKET_MB)
            got = observe(base.llm)
            assert got is not None
            sigs.append(got)
            time.sleep(0.05)  # let the hammer in between syncs too
    finally:
        stop.set()
        thread.join(timeout=120)
    assert len(seen) >= 20, len(seen)
    assert all(not same(a, b) for a, b in zip(sigs, sigs[1:]))  # every sync changed the output
    for obs in seen:
        matches = sum(same(obs, s) for s in sigs)
        record("generation during 20 syncs", refused=obs is None, half=obs is not None and matches != 1, attack=False)
    base.restore()


def test_swift_rollout_generation_takes_the_engine_lock(base: Baseline, monkeypatch: pytest.MonkeyPatch) -> None:
    """``swift rollout``'s routes all end in ``engine.infer``: guarded, it waits for a sync in progress and refuses
    while the engine is stale; every handle on one ``LLMEngine`` is the same (one lock)."""
    pytest.importorskip("swift")
    from hwsync.engine.vllm.applier import VllmApplier
    from hwsync.integrations.swift._engine_view import LLMEngineView
    from hwsync.integrations.swift._server import guard_generation

    view = LLMEngineView.of(base.llm.llm_engine)
    assert LLMEngineView.of(base.llm.llm_engine) is view
    handle = hwsync.as_engine(view)
    assert hwsync.as_engine(LLMEngineView.of(base.llm.llm_engine)) is handle

    class Rollout:  # ms-swift's engine surface the routes call
        def infer(self, requests: Any) -> Any:
            return view.generate([{"prompt_token_ids": p} for p in requests])

    rollout = Rollout()
    guard_generation(rollout, handle)
    guard_generation(rollout, handle)  # idempotent
    assert len(rollout.infer(PROMPTS)) == 2
    # during a sync: waits for the lock
    entered = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with handle.lock:
            entered.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    entered.wait(10)
    done: list[float] = []
    gen = threading.Thread(target=lambda: (rollout.infer(PROMPTS), done.append(time.perf_counter())))
    t_release = time.perf_counter() + 0.5
    gen.start()
    time.sleep(0.5)
    assert not done  # still waiting for the "sync"
    release.set()
    holder.join()
    gen.join(30)
    assert done and done[0] >= t_release
    # stale: refused
    original = VllmApplier.load_base

    def failing(self: Any, plan: Any, weights: Any) -> str:
        def gen() -> Iterator[Any]:
            for i, item in enumerate(weights):
                if i == 2:
                    raise RuntimeError("injected")
                yield item

        return original(self, plan, gen())

    monkeypatch.setattr(VllmApplier, "load_base", failing)
    m1 = lora_trainer(base.path)
    _perturb(m1, 1100, base=True)
    with pytest.raises(SyncError):
        hwsync.sync(base.remote, m1, strategy="full", bucket_mb=BUCKET_MB)
    monkeypatch.undo()
    with pytest.raises(StaleEngineError):
        rollout.infer(PROMPTS)
    record("swift rollout route while stale", refused=True, attack=False)
    base.restore()
    assert len(rollout.infer(PROMPTS)) == 2


# -- the control channel ---------------------------------------------------------------------------------------------
def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _closed_by_server(sock: socket.socket, timeout: float = 15.0) -> bool:
    """True once the server closed the connection without proving anything (reads until EOF)."""
    sock.settimeout(timeout)
    try:
        while True:
            if not sock.recv(4096):
                return True
    except (ConnectionError, OSError):
        return True
    except TimeoutError:
        return False


def _raw_connect(address: str) -> socket.socket:
    sock = socket.create_connection(_host_port(address), timeout=15)
    return sock


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def _hello(sock: socket.socket) -> tuple[bytes, bytes]:
    """The server's hello: (salt, nonce)."""
    data = _exactly(sock, 4 + 16 + 32)
    assert data[:4] == b"HWS2"
    return data[4:20], data[20:]


def _mac(key: bytes, *parts: bytes | str) -> bytes:
    import hashlib
    import hmac

    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        b = p if isinstance(p, bytes) else p.encode()
        h.update(struct.pack("<I", len(b)))
        h.update(b)
    return h.digest()


def _hang_up(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class _Proxy:
    """A man in the middle between one trainer and the server: forwards the handshake, then applies ``mode`` to
    the first request frame the trainer sends."""

    def __init__(self, address: str, mode: str) -> None:
        self.target = _host_port(address)
        self.mode = mode
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.captured: list[bytes] = []
        threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def _exact(sock: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    def _run(self) -> None:
        client, _ = self.listener.accept()
        upstream = socket.create_connection(self.target)

        def down() -> None:
            try:
                while chunk := upstream.recv(65536):
                    client.sendall(chunk)
            except OSError:
                pass
            _hang_up(client)  # shutdown, not just close: wakes the reader blocked on it, the trainer sees EOF

        threading.Thread(target=down, daemon=True).start()
        try:
            hs = self._exact(client, 4 + 32)  # the client's nonce; its proof follows the server's
            upstream.sendall(hs)
            proof = self._exact(client, 32)
            upstream.sendall(proof)
            self.captured.append(hs + proof)
            first = True
            while True:
                head = self._exact(client, 4 + 32)
                (n,) = struct.unpack("<I", head[:4])
                body = self._exact(client, n)
                frame = head + body
                self.captured.append(frame)
                if first:
                    first = False
                    if self.mode == "replay":
                        upstream.sendall(frame + frame)
                        continue
                    if self.mode == "tamper body":
                        frame = frame[:-2] + bytes([frame[-2] ^ 0x01]) + frame[-1:]
                    elif self.mode == "tamper mac":
                        frame = frame[:4] + bytes([frame[4] ^ 0x80]) + frame[5:]
                    elif self.mode == "oversized length":
                        frame = struct.pack("<I", (256 << 20) + 1) + frame[4:]
                    elif self.mode == "truncate":
                        upstream.sendall(frame[: len(frame) // 2])
                        upstream.shutdown(socket.SHUT_WR)
                        return
                    elif self.mode == "swap to shutdown":  # a body of the attacker's choice under the real MAC
                        frame = head + json.dumps({"op": "shutdown", "args": {}}).encode()[:n].ljust(n)
                upstream.sendall(frame)
        except OSError:
            pass
        finally:
            _hang_up(upstream)
            _hang_up(client)


@pytest.mark.parametrize(
    "mode", ["replay", "tamper body", "tamper mac", "oversized length", "truncate", "swap to shutdown"]
)
def test_man_in_the_middle_frames_are_refused(base: Baseline, mode: str) -> None:
    proxy = _Proxy(base.server.address, mode)
    remote = hwsync.connect(proxy.address, TOKEN, timeout_s=30)
    before = base.remote.state()
    refused = False
    try:
        remote.state()
        if mode == "replay":
            remote.state()  # the duplicate is the 2nd frame the server sees: dropped there
    except (SyncError, ConnectionError, OSError):
        refused = True
    assert refused, mode
    assert not base.server.wait(0)  # the swapped "shutdown" did not reach the server
    after = base.remote.state()
    record(
        "MITM: forged / replayed / cut frames",
        refused=refused,
        half=after != before or half_applied(base.llm, base.sig),
    )
    # the server still serves honest trainers
    assert hwsync.connect(base.server.address, TOKEN, timeout_s=30).state()["version"] == before["version"]


def test_nothing_listens_on_the_wildcard(base: Baseline) -> None:
    """The sync server and the trainer's rendezvous store listen on exactly the loopback address they were given
    (``ss -ltn``): no ``*:port`` / ``0.0.0.0:port`` / ``[::]:port``."""
    import shutil

    if shutil.which("ss") is None:
        pytest.skip("ss (iproute2) is not installed")
    store = base.remote.plane.store()
    ports = {base.server.port: "sync server", store.port: "trainer's rendezvous store"}
    listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, check=True).stdout.split("\n")
    for port, what in ports.items():
        local = [line.split()[3] for line in listening if line.split() and line.split()[3].endswith(f":{port}")]
        assert local, f"{what} on port {port} is not listening"
        assert all(addr.rsplit(":", 1)[0] in ("127.0.0.1", "[::1]") for addr in local), (what, local)
        record("listens only on the given host", refused=True)


def test_unauthenticated_inputs_are_refused(base: Baseline) -> None:
    address = base.server.address
    before = base.remote.state()
    cases: dict[str, Any] = {}

    def garbage(sock: socket.socket) -> None:
        _hello(sock)
        sock.sendall(bytes(random.Random(1).getrandbits(8) for _ in range(200)))

    def wrong_token(sock: socket.socket) -> None:
        from hwsync.common.protocol import stretch

        salt, nonce = _hello(sock)
        mine = b"\1" * 32
        sock.sendall(b"HWC2" + mine)
        _exactly(sock, 32)  # the server proves first
        sock.sendall(_mac(stretch("a wrong token, but a long one: 1234", salt), "client-auth", nonce, mine))

    def silent(sock: socket.socket) -> None:
        _hello(sock)  # never answers: dropped after the handshake timeout

    def oversized_hello(sock: socket.socket) -> None:
        _hello(sock)
        sock.sendall(b"HWC2" + b"\xff" * (1 << 16))

    def http(sock: socket.socket) -> None:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")

    proxy = _Proxy(address, "pass")
    legit = hwsync.connect(proxy.address, TOKEN, timeout_s=30)
    legit.state()
    captured = list(proxy.captured)

    def replayed_handshake(sock: socket.socket) -> None:
        _hello(sock)
        sock.sendall(captured[0])  # a real trainer's answer to another nonce

    def replayed_session(sock: socket.socket) -> None:
        _hello(sock)
        sock.sendall(b"".join(captured))  # the whole recorded conversation

    cases = {
        "garbage": garbage,
        "wrong token": wrong_token,
        "silent": silent,
        "oversized hello": oversized_hello,
        "http": http,
        "replayed handshake": replayed_handshake,
        "replayed session": replayed_session,
    }
    for name, attack in cases.items():
        sock = _raw_connect(address)
        try:
            attack(sock)
            refused = _closed_by_server(sock)
        except (ConnectionError, OSError):
            refused = True
        finally:
            sock.close()
        assert refused, name
        record(
            "unauthenticated connections",
            refused=refused,
            half=base.remote.state() != before or half_applied(base.llm, base.sig),
        )
    legit.close()


def _authenticated(address: str) -> Any:
    from hwsync.common.protocol import client_handshake

    sock = socket.create_connection(_host_port(address), timeout=30)
    return client_handshake(sock, TOKEN, address)


def _call(channel: Any, body: dict[str, Any]) -> dict[str, Any]:
    channel.send(body)
    rep = channel.recv()
    if rep.get("ok") and isinstance(rep.get("result"), dict) and rep["result"].get("go"):
        rep = channel.recv()
    return rep


def test_malformed_requests_from_a_token_holder(base: Baseline) -> None:
    """A trainer with the token but a broken (or hostile) client: each request gets one error, nothing changes."""
    from hwsync.common.wire import Strategy
    from hwsync.trainer.api import SyncPlan, SyncRequest

    before = base.remote.state()
    plan = SyncPlan.make(base.remote, base.model, SyncRequest(Strategy.FULL, BUCKET_MB))
    good = json.loads(plan.manifest.to_json())
    good["version"] = before["version"] + 1
    manifest = json.dumps(good)
    old = json.dumps({**good, "version": before["version"]})
    channel = _authenticated(base.server.address)
    secret = "00" * 32
    closed = socket.create_server(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()
    group = {"host": "127.0.0.1", "port": dead_port, "world_size": 2, "first_rank": 1}

    def sync_args(**over: Any) -> dict[str, Any]:
        args = {
            "manifest": manifest,
            "group": group,
            "group_id": secret,
            "new_group_id": secret,
            "data_key": secret,
            "timeout": 2.0,
        }
        args.update(over)
        return {"op": "sync", "args": args}

    bodies = {
        "op not a string": {"op": 5},
        "unknown op": {"op": "__init__"},
        "private attribute": {"op": "OPS"},
        "args not an object": {"op": "describe", "args": [1, 2]},
        "sync without args": {"op": "sync"},
        "manifest not JSON": sync_args(manifest="{"),
        "manifest replayed (old version)": sync_args(manifest=old),
        "group not an object": sync_args(group="x"),
        "secret not hex": sync_args(group_id="zz" * 32),
        "secret too short": sync_args(data_key="00"),
        "timeout NaN": sync_args(timeout=float("nan")),
        "timeout negative": sync_args(timeout=-1),
        "timeout a string": sync_args(timeout="forever"),
        "rank 0 (the trainer's)": sync_args(group={**group, "first_rank": 0}),
        "world of 10^9": sync_args(group={**group, "world_size": 10**9}),
        "unreachable rendezvous": sync_args(),
        "logprobs garbage": {"op": "logprobs", "args": {"prompts": "abc", "max_tokens": -1}},
        "logprobs huge token": {"op": "logprobs", "args": {"prompts": [[10**12]], "max_tokens": 1}},
        "prepare garbage": {"op": "prepare", "args": {"manifest": {"version": 1}}},
        "describe garbage": {"op": "describe", "args": {"lora_paths": 5}},
        "fingerprints garbage": {"op": "fingerprints", "args": {"base": "x", "seed": "y"}},
        "fingerprints of no such weight": {
            "op": "fingerprints",
            "args": {"base": [["model.no_such.weight", [4, 4], "float32"]]},
        },
    }
    for name, body in bodies.items():
        t0 = time.perf_counter()
        rep = _call(channel, body)
        took = time.perf_counter() - t0
        refused = not rep.get("ok")
        assert refused, (name, rep)
        assert took < 30, (name, took)  # the server-side timeout cap holds whatever the client asks
        after = base.remote.state()
        record(
            "malformed requests (token holder)",
            refused=refused,
            half=after["version"] != before["version"] or half_applied(base.llm, base.sig),
        )
    assert _call(channel, {"op": "state"})["ok"]  # the connection survived every refusal
    channel.close()

    # one of several engines (confirm): after its go it takes nothing but the trainer's commit or cancel
    for name, then in {
        "anything but a commit": lambda ch: ch.send({"op": "state"}),
        "no commit (the trainer stalls)": lambda ch: None,
    }.items():
        channel = _authenticated(base.server.address)
        channel.send(sync_args(confirm=True))
        assert channel.recv()["result"]["go"], name
        then(channel)
        with pytest.raises((ConnectionError, OSError)):  # the connection is dropped (after the 2 s timeout)
            channel.recv()
        channel.close()
        after = base.remote.state()  # the engine's lock is free again, nothing was applied
        record(
            "malformed requests (token holder)",
            refused=True,
            half=after["version"] != before["version"] or after["stale"] or half_applied(base.llm, base.sig),
        )


# -- the data plane ----------------------------------------------------------------------------------------------------
INTRUDER = textwrap.dedent("""
    import datetime, sys, time, torch, torch.distributed as dist
    host, port, seconds, mode = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=5))
    print("READY", flush=True)
    end, found = time.time() + seconds, set()
    while time.time() < end:
        try:
            keys = store.list_keys()
        except Exception:
            keys = []
        for k in keys:
            if "/g/" not in k or k in found:
                continue
            found.add(k)
            prefix = k[: k.index("/g/") + 3 + 64 + 1]
            if mode == "overwrite":
                try:
                    store.set(k, b"\\0" * 64)
                    store.set(prefix + "abort", "intruder says abort")
                except Exception:
                    pass
            elif mode == "join":
                try:
                    pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), 1, 2, datetime.timedelta(seconds=5))
                    buf = torch.zeros(1 << 16, dtype=torch.uint8)
                    o = dist.BroadcastOptions(); o.rootRank = 0; o.rootTensor = 0
                    pg.broadcast([buf], o).wait()
                    print("STOLE", int(buf.sum()), flush=True)
                except Exception as e:
                    print("JOIN-FAILED", type(e).__name__, flush=True)
        time.sleep(0.001)
    print("KEYS-SEEN", len(found), flush=True)
""")


@pytest.mark.parametrize("mode", ["overwrite", "join"])
def test_third_process_on_the_data_plane(base: Baseline, mode: str) -> None:
    """Another process reaches the trainer's rendezvous store while a sync forms its group: it lists the keys and
    overwrites them, or joins the group itself. The sync goes through or fails cleanly; nothing it sends is
    applied."""
    remote = hwsync.connect(base.server.address, TOKEN, timeout_s=15)
    store = remote.plane.store()
    proc = subprocess.Popen(
        [sys.executable, "-c", INTRUDER, remote.data_host, str(store.port), "20", mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "READY"
    for _attempt in range(2):
        try:
            hwsync.sync(remote, base.model, strategy="full", bucket_mb=BUCKET_MB)
            refused = False
        except HwsyncError:
            refused = True
        record("third process on the data plane", refused=refused, half=half_applied(base.llm, base.sig), attack=False)
        remote.plane.drop()  # form the group again: the intruder gets another go at the rendezvous
    out = proc.communicate(timeout=60)[0]
    assert "STOLE" not in out, out  # it never got into the group
    remote.close()
    base.restore()


def receive_in_thread(
    engine: Any, manifest: Any, spec: Any, key: bytes, *, daemon: bool = False
) -> tuple[threading.Thread, list[BaseException | None]]:
    """The engine's side of one sync over the data plane ``spec`` (data key ``key``), started in a thread; the list
    receives ``None`` or the error it ended with."""
    result: list[BaseException | None] = []

    def receive() -> None:
        try:
            with engine.lock:
                engine.prepare(manifest)
                engine.receive_remote(manifest, spec, 1, key, spec.prefix + "abort")
            result.append(None)
        except BaseException as e:  # noqa: BLE001
            result.append(e)

    thread = threading.Thread(target=receive, daemon=daemon)
    thread.start()
    return thread, result


def _data_plane(tag: bytes, timeout_s: float) -> tuple[socket.socket, Any, Any]:
    """A store of our own and a 2-rank data-plane spec on it (the trainer's side of a sync, without the trainer)."""
    import datetime

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
    return sock, store, LinkSpec("127.0.0.1", store.port, group_prefix(tag * 32), 2, timeout_s)


def _forge(base: Baseline, kind: str) -> bool:
    """Be rank 0 of the engine's data-plane group and send buckets of the manifest's shapes that the data key did not
    seal (the CPU link's rendezvous itself needs that key: ``test_the_data_plane_rendezvous_needs_the_token`` in
    ``tests/test_attacks_reliability.py``; here the link is joined with it, the buckets are still forged). True when
    the engine refused before any loader saw them."""
    from hwsync.common.transport.buckets import _HEAD, TRAILER_BYTES
    from hwsync.common.transport.seal import Sealer
    from hwsync.common.wire import Strategy
    from hwsync.trainer.api import SyncPlan, SyncRequest

    engine = hwsync.as_engine(base.llm)
    if kind == "bucket replayed as the next one":
        evil = base.model  # what the engine serves: the replayed bucket 0 is the trainer's own
    else:
        evil = lora_trainer(base.path)
        _perturb(evil, 900, base=True)
    plan = SyncPlan.make(base.remote, evil, SyncRequest(Strategy.FULL, BUCKET_MB))
    version = engine.state()["version"] + 1
    manifest = plan.manifest.with_version(version, None)
    sock, store, spec = _data_plane(b"\7", 5.0)
    engine_key, attacker_key = b"E" * 32, b"A" * 32
    thread, result = receive_in_thread(engine, manifest, spec, engine_key)
    from hwsync.common.backend import open_link

    # join as a trainer on this machine would (CUDA: the GPU identity exchange first, then NCCL -- or gloo, as here,
    # when the engine shares the GPU): only the data key is missing
    cpu = engine.describe().device_type == "cpu"
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    link = open_link(store, spec, 0, device, engine_key)
    size = max(b.nbytes for b in manifest.buckets)
    tensors = list(plan.payload.produce())
    replay = None
    for bucket in manifest.buckets:
        buf = torch.zeros(size + TRAILER_BYTES, dtype=torch.uint8)
        from hwsync.common.transport.pack import pack

        pack(
            buf, bucket.offsets, [tensors[i] for i in bucket.entries], [manifest.specs[i].dtype for i in bucket.entries]
        )
        status, index, v = 0x4F4B, bucket.index, version
        if kind == "wrong key":
            tag = Sealer(attacker_key).seal(buf[: bucket.nbytes], index, v)
        elif kind == "random tag":
            tag = bytes(random.Random(index).getrandbits(8) for _ in range(32))
        elif kind == "forged abort":
            status, tag = 0x4142, b""
        elif kind == "out of step":
            index, tag = index + 1, Sealer(engine_key).seal(buf[: bucket.nbytes], index + 1, v)
        elif kind == "bucket replayed as the next one":
            # the trainer's own bucket 0 (its current weights, sealed with the session key), captured and sent
            # again as bucket 1 under a rewritten index: the tag binds the index
            if bucket.index == 0:
                replay = buf.clone()
                tag = Sealer(engine_key).seal(buf[: bucket.nbytes], 0, v)
            else:
                buf = replay
                tag = Sealer(engine_key).seal(buf[: manifest.buckets[0].nbytes], 0, v)
        else:  # pragma: no cover
            raise AssertionError(kind)
        head = _HEAD.pack(status, index, v) + tag
        buf[size : size + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        try:
            link.broadcast(buf.to(link.device), 0).wait()
        except Exception:  # noqa: BLE001 - the engine left the group
            break
        thread.join(timeout=0.5)
        if result:
            break
    thread.join(timeout=60)
    link.close()
    sock.close()
    err = result[0] if result else None
    return isinstance(err, SyncError)


def test_a_peer_that_never_joins_the_data_plane_is_a_refused_sync(base: Baseline) -> None:
    """The control channel said "go" but nobody joins the data-plane group (a trainer that died, or a client that
    skips the GPU identity exchange): one SyncError after the link timeout, nothing applied, engine not stale."""
    from hwsync.common.wire import Strategy
    from hwsync.trainer.api import SyncPlan, SyncRequest

    engine = hwsync.as_engine(base.llm)
    before = engine.state()
    plan = SyncPlan.make(base.remote, base.model, SyncRequest(Strategy.FULL, BUCKET_MB))
    manifest = plan.manifest.with_version(before["version"] + 1, None)
    sock, store, spec = _data_plane(b"\6", 3.0)
    try:
        with engine.lock, pytest.raises(SyncError, match="could not join the trainer's data-plane group"):
            engine.prepare(manifest)
            engine.receive_remote(manifest, spec, 1, b"E" * 32, spec.prefix + "abort")
    finally:
        sock.close()
    after = engine.state()
    assert not after["stale"] and after["version"] == before["version"], after
    record("nobody joins the data plane", refused=True, half=half_applied(base.llm, base.sig), attack=False)


@pytest.mark.parametrize(
    "kind", ["wrong key", "random tag", "forged abort", "out of step", "bucket replayed as the next one"]
)
def test_forged_buckets_never_reach_a_loader(base: Baseline, kind: str) -> None:
    before = base.remote.state()
    refused = _forge(base, kind)
    assert refused, kind
    after = base.remote.state()
    if kind != "bucket replayed as the next one":  # bucket 0 was the trainer's own: later ones are refused
        assert not after["stale"] and after["version"] == before["version"], after  # refused before any write
    record("forged bytes on the data plane", refused=refused, half=half_applied(base.llm, base.sig))
    if after["stale"]:
        base.restore()


# -- fuzzed manifests ------------------------------------------------------------------------------------------------
_ODD = [
    None,
    True,
    False,
    -1,
    0,
    1,
    2**63,
    -(2**63) - 1,
    2**64,
    1.5,
    float("nan"),
    "",
    "x",
    "float32",
    "lora",
    "base",
    [],
    {},
    [[]],
    {"a": 1},
    "\u0000",
    "A" * 5000,
]


def _paths(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*path, i))


def _get(node: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        node = node[p]
    return node


def mutate(doc: Any, rng: random.Random) -> Any:
    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in _paths(doc) if p]
        path = rng.choice(paths)
        parent, key = _get(doc, path[:-1]), path[-1]
        value = parent[key]
        op = rng.randrange(8)
        if op == 0:
            parent[key] = rng.choice(_ODD)
        elif op == 1 and isinstance(value, int) and not isinstance(value, bool):
            parent[key] = value + rng.choice([-1, 1, 16, -16, value, -2 * value, 1 << 40])
        elif op == 2:
            if isinstance(parent, dict):
                del parent[key]
            else:
                parent.pop(key)
        elif op == 3 and isinstance(parent, list):
            parent.insert(rng.randrange(len(parent) + 1), copy.deepcopy(value))
        elif op == 4 and isinstance(parent, list) and len(parent) > 1:
            j = rng.randrange(len(parent))
            parent[key], parent[j] = parent[j], parent[key]
        elif op == 5 and isinstance(value, str) and value:
            i = rng.randrange(len(value))
            parent[key] = value[:i] + rng.choice("._0aZ/") + value[i + 1 :]
        elif op == 6 and isinstance(parent, dict):
            parent[rng.choice(["extra", "kind", "specs2", "__class__"])] = rng.choice(_ODD)
        elif op == 7 and isinstance(value, list) and value:
            parent[key] = value[: rng.randrange(len(value))]
    return doc


def test_fuzzed_manifests(base: Baseline) -> None:
    """Seeded random mutations of real manifests (full and adapter syncs) and of their bytes: each is refused with
    one SyncError by ``Manifest.from_json`` or by the engine's validation, or is a valid manifest the engine
    prepares without writing anything."""
    from hwsync.common.wire import Manifest, Strategy
    from hwsync.trainer.api import SyncPlan, SyncRequest

    engine = hwsync.as_engine(base.llm)
    lora = lora_trainer(base.path, ATTN)
    _perturb(lora, 1000)
    plans = [
        SyncPlan.make(base.remote, base.model, SyncRequest(Strategy.FULL, BUCKET_MB)),
        SyncPlan.make(base.remote, lora, SyncRequest(Strategy.ADAPTER, 0.01)),
    ]
    docs = [json.loads(p.manifest.to_json()) for p in plans]
    before = engine.state()
    for doc in docs:
        doc["version"] = before["version"] + 1
    rng = random.Random(1234)
    crashes: list[str] = []
    prepared = 0
    for i in range(600):
        doc = docs[i % 2]
        if i % 5 == 4:  # byte-level: flip / drop / duplicate a few characters of the JSON text
            text = bytearray(json.dumps(doc).encode())
            for _ in range(rng.randint(1, 4)):
                j = rng.randrange(len(text))
                text[j] = rng.randrange(256) if rng.random() < 0.7 else text[j - 1]
            payload: Any = bytes(text)
        else:
            payload = json.dumps(mutate(doc, rng))
        try:
            manifest = Manifest.from_json(payload)
        except SyncError:
            record("fuzzed manifests", refused=True)
            continue
        except Exception as e:  # noqa: BLE001 - a crash instead of one clear error: a hole
            crashes.append(f"from_json: {type(e).__name__}: {e}"[:200])
            record("fuzzed manifests", refused=False, half=True)
            continue
        try:
            with engine.lock:
                engine.prepare(manifest)
            refused = False
            prepared += 1
        except HwsyncError:
            refused = True
        except Exception as e:  # noqa: BLE001
            crashes.append(f"prepare: {type(e).__name__}: {e}"[:200])
            refused = True
        after = engine.state()
        record("fuzzed manifests", refused=refused, half=after != before)
    assert not crashes, crashes[:5]
    assert not half_applied(base.llm, base.sig)
    print(f"fuzz: {prepared} mutants were valid manifests (prepared, nothing written)")


# -- issue 27: no unauthenticated crash, no hang without a deadline, no commit that serves mixed weights ---------------
def _listening_ports() -> set[int]:
    """TCP ports this process listens on (read from /proc: no tool needed)."""
    import os

    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            col = row.split()
            if col[3] == "0A" and col[9] in inodes:  # LISTEN
                ports.add(int(col[1].rsplit(":", 1)[1], 16))
    return ports


def _open_fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


def _flood(port: int, times: int) -> int:
    """Connect and close ``times`` times without a word; returns how many connects were accepted."""
    accepted = 0
    for _ in range(times):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            accepted += 1
        except OSError:
            pass
    return accepted


def test_data_plane_listens_only_during_a_sync(base: Baseline, monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo's listener leaks a descriptor per connection that closes before gloo's handshake and aborts the process
    at the limit (``gloo::EnforceNotMet ... accept: Too many open files``, the engine or the trainer). hwsync's gloo
    data plane therefore exists only during a sync: afterwards nothing of it listens, and a connect/close flood on
    what does listen (the sync server, the trainer's rendezvous store) costs no descriptor."""
    from hwsync.common.cpu import framed

    base.restore()  # the rendezvous store exists: what listens now is what listens between syncs
    between = _listening_ports()
    during: set[int] = set()
    opened = framed.socket.create_server

    def watched(*args: Any, **kwargs: Any) -> Any:
        listener = opened(*args, **kwargs)
        during.update(_listening_ports() - between)  # this group's listener, seen while it exists
        return listener

    monkeypatch.setattr(framed.socket, "create_server", watched)
    for seed in (1, 2):
        m = lora_trainer(base.path)
        _perturb(m, 1200 + seed, base=True)
        base.remote.plane.drop()  # a fresh group each time (where groups are kept between syncs, too)
        hwsync.sync(base.remote, m, strategy="full", bucket_mb=BUCKET_MB)
        left = _listening_ports() - between
        assert during and not left, f"data-plane listeners left after the sync: {sorted(left)}"
        record("data plane: listener after a sync", refused=not left)
        # the ports the data plane used are closed: a flood there is refused by the kernel, not leaked by gloo
        fds = _open_fds()
        assert sum(_flood(p, 200) for p in during) == 0
        assert _open_fds() <= fds + 2
        record("data plane: connect/close flood between syncs", refused=True)
        during.clear()
    monkeypatch.undo()
    base.restore()
    store = base.remote.plane.store().port
    for port, what in ((base.server.port, "sync server"), (store, "rendezvous store")):
        fds = _open_fds()
        assert _flood(port, 600) == 600
        time.sleep(1.0)  # the server threads see EOF and close their ends
        assert _open_fds() <= fds + 4, (what, fds, _open_fds())
        record(f"connect/close flood: {what}", refused=True, half=half_applied(base.llm, base.sig))


def _server(base: Baseline, **kwargs: Any) -> Any:
    """A second sync server on the suite's engine (same handle and lock), with its own limits."""
    from hwsync.engine.server import SyncServer

    return SyncServer(base.llm, "127.0.0.1:0", TOKEN, timeout_s=30, **kwargs)


def test_slow_handshakes_hold_no_slot_past_the_deadline(base: Baseline) -> None:
    """Slow-loris: every handshake slot held by a socket that sends one byte every 0.3 s. One deadline for the whole
    handshake (not per read) frees them, and a trainer then gets in."""
    with _server(base, max_clients=1, handshake_s=2.0) as server:
        lorises = [_raw_connect(server.address) for _ in range(4)]  # 4 * max_clients handshake slots
        stop = threading.Event()

        def trickle(sock: socket.socket) -> None:
            try:
                _hello(sock)
                for b in b"HWC2" + b"\0" * 32:
                    if stop.wait(0.3):
                        return
                    sock.sendall(bytes([b]))
            except OSError:
                pass

        threads = [threading.Thread(target=trickle, args=(s,), daemon=True) for s in lorises]
        for t in threads:
            t.start()
        time.sleep(3.0)  # past the 2 s deadline, while each socket still sends a byte every 0.3 s
        remote = hwsync.connect(server.address, TOKEN, timeout_s=10)
        assert remote.state()["version"] == base.remote.state()["version"]
        remote.close()
        stop.set()
        for sock in lorises:
            closed = _closed_by_server(sock, timeout=1.0)
            sock.close()
            record("slow-loris handshakes", refused=closed)
            assert closed


def test_busy_engine_says_busy(base: Baseline) -> None:
    """Every slot held: the trainer is told the engine is busy (not that it refused the token), after retrying for
    a while when unauthenticated connections hold the handshake slots."""
    from hwsync.common.errors import EngineBusyError

    with _server(base, max_clients=1, idle_s=60.0) as server:
        holder = hwsync.connect(server.address, TOKEN, timeout_s=10)
        with pytest.raises(EngineBusyError, match="busy: all 1 trainer slots"):
            hwsync.connect(server.address, TOKEN, timeout_s=2)
        record("busy: every trainer slot held", refused=True)
        holder.close()
    with _server(base, max_clients=1, handshake_s=30.0) as server:
        mute = [_raw_connect(server.address) for _ in range(4)]  # hold every handshake slot, say nothing
        time.sleep(0.5)
        t0 = time.perf_counter()
        with pytest.raises(EngineBusyError, match="busy authenticating other connections"):
            hwsync.connect(server.address, TOKEN, timeout_s=3)
        assert time.perf_counter() - t0 < 10  # retried within its timeout, then said why
        record("busy: every handshake slot held", refused=True)
        for sock in mute:
            sock.close()
        time.sleep(0.5)
        assert hwsync.connect(server.address, TOKEN, timeout_s=10).state()["stale"] is False


def test_idle_and_stalled_trainers_lose_their_slot(base: Baseline, monkeypatch: pytest.MonkeyPatch) -> None:
    """Token holders that idle, or stall in the middle of a frame, do not lock a trainer out: an idle one loses its
    slot after ``idle_s`` (its handle reconnects by itself on its next call), a stalled frame is dropped after the
    frame deadline."""
    import hwsync.common.protocol as protocol

    monkeypatch.setattr(protocol, "FRAME_TIMEOUT_S", 2.0)
    with _server(base, max_clients=1, idle_s=1.5) as server:
        idle = hwsync.connect(server.address, TOKEN, timeout_s=10)
        version = idle.state()["version"]
        time.sleep(3.0)
        other = hwsync.connect(server.address, TOKEN, timeout_s=10)  # the idle one's slot was freed
        assert other.state()["version"] == version
        other.close()
        record("token holder idles", refused=True)
        assert idle.state()["version"] == version  # reconnected transparently
        idle.close()
        stalled = _authenticated(server.address)
        stalled.sock.sendall(struct.pack("<I", 1000) + b"\0" * 10)  # a frame that never completes
        time.sleep(3.0)
        other = hwsync.connect(server.address, TOKEN, timeout_s=10)
        assert other.state()["version"] == version
        other.close()
        assert _closed_by_server(stalled.sock, timeout=1.0)
        stalled.close()
        record("token holder stalls mid-frame", refused=True)


def test_accept_survives_running_out_of_descriptors(base: Baseline, caplog: pytest.LogCaptureFixture) -> None:
    """``accept`` fails with EMFILE while the process has no descriptor left: the server logs it and keeps accepting
    once descriptors are free again (it used to end its accept loop silently and answer nobody, ever)."""
    import os
    import resource

    with _server(base) as server:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        fds = [int(f) for f in os.listdir("/proc/self/fd")]
        filler: list[int] = []
        client = None
        try:
            # one above the highest open descriptor: at least that one is free below the limit even where the open
            # ones leave no gap (with the limit at max + 1 such a process had nothing to fill and the test broke)
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(fds) + 2, hard))
            with caplog.at_level("ERROR", logger="hwsync.server"):
                while True:  # take every free descriptor below the limit
                    try:
                        filler.append(os.open(os.devnull, os.O_RDONLY))
                    except OSError:
                        break
                os.close(filler.pop())  # one for the client's socket: the server's accept gets none
                client = socket.create_connection(_host_port(server.address), timeout=5)
                deadline = time.time() + 10
                while "accept failed" not in caplog.text and time.time() < deadline:
                    time.sleep(0.1)
        finally:
            for fd in filler:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert "accept failed" in caplog.text and "Too many open files" in caplog.text
        assert client is not None
        salt, _ = _hello(client)  # the connection that waited in the backlog is served now
        client.close()
        assert hwsync.connect(server.address, TOKEN, timeout_s=10).state()["stale"] is False
        record("accept fails (out of descriptors)", refused=True)


class _Frozen:
    """Between a trainer and the server: forwards the handshake and the first frames, then stops forwarding the
    server's answers (an engine stopped with SIGSTOP, a dead link): the trainer waits on a socket that stays open."""

    def __init__(self, address: str) -> None:
        self.target = _host_port(address)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.frozen = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:  # a handle that timed out reconnects: that connection is frozen as well
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, freezes: bool) -> None:
        try:
            while chunk := src.recv(65536):
                if not (freezes and self.frozen.is_set()):
                    dst.sendall(chunk)
        except OSError:
            pass


def test_every_trainer_call_is_bounded_by_its_timeout(base: Baseline) -> None:
    """The engine stops answering (frozen): ``state()`` and ``sync`` raise after ``timeout_s`` instead of waiting
    forever, and the handle works again once the engine answers."""
    link = _Frozen(base.server.address)
    remote = hwsync.connect(link.address, TOKEN, timeout_s=2)
    version = remote.state()["version"]
    link.frozen.set()
    for what, call in (
        ("state()", remote.state),
        ("sync", lambda: hwsync.sync(remote, base.model, strategy="full", bucket_mb=BUCKET_MB)),
    ):
        outcome: list[BaseException | None] = []
        thread = threading.Thread(target=lambda outcome=outcome, call=call: outcome.append(_raises(call)), daemon=True)
        t0 = time.perf_counter()
        thread.start()
        thread.join(30)
        took = time.perf_counter() - t0
        assert outcome and isinstance(outcome[0], SyncError), (what, outcome)
        assert took < 15, (what, took, outcome[0])  # 2 s for the answer (a reconnect: 2 s for the handshake)
        if what == "state()":
            assert "did not answer within 2 s" in str(outcome[0]), outcome[0]
        record("engine stops answering (trainer waits)", refused=True, half=half_applied(base.llm, base.sig))
    link.listener.close()
    assert base.remote.state()["version"] == version


def _raises(call: Any) -> BaseException | None:
    try:
        call()
    except BaseException as e:  # noqa: BLE001
        return e
    return None


def _reset_declined(llm: Any, monkeypatch: pytest.MonkeyPatch, when: Any = None) -> None:
    """vLLM declines to reset its prefix cache (as it does while a request it cannot preempt holds KV blocks)."""
    original = llm.reset_prefix_cache

    def reset(*args: Any, **kwargs: Any) -> bool:
        if when is None or when():
            return False
        return original(*args, **kwargs)

    monkeypatch.setattr(llm, "reset_prefix_cache", reset)


@pytest.mark.parametrize("mode", ["server", "colocate"])
def test_a_declined_cache_reset_leaves_the_engine_stale(
    base: Baseline, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """The weights are written but vLLM declines the prefix-cache reset: cached KV of the old weights would mix into
    what the engine serves, so the sync fails with the engine marked stale (generation refused) until a sync
    completes with the reset."""
    target = base.remote if mode == "server" else base.llm
    m1 = lora_trainer(base.path)
    _perturb(m1, 1300, base=True)
    _reset_declined(base.llm, monkeypatch)
    with pytest.raises(SyncError, match="could not reset its prefix cache.*marked stale"):
        hwsync.sync(target, m1, strategy="full", bucket_mb=BUCKET_MB)
    assert base.remote.state()["stale"]
    with pytest.raises(StaleEngineError, match="prefix cache"):
        hwsync.generate(base.llm, [{"prompt_token_ids": PROMPTS[0]}])
    record(
        "prefix-cache reset declined after the write", refused=True, half=half_applied(base.llm, base.sig), attack=False
    )
    monkeypatch.undo()
    base.restore()


def test_a_failed_sync_keeps_its_own_error(base: Baseline, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sync that fails while vLLM would also decline the reset reports its own failure, not the reset's."""
    from hwsync.engine.vllm.applier import VllmApplier

    original = VllmApplier.load_base

    def failing(self: Any, plan: Any, weights: Any) -> str:
        def gen() -> Iterator[Any]:
            for i, item in enumerate(weights):
                if i == 3:
                    raise RuntimeError("injected: the original error")
                yield item

        return original(self, plan, gen())

    m1 = lora_trainer(base.path)
    _perturb(m1, 1310, base=True)
    _reset_declined(base.llm, monkeypatch)
    monkeypatch.setattr(VllmApplier, "load_base", failing)
    with pytest.raises(SyncError, match="injected: the original error") as err:
        hwsync.sync(base.remote, m1, strategy="full", bucket_mb=BUCKET_MB)
    assert "prefix cache" not in str(err.value)
    record("sync fails, reset declined too", refused=True, half=half_applied(base.llm, base.sig), attack=False)
    monkeypatch.undo()
    base.restore()


def test_plan_changed_is_re_planned_not_reported_as_written(base: Baseline, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another writer moved the engine on: the cached plan is refused as plan-changed before anything is written,
    and ``hwsync.sync`` re-plans and syncs -- also while vLLM would decline a reset at that moment (the refusal
    used to be replaced by "the weights were written but vLLM could not reset its prefix cache")."""
    engine = hwsync.as_engine(base.llm)
    lora = lora_trainer(base.path, ATTN)
    _perturb(lora, 1320)
    hwsync.sync(base.llm, lora, strategy="adapter", bucket_mb=BUCKET_MB)  # colocated: the plan is cached
    other = lora_trainer(base.path, ATTN)
    _perturb(other, 1321)
    hwsync.sync(base.remote, other, strategy="adapter", bucket_mb=BUCKET_MB)  # another writer (server mode)
    moved = engine.state()["version"]
    _reset_declined(base.llm, monkeypatch, when=lambda: engine.state()["version"] == moved)  # nothing new written
    _perturb(lora, 1322)
    report = hwsync.sync(base.llm, lora, strategy="adapter", bucket_mb=BUCKET_MB)
    assert report.version == moved + 1 and "plan reused" not in report.reason, report.line()
    assert not engine.state()["stale"]
    record("plan changed by another writer", refused=False, attack=False)
    monkeypatch.undo()
    base.restore()


def test_one_recorded_handshake_allows_no_fast_guessing(base: Baseline) -> None:
    """The client proves nothing to a peer that has not proven the token first (an impostor on the engine's address
    gets a nonce and nothing else); what the server proves to anyone costs a scrypt per offline guess (the HMAC it
    replaced allowed ~300k guesses per second and core)."""
    from hwsync.common.protocol import stretch

    impostor = socket.create_server(("127.0.0.1", 0))
    heard: list[bytes] = []

    def play() -> None:
        conn, _ = impostor.accept()
        with conn:
            conn.sendall(b"HWS2" + b"\7" * 16 + b"\1" * 32)
            conn.settimeout(5)
            try:
                heard.append(_exactly(conn, 36))
                conn.sendall(b"\0" * 32)  # cannot prove the token
                heard.append(conn.recv(1024))  # anything more the client says
            except OSError:
                pass

    thread = threading.Thread(target=play, daemon=True)
    thread.start()
    with pytest.raises(SyncError, match="does not know this token"):
        hwsync.connect(f"127.0.0.1:{impostor.getsockname()[1]}", TOKEN, timeout_s=10)
    thread.join(10)
    impostor.close()
    assert heard and heard[0][:4] == b"HWC2" and heard[1:] in ([], [b""]), heard  # a nonce, then nothing
    record("impostor server collects a proof", refused=True)

    sock = _raw_connect(base.server.address)  # anyone can make the real server prove the token
    salt, nonce = _hello(sock)
    mine = b"\2" * 32
    sock.sendall(b"HWC2" + mine)
    proof = _exactly(sock, 32)
    sock.close()
    guesses, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        assert _mac(stretch(f"guess number {guesses:08d} of a dictionary", salt), "server-auth", nonce, mine) != proof
        guesses += 1
    assert _mac(stretch(TOKEN, salt), "server-auth", nonce, mine) == proof  # the right guess would match
    assert guesses < 200, guesses  # per second and core (HMAC-SHA256 alone: ~300k)
    record("offline guessing from a server proof", refused=True)


def test_weak_tokens_are_refused(base: Baseline) -> None:
    import subprocess as sp

    for weak in ("", "secret", "attack-suite token", "a" * 64, "abcabcabcabcabcabcabcabcabcabcabcab"):
        for call in (
            lambda weak=weak: hwsync.serve(base.llm, "127.0.0.1:0", weak),
            lambda weak=weak: hwsync.connect(base.server.address, weak, timeout_s=5),
        ):
            with pytest.raises(SyncError, match=r"too weak .*hwsync token.*secrets.token_urlsafe\(32\)"):
                call()
            record("weak tokens", refused=True)
    made = sp.run([sys.executable, "-m", "hwsync", "token"], capture_output=True, text=True, check=True).stdout.strip()
    from hwsync.common.tokens import check_token

    assert check_token(made) == made and made != hwsync.new_token()


def test_a_version_cannot_use_up_the_range(base: Baseline) -> None:
    """A token holder syncing version 2^63 - 1 used to lock the engine out for good (every later version was
    "malformed"); a version may now step at most 2^32 past the engine's."""
    from hwsync.common.errors import VersionError

    before = base.remote.state()["version"]
    for version in (2**63 - 1, before + 2**32 + 1):
        with pytest.raises(VersionError, match="jumps more than 2\\^32"):
            hwsync.sync(base.remote, base.model, strategy="full", bucket_mb=BUCKET_MB, version=version)
        assert base.remote.state()["version"] == before
        record("version at the end of the range", refused=True)
    r = hwsync.sync(base.remote, base.model, strategy="full", bucket_mb=BUCKET_MB, version=before + 2**32)
    assert r.version == before + 2**32
    base.restore()
    assert base.remote.state()["version"] == before + 2**32 + 1


def test_swift_rollout_weight_routes_are_closed(base: Baseline) -> None:
    """While hwsync serves ``swift rollout``'s engine, ms-swift's own weight-writing routes
    (``/update_flattened_params/``, ...: no key, no lock, no stale flag) end in one error in the engine; hwsync's own
    calls go through. ``init_communicator`` stays open: ms-swift's trainer opens it before any plugin loads
    (tests/test_swift_server.py runs that start-up end to end)."""
    pytest.importorskip("swift")
    from hwsync.common.errors import UnsupportedSetupError
    from hwsync.integrations.swift._server import SWIFT_WEIGHT_METHODS, close_weight_routes

    llm_engine = base.llm.llm_engine
    close_weight_routes(llm_engine, base.server.address)
    close_weight_routes(llm_engine, base.server.address)  # idempotent
    try:
        assert "init_communicator" not in SWIFT_WEIGHT_METHODS
        calls = {
            "update_flattened_params": {"args": ([{"name": "x", "dtype": "torch.float32", "shape": [1]}],)},
            "process_weights_after_loading": {"args": ()},
        }
        assert set(calls) <= SWIFT_WEIGHT_METHODS
        for method, kwargs in calls.items():
            with pytest.raises(UnsupportedSetupError, match=f"weight route '{method}' is closed"):
                llm_engine.collective_rpc(method=method, **kwargs)
            record("swift rollout's own weight routes", refused=True, half=half_applied(base.llm, base.sig))
        assert base.remote.state()["version"] >= 1  # hwsync's collective_rpc (a callable) goes through
        base.restore()
    finally:
        del llm_engine.collective_rpc  # the instance attribute; vLLM's method again


# -- the table -------------------------------------------------------------------------------------------------------
def test_zz_attack_table() -> None:
    if not TABLE:
        pytest.skip("no category ran")
    width = max(len(c) for c in TABLE) + 2
    lines = ["category".ljust(width) + " | " + " | ".join(COLUMNS)]
    for cat, row in TABLE.items():
        lines.append(cat.ljust(width) + " | " + " | ".join(str(v).rjust(len(c)) for v, c in zip(row, COLUMNS)))
    total = [sum(r[i] for r in TABLE.values()) for i in range(4)]
    lines.append("total".ljust(width) + " | " + " | ".join(str(v).rjust(len(c)) for v, c in zip(total, COLUMNS)))
    print("\n" + "\n".join(lines))
    assert total[3] == 0, "half-applied engine states: " + str({c: r[3] for c, r in TABLE.items() if r[3]})
    for cat in ATTACKS - {"fuzzed manifests"}:
        assert TABLE[cat][1] == TABLE[cat][0], f"{cat}: not every attack was refused"
