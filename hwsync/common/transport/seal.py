"""Keyed tags over bucket bytes: a bucket that was not sent by the token holder never reaches a loader.

The data plane (gloo / NCCL / HCCL) itself authenticates nobody, so every bucket carries a tag only a holder of the
session secret (derived from the shared token, never sent) can compute, and the receiver checks it before the
bucket's tensors are used.

* Host memory: keyed BLAKE2b over the bytes.
* Device memory (the bytes never leave the GPU/NPU): a keyed *linear* hash computed where the data is, then keyed
  BLAKE2b over its short digest. The payload is read as signed bytes ``w`` (no copy); each row of ``L = 2**14``
  bytes gives, per lane, ``sum_i w_i * k_i`` with secret keys ``k_i`` uniform in ``[-128, 128)`` -- one int8 matrix
  product with int32 accumulation (``torch._int_mm``; exact, ``|sum| <= 2**28``), or the same integers through a
  float64 product where int8 products are not available (exact below ``2**53``: both give the same digest). The
  row sums are hashed again per lane in int64 with secret keys in ``[0, 2**16)`` (exact: ``|sum| < 2**63`` for any
  bucket below 2**33 bytes, 8 GiB; buckets are a few hundred MB). For any change of the payload, one lane's final sum
  stays equal with probability at most ``2**-8 + 2**-16`` over the secret keys; 8 independent lanes are used (about
  ``2**-64``), then bound with the bucket's index, the sync version and the payload length by BLAKE2b. An attacker
  without the token learns nothing about the keys. The payload is read once, with no temporary of its size (the float64
  products of the previous design wrote and read 8 bytes per byte: 3-4 ms per 617 MB bucket on an H200, which held the
  wire).
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import torch
from torch import Tensor

from hwsync.common.errors import SyncError

__all__ = ["Sealer", "derive_secret"]

_LANES = 8  # also what an int8 matrix product needs: a multiple of 8 columns
_ROW = 1 << 14
_KEY2_BITS = 16
_KINDS = {"row": 1, "sum": 2}  # each kind of key its own generator seed, also where the row counts coincide
_MIN_INT_MM_ROWS = 17  # torch._int_mm on CUDA takes more than 16 rows; fewer go through float64
_CHUNK_ROWS = 1024  # the float64 path's temporaries: at most 1024 * 2**14 * 8 bytes = 128 MiB at a time


def derive_secret(token: str, *context: object) -> bytes:
    """A 32-byte secret bound to ``context`` (session, purpose); the token itself never travels."""
    msg = "|".join(str(c) for c in ("hwsync", *context)).encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).digest()


class Sealer:
    """Seals and checks buckets of one data-plane session (both sides derive it from the same secret)."""

    tag_bytes = 32

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise SyncError("data-plane secret too short")
        self._mac_key = hashlib.blake2b(secret, digest_size=32, person=b"hwsync-mac").digest()
        self._seed = int.from_bytes(hashlib.blake2b(secret, digest_size=8, person=b"hwsync-keys").digest(), "little")
        self._keys: dict[tuple[str, int, str], Tensor] = {}
        self._int_mm: dict[str, bool] = {}  # per device: does torch._int_mm run there?

    # -- keys -----------------------------------------------------------------------------------------------------
    def _key(self, device: torch.device, rows: int, kind: str) -> Tensor:
        """Secret integer keys on ``device`` (deterministic per secret): ``"row"`` ``[_ROW, _LANES]`` int8,
        ``"row64"`` the same as float64, ``"sum"`` ``[rows, _LANES]`` int64 in ``[0, 2**16)``."""
        k = (str(device), rows, kind)
        if k not in self._keys:
            if kind == "row64":
                keys = self._key(device, _ROW, "row").to(torch.float64)
            else:
                g = torch.Generator().manual_seed((self._seed + 1_000_003 * rows + _KINDS[kind]) % (1 << 63))
                if kind == "row":
                    keys = torch.randint(-128, 128, (_ROW, _LANES), generator=g, dtype=torch.int64).to(torch.int8)
                else:
                    keys = torch.randint(0, 1 << _KEY2_BITS, (rows, _LANES), generator=g, dtype=torch.int64)
                keys = keys.to(device)
            self._keys[k] = keys
            if len(self._keys) > 16:
                self._keys.pop(next(iter(self._keys)))
        return self._keys[k]

    def _row_sums(self, rows: Tensor) -> Tensor:
        """``rows`` (``[m, _ROW]`` int8) times the row keys: ``[m, _LANES]`` int64, exactly."""
        device = rows.device
        if rows.shape[0] >= _MIN_INT_MM_ROWS and self._int_mm.get(str(device), True):
            try:
                return torch._int_mm(rows, self._key(device, _ROW, "row")).to(torch.int64)
            except (RuntimeError, NotImplementedError):  # no int8 products on this device: float64 below
                self._int_mm[str(device)] = False
        k = self._key(device, _ROW, "row64")
        out = torch.empty(rows.shape[0], _LANES, dtype=torch.int64, device=device)
        for r0 in range(0, rows.shape[0], _CHUNK_ROWS):
            block = rows[r0 : r0 + _CHUNK_ROWS]
            out[r0 : r0 + block.shape[0]] = (block.to(torch.float64) @ k).to(torch.int64)
        return out

    def _lane_digest(self, payload: Tensor) -> bytes:
        words = payload.view(torch.int8)
        full = words.numel() // _ROW
        parts = [self._row_sums(words[: full * _ROW].view(full, _ROW))] if full else []
        if words.numel() > full * _ROW:  # the last, partial row, zero-padded (the length is bound by the tag)
            tail = words.new_zeros(1, _ROW)
            tail[0, : words.numel() - full * _ROW] = words[full * _ROW :]
            parts.append(self._row_sums(tail))
        if not parts:
            return b""
        sums = parts[0] if len(parts) == 1 else torch.cat(parts)
        final = (sums * self._key(payload.device, sums.shape[0], "sum")).sum(dim=0)
        return final.cpu().numpy().tobytes()

    # -- tags -----------------------------------------------------------------------------------------------------
    def seal(self, payload: Tensor, index: int, version: int) -> bytes:
        """The tag of one bucket's payload (``uint8``, contiguous, on any device)."""
        h = hashlib.blake2b(key=self._mac_key, digest_size=self.tag_bytes)
        h.update(struct.pack("<qqq", index, version, payload.numel()))
        if payload.device.type != "cpu":
            h.update(self._lane_digest(payload))
        elif payload.numel():
            h.update(payload.numpy().data)
        return h.digest()

    def check(self, payload: Tensor, index: int, version: int, tag: bytes) -> None:
        """Raise :class:`~hwsync.common.errors.SyncError` unless ``tag`` seals ``payload`` for (index, version)."""
        if not hmac.compare_digest(self.seal(payload, index, version), bytes(tag)):
            raise SyncError(
                f"bucket {index} of sync v{version} fails authentication: its bytes were not sent by the trainer "
                "holding the token (or were altered on the way); nothing of it was applied"
            )
