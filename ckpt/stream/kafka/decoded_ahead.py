"""A read ahead's frames decoded on a thread while a restarted job builds its model (docs/design/kafka.md).

`KafkaSource.read_ahead` assigns the restore's reads before the model exists, and librdkafka
fetches their messages into its read buffer. What the restore's first frames then still wait
for is checking and parsing each one (its CRC, its row ids): `DecodedAhead` does that too, on
a daemon thread, for up to a bound of frame bytes, so the restore that takes the reads over
starts with frames ready. Written here because the consumer's own prefetch stops at raw
messages; nothing in confluent-kafka parses ahead.

What the restore sees is what reading the messages itself would give, in the same order: the
frames decoded ahead, then the rest decoded as they come; a damaged frame raises its
`FrameError` at its place. Any other failure ahead (a read that timed out, a broker gone)
drops what was read ahead: `take` says so and the restore reads afresh, meeting a failure that
persists with its own context.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Generator, Iterator

from confluent_kafka import Message

from ckpt.stream.frames import Frame, FrameError

__all__ = ["DecodedAhead", "Decoded"]

Decoded = tuple[int, int, Frame]  # (index into the reads, offset, frame), as `read_ranges` yields


class DecodedAhead:
    """`decode` of every message of `messages` on a thread started now, until `limit_bytes` of
    message values are held, the messages end, or `take`/`close`; `take` it once, or `close`."""

    def __init__(
        self,
        messages: Generator[tuple[int, Message], None, None],
        decode: Callable[[int, Message], Decoded],
        limit_bytes: int,
    ) -> None:
        self._messages, self._decode, self._limit = messages, decode, limit_bytes
        self._items: deque[Decoded | FrameError] = deque()
        self._failed: BaseException | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # `_running` and `_dropped`: who closes the messages
        self._running, self._dropped = True, False
        self.held_bytes = 0  # message bytes decoded ahead
        # a daemon thread: a process that exits does not wait out a fetch in flight
        self._thread = threading.Thread(target=self._run, name="deltarec-frames-ahead", daemon=True)
        self._thread.start()

    @property
    def decoded(self) -> int:
        """Frames decoded ahead so far (a damaged one included)."""
        return len(self._items)

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and self.held_bytes < self._limit:
                got = next(self._messages, None)
                if got is None:
                    return
                i, msg = got
                try:
                    self._items.append(self._decode(i, msg))
                except FrameError as exc:  # raised at its place by `take`'s frames
                    self._items.append(exc)
                    return
                self.held_bytes += len(msg.value() or b"")
        except BaseException as exc:  # noqa: BLE001 - `take` drops the read ahead; the restore reads afresh
            self._failed = exc
        finally:
            with self._lock:
                self._running = False
                close_now = self._dropped
            if close_now:
                self._messages.close()

    def take(self) -> Iterator[Decoded] | None:
        """The frames, those decoded ahead first, once the thread has stopped (it finishes the
        message it waits for, which the caller wants next anyway); None when the read ahead
        failed, its consumer closed."""
        self._stop.set()
        self._thread.join()
        if self._failed is not None:
            self._messages.close()
            return None
        return self._frames()

    def _frames(self) -> Iterator[Decoded]:
        try:
            while self._items:
                item = self._items.popleft()
                if isinstance(item, FrameError):
                    raise item
                yield item
            for i, msg in self._messages:
                yield self._decode(i, msg)
        finally:
            self._messages.close()

    def close(self) -> None:
        """Drop the read ahead: its consumer closes now, or when the thread's fetch in flight
        returns (a fetch cannot be interrupted)."""
        self._stop.set()
        with self._lock:
            self._dropped = True
            close_now = not self._running
        if close_now:
            self._messages.close()
        self._items.clear()
