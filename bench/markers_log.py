"""A restore's choice of checkpoint against the length of the markers log: folding the whole
log (`ckpt.log.catalog.read_catalog`) against folding it from its newest catalog record
(`ckpt.log.catalog_record.read_recent_catalog`), on the embedded broker and on files.

    python -m bench.run --suite markers [--commits 100,1000,10000] [--repeats 5] [--sinks kafka,fs]
                                        [--out results.json]

The log is what a job of the full suite's shape leaves: COMMIT markers of the default policy
(a full link and a delta, each indexing 40 shard runs on each of 2 ranks of 26 tables), each
after the LINK record of its own link (ckpt/log/links.py), and
a catalog record every `--catalog-every` records, as the
trainer's committer appends them. It grows to each length of `--commits` in turn; at each, a
fresh reader (connected first, as the checkpointer connects while it is built) reads the
log and lists the restorable checkpoints, both ways alternating, `--repeats` times each.
Figures: median seconds per way and their ratio, records decoded, and that both ways chose
the same checkpoint.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import median
from typing import Any

from bench.common import Measurement, document_head, log, machine_info, scalars
from ckpt.log.catalog import Catalog, read_catalog
from ckpt.log.catalog_record import read_recent_catalog, summarize
from ckpt.log.links import append_with_link
from ckpt.log.markers import ChainLink, IndexEntry, Marker, OffsetRange, encode_marker
from ckpt.stream.filesystem import FsMarkers
from ckpt.stream.kafka import KafkaMarkers
from ckpt.stream.sink import MarkerLog
from launch.broker import EmbeddedBroker

RUN = "markers-bench"
TABLES = 26
INDEX_PER_RANK = 40


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--commits", default="100,1000,10000", help="log lengths (COMMIT markers), comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sinks", default="kafka,fs", help="kafka (the embedded broker), fs (files), or both")
    p.add_argument("--catalog-every", type=int, default=32, help="as ckpt.sink.catalog_every")
    p.add_argument("--out", type=Path)
    return p


def _link(cid: int, base: int, full: bool) -> ChainLink:
    index = [
        IndexEntry(rank, 1000 * cid + i, 1000 * cid + i + 3, f"t_{i % TABLES}", 0, 0, 200_000, 64)
        for rank in range(2)
        for i in range(INDEX_PER_RANK)
    ]
    return ChainLink(
        checkpoint_id=cid,
        full=full,
        generation=base,
        rows=123_456,
        bytes=78_000_000,
        epoch=1,
        ranges={rank: [OffsetRange(1000 * cid, 1000 * cid + 400)] for rank in range(2)},
        index=index,
    )


def _commit(cid: int) -> Marker:
    """The default policy's marker: a full checkpoint every tenth, a delta of it otherwise."""
    base = max(1, cid - (cid - 1) % 10)
    chain = [_link(base, base, True)] + ([_link(cid, base, False)] if cid != base else [])
    return Marker(
        kind="commit",
        run_id=RUN,
        checkpoint_id=cid,
        step=170 * cid,
        world_size=2,
        chain=chain,
        policy="intermittent_diff",
        plan={f"t_{i}": "row_wise" for i in range(TABLES)},
        tables={f"t_{i}": [200_000, 64] for i in range(TABLES)},
        encodings={"weights": "adaptive4", "optimizer": "fp32"},
        dense={"path": f"/runs/x/dense/ckpt_{cid}.pt", "sha256": "ab" * 32, "bytes": 123_456},
        stall_ms=[30.0, 31.0],
        attempt="host:1:abcd",
        created_unix=1.7e9 + cid,
    )


class _Recorder:
    """Appends to a markers log and keeps what it appended, for the writer's own fold."""

    def __init__(self, markers: MarkerLog) -> None:
        self.markers, self.appended = markers, []

    def append_marker(self, payload: bytes) -> int:
        pos = self.markers.append_marker(payload)
        self.appended.append((pos, payload))
        return pos

    def append_markers(self, payloads: Sequence[bytes]) -> list[int]:
        positions = self.markers.append_markers(payloads)
        self.appended.extend(zip(positions, payloads))
        return positions


class _Writer:
    """Appends commits and, as the committer does, a catalog record every `every` records."""

    def __init__(self, markers: MarkerLog, every: int) -> None:
        self.markers, self.every = markers, every
        self.fold = Catalog(RUN)
        self.commits = 0
        self.records = 0

    def grow_to(self, commits: int) -> None:
        while self.commits < commits:
            self.commits += 1
            records = _Recorder(self.markers)
            append_with_link(records, _commit(self.commits), "host:1:abcd")  # as the committer writes it
            self.fold.feed(records.appended)
            self.records += len(records.appended)
            if self.fold.since_summary >= self.every:
                summary = encode_marker(summarize(self.fold))
                self.fold.feed([(self.markers.append_marker(summary), summary)])
                self.records += 1


def _timed(open_reader: Callable[[], MarkerLog], read: Callable[[MarkerLog, str], Catalog]) -> tuple[float, int, int]:
    """Seconds to read the log and list what is restorable, records decoded, the newest id."""
    reader = open_reader()
    try:
        reader.check_reachable(30.0)  # connected, as a restore's reader is
        t0 = time.perf_counter()
        catalog = read(reader, RUN)
        newest = catalog.restorable()[0].checkpoint_id
        return time.perf_counter() - t0, catalog.read, newest
    finally:
        reader.close()


def _measure(
    sink: str, open_reader: Callable[[], MarkerLog], writer: _Writer, lengths: list[int], repeats: int
) -> list[dict[str, Any]]:
    rows = []
    for n in lengths:
        writer.grow_to(n)
        whole: list[float] = []
        recent: list[float] = []
        for _ in range(repeats):
            s_whole, read_whole, newest_whole = _timed(open_reader, read_catalog)
            s_recent, read_recent, newest_recent = _timed(open_reader, read_recent_catalog)
            whole.append(s_whole)
            recent.append(s_recent)
        row = {
            "sink": sink,
            "commits": n,
            "records": writer.records,
            "whole_s": median(whole),
            "recent_s": median(recent),
            "speedup": median(whole) / median(recent),
            "whole_records_read": read_whole,
            "recent_records_read": read_recent,
            "same_checkpoint": newest_whole == newest_recent == n,
        }
        log(
            f"{sink} {n} commits ({writer.records} records): whole log {row['whole_s'] * 1e3:.1f} ms, from the "
            f"newest catalog record {row['recent_s'] * 1e3:.1f} ms ({row['speedup']:.1f}x; {read_recent} records "
            f"decoded against {read_whole})"
        )
        rows.append(row)
    return rows


def run(argv: list[str], prog: str = "python -m bench.run --suite markers") -> dict[str, Any]:
    args = parser(prog).parse_args(argv)
    lengths = sorted(int(x) for x in args.commits.split(","))
    sinks = args.sinks.split(",")
    machine = machine_info()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="markers-bench-") as tmp:
        if "fs" in sinks:
            rows += _measure(
                "fs", lambda: FsMarkers(tmp, RUN), _Writer(FsMarkers(tmp, RUN), args.catalog_every), lengths, args.repeats
            )
        if "kafka" in sinks:
            with EmbeddedBroker() as broker:
                conf = {"bootstrap.servers": broker.bootstrap}
                writer = _Writer(KafkaMarkers(RUN, conf, timeout_s=30.0), args.catalog_every)
                rows += _measure("kafka", lambda: KafkaMarkers(RUN, conf, timeout_s=30.0), writer, lengths, args.repeats)
    result = {
        **document_head("markers", prog, argv, machine),
        "settings": {"commits": lengths, "repeats": args.repeats, "catalog_every": args.catalog_every},
        "rows": rows,
    }
    print("| sink | commits | records | whole log | from the newest catalog record | speedup | records decoded |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(
            f"| {r['sink']} | {r['commits']:,} | {r['records']:,} | {r['whole_s'] * 1e3:.1f} ms | "
            f"{r['recent_s'] * 1e3:.1f} ms | {r['speedup']:.1f}x | {r['recent_records_read']} of "
            f"{r['whole_records_read']} |"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


def measurements(result: dict[str, Any]) -> list[Measurement]:
    """One record per figure of each (sink, log length)."""
    out = []
    for r in result["rows"]:
        out += scalars(
            {k: v for k, v in r.items() if k not in ("sink", "commits")},
            {"sink": r["sink"], "commits": r["commits"]},
            units={"speedup": "x", "records": "records"},
        )
    return out
