"""`DecodedAhead` (ckpt/stream/kafka/decoded_ahead.py): a read ahead's frames decoded on a thread.
The restore that takes them gets exactly what decoding the messages itself gives, in order; the
thread stops at its byte bound; a damaged frame raises at its place; any other failure drops
the read ahead; a drop while a fetch is in flight closes the messages once it returns."""

from __future__ import annotations

import threading
import time
from collections.abc import Generator
from typing import Any

import pytest

from ckpt.stream.frames import FrameError
from ckpt.stream.kafka.decoded_ahead import DecodedAhead

WAIT_S = 10.0  # bound on any wait for the thread: a hang fails the test


class _Msg:
    def __init__(self, value: bytes) -> None:
        self._value = value

    def value(self) -> bytes:
        return self._value


class _Messages:
    """`(read index, message)` pairs as `_read_partitions` yields them; `gate` (when given) is
    waited before message `gate_at`; `fail_at` raises there; `closed` once the generator is."""

    def __init__(self, values: list[bytes], *, gate_at: int = -1, fail_at: int = -1) -> None:
        self.values, self.gate_at, self.fail_at = values, gate_at, fail_at
        self.gate = threading.Event()
        self.pulled = 0
        self.closed = threading.Event()

    def __call__(self) -> Generator[tuple[int, Any], None, None]:
        try:
            for n, v in enumerate(self.values):
                if n == self.gate_at:
                    assert self.gate.wait(WAIT_S), "gate never opened"
                if n == self.fail_at:
                    raise RuntimeError("nothing arrived")  # a read's own failure (a SourceError)
                self.pulled += 1
                yield n % 2, _Msg(v)
        finally:
            self.closed.set()


def _decode(i: int, msg: Any) -> tuple[int, int, Any]:
    value = msg.value()
    if value.startswith(b"bad"):
        raise FrameError("CRC mismatch", f"offset {value.decode()}")
    return i, int(value), value


def _values(n: int, width: int = 10) -> list[bytes]:
    return [str(k).zfill(width).encode() for k in range(n)]


def _until(cond: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, "the thread did not get there"
        time.sleep(0.005)


def test_the_frames_taken_are_the_messages_decoded_in_order_and_all_were_decoded_ahead() -> None:
    msgs = _Messages(_values(25))
    ahead = DecodedAhead(msgs(), _decode, limit_bytes=10**6)
    _until(msgs.closed.is_set)  # every message read ahead: the generator ended on the thread
    assert ahead.decoded == 25 and ahead.held_bytes == 250
    frames = ahead.take()
    assert frames is not None
    assert list(frames) == [_decode(n % 2, _Msg(v)) for n, v in enumerate(_values(25))]


def test_the_thread_stops_at_its_bound_and_the_rest_is_decoded_when_asked() -> None:
    msgs = _Messages(_values(40))
    ahead = DecodedAhead(msgs(), _decode, limit_bytes=95)  # 10 bytes a message: stops after 10
    _until(lambda: ahead.decoded == 10)
    time.sleep(0.05)
    assert ahead.decoded == 10 and msgs.pulled == 10 and not msgs.closed.is_set()
    frames = ahead.take()
    assert frames is not None
    assert [off for _, off, _ in frames] == list(range(40))
    assert msgs.closed.is_set()


def test_a_damaged_frame_raises_at_its_place_after_the_frames_before_it() -> None:
    values = _values(6)
    values[4] = b"bad-at-4"
    msgs = _Messages(values)
    ahead = DecodedAhead(msgs(), _decode, limit_bytes=10**6)
    _until(lambda: ahead.decoded == 5)
    frames = ahead.take()
    assert frames is not None
    assert [next(frames)[1] for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(FrameError, match="offset bad-at-4"):
        next(frames)
    assert msgs.closed.is_set()


def test_any_other_failure_ahead_drops_the_read_ahead() -> None:
    msgs = _Messages(_values(8), fail_at=3)
    ahead = DecodedAhead(msgs(), _decode, limit_bytes=10**6)
    assert ahead.take() is None  # the restore reads afresh
    assert msgs.closed.is_set()


def test_take_waits_for_the_message_in_flight_and_serves_it() -> None:
    msgs = _Messages(_values(6), gate_at=3)
    ahead = DecodedAhead(msgs(), _decode, limit_bytes=10**6)
    _until(lambda: ahead.decoded == 3)
    taker: list[Any] = []
    t = threading.Thread(target=lambda: taker.append(ahead.take()))
    t.start()
    time.sleep(0.05)
    assert t.is_alive()  # the thread is in its fetch: take waits for it ...
    msgs.gate.set()
    t.join(WAIT_S)
    assert not t.is_alive() and taker[0] is not None
    assert [off for _, off, _ in taker[0]] == list(range(6))  # ... and nothing is lost or repeated


def test_a_drop_during_a_fetch_closes_the_messages_when_it_returns() -> None:
    msgs = _Messages(_values(6), gate_at=2)
    ahead = DecodedAhead(msgs(), _decode, limit_bytes=10**6)
    _until(lambda: ahead.decoded == 2)
    ahead.close()  # returns at once: the fetch in flight cannot be interrupted
    assert not msgs.closed.is_set()
    msgs.gate.set()
    assert msgs.closed.wait(WAIT_S)
    assert msgs.pulled == 3  # the message in flight, then nothing more
