"""An exclusive write lock on object storage: one capture writes an ``s3://`` store at a time
(any backend whose ``capabilities.conditional_create`` holds takes the same lock: ``gs://``
and ``az://`` too).

Object storage has no ``flock``, so the lock is a small JSON object,
``<store prefix>/.actstore-lock.json``, holding the holder's host, pid, start time, a random
token and its lease (seconds). It is created with a conditional PUT (``If-None-Match: *``):
of two captures starting at once, on one machine or two, exactly one creates it; the
other gets :class:`~actstore.errors.StoreLockedError` with one line naming the holder.

The holder refreshes the object every quarter lease (``If-Match`` on the ETag it wrote, so
a holder that lost the lock learns it instead of overwriting the new holder's record) and
deletes it when it releases the lock. A holder that stops refreshing (killed, or its
machine gone) leaves a *stale* lock: one whose age, by the server's own clock (the
response's ``Date`` minus the object's ``Last-Modified``), exceeds the lease it recorded.
The next writer takes a stale lock over with a warning (a conditional PUT on the stale
ETag, so two takers cannot both win); a dead holder on the same host is taken over at
once. ``break_lock=True`` (``ACTSTORE_BREAK_LOCK=1``, ``capture --break-lock``) takes over
a live one: only for a holder known to be dead.

Services without conditional writes (HTTP 501 / ``NotImplemented``) get a weaker fallback,
logged once: read, PUT, read back the token. Two writers starting within the same moment
may then both pass; a lock they find later is still honoured.

Listings of a store leave the lock object out (:func:`~.base.is_internal`).

Example:
    >>> lock = S3Lock.acquire(store, "acts/3f1c")  # doctest: +SKIP
    >>> lock.check(); lock.release()  # doctest: +SKIP
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket
import threading
import uuid
from typing import Any, Protocol, Self

from ...errors import StoreLockedError, UnsupportedError
from ..local import load_json
from ..lock import BREAK_LOCK_ENV, describe_holder, pid_alive
from .base import LOCK_NAME, join_key

#: Logged under its historical name (``actstore.storage.s3lock``, where it was defined).
log = logging.getLogger("actstore.storage.s3lock")

#: Seconds a holder's lock stays valid without a refresh (it refreshes every quarter).
DEFAULT_LEASE_S = 60.0
_TRIES = 8


class ConditionalStore(Protocol):
    """What the lock needs of a store: conditional writes and deletes, and reads that give
    the object's age (every :class:`~.base.ObjectStore` whose ``capabilities`` have
    ``conditional_create``; S3 by the server's clock)."""

    root_url: str

    def url(self, key: str) -> str: ...

    def put(self, key: str, data: bytes | bytearray | memoryview) -> str: ...

    def delete(self, key: str) -> None: ...

    def put_if(self, key: str, data: bytes, *, etag: str | None) -> str | None: ...

    def get_with_age(self, key: str) -> tuple[bytes, str, float] | None: ...

    def delete_if(self, key: str, etag: str) -> bool: ...


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def _parse(body: bytes) -> dict[str, Any]:
    try:
        doc = load_json(body)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


class S3Lock:
    """A held write lock on ``s3://bucket/prefix``; :meth:`release` frees it. A thread
    refreshes it until then; :meth:`check` raises if another writer took it over."""

    def __init__(
        self,
        store: ConditionalStore,
        key: str,
        record: dict[str, Any],
        etag: str,
        conditional: bool,
    ) -> None:
        self.store, self.key, self.record = store, key, record
        self.url = store.url(key)
        self.lease_s = float(record["lease_s"])
        self._etag, self._conditional = etag, conditional
        self._lost: str | None = None
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="actstore-s3-lock", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ acquire

    @classmethod
    def acquire(
        cls,
        store: ConditionalStore,
        prefix: str,
        *,
        break_lock: bool = False,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> S3Lock:
        """Lock the store at ``prefix`` for writing or raise :class:`StoreLockedError`."""
        key = join_key(prefix, LOCK_NAME)
        where = store.url(prefix)
        break_lock = break_lock or os.environ.get(BREAK_LOCK_ENV) == "1"
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "start": _now(),
            "heartbeat": _now(),
            "lease_s": lease_s,
            "token": uuid.uuid4().hex,
        }
        data = json.dumps(record).encode()
        for _ in range(_TRIES):
            try:
                etag = store.put_if(key, data, etag=None)
            except UnsupportedError:
                return cls._acquire_unconditionally(store, key, where, record, break_lock)
            if etag is not None:
                return cls(store, key, record, etag, True)
            found = store.get_with_age(key)
            if found is None:
                continue  # released in the meantime
            body, old, age = found
            holder = _parse(body)
            if holder.get("token") == record["token"]:  # our PUT landed; its reply was lost
                return cls(store, key, record, old, True)
            reason = _takeover_reason(holder, age, break_lock, where)
            log.warning(
                "taking over the write lock of %s from %s (%s)",
                where,
                describe_holder(holder),
                reason,
            )
            break_lock = False
            etag = store.put_if(key, data, etag=old)
            if etag is not None:
                return cls(store, key, record, etag, True)
        raise StoreLockedError(
            f"the write lock of {where} keeps changing hands (several captures are starting "
            "on it); run one capture per destination"
        )

    @classmethod
    def _acquire_unconditionally(
        cls,
        store: ConditionalStore,
        key: str,
        where: str,
        record: dict[str, Any],
        break_lock: bool,
    ) -> S3Lock:
        log.warning(
            "%s does not support conditional writes: the write lock of %s is checked but two "
            "captures starting at the same moment are not told apart",
            store.root_url,
            where,
        )
        found = store.get_with_age(key)
        if found is not None:
            holder = _parse(found[0])
            reason = _takeover_reason(holder, found[2], break_lock, where)
            log.warning(
                "taking over the write lock of %s from %s (%s)",
                where,
                describe_holder(holder),
                reason,
            )
        store.put(key, json.dumps(record).encode())
        back = store.get_with_age(key)
        if back is None or _parse(back[0]).get("token") != record["token"]:
            holder = _parse(back[0]) if back is not None else {}
            raise StoreLockedError(
                f"another capture ({describe_holder(holder)}) is writing {where}; wait for it or, if it "
                "is dead, rerun with --break-lock"
            )
        return cls(store, key, record, back[1], False)

    # ------------------------------------------------------------------ hold

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            try:
                self.refresh()
            except Exception as err:  # noqa: BLE001 - the next beat tries again
                log.warning("could not refresh the write lock %s: %s", self.url, err)
            if self._lost is not None:
                return

    def refresh(self) -> None:
        """Rewrite the lock object (a heartbeat); notes a takeover for :meth:`check`."""
        with self._guard:
            if self._lost is not None or self._stop.is_set():
                return
            record = {**self.record, "heartbeat": _now()}
            data = json.dumps(record).encode()
            if self._conditional:
                etag = self.store.put_if(self.key, data, etag=self._etag)
            else:
                etag = self._put_if_mine(data)
            if etag is not None:
                self._etag = etag
                return
            found = self.store.get_with_age(self.key)
            if found is not None and _parse(found[0]).get("token") == record["token"]:
                self._etag = found[1]  # our PUT landed; its reply was lost
                return
            holder = _parse(found[0]) if found is not None else {}
            self._lost = (
                f"this capture lost the write lock of {self.url} to another capture "
                f"({describe_holder(holder)}); stop one of them and rerun the other to resume"
                if found is not None
                else f"the write lock {self.url} was removed by someone else; rerun the "
                "capture to resume"
            )
            log.error("%s", self._lost)

    def _put_if_mine(self, data: bytes) -> str | None:
        """The fallback refresh: rewrite the object if it still holds our token."""
        found = self.store.get_with_age(self.key)
        if found is None or _parse(found[0]).get("token") != self.record["token"]:
            return None
        self.store.put(self.key, data)
        back = self.store.get_with_age(self.key)
        return back[1] if back is not None else None

    @property
    def lost(self) -> str | None:
        """Why the lock is no longer ours (another writer took it over), or None."""
        return self._lost

    def check(self) -> None:
        """Raise :class:`StoreLockedError` if another writer took the lock over."""
        if self._lost is not None:
            raise StoreLockedError(self._lost)

    def release(self) -> None:
        """Stop refreshing and delete the lock object if it is still ours (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        with self._guard:
            if self._lost is not None:
                return
            try:
                if self._conditional:
                    self.store.delete_if(self.key, self._etag)
                else:
                    found = self.store.get_with_age(self.key)
                    if found is not None and _parse(found[0]).get("token") == self.record["token"]:
                        self.store.delete(self.key)
            except Exception as err:  # noqa: BLE001 - a left lock goes stale by itself
                log.warning(
                    "could not remove the write lock %s (%s); it goes stale in %.0fs",
                    self.url,
                    err,
                    self.lease_s,
                )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _takeover_reason(holder: dict[str, Any], age: float, break_lock: bool, where: str) -> str:
    """Why a found lock may be taken over, or :class:`StoreLockedError` if it may not."""
    lease = float(holder.get("lease_s") or DEFAULT_LEASE_S)
    host, pid = holder.get("host"), holder.get("pid")
    if host == socket.gethostname() and isinstance(pid, int) and not pid_alive(pid):
        return "that process is dead"
    if age > lease:
        return f"it has not refreshed the lock for {age:.0f}s, past its {lease:.0f}s lease"
    if break_lock:
        return "--break-lock"
    raise StoreLockedError(
        f"another capture ({describe_holder(holder)}, lock refreshed {age:.0f}s ago) is writing {where}; "
        "wait for it or, if it is dead, rerun with --break-lock (or after its "
        f"{lease:.0f}s lease runs out)"
    )
