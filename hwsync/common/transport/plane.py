"""Both ends of the data plane between a trainer and the engine workers in other processes: where the group meets
(rendezvous), how long a link lives, how buckets go out sealed and come in checked, and how an abort's reason
reaches every worker. The control channel (which sync, which group, which keys: ``hwsync.engine.server`` and
``hwsync.trainer.client``) only hands these ends their parameters.

* :class:`SendingEnd` (the trainer, rank 0): hosts the group's rendezvous store on the interface the engines reach
  the trainer on, keeps one link while the engines keep theirs (a persistent link: NCCL, HCCL), streams the buckets
  sealed with the sync's data key and, on a failure, publishes why before the ``ABORT`` goes out.
* :class:`ReceivingEnd` (an engine worker, rank ``first_rank + worker rank``): joins the group (the link kept while
  the group is the same), yields each bucket after its seal was checked, reads an abort's reason from the store, and
  closes its link after a failure or where the link does not persist (gloo's listener must not outlive a sync).

The link itself is the device's (``hwsync.common.backend.open_link``, passed in as ``open_link``: the transport
knows no backend).
"""

from __future__ import annotations

import datetime
import secrets
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hwsync.common.errors import SyncError
from hwsync.common.transport.base import Link, LinkSpec
from hwsync.common.transport.buckets import BucketLists, pool_of, receive_buckets, send_buckets
from hwsync.common.transport.seal import Sealer
from hwsync.common.wire import Manifest

__all__ = ["OpenLink", "ReceivingEnd", "SendingEnd", "publish_abort"]

OpenLink = Callable[[Any, LinkSpec, int, torch.device, bytes], Link]
"""``(store, spec, rank, device, secret) -> Link``: the device's link (``hwsync.common.backend.open_link``)."""


def publish_abort(store: Any, spec: LinkSpec, error: BaseException) -> None:
    """Why the trainer aborted, where the engine workers look for it (first reason wins)."""
    try:
        key = spec.prefix + "abort"
        if not store.check([key]):
            store.set(key, f"{type(error).__name__}: {error}"[:2000])
    except Exception:  # noqa: BLE001 - the reason is a courtesy; the abort itself is what counts
        pass


class SendingEnd:
    """The trainer's end: one rendezvous store for the handle's life, one link while the engines keep theirs."""

    def __init__(self, data_host: str, timeout_s: float, open_link: OpenLink) -> None:
        self.data_host = data_host
        self.timeout_s = timeout_s
        self._open_link = open_link
        self._store: Any = None
        self._store_sock: socket.socket | None = None
        self._link: tuple[bytes, Link] | None = None
        self._pools: dict[str, Any] = {}

    def store(self) -> Any:
        """The group's rendezvous store (a ``torch.distributed.TCPStore``), listening on exactly ``data_host``."""
        if self._store is None:
            family = socket.AF_INET6 if ":" in self.data_host else socket.AF_INET
            sock = socket.create_server((self.data_host, 0), family=family, backlog=128)
            self._store_sock = sock  # keep the listening socket (and its fd) alive with the store
            self._store = dist.TCPStore(
                self.data_host,
                sock.getsockname()[1],
                is_master=True,
                wait_for_workers=False,
                master_listen_fd=sock.fileno(),
                use_libuv=True,
                timeout=datetime.timedelta(seconds=self.timeout_s),
            )
        return self._store

    def group_ids(self) -> tuple[bytes, bytes]:
        """The id of the group the engines may still hold (the live link's, else a new one) and a fresh one, for the
        control channel to hand every engine sealed: each engine answers whether it can reuse the first."""
        held = self._link[0] if self._link is not None else secrets.token_bytes(32)
        return held, secrets.token_bytes(32)

    def stream(
        self,
        manifest: Manifest,
        lists: BucketLists,
        spec: LinkSpec,
        group_id: bytes,
        device: torch.device,
        data_key: bytes,
    ) -> Link:
        """Send every bucket over the group ``spec`` names (the live link where ``group_id`` is its group), sealed
        with ``data_key``; on any failure (joining included) publish why, send ``ABORT`` where the link stands, and
        raise."""
        store = self.store()
        if self._link is not None and self._link[0] != group_id:
            self.drop()
        try:
            link = self._link[1] if self._link is not None else self._open_link(store, spec, 0, device, data_key)
            self._link = (group_id, link)
            # the reason is in the store before the ABORT reaches any engine worker: every worker reports it
            send_buckets(
                manifest,
                lists,
                link,
                pool_of(self._pools, link.device),
                Sealer(data_key),
                on_abort=lambda e: publish_abort(store, spec, e),
            )
        except BaseException as e:
            publish_abort(store, spec, e)  # a failure before the stream (e.g. joining the link) too
            raise
        return link

    def done(self, ok: bool) -> None:
        """After the engines answered: the link stays only where it persists and the sync went through (the
        engines closed their ends otherwise: gloo's after every sync)."""
        if self._link is not None and (not ok or not getattr(self._link[1], "persistent", False)):
            self.drop()

    def drop(self) -> None:
        """Close the link; the next sync forms a fresh group."""
        if self._link is not None:
            self._link[1].close()
            self._link = None

    def close(self) -> None:
        self.drop()


class ReceivingEnd:
    """An engine worker's end: joins the trainer's group, receives checked buckets, keeps or closes its link."""

    def __init__(self, open_link: OpenLink) -> None:
        self._open_link = open_link
        self._held: tuple[str, Link, Any] | None = None  # (group prefix, link, store)
        self._pools: dict[str, Any] = {}

    def join(self, spec: Mapping[str, Any], rank: int, device: torch.device, secret: bytes) -> Link:
        """Rank ``rank`` of the group ``spec`` describes (the live link while its prefix is the same; one live
        group per worker). A peer that never joins, or joins wrong, is one :class:`SyncError`: nothing applied."""
        if self._held is not None and self._held[0] == spec["prefix"]:
            return self._held[1]
        self.close()
        try:
            ls = LinkSpec(**spec)
            store = dist.TCPStore(ls.host, ls.port, is_master=False, timeout=datetime.timedelta(seconds=ls.timeout_s))
            link = self._open_link(store, ls, rank, device, secret)
        except Exception as e:  # noqa: BLE001 - a refused sync, not a crash
            raise SyncError(
                f"could not join the trainer's data-plane group ({type(e).__name__}: {str(e)[:300]}); "
                "nothing was applied. Check that the trainer reaches the engine's data host/port and "
                "runs the same hwsync version"
            ) from e
        self._held = (ls.prefix, link, store)
        return link

    def buckets(self, manifest: Manifest, secret: bytes, abort_key: str) -> Iterator[Sequence[Tensor]]:
        """The manifest's buckets as they arrive on the joined link, each seal checked before it is yielded; an
        abort raises with the reason the trainer published under ``abort_key``."""
        if self._held is None:
            raise SyncError("internal: receiving buckets before joining the data plane")
        _, link, store = self._held

        def abort_reason() -> str:
            try:
                if store.check([abort_key]):
                    return str(store.get(abort_key).decode(errors="replace"))[:2000]
            except Exception:  # noqa: BLE001 - the reason is a courtesy; the abort itself is what counts
                return ""
            return ""

        return receive_buckets(manifest, link, pool_of(self._pools, link.device), Sealer(secret), abort_reason)

    def done(self, ok: bool) -> bool:
        """After the receive: close the link after a failure (the group may be mid-collective or out of step: the
        next sync forms a fresh one) or where it does not persist (CPU: no listener outlives the sync). Returns
        whether it is kept."""
        kept = ok and self._held is not None and bool(getattr(self._held[1], "persistent", False))
        if not kept:
            self.close()
        return kept

    def close(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held[1].close()
