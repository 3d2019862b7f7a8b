"""How long the device waited for weights, timed on the compute stream.

For a ticket that was not ready when the trainer asked for it (its reply had not come, or its
ready event was not complete), the session records a timing event on the compute stream before
it blocks for the reply and another after the stream's ``wait_event(ready)``: the time between
the two, on the device, is the time the stream had nothing to do but wait for the weights (if
the stream was still busy with earlier work when the weights arrived, the two events run back
to back and the wait is ~0). A ticket whose ready event is already complete cannot hold the
stream: nothing is recorded for it, so hits cost one event query.

The elapsed times are harvested without synchronising: each later call queries the later event
of the oldest pending pairs and adds those that are done. The pending list is bounded: past
``PENDING_LIMIT`` pairs (a host that runs that many waits ahead of its device) the oldest is
waited for, which in practice is long done.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

#: Pairs of events kept pending before the oldest is waited for.
PENDING_LIMIT = 1024


class WaitTimer:
    """Times waits on a stream with pairs of timing events.

    ``add(group, ns, step)`` receives each harvested wait; ``new_event()`` makes a timing
    event (``torch.cuda.Event(enable_timing=True)``: ``record(stream)``, ``query()``,
    ``elapsed_time(other)`` in milliseconds, ``synchronize()``). Events are reused."""

    def __init__(
        self,
        add: Callable[[int, int, int], None],
        new_event: Callable[[], object],
        limit: int = PENDING_LIMIT,
    ):
        self._add = add
        self._new_event = new_event
        self._limit = limit
        self._free: list = []
        self._pending: collections.deque = collections.deque()

    def _event(self):
        return self._free.pop() if self._free else self._new_event()

    def start(self, stream):
        """Records the event before a wait on ``stream``; give it to ``finish``."""
        before = self._event()
        before.record(stream)
        return before

    def finish(self, before, stream, group: int, step: int):
        """Records the event after the wait (after ``stream.wait_event(ready)``)."""
        after = self._event()
        after.record(stream)
        self._pending.append((group, step, before, after))
        if len(self._pending) > self._limit:
            self._harvest_oldest(block=True)

    def harvest(self, block: bool = False):
        """Adds every pending wait whose events are done, oldest first; never blocks unless
        ``block``: then every pending wait, once the device has passed it."""
        while self._pending and self._harvest_oldest(block=block):
            pass

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _harvest_oldest(self, block: bool) -> bool:
        group, step, before, after = self._pending[0]
        if block:
            after.synchronize()
        elif not after.query():
            return False
        self._pending.popleft()
        ns = max(0, round(before.elapsed_time(after) * 1_000_000))
        self._free += (before, after)
        self._add(group, ns, step)
        return True
