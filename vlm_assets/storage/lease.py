"""Leases in the artifact store: one live builder per key, across processes, hosts and runs.

A lease is a small JSON object beside the artifacts (``.leases/<key>.json``) naming its holder (run
id, host, pid, since when). It is created only if absent (local: ``O_CREAT|O_EXCL``; S3: a PUT with
``If-None-Match: *``), renewed by its holder every ``ttl_s / 3`` while the work runs (local: the
file's mtime; S3: a conditional PUT on the holder's ETag), and removed on release. A holder that
died stops renewing: once the lease is older than ``ttl_s`` (or at once, when its holder ran on this host and its
process is gone) the next attempt removes it (the removal is itself conditional, so two attempts
cannot both take it over) and goes on.

Dagster has no cross-run lock: its pools limit how many steps run at once, not which key they build,
and a pool slot is freed when the run worker dies, not when its orphaned workers do.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class LeaseState:
    """A lease as read from the store: the holder's record, its age, and the token for conditional renewal/removal.

    The token is the S3 ETag; the local store uses the record's ``attempt`` id.
    """

    holder: dict[str, Any]
    age_s: float
    token: str

    def holder_dead_here(self) -> bool:
        """Return whether the holder ran on this host and its process is gone: dead now, no need to wait for the ttl."""
        if self.holder.get("host") != socket.gethostname() or not isinstance(self.holder.get("pid"), int):
            return False
        try:
            os.kill(self.holder["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return False

    def expired(self, ttl_s: float) -> bool:
        """Return whether the lease is older than ``ttl_s`` or its holder is dead on this host."""
        return self.age_s > ttl_s or self.holder_dead_here()

    def describe(self) -> str:
        """Describe the holder for a message: its run, host, pid, start and last renewal."""
        h = self.holder
        return (
            f"run {h.get('run_id', '?')} on {h.get('host', '?')} (pid {h.get('pid', '?')}) since "
            f"{h.get('since', '?')}, renewed {self.age_s:.0f} s ago"
        )


class LeaseHeldError(RuntimeError):
    """Another live attempt holds the lease (and the caller asked to fail rather than wait, or waited its limit)."""


class LeaseLostError(RuntimeError):
    """The lease expired and was taken over while this attempt still held it: its work must not commit."""


def holder_record(run_id: str, **extra: Any) -> dict[str, Any]:
    """Return this process's lease holder record for ``run_id``: host, pid, start time, a new attempt id, ``extra``."""
    return {
        "run_id": run_id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "attempt": uuid.uuid4().hex,
        **extra,
    }


class Lease:
    """``try_acquire`` then ``release`` (or ``with store.lease(...)`` after a successful acquire)."""

    def __init__(
        self, backend: Any, key: str, holder: dict[str, Any], ttl_s: float, log: Callable[[str], None] | None = None
    ):
        if ttl_s <= 0:
            raise ValueError(f"lease ttl_s must be > 0, got {ttl_s}")
        self.backend, self.key, self.holder, self.ttl_s = backend, key, holder, ttl_s
        self.log = log or (lambda _msg: None)
        self._token: str | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.lost = False
        self.taken_over: LeaseState | None = None  # the expired lease this attempt replaced, if any

    def try_acquire(self) -> LeaseState | None:
        """Take the lease; return None when taken (and renewed from now on), else the live holder's state.

        An expired lease is removed first (its holder stopped renewing: it is dead or cut off).
        """
        body = json.dumps({**self.holder, "key": self.key}).encode()
        for _ in range(3):
            token = self.backend.lease_create(self.key, body)
            if token is not None:
                self._token = token
                self._renewer = threading.Thread(target=self._renew_loop, name=f"lease:{self.key}", daemon=True)
                self._renewer.start()
                return None
            state = self.backend.lease_read(self.key)
            if state is None:
                continue  # released between our create and read: try again
            if not state.expired(self.ttl_s):
                return state
            why = "its process is gone" if state.holder_dead_here() else f"ttl {self.ttl_s:.0f} s"
            self.log(f"lease on {self.key} expired ({state.describe()}; {why}): taking it over")
            self.backend.lease_remove(self.key, state.token)
            self.taken_over = state
        return self.backend.lease_read(self.key)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            token = self.backend.lease_renew(self.key, self._token)
            if token is None:
                self.lost = True
                self.log(f"lease on {self.key} was taken over by another attempt: this one must not commit")
                return
            self._token = token

    def acquire_or_wait(
        self, done: Callable[[], bool], *, fail_at_once: bool, timeout_s: float, log: Callable[[str], None]
    ) -> bool:
        """Take the lease, waiting while another live attempt holds it; return True once taken.

        Return False as soon as ``done()`` (the work it guards was completed by that attempt). ``LeaseHeldError``
        names the holder at once when ``fail_at_once``, else after ``timeout_s``.
        """
        deadline, said = time.monotonic() + timeout_s, False
        while (busy := self.try_acquire()) is not None:
            if done():
                return False
            if fail_at_once or time.monotonic() > deadline:
                waited = "" if fail_at_once else f" (waited {timeout_s:.0f} s)"
                raise LeaseHeldError(
                    f"{self.key} is being built by another attempt{waited}: {busy.describe()}. It "
                    f"expires {self.ttl_s:.0f} s after its holder stops renewing it."
                )
            if not said:
                log(f"{self.key} is being built by {busy.describe()}: waiting for it")
                said = True
            time.sleep(min(5.0, self.ttl_s / 4))
        return True

    def ensure_held(self) -> None:
        """Raise ``LeaseLostError`` if the lease was lost; call right before committing."""
        if self.lost or self._token is None:
            raise LeaseLostError(
                f"lease on {self.key} is no longer held by this attempt "
                f"(not renewed within {self.ttl_s:.0f} s and taken over): nothing committed"
            )

    def release(self) -> None:
        """Stop renewing the lease and remove it from the store, unless it was lost."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        if self._token is not None and not self.lost:
            self.backend.lease_remove(self.key, self._token)
        self._token = None

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
