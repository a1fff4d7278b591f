"""The copy that checks as it copies (:mod:`hwsync.common.finite`, :mod:`hwsync.common.cuda.checked_copy`): same bytes
as ``copy_``, NaN and +-Inf found in any block, queued copies launched together when the bucket closes, the rest left
to the separate reduction.

The queueing runs on every device (on CPU every queued pair is left to the plain copy and the reduction, and a
stand-in checking copy shows the flag path); the Triton kernel's own tests need CUDA."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from hwsync.common.backend import backend_for_device
from hwsync.common.cuda import checked_copy
from hwsync.common.finite import FiniteFlags, copy_, copy_all, deferred

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the checking copy is a CUDA (Triton) kernel")


def _same_bytes(a: Tensor, b: Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("queued", [True, False])
def test_checking_copy_writes_the_same_bytes_and_finds_non_finite(
    dtype: torch.dtype, bad: float | None, queued: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checked_copy, "MIN_BYTES", 0)  # every size through the kernel (its masks and tails)
    sizes = (1, 2047, 2048, 2049, 3 * 2048 + 8, 1 << 20, 0)
    srcs = [torch.randn(n, device="cuda").to(dtype) for n in sizes]
    if bad is not None:
        srcs[4].view(-1)[-1] = bad  # the last element of a partial block
    dsts = [torch.empty_like(s) for s in srcs]
    flags = FiniteFlags()
    scope = deferred() if queued else torch.no_grad()
    with flags.writing(), scope:
        flags.open(0, srcs[:3], ["a", "b", "c"])
        copy_all(dsts[:3], srcs[:3])
        flags.open(1, srcs[3:], ["d", "e", "f", "g"])
        copy_all(dsts[3:5], srcs[3:5])
        copy_(dsts[5], srcs[5])
        copy_(dsts[6], srcs[6])
    assert flags.non_finite() == ([] if bad is None else [1])
    # the kernel moves 32-bit words: an odd number of 16-bit values is left to the plain copy and the reduction
    # (which still finds the NaN in srcs[4] where it lands there); the empty tensor is nobody's to check
    words = [s for s in srcs if s.numel() and s.numel() * s.element_size() % 4 == 0]
    assert flags.checked_in_copy == len(words) and (dtype is not torch.float32 or len(words) == len(srcs) - 1)
    for d, s in zip(dsts, srcs):
        assert _same_bytes(d, s)


@cuda
def test_one_launch_takes_many_pairs_at_odd_offsets_and_leaves_what_it_cannot() -> None:
    """A bucket's queue: views at 16-byte offsets of one buffer (a receive buffer) and separate tensors, in one launch;
    a misaligned view and a non-contiguous one are left to the plain copy and the reduction."""
    buf = torch.randn(1 << 16, device="cuda", dtype=torch.bfloat16)
    views = [buf[8:4104], buf[4104 : 4104 + 24], buf[8192:40000], buf[3:1027], buf[:2048].view(32, 64).t()]
    own = torch.randn(5000, device="cuda", dtype=torch.bfloat16)
    srcs = [*views, own]
    dsts = [torch.empty_like(s) for s in srcs]
    flag = torch.zeros((), dtype=torch.int32, device="cuda")
    left = checked_copy.checked_copy_all(dsts, srcs, flag)
    assert left == [3, 4] and flag.item() == 0
    for i in (0, 1, 2, 5):
        assert _same_bytes(dsts[i], srcs[i])
    buf[9000] = float("nan")
    assert checked_copy.checked_copy_all(dsts, srcs, flag) == [3, 4] and flag.item() == 1


@cuda
@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("block", [256, 2048])
def test_every_kernel_variant_the_sweep_may_pick_copies_and_checks(
    streaming: bool, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``bench_isfinite.py --sweep`` picks the kernel's block size and cache hints by speed: each must be right --
    every block of every pair copied once whatever the pairs' sizes (each program searches its pair), a NaN in any
    block and at any pair's first or last word found."""
    monkeypatch.setattr(checked_copy, "STREAMING", streaming)
    monkeypatch.setattr(checked_copy, "BLOCK", block)
    sizes = [2, 2 * block, 2 * block + 2, 40 * block - 6, 4, 7 * block]  # bf16 values: whole words
    for where in [None, (0, 0), (1, -1), (3, 9 * block + 5), (5, -1), (4, 1)]:
        srcs = [torch.randn(n, device="cuda").to(torch.bfloat16) for n in sizes]
        if where is not None:
            srcs[where[0]].view(-1)[where[1]] = float("nan")
        dsts = [torch.empty_like(s) for s in srcs]
        flag = torch.zeros((), dtype=torch.int32, device="cuda")
        assert checked_copy.checked_copy_all(dsts, srcs, flag) == []
        assert flag.item() == (where is not None), where
        assert all(_same_bytes(d, s) for d, s in zip(dsts, srcs))


@cuda
def test_what_no_checking_copy_reads_is_reduced_when_the_bucket_closes() -> None:
    whole = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    whole[40, 3] = float("nan")  # in rows a sliced copy does not write
    other = torch.randn(8, device="cuda", dtype=torch.bfloat16)
    other[2] = float("inf")  # never written by a copy at all (a loader's tensor, the adapter)
    dst = torch.zeros(16, 32, device="cuda", dtype=torch.bfloat16)
    flags = FiniteFlags()
    with flags.writing(), deferred():
        flags.open(0, [whole], ["whole"])
        copy_(dst, whole[:16])  # a piece, not the bucket tensor: copied plainly, the tensor reduced at close
        flags.open(1, [other], ["other"])
    assert flags.non_finite() == [0, 1]
    assert flags.checked_in_copy == 0
    assert torch.equal(dst, whole[:16])


@cuda
def test_small_tensors_outside_a_queue_are_left_to_the_reduction() -> None:
    """Outside :func:`deferred` a tensor below MIN_BYTES is not worth a launch of its own: copied plainly, still
    checked."""
    small = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    small[5] = float("nan")
    big = torch.randn(checked_copy.MIN_BYTES // 2, device="cuda", dtype=torch.bfloat16)
    dsts = [torch.empty_like(small), torch.empty_like(big)]
    flags = FiniteFlags()
    with flags.writing():
        flags.open(0, [small, big], ["small", "big"])
        copy_all(dsts, [small, big])
    assert flags.checked_in_copy == 1 and flags.non_finite() == [0]
    torch.testing.assert_close(dsts[0], small, rtol=0, atol=0, equal_nan=True)  # torch's copy: NaN stays NaN
    assert _same_bytes(dsts[1], big)


# -- the queue, on any device --------------------------------------------------------------------------------------


def test_queued_copies_land_when_the_bucket_closes_and_are_checked() -> None:
    srcs = [torch.randn(6, 4), torch.randn(10), torch.randn(3)]
    srcs[1][7] = float("nan")
    dsts = [torch.zeros_like(s) for s in srcs]
    flags = FiniteFlags()
    with flags.writing():
        flags.open(0, srcs[:2], ["a", "b"])
        with deferred():
            copy_(dsts[0], srcs[0])
            copy_all(dsts[1:2], srcs[1:2])
        assert not dsts[0].any(), "a queued copy landed before its bucket closed"
        flags.close()
        assert torch.equal(dsts[0], srcs[0])
        flags.open(1, srcs[2:], ["c"])
        with deferred():
            copy_(dsts[2], srcs[2])
    assert torch.equal(dsts[2], srcs[2]), "leaving writing() launches what is queued"
    assert flags.non_finite() == [0]
    torch.testing.assert_close(dsts[1], srcs[1], rtol=0, atol=0, equal_nan=True)


def test_a_destination_written_twice_in_one_bucket_keeps_the_second_write() -> None:
    first, second = torch.full((8,), 1.0), torch.full((8,), 2.0)
    dst = torch.zeros(8)
    flags = FiniteFlags()
    with flags.writing(), deferred():
        flags.open(0, [first, second], ["first", "second"])
        copy_(dst, first)
        copy_(dst, second)
    assert torch.equal(dst, second) and flags.non_finite() == []


def test_a_failed_write_drops_the_queue() -> None:
    src, dst = torch.ones(4), torch.zeros(4)
    flags = FiniteFlags()
    with pytest.raises(RuntimeError, match="loader failed"), flags.writing(), deferred():
        flags.open(0, [src], ["w"])
        copy_(dst, src)
        raise RuntimeError("loader failed")
    flags.close()
    assert not dst.any(), "a sync that failed must not finish its queued writes"


def test_a_backend_that_checks_in_copy_gets_the_whole_queue_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flag path without a GPU: a stand-in checking copy on the CPU backend takes every pair but the odd one."""
    backend = backend_for_device(torch.device("cpu"))
    calls: list[int] = []

    def checked_copy_all(
        dsts: Sequence[Tensor], srcs: Sequence[Tensor], flag: Tensor, *, alone: bool = False
    ) -> list[int]:
        calls.append(len(srcs))
        left = [i for i, s in enumerate(srcs) if s.dtype == torch.float64]
        for i, (d, s) in enumerate(zip(dsts, srcs)):
            if i not in left:
                d.copy_(s)
                flag.bitwise_or_((~s.isfinite().all()).to(torch.int32))
        return left

    monkeypatch.setattr(type(backend), "checks_in_copy", True)
    monkeypatch.setattr(backend, "checked_copy_all", checked_copy_all)
    srcs = [torch.randn(5), torch.randn(7), torch.randn(3, dtype=torch.float64)]
    srcs[1][0] = float("inf")
    srcs[2][1] = float("nan")
    dsts = [torch.zeros_like(s) for s in srcs]
    flags = FiniteFlags()
    with flags.writing(), deferred():
        flags.open(0, srcs[:2], ["a", "b"])
        copy_all(dsts[:2], srcs[:2])
        flags.open(1, srcs[2:], ["c"])
        copy_(dsts[2], srcs[2])
    assert calls == [2, 1]
    assert flags.checked_in_copy == 2
    assert flags.non_finite() == [0, 1]  # bucket 0 by the copy's flag, bucket 1 by the reduction of the pair left
    torch.testing.assert_close(dsts, srcs, rtol=0, atol=0, equal_nan=True)


def test_flags_of_more_buckets_than_one_buffer_holds_name_the_right_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket's checking-copy flag is a slot of a per-device buffer: past one buffer's slots a new one is added, and
    a non-finite bucket is named whichever buffer its slot is in (a 48-layer sync in 512 MiB buckets uses ~100)."""
    from hwsync.common import finite

    backend = backend_for_device(torch.device("cpu"))

    def checked_copy_all(
        dsts: Sequence[Tensor], srcs: Sequence[Tensor], flag: Tensor, *, alone: bool = False
    ) -> list[int]:
        for d, s in zip(dsts, srcs):
            d.copy_(s)
            flag.bitwise_or_((~s.isfinite().all()).to(torch.int32))
        return []

    monkeypatch.setattr(type(backend), "checks_in_copy", True)
    monkeypatch.setattr(backend, "checked_copy_all", checked_copy_all)
    n = finite._SLOTS + 44
    srcs = [torch.randn(4) for _ in range(n)]
    for bad in (3, finite._SLOTS + 1, n - 1):
        srcs[bad][2] = float("nan")
    dsts = [torch.zeros_like(s) for s in srcs]
    flags = FiniteFlags()
    with flags.writing(), deferred():
        for k, (d, s) in enumerate(zip(dsts, srcs)):
            flags.open(k, [s], [f"t{k}"])
            copy_(d, s)
    assert flags.checked_in_copy == n
    assert flags.non_finite() == [3, finite._SLOTS + 1, n - 1]
    assert len(flags._buffers[torch.device("cpu")]) == 2


def test_outside_a_receive_copies_are_plain_copies() -> None:
    src = torch.tensor([1.0, float("nan")])
    dst = torch.zeros(2)
    copy_(dst, src)
    copy_all([dst], [src])
    with deferred():
        copy_(dst, src)
    assert dst[0] == 1 and dst[1].isnan()


def test_a_checking_copy_that_fails_to_run_falls_back_and_is_not_tried_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A kernel that does not build or launch on this machine must not stop syncs: the bucket's copies land plainly,
    its sources are reduced, the failure is logged once and that device kind is not asked again."""
    import hwsync.common.finite as finite

    backend = backend_for_device(torch.device("cpu"))
    calls: list[int] = []

    def broken(dsts: Sequence[Tensor], srcs: Sequence[Tensor], flag: Tensor, *, alone: bool = False) -> list[int]:
        calls.append(len(srcs))
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(type(backend), "checks_in_copy", True)
    monkeypatch.setattr(backend, "checked_copy_all", broken)
    monkeypatch.setattr(finite, "_UNUSABLE", set())
    srcs = [torch.randn(6), torch.randn(4), torch.randn(5)]
    srcs[2][1] = float("nan")
    dsts = [torch.zeros_like(s) for s in srcs]
    flags = FiniteFlags()
    with caplog.at_level("WARNING", logger="hwsync"), flags.writing(), deferred():
        flags.open(0, srcs[:2], ["a", "b"])
        copy_all(dsts[:2], srcs[:2])
        flags.open(1, srcs[2:], ["c"])
        copy_(dsts[2], srcs[2])
    assert calls == [2], "asked once, then never again on that device kind"
    assert flags.checked_in_copy == 0 and flags.non_finite() == [1]
    torch.testing.assert_close(dsts, srcs, rtol=0, atol=0, equal_nan=True)
    assert sum("checking copy failed" in r.getMessage() for r in caplog.records) == 1
