"""Bad input, fuzzed: what a user or a damaged disk hands deltarec never
gives a traceback.

- configs: random mutations of a valid YAML config (values, deleted, renamed and added keys,
  damaged text, random overrides) load, or raise one `ConfigError` line naming the key;
- frames and markers: random byte flips, truncations and extensions raise only `FrameError` /
  `MarkerError` naming where (topic/partition/offset, file and byte, marker position); forged
  ones (damaged, then given a matching CRC) are refused or decode to consistent records;
- Criteo input: random garbage lines give `file:line: reason` errors, or counted skips;
- configs that make a checkpoint impossible are refused when the config is loaded.

Every draw comes from the `replay_seed` fixture: a failure prints the seed and the command that
replays it (`DELTAREC_TEST_SEED=<seed>`). The loops are bounded to keep this file to seconds.
"""

from __future__ import annotations

import copy
import json
import random
import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import yaml

from ckpt.log.catalog import Catalog, commits
from ckpt.log.markers import MAGIC as MARKER_MAGIC
from ckpt.log.markers import ChainLink, IndexEntry, Marker, MarkerError, OffsetRange, decode_record, encode_marker
from ckpt.stream.filesystem import FsMarkers, FsSink, FsSource
from ckpt.stream.frames import FrameError, OptimState, decode_frame, encode_frame, kafka_where
from ckpt.stream.sink import SourceError
from common.errors import ConfigError
from trainer.config import load_config
from trainer.data.criteo import CriteoTsvReader, MalformedLineError, diagnose_line

if TYPE_CHECKING:
    from tests.conftest import DebugConfig, ReplaySeed

# --- configs ------------------------------------------------------------------------------------

# The debug config with checkpointing on, so the ckpt section's rules run too.
CKPT = {
    "enabled": True,
    "sink": {"kind": "filesystem"},
    "schedule": {"interval_steps": 20, "policy": "incremental"},
    "encoding": {"weights": "fp16"},
}
# Values a mutation puts anywhere: every YAML type, out-of-range numbers, path-like and odd strings.
VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    7,
    2**40,
    0.5,
    -2.5,
    "",
    "x",
    "../x",
    "a/b",
    "a.b",
    "\u00e9t\u00e9",
    "row_wise",
    "fp7",
    "none",
    [],
    [0],
    [1, 2],
    ["a"],
    [[1]],
    {},
    {"k": 1},
    {"a": {"b": 1}},
]
NEW_KEYS: list[Any] = ["stepz", "x", "Name", "", 1, None, True, "a.b"]


def _job(debug_config: DebugConfig) -> dict[str, Any]:
    data = debug_config.raw()
    data["ckpt"] = copy.deepcopy(CKPT)
    return data


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path of a YAML tree (mapping keys and list indices), the root excluded."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        out.append(prefix + (key,))
        out += _paths(child, prefix + (key,))
    return out


def _mutate(data: dict[str, Any], rng: random.Random) -> tuple[str, list[tuple]]:
    """Change one thing in `data` in place; returns what was done and the key paths an error
    about it may name (the changed key; for a renamed key, its new and its old name)."""
    path = rng.choice(_paths(data))
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    op = rng.choice(["value", "value", "value", "delete", "rename", "add"])
    if op == "value":
        parent[path[-1]] = copy.deepcopy(rng.choice(VALUES))
        return f"set {path} to {parent[path[-1]]!r}", [path]
    if op == "delete":
        del parent[path[-1]]
        return f"deleted {path}", [path]
    if op == "rename" and isinstance(parent, dict):
        key = str(path[-1])
        at = rng.randrange(len(key))
        new = key[:at] + rng.choice("xz_") + key[at + 1 :]
        parent[new] = parent.pop(path[-1])
        return f"renamed {path} to {new!r}", [path, path[:-1] + (new,)]
    holder = parent[path[-1]] if isinstance(parent[path[-1]], dict) else parent
    where = path if holder is not parent else path[:-1]
    key = rng.choice(NEW_KEYS)
    if isinstance(holder, dict) and key not in holder:
        holder[key] = copy.deepcopy(rng.choice(VALUES))
        return f"added {where + (key,)}", [where + (key,)]
    parent[path[-1]] = copy.deepcopy(rng.choice(VALUES))
    return f"set {path} to {parent[path[-1]]!r}", [path]


def _names(message: str, path: tuple) -> bool:
    """Whether an error names the key at `path`: its dotted path; for a list item, the list; or
    the section holding it and its own name (`model.tables.1 (t_item): embedding_dim ...`)."""
    parts = list(path)
    while parts:
        if ".".join(map(str, parts)) in message:
            return True
        if len(parts) > 2 and ".".join(map(str, parts[:-1])) in message and str(parts[-1]) in message:
            return True
        if not isinstance(parts[-1], int):
            return False
        parts.pop()  # a list item: naming the list names it
    return False


def _load_or_config_error(path: Path, overrides: list[str], what: str) -> str | None:
    """Load; return None, or the one-line message of the ConfigError it raised. Any other
    exception fails the test showing what was done and the config."""
    try:
        load_config(path, overrides)
        return None
    except ConfigError as exc:
        message = str(exc)
    except Exception as exc:  # the bug this test looks for
        pytest.fail(
            f"{what}: {type(exc).__name__}: {exc}\n--- config ---\n{path.read_text(errors='replace')}"
            f"\n--- overrides --- {overrides}",
            pytrace=False,
        )
    assert "\n" not in message, f"{what}: a ConfigError of several lines:\n{message}"
    return message


def test_mutated_configs_load_or_name_the_key(tmp_path: Path, debug_config: DebugConfig, replay_seed: ReplaySeed) -> None:
    rng = replay_seed.rng()
    path = tmp_path / "job.yaml"
    loaded = refused = 0
    for _ in range(300):
        data = _job(debug_config)
        what, keys = _mutate(data, rng)
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        message = _load_or_config_error(path, [], f"{replay_seed}: {what}")
        if message is None:
            loaded += 1
            continue
        refused += 1
        assert message.startswith(f"{path}: "), f"{replay_seed}: {what}: the error does not name the file: {message}"
        reason = message[len(f"{path}: ") :]
        assert any(_names(reason, k) for k in keys), f"{replay_seed}: {what}: the error does not name the key: {message}"
    assert loaded > 10 and refused > 100, (loaded, refused)  # the mutations reach both outcomes


def test_damaged_config_text_loads_or_is_one_config_error(
    tmp_path: Path, debug_config: DebugConfig, replay_seed: ReplaySeed
) -> None:
    rng = replay_seed.rng()
    text = yaml.safe_dump(_job(debug_config), sort_keys=False).encode()
    path = tmp_path / "job.yaml"
    for _ in range(150):
        data = bytearray(text)
        op = rng.choice(["flip", "flip", "cut", "drop line", "insert"])
        if op == "flip":
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif op == "cut":
            del data[rng.randrange(len(data)) :]
        elif op == "drop line":
            lines = data.split(b"\n")
            del lines[rng.randrange(len(lines))]
            data = bytearray(b"\n".join(lines))
        else:
            at = rng.randrange(len(data))
            data[at:at] = rng.choice([b"\t", b": ", b"- ", b"[", b"{", b"&a ", b"*a", b"!!python/object ", b"\xff", b"\0"])
        path.write_bytes(bytes(data))
        message = _load_or_config_error(path, [], f"{replay_seed}: {op}")
        assert message is None or str(path) in message, f"{replay_seed}: {op}: {message}"


def test_random_overrides_load_or_name_the_key(debug_config: DebugConfig, replay_seed: ReplaySeed) -> None:
    rng = replay_seed.rng()
    keys = [".".join(map(str, p)) for p in _paths(debug_config.raw())]
    keys += ["ckpt." + k for k in CKPT] + ["train.stepz", "model.tables.9.name", "train.steps.x", "run.name.0", "..", "a..b"]
    raws = ["", "1", "-1", "0", "x", "[1, 2]", "{a: 1}", "null", "true", "[", "'", "../x", "1e9", ": :", "{}"]
    for _ in range(200):
        override = f"{rng.choice(keys)}={rng.choice(raws)}" if rng.random() < 0.95 else rng.choice(keys)
        message = _load_or_config_error(
            debug_config.path,
            ["ckpt.enabled=true", "ckpt.sink.kind=filesystem", override],
            f"{replay_seed}: override {override!r}",
        )
        if message is not None:
            parts = override.split("=", 1)[0].split(".")
            # the source (file and overrides) leads most messages; the key must be named after it:
            # all of it, the part of it where it went wrong (`model.tables.9`), or as `_names` says
            reason = message.split("): ", 1)[-1] if message.startswith(str(debug_config.path)) else message
            prefixes = [".".join(parts[:k]) for k in range(min(2, len(parts)), len(parts) + 1)]
            assert any(p in reason for p in prefixes) or _names(reason, tuple(int(p) if p.isdigit() else p for p in parts)), (
                f"{replay_seed}: override {override!r}: the error does not name the key: {message}"
            )


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["ckpt.schedule.interval_steps=0"], "ckpt.schedule.interval_steps"),  # no interval_s either: never a checkpoint
        (["ckpt.schedule.interval_steps=0", "ckpt.schedule.interval_s=-5"], "ckpt.schedule.interval_s"),
        (["ckpt.schedule.interval_steps=-100"], "ckpt.schedule.interval_steps"),
        (["ckpt.encoding.weights=fp7"], "ckpt.encoding.weights"),
        (["ckpt.encoding.optimizer=Asym8"], "ckpt.encoding.optimizer"),
        (["ckpt.encoding.optimizer=asym4"], "ckpt.encoding.optimizer"),  # optimizer state below 8 bits
        (["ckpt.sink.flush_timeout_s=0"], "ckpt.sink.flush_timeout_s"),
        (["ckpt.sink.max_frame_bytes=1000"], "ckpt.sink.max_frame_bytes"),
        (["ckpt.restore.resume=yesterday"], "ckpt.restore.resume"),
        (["ckpt.sink.kind=kafka"], "ckpt.sink.bootstrap_servers"),
        # a dotted librdkafka name on the command line nests: `sasl: {password: x}` is no setting
        (["ckpt.sink.kind=kafka", "ckpt.sink.bootstrap_servers=h:9092", "ckpt.kafka.sasl.password=x"], "ckpt.kafka.sasl"),
    ],
)
def test_a_config_that_makes_checkpoints_impossible_is_refused_at_load(
    overrides: list[str], key: str, debug_config: DebugConfig
) -> None:
    with pytest.raises(ConfigError) as err:
        debug_config.load(["ckpt.enabled=true", "ckpt.sink.kind=filesystem", *overrides])
    assert key in str(err.value) and "\n" not in str(err.value), str(err.value)


# --- frames -------------------------------------------------------------------------------------


def _random_frame(rng: random.Random) -> bytes:
    n = rng.randint(0, 12)
    ids = (
        (torch.arange(n) + rng.randrange(1 << 40))
        if rng.random() < 0.5
        else torch.tensor(rng.sample(range(1 << 20), n), dtype=torch.int64)
    )
    dim = rng.choice([4, 8, 16])
    optim = [OptimState(f"state{i}", rng.randrange(256), torch.rand(n, rng.randint(0, 3))) for i in range(rng.randint(0, 2))]
    return encode_frame(
        run_id=rng.choice(["r", "run-7", "x" * 200]),
        checkpoint_id=rng.randrange(1 << 63),
        rank=rng.randrange(1 << 16),
        table=rng.choice(["t", "t_cat_25", "\u00e9"]),
        col_offset=rng.randrange(1024),
        dim=dim,
        encoding=rng.randrange(256),
        row_ids=ids,
        payload=torch.rand(n, dim),
        optim=optim,
        chunk_index=0,
        chunk_count=rng.randint(1, 9),
    )


def _damage(buf: bytes, rng: random.Random) -> tuple[str, bytes]:
    """Random byte flips (XOR with a non-zero byte: never a no-op), a truncation, an extension
    or a deleted slice."""
    data = bytearray(buf)
    op = rng.choice(["flip", "flip", "cut", "extend", "splice"])
    if op == "flip":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= rng.randint(1, 255)
        if data == buf:  # two flips of one byte that cancel: flip once more
            data[0] ^= 1
    elif op == "cut":
        del data[rng.randrange(len(data)) :]
    elif op == "extend":
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    else:
        at = rng.randrange(len(data))
        del data[at : at + rng.randint(1, 32)]
    return op, bytes(data)


def test_damaged_frames_raise_only_frame_errors_naming_where(replay_seed: ReplaySeed) -> None:
    """The CRC covers every byte before the trailer, and the trailer is compared: any change is
    an error (short of a CRC32 collision, 2**-32), and it names where the frame came from."""
    rng = replay_seed.rng()
    for i in range(400):
        op, bad = _damage(_random_frame(rng), rng)
        where = kafka_where("r.rows.g3", i % 7, i)
        try:
            decode_frame(bad, where=where)
        except FrameError as exc:
            assert str(exc).startswith(where + ": ") and exc.where == where, f"{replay_seed}: {exc}"
            assert "\n" not in str(exc)
            continue
        except Exception as exc:
            pytest.fail(f"{replay_seed}: frame {i} ({op}): {type(exc).__name__}: {exc}", pytrace=False)
        pytest.fail(f"{replay_seed}: frame {i} ({op}): a damaged frame decoded", pytrace=False)


def _reseal(data: bytes) -> bytes:
    return data[:-4] + struct.pack("<I", zlib.crc32(data[:-4]))


def test_forged_frames_with_a_matching_crc_are_refused_or_consistent(replay_seed: ReplaySeed) -> None:
    """Header bytes changed and the CRC recomputed (a writer bug, or a forgery): the checks after
    the CRC refuse the frame, or what decodes is self-consistent."""
    rng = replay_seed.rng()
    decoded = 0
    for i in range(600):
        buf = bytearray(_random_frame(rng))
        header_len = struct.unpack_from("<I", buf, 8)[0]
        for _ in range(rng.randint(1, 3)):
            buf[rng.randrange(4, header_len)] ^= rng.randint(1, 255)  # the magic is checked before the CRC
        try:
            frame = decode_frame(_reseal(bytes(buf)))
        except FrameError:
            continue
        except Exception as exc:
            pytest.fail(f"{replay_seed}: forged frame {i}: {type(exc).__name__}: {exc}", pytrace=False)
        decoded += 1
        n = frame.row_count
        assert frame.payload.shape == (n, frame.row_bytes), replay_seed
        assert all(o.rows.shape[0] == n for o in frame.optim), replay_seed
        assert 0 <= frame.chunk_index < frame.chunk_count, replay_seed
        assert isinstance(frame.run_id, str) and isinstance(frame.table, str)
    assert decoded < 600  # most forgeries are caught


def test_damaged_segment_files_raise_errors_naming_file_and_byte(tmp_path: Path, replay_seed: ReplaySeed) -> None:
    """Filesystem sink: damage anywhere in a segment; reading the acknowledged range raises a
    FrameError or SourceError naming the segment, or returns exactly the frames written (a flip
    in a record's own CRC field, which range reads leave to the frame's CRC)."""
    rng = replay_seed.rng()
    for trial in range(25):
        run = f"seg{trial}"
        sink, source = FsSink(tmp_path, run), FsSource(tmp_path, run)
        frames = [
            encode_frame(
                run_id=run,
                checkpoint_id=1,
                rank=0,
                table="t",
                col_offset=0,
                dim=4,
                encoding=1,
                row_ids=torch.arange(k * 8, k * 8 + 3),
                payload=torch.rand(3, 4),
                chunk_index=k,
                chunk_count=6,
            )
            for k in range(6)
        ]
        for fr in frames:
            sink.write(fr, generation=0, partition=0)
        ((first, last),) = sink.flush().raise_for_error().ranges[(0, 0)]
        sink.close()
        seg = source.segment_path(0, 0)
        op, bad = _damage(seg.read_bytes(), rng)
        seg.write_bytes(bad)
        try:
            got = [bytes(f.payload.numpy()) for _, f in source.read_range(0, 0, first, last)]
        except (FrameError, SourceError) as exc:
            assert str(seg) in str(exc) and "\n" not in str(exc), f"{replay_seed}: {op}: {exc}"
            continue
        except Exception as exc:
            pytest.fail(f"{replay_seed}: segment {trial} ({op}): {type(exc).__name__}: {exc}", pytrace=False)
        assert got == [bytes(decode_frame(fr).payload.numpy()) for fr in frames], f"{replay_seed}: {op}"


# --- markers ------------------------------------------------------------------------------------


def _random_marker(rng: random.Random, cid: int) -> Marker:
    index = [IndexEntry(p, 0, rng.randrange(9), "t", 0, 0, rng.randrange(99), 4) for p in range(rng.randint(0, 3))]
    chain = [
        ChainLink(
            checkpoint_id=c,
            full=c == 1,
            generation=1,
            rows=rng.randrange(1000),
            bytes=rng.randrange(1 << 30),
            ranges={p: [OffsetRange(0, rng.randrange(9))] for p in range(rng.randint(1, 3))},
            index=index,
        )
        for c in range(1, cid + 1)
    ]
    return Marker(
        kind=rng.choice(["commit", "failed"]),
        run_id="r",
        checkpoint_id=cid,
        step=10 * cid,
        world_size=2,
        chain=chain,
        plan={"t": "row_wise"},
        tables={"t": [100, 4]},
        stall_ms=[rng.random()],
    )


def test_damaged_markers_raise_only_marker_errors_naming_the_position(replay_seed: ReplaySeed) -> None:
    """Decoding a damaged marker raises MarkerError alone; folding the log skips it, naming its
    position, and keeps the records around it."""
    rng = replay_seed.rng()
    for i in range(400):
        op, bad = _damage(encode_marker(_random_marker(rng, rng.randint(1, 4))), rng)
        try:
            decode_record(bad)
        except MarkerError as exc:
            assert "\n" not in str(exc), f"{replay_seed}: {exc}"
        except Exception as exc:
            pytest.fail(f"{replay_seed}: marker {i} ({op}): {type(exc).__name__}: {exc}", pytrace=False)
        else:
            pytest.fail(f"{replay_seed}: marker {i} ({op}): a damaged marker decoded", pytrace=False)
        good = encode_marker(_random_marker(rng, 5))
        catalog = Catalog("r").feed([(i, bad), (i + 1, good)])
        assert catalog.damaged == [i] and catalog.last_pos == i + 1, f"{replay_seed}: marker {i} ({op})"
        assert [(p, m) for p, m in commits([(i, bad), (i + 1, good)], "r")] == commits([(i + 1, good)], "r")


def test_forged_marker_bodies_are_refused_or_decode_to_sound_records(replay_seed: ReplaySeed) -> None:
    """A marker body changed and sealed with a matching CRC: any JSON value anywhere, fields
    deleted. Refused with MarkerError, or a record that encodes back and decodes to itself."""
    rng = replay_seed.rng()
    values: list[Any] = [
        None,
        True,
        -1,
        0,
        2**70,
        1.5,
        float("inf"),
        "",
        "x",
        [],
        [1],
        {},
        {"a": 1},
        [[1, 2]],
        "commit",
        "lease",
        "dropped",
    ]
    for i in range(600):
        body = json.loads(encode_marker(_random_marker(rng, rng.randint(1, 3)))[8:])
        path = rng.choice(_paths(body) + [()])
        if not path:
            body = copy.deepcopy(rng.choice(values))
        else:
            parent = body
            for key in path[:-1]:
                parent = parent[key]
            if isinstance(parent, dict) and rng.random() < 0.2:
                del parent[path[-1]]
            else:
                parent[path[-1]] = copy.deepcopy(rng.choice(values))
        raw = json.dumps(body).encode()
        try:
            record = decode_record(struct.pack("<4sI", MARKER_MAGIC, zlib.crc32(raw)) + raw)
        except MarkerError as exc:
            assert "\n" not in str(exc)
            continue
        except Exception as exc:
            pytest.fail(f"{replay_seed}: forged marker {i} ({path}): {type(exc).__name__}: {exc}\n{raw!r}", pytrace=False)
        assert decode_record(encode_marker(record)) == record, f"{replay_seed}: forged marker {i} ({path})"


def test_damaged_markers_log_loses_only_the_damaged_records(tmp_path: Path, replay_seed: ReplaySeed) -> None:
    """Filesystem markers log: reading never fails on damage (docs/design/failures.md). It gives the
    records before the damage and every record that is intact after it (at its new position
    when bytes were inserted or deleted); only damaged records are lost, each with a warning
    naming file and byte, and damage with nothing intact after it reads as a torn tail."""
    rng = replay_seed.rng()
    for trial in range(40):
        log = FsMarkers(tmp_path, f"mk{trial}")
        for c in range(1, 6):
            log.append_marker(encode_marker(_random_marker(rng, c)))
        log.close()
        original = Path(log.path).read_bytes()
        written = FsMarkers(tmp_path, f"mk{trial}").read_markers()
        op, bad = _damage(original, rng)
        if rng.random() < 0.3:  # a damaged length: runs past the end, or ends exactly at the end
            pos, payload = written[rng.randrange(len(written) - 1)]
            length = rng.choice([len(payload) + rng.randint(1, 1 << 20), len(original) - pos - 12])
            op, bad = (
                f"length of the record at {pos} set to {length}",
                original[: pos + 4] + struct.pack("<I", length) + original[pos + 8 :],
            )
        Path(log.path).write_bytes(bad)
        first_change = next((i for i, (a, b) in enumerate(zip(original, bad)) if a != b), min(len(bad), len(original)))
        ends = [pos + 12 + len(payload) for pos, payload in written]  # 12: the record header
        kept = [r for r, end in zip(written, ends) if end <= first_change]
        shift = len(bad) - len(original)
        intact_after = [
            (pos + shift, payload)
            for (pos, payload), end in zip(written, ends)
            if pos >= first_change and bad[pos + shift : end + shift] == original[pos:end]
        ]
        try:
            got = FsMarkers(tmp_path, f"mk{trial}").read_markers()
        except Exception as exc:
            pytest.fail(f"{replay_seed}: markers log {trial} ({op}): {type(exc).__name__}: {exc}", pytrace=False)
        # a damaged record between them may still hold its own intact bytes elsewhere: only order matters
        assert got[: len(kept)] == kept, f"{replay_seed}: {op} at byte {first_change}: records before the damage lost"
        assert [r for r in got if r in intact_after] == intact_after, (
            f"{replay_seed}: {op} at byte {first_change}: intact records after the damage lost"
        )
        assert {p for p, _ in got} <= {p for p, _ in kept} | {p for p, _ in intact_after}, (
            f"{replay_seed}: {op}: a record read that was never written whole"
        )


def test_a_damaged_record_mid_log_is_skipped_by_readers_and_the_next_writer_cuts_nothing(tmp_path: Path, caplog) -> None:
    """A length that runs past the end of the file looks like a torn tail from its header; with
    complete records after it, it is damage: readers skip to the next intact record with a
    warning naming the file and byte, and a writer appends after the last record instead of
    cutting the records after the damage (as it cuts a real torn tail). A CRC failure in the
    middle is skipped the same way."""
    log = FsMarkers(tmp_path, "mk")
    records = [encode_marker(_random_marker(random.Random(c), c)) for c in (1, 2, 3, 4)]
    positions = [log.append_marker(r) for r in records]
    log.close()
    data = bytearray(Path(log.path).read_bytes())
    struct.pack_into("<I", data, positions[1] + 4, len(data))  # record 2's length now runs past the end
    data[positions[2] + 20] ^= 0xFF  # record 3's body fails its CRC
    Path(log.path).write_bytes(bytes(data))
    assert FsMarkers(tmp_path, "mk").read_markers() == [(positions[0], records[0]), (positions[3], records[3])]
    messages = "\n".join(r.getMessage() for r in caplog.records)
    assert f"{log.path} at byte {positions[1]}: record length {len(data)} runs past the end" in messages
    assert (
        f"skipped {positions[3] - positions[1]} damaged bytes, the next intact record starts at byte {positions[3]}" in messages
    )
    fifth = encode_marker(_random_marker(random.Random(5), 5))
    at = FsMarkers(tmp_path, "mk").append_marker(fifth)
    assert at == len(data) and Path(log.path).read_bytes() == bytes(data) + Path(log.path).read_bytes()[len(data) :]
    assert FsMarkers(tmp_path, "mk").read_markers()[-1] == (at, fifth)


# --- Criteo input -------------------------------------------------------------------------------


CATS = [f"C{i}" for i in range(1, 27)]


def _valid_line(rng: random.Random) -> bytes:
    dense = [rng.choice(["", str(rng.randint(-5, 10**6))]) for _ in range(13)]
    cats = [rng.choice(["", f"{rng.randrange(1 << 32):x}"]) for _ in range(26)]
    return "\t".join([rng.choice("01"), *dense, *cats]).encode()


def _garbage_line(rng: random.Random) -> bytes:
    line = bytearray(_valid_line(rng))
    op = rng.randrange(6)
    if op == 0:  # random bytes (never a newline: one line stays one line)
        return bytes(rng.choice([b for b in range(256) if b != 10]) for _ in range(rng.randint(0, 80)))
    if op == 1:  # a byte replaced
        line[rng.randrange(len(line))] = rng.choice(b"\t\r\0 x-.\xff\xe9Gg")
    elif op == 2:  # a field dropped or doubled
        fields = bytes(line).split(b"\t")
        at = rng.randrange(len(fields))
        fields[at : at + 1] = [] if rng.random() < 0.5 else [fields[at]] * 2
        return b"\t".join(fields)
    elif op == 3:  # cut short
        del line[rng.randrange(len(line)) :]
    elif op == 4:  # a huge field
        fields = bytes(line).split(b"\t")
        fields[rng.randrange(len(fields))] = rng.choice([b"9" * 400, b"f" * 400, b"-" * 3, b"\xff\xfe" * 20])
        return b"\t".join(fields)
    else:
        return rng.choice([b"", b"\t" * 39, b"\r", b"label\tI1", "\u00e9".encode() * 40])
    return bytes(line)


def _reader(path: str, **kw: Any) -> CriteoTsvReader:
    return CriteoTsvReader(
        paths=[path],
        feature_names=CATS,
        num_embeddings=[1000] * 26,
        batch_size=kw.pop("batch_size", 3),
        rank=0,
        world_size=1,
        **kw,
    )


def test_criteo_garbage_lines_stop_with_file_and_line_or_are_counted_skips(tmp_path: Path, replay_seed: ReplaySeed) -> None:
    """Byte-level garbage (random bytes, NUL, non-UTF-8, huge or missing fields) mixed into valid
    lines: `stop` raises `path:line: reason` for the first bad line (the reason `diagnose_line`
    gives), `skip` yields exactly the valid lines in one epoch and counts the others."""
    rng = replay_seed.rng()
    for trial in range(30):
        lines = [_garbage_line(rng) if rng.random() < 0.25 else _valid_line(rng) for _ in range(rng.randint(0, 40))]
        lines.append(_valid_line(rng))  # one batch of every valid line then reads the whole file
        path = tmp_path / f"day_{trial}.tsv"
        path.write_bytes(b"\n".join(lines) + b"\n")
        bad = [i + 1 for i, text in enumerate(lines) if diagnose_line(text) is not None]
        labels = [float(text[:1]) for text in lines if diagnose_line(text) is None]
        what = f"{replay_seed}: file {trial}, bad lines {bad}"
        try:
            stop = _reader(str(path))
            while stop.state_dict()["epoch"] == 0:
                stop.next_batch()
            assert not bad, f"{what}: read a whole epoch past a bad line"
        except MalformedLineError as exc:
            assert bad and str(exc) == f"{path}:{bad[0]}: {diagnose_line(lines[bad[0] - 1])}", f"{what}: {exc}"
        except Exception as exc:
            pytest.fail(f"{what}: {type(exc).__name__}: {exc}", pytrace=False)
        try:
            skip = _reader(str(path), batch_size=len(labels), on_malformed="skip")
            batch = skip.next_batch()
        except Exception as exc:
            pytest.fail(f"{what} (skip): {type(exc).__name__}: {exc}", pytrace=False)
        assert batch.labels.tolist() == labels and skip.skipped_lines == len(bad), what
        assert skip.state_dict()["epoch"] == 1 and skip.state_dict()["byte_offset"] == 0, what  # one pass, no more
