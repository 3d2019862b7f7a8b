"""The trainer's own copies of trainable state under the daemon's pacing: ``Granter`` (one
thread per direction that asks the session for each copy's grant and issues it) and ``Issued``
(a copy asked for, waited for where its result is used)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from weightstream.torch.host.storage import HostStorage


class Issued:
    """A copy the granter thread issues once the daemon grants it. ``take()`` returns, once
    it is issued, what the copy made (the device copies, handed over once: the slots keep
    this object to wait for the copy, not the copies; None for a copy to the host) and the
    CUDA event after it (None on the CPU); ``synchronize()`` waits for the copy itself (for a
    writer of the source, or a reader of the destination); ``discard()`` frees the device
    copies of a group dropped before it used them."""

    def __init__(self):
        self._set = threading.Event()
        self._lock = threading.Lock()
        self._copies = None
        self._discarded = False
        self.event = None
        self._error: BaseException | None = None

    def settle(self, result=(None, None), error: BaseException | None = None):
        with self._lock:
            copies, self.event = result
            self._copies = None if self._discarded else copies
            self._error = error
        self._set.set()

    def _wait(self):
        self._set.wait()
        if self._error is not None:
            raise RuntimeError("weightstream: a paced copy of trainable state failed") from (
                self._error
            )

    def take(self):
        self._wait()
        with self._lock:
            copies, self._copies = self._copies, None
        return copies, self.event

    def synchronize(self):
        self._wait()
        if self.event is not None:
            self.event.synchronize()

    def query(self) -> bool:
        """Whether the copy is issued and done, at once."""
        return self._set.is_set() and (self.event is None or self.event.query())

    def discard(self):
        with self._lock:
            self._discarded, self._copies = True, None


#: ``Group.copies`` while the granter thread has yet to issue them.
ISSUING: list = []


class Granter:
    """One thread that, in order, asks the daemon for each of the trainer's own copies in one
    direction (``HostStorage.grant``: the session's ``grant``, which waits for the copy's turn
    among the daemon's copies under a limit or a share) and issues it once granted, so that the
    trainer's thread (and autograd's) go on queueing work meanwhile: a copy asked for ahead
    (a prefetch) is issued by the time it is used, instead of stopping the trainer until the
    daemon's earlier copies are paced."""

    def __init__(self, storage: HostStorage, to_device: bool):
        self._storage, self._to_device = storage, to_device
        self._queue: queue.Queue = queue.Queue()
        name = "weightstream-grants-" + ("h2d" if to_device else "d2h")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def request(self, nbytes: int, copy: Callable[[], tuple]) -> Issued:
        """``copy()`` once ``nbytes`` are granted: its ``Issued``."""
        issued = Issued()
        self._queue.put((nbytes, copy, issued))
        return issued

    def _run(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            nbytes, copy, issued = item
            try:
                self._storage.grant(nbytes, self._to_device)
                issued.settle(copy())
            except BaseException as e:  # noqa: BLE001 - raised where the copy is waited for
                issued.settle(error=e)

    def close(self):
        """Issues what was asked for, then ends the thread."""
        self._queue.put(None)
        self._thread.join()
