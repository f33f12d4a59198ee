"""DeferredPrefetch: holds back the prefetch that an SCO reload starts, from collect()
until start() (moepeak.tiled uses it around a tiled block's backward)."""
from __future__ import annotations

import contextlib
import threading

_DEFERRAL = threading.local()  # .open: the DeferredPrefetch collecting on this thread, or None


def open_deferral():
    """The DeferredPrefetch collecting on this thread, or None."""
    return getattr(_DEFERRAL, "open", None)


class DeferredPrefetch:
    """Holds back the prefetch that a reload starts, from `collect()` until `start()`.

    A reload normally enqueues the previous boundaries' loads at once, so the prefetched
    buffers are allocated while the reloaded block's backward runs. A caller whose
    backward peaks soon after its boundary is reloaded (the sequence-tiled block: its
    attention core's backward) opens this around the reload and starts the prefetch once
    that peak has passed, so the prefetched boundary is not part of it. Reloads on this
    thread inside collect() queue their prefetch; start() issues the queue (once; later
    calls do nothing). A prefetch never started is not lost: the next reload loads that
    boundary itself (the same bytes, only not overlapped)."""

    __slots__ = ("queue", "_outer")

    def __init__(self):
        self.queue: list = []  # (engine, seq of the reloaded boundary)

    @contextlib.contextmanager
    def collect(self):
        self._outer = open_deferral()
        _DEFERRAL.open = self
        try:
            yield self
        finally:
            _DEFERRAL.open = self._outer

    def start(self) -> None:
        queue, self.queue = self.queue, []
        for engine, seq in queue:
            engine.prefetch_before(seq)
