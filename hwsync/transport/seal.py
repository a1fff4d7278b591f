"""Keyed tags over bucket bytes: a bucket that was not sent by the token holder never reaches a loader.

The data plane (gloo / NCCL / HCCL) itself authenticates nobody, so every bucket carries a tag only a holder of the
session secret (derived from the shared token, never sent) can compute, and the receiver checks it before the
bucket's tensors are used.

* Host memory: keyed BLAKE2b over the bytes.
* Device memory (the bytes never leave the GPU/NPU): a keyed *linear* hash computed where the data is, then keyed
  BLAKE2b over that short digest. The payload is read as 16-bit words ``w``; each row of ``L = 2**14`` words gives
  ``sum_i w_i * k_i`` with secret integer keys ``k_i < 2**20``, computed exactly in float64 (|sum| < 2**49 < 2**53);
  the row sums (split into 17-bit limbs) are hashed again the same way with keys ``< 2**16`` (|sum| < 2**52). For
  any change of the payload, one lane's final sum stays equal with probability at most ``2**-20 + 2**-16`` over the
  secret keys, and 4 independent lanes are used (about ``2**-63``), then bound with the bucket's index, the sync
  version and the payload length by BLAKE2b. An attacker without the token learns nothing about the keys.
"""
from __future__ import annotations

import hashlib
import hmac
import struct

import torch
from torch import Tensor

from hwsync.errors import SyncError

__all__ = ["Sealer", "derive_secret"]

_LANES = 4
_ROW = 1 << 14
_KEY1_BITS, _KEY2_BITS = 20, 16
_CHUNK_ROWS = 1024  # float64 temporaries of at most 1024 * 2**14 * 8 bytes = 128 MiB per lane block


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
        self._keys: dict[tuple[str, int, int], Tensor] = {}

    # -- keys -----------------------------------------------------------------------------------------------------
    def _key(self, device: torch.device, length: int, bits: int) -> Tensor:
        """``[_LANES, length]`` float64 secret integer keys on ``device`` (deterministic per secret)."""
        k = (str(device), length, bits)
        if k not in self._keys:
            g = torch.Generator().manual_seed((self._seed + 1_000_003 * length + bits) % (1 << 63))
            keys = torch.randint(0, 1 << bits, (_LANES, length), generator=g, dtype=torch.int64)
            self._keys[k] = keys.to(torch.float64).to(device)
            if len(self._keys) > 16:
                self._keys.pop(next(iter(self._keys)))
        return self._keys[k]

    def _lane_digest(self, payload: Tensor) -> bytes:
        n = payload.numel()
        words = payload
        if n % 2:
            words = torch.cat([payload, payload.new_zeros(1)])
        words = words.view(torch.int16)
        rows = -(-words.numel() // _ROW)
        k1 = self._key(payload.device, _ROW, _KEY1_BITS)
        level1 = torch.empty(rows, _LANES, dtype=torch.float64, device=payload.device)
        for r0 in range(0, rows, _CHUNK_ROWS):
            r1 = min(rows, r0 + _CHUNK_ROWS)
            block = words[r0 * _ROW: r1 * _ROW]
            if block.numel() < (r1 - r0) * _ROW:
                block = torch.cat([block, block.new_zeros((r1 - r0) * _ROW - block.numel())])
            level1[r0:r1] = block.view(r1 - r0, _ROW).to(torch.float64) @ k1.T
        # |level1| < 2**49: shift to [0, 2**50) and split into three 17-bit limbs (exact in float64)
        shifted = level1 + float(1 << 49)
        limbs = []
        for _ in range(3):
            low = torch.remainder(shifted, float(1 << 17))
            limbs.append(low)
            shifted = (shifted - low) / float(1 << 17)
        msg = torch.stack(limbs, dim=-1).permute(1, 0, 2).reshape(_LANES, -1)  # per lane: rows x 3 limbs
        k2 = self._key(payload.device, msg.shape[1], _KEY2_BITS)
        final = (msg * k2).sum(dim=1)
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
        """Raise :class:`~hwsync.errors.SyncError` unless ``tag`` seals ``payload`` for (index, version)."""
        if not hmac.compare_digest(self.seal(payload, index, version), bytes(tag)):
            raise SyncError(
                f"bucket {index} of sync v{version} fails authentication: its bytes were not sent by the trainer "
                "holding the token (or were altered on the way); nothing of it was applied")
