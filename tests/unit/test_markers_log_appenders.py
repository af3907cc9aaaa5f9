"""Several processes append to one filesystem markers log (the trainer's rank 0, a follower,
`deltarec-ckpt gc`): an append holds the file's lock, and only under it is a torn tail cut. A
process that opens the log while another is in the middle of an append must wait for the lock,
never cut the other's record as if a crash had torn it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from ckpt.stream.filesystem import FsMarkers

# Another process's append, held in its middle: lock, the record's header and half its payload
# written and flushed, then (once `go` exists) the rest, fsync, unlock.
_HALF_WRITER = textwrap.dedent(
    """
    import fcntl, os, sys, time
    from ckpt.stream.filesystem import encode_record
    path, payload, ready, go = sys.argv[1], sys.argv[2].encode(), sys.argv[3], sys.argv[4]
    head, _ = encode_record(payload)
    with open(path, "ab") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        f.write(head + payload[: len(payload) // 2])
        f.flush()
        open(ready, "w").close()
        while not os.path.exists(go):
            time.sleep(0.01)
        f.write(payload[len(payload) // 2 :])
        f.flush()
        os.fsync(f.fileno())
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    """
)


def test_an_append_waits_for_one_in_progress_in_another_process_and_cuts_nothing(tmp_path: Path) -> None:
    first = FsMarkers(tmp_path, "run")
    at_first = first.append_marker(b"first record")
    first.close()
    theirs, ours = b"another process's record " * 40, b"this process's record"
    ready, go = tmp_path / "ready", tmp_path / "go"
    other = subprocess.Popen([sys.executable, "-c", _HALF_WRITER, str(first.path), theirs.decode(), str(ready), str(go)])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert other.poll() is None and time.monotonic() < deadline, "the other process never started its append"
            time.sleep(0.01)
        torn_size = first.path.stat().st_size
        appended: list[int] = []
        later = FsMarkers(tmp_path, "run")  # opened while the other append is half written
        appender = threading.Thread(target=lambda: appended.append(later.append_marker(ours)))
        appender.start()
        appender.join(0.5)
        assert appender.is_alive() and not appended, "the append did not wait for the other process's lock"
        assert first.path.stat().st_size == torn_size, "the other process's half-written record was cut"
        go.touch()
        appender.join(60)
        assert other.wait(60) == 0 and appended
    finally:
        go.touch()
        other.wait(60)
    records = FsMarkers(tmp_path, "run").read_markers()
    assert [payload for _, payload in records] == [b"first record", theirs, ours]
    assert records[0][0] == at_first and records[2][0] == appended[0]
