"""The copy that checks as it copies (:mod:`hwsync.common.cuda.checked_copy`, used by :mod:`hwsync.common.finite` inside
a receive): same bytes as ``copy_``, NaN and +-Inf found in any block, the rest left to the separate reduction.

CUDA only (the kernel is Triton's); on CPU the receiver's reduction path is what tests/test_attacks_reliability.py
runs."""

from __future__ import annotations

import pytest
import torch

from hwsync.common.cuda import checked_copy
from hwsync.common.finite import FiniteFlags, copy_, copy_all

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the checking copy is a CUDA (Triton) kernel")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
def test_checking_copy_writes_the_same_bytes_and_finds_non_finite(
    dtype: torch.dtype, bad: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checked_copy, "MIN_BYTES", 0)  # every size through the kernel (its masks and tails)
    srcs = [torch.randn(n, device="cuda").to(dtype) for n in (1, 4095, 4096, 4097, 3 * 4096 + 5, 1 << 20)]
    if bad is not None:
        srcs[4].view(-1)[-1] = bad  # the last element of a partial block
    dsts = [torch.empty_like(s) for s in srcs]
    flags = FiniteFlags()
    with flags.writing():
        flags.open(0, srcs[:3], ["a", "b", "c"])
        copy_all(dsts[:3], srcs[:3])
        flags.open(1, srcs[3:], ["d", "e", "f"])
        copy_all(dsts[3:5], srcs[3:5])
        copy_(dsts[5], srcs[5])
    assert flags.non_finite() == ([] if bad is None else [1])
    assert flags.checked_in_copy == len(srcs)
    for d, s in zip(dsts, srcs):
        assert torch.equal(d.view(torch.uint8), s.view(torch.uint8))


@cuda
def test_what_no_checking_copy_reads_is_reduced_when_the_bucket_closes() -> None:
    whole = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    whole[40, 3] = float("nan")  # in rows a sliced copy does not write
    other = torch.randn(8, device="cuda", dtype=torch.bfloat16)
    other[2] = float("inf")  # never written by a copy at all (a loader's tensor, the adapter)
    dst = torch.zeros(16, 32, device="cuda", dtype=torch.bfloat16)
    flags = FiniteFlags()
    with flags.writing():
        flags.open(0, [whole], ["whole"])
        copy_(dst, whole[:16])  # a piece, not the bucket tensor: copied plainly, the tensor reduced at close
        flags.open(1, [other], ["other"])
    assert flags.non_finite() == [0, 1]
    assert flags.checked_in_copy == 0
    assert torch.equal(dst, whole[:16])


@cuda
def test_small_tensors_are_left_to_the_reduction() -> None:
    """Below MIN_BYTES a kernel launch costs more than reading the bytes again: copied plainly, still checked."""
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
    assert torch.equal(dsts[1].view(torch.uint8), big.view(torch.uint8))


def test_outside_a_receive_copies_are_plain_copies() -> None:
    src = torch.tensor([1.0, float("nan")])
    dst = torch.zeros(2)
    copy_(dst, src)
    copy_all([dst], [src])
    assert dst[0] == 1 and dst[1].isnan()
