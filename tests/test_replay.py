"""hwsync.common.replay: per-sync work recorded once and replayed while its tensors stay put (CUDA graphs on a GPU).
Here the recorder is a stand-in backend for torch's ``meta`` device that counts what it records, so the state machine --
eager first, recorded right after and launched once, replayed while the key holds (the last two keys kept: alternating
buffers), recorded only when seen again once a recording was dropped unused, op by op for good after a failed
recording -- is checked on any machine; the GPU job runs the real graphs under the exactness tests."""

from __future__ import annotations

import logging

import pytest
import torch

from hwsync.common.backend import register_backend, unregister_backend
from hwsync.common.cpu import CpuBackend
from hwsync.common.replay import GRAPHS_ENV, Replay, addresses, common_device, copy_all


class _Recorder(CpuBackend):
    """The CPU backend's answers, for torch's ``meta`` device, with a recorder that counts what it records."""

    name = "replay-test"
    device_type = "meta"
    recorded = 0
    fail = False

    def capture(self, work, device):
        if type(self).fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        type(self).recorded += 1
        return work  # "replaying" runs the recorded work again


@pytest.fixture()
def recorder(monkeypatch):
    monkeypatch.delenv(GRAPHS_ENV, raising=False)
    _Recorder.recorded, _Recorder.fail = 0, False
    register_backend(_Recorder, replace=True)
    yield _Recorder
    unregister_backend(_Recorder.name)


def test_eager_then_recorded_then_replayed_while_the_key_holds(recorder) -> None:
    runs: list[int] = []
    r = Replay("test work")
    meta = torch.device("meta")
    for key in ["a", "a", "a", "b", "b", "b"]:
        r.run(key, meta, lambda: runs.append(1))
    # recorded after the 1st "a" and the 1st "b", each launched once right away (the stand-in's launch runs the work):
    # every later run is a launch
    assert recorder.recorded == 2 and r.replays == 4 and len(runs) == 8


def test_alternating_addresses_replay_too(recorder) -> None:
    r = Replay("test work")
    meta = torch.device("meta")
    for key in ["a", "b"] * 4:  # e.g. receive buffers used in turn
        r.run(key, meta, lambda: None)
    assert recorder.recorded == 2 and r.replays == 6


def test_keys_that_move_every_run_stop_being_recorded_at_first_sight(recorder) -> None:
    runs: list[int] = []
    r = Replay("test work")
    meta = torch.device("meta")
    for key in ["a", "b", "c", "d", "f"]:  # e.g. sources gathered afresh at every sync
        r.run(key, meta, lambda: runs.append(1))
    # "a" dropped unused when "c" was recorded: from "d" on, nothing is recorded at first sight
    assert recorder.recorded == 3 and r.replays == 0 and len(runs) == 3 * 2 + 2
    for key in ["e", "e", "e"]:
        r.run(key, meta, lambda: runs.append(1))
    assert recorder.recorded == 4 and r.replays == 2  # recorded (and launched) the 2nd time it was seen
    assert len(runs) == 8 + 3


def test_cpu_and_the_switch_never_record(recorder, monkeypatch) -> None:
    r = Replay("test work")
    for _ in range(3):
        r.run("k", torch.device("cpu"), lambda: None)
    monkeypatch.setenv(GRAPHS_ENV, "0")
    for _ in range(3):
        r.run("k", torch.device("meta"), lambda: None)
    assert recorder.recorded == 0 and r.replays == 0


def test_a_failed_recording_falls_back_for_good(recorder, caplog) -> None:
    recorder.fail = True
    runs: list[int] = []
    r = Replay("test work")
    with caplog.at_level(logging.WARNING, logger="hwsync"):
        for _ in range(4):
            r.run("k", torch.device("meta"), lambda: runs.append(1))
    assert len(runs) == 4  # the sync whose recording failed ran the work op by op
    assert r.replays == 0 and sum("could not be recorded" in m for m in caplog.messages) == 1


def test_addresses_change_with_storage_and_layout_not_values() -> None:
    t = torch.zeros(4, 6)
    key = addresses([t])
    t.add_(1)
    assert addresses([t]) == key
    assert addresses([t.t()]) != key and addresses([t.clone()]) != key


def test_copy_all_casts_and_crosses_layouts() -> None:
    src = [torch.randn(3, 5), torch.randn(5, 3).t(), torch.randn(2, 2, dtype=torch.float64)]
    dst = [torch.empty(3, 5, dtype=torch.bfloat16), torch.empty(3, 5), torch.empty(2, 2)]
    copy_all(dst, src)
    for d, s in zip(dst, src):
        assert torch.equal(d, s.to(d.dtype))


def test_work_across_devices_is_never_recorded() -> None:
    meta = torch.empty(2, device="meta")
    assert common_device([meta, meta]) == torch.device("meta")
    assert common_device([meta, torch.zeros(2)]) == torch.device("cpu")  # several devices: the op-by-op path
