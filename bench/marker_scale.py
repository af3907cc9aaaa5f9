"""The markers log at scale: marker bytes and the log's fold time against the job's shape (ranks x
tables, up to 1,024 x 1,000) and against the chain's length (up to 10,000 one-step links).

    python -m bench.run --suite marker-scale [--shapes 2x8,8x26,...] [--chains 10,100,1000,10000]
                                             [--chain-shape 8x26] [--out results.json]

Writers are simulated: each link indexes one run of frames per (rank, table), what a row-wise
plan's full checkpoint writes. Shapes: one full checkpoint written as the committer writes it
(`ckpt.log.links.append_with_link`: its link's records, then the COMMIT naming them); figures: the
COMMIT's bytes, the link's records and the largest, what the same marker weighs with its chain
inline (format 1), and the time to fold the log and list what is restorable. Chains: a full
checkpoint and n - 1 one-step deltas, each a marker naming its chain, with a catalog record every
32 records as the committer appends them; figures: the last COMMIT's bytes against format 1's,
the whole log's fold and a restore's fold from the newest catalog record. The log lives in memory:
these are the fold's costs, not a broker's (`--suite markers` reads real logs).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.common import Measurement, document_head, log, machine_info, scalars
from ckpt.log.catalog import Catalog
from ckpt.log.catalog_record import read_recent_catalog, summarize
from ckpt.log.links import append_with_link, link_records
from ckpt.log.markers import ChainLink, IndexEntry, Marker, OffsetRange, encode_marker
from ckpt.stream.sink import TailRead

RUN = "marker-scale"
#: Kafka's default limit on a produced message (librdkafka's message.max.bytes)
KAFKA_LIMIT = 1_000_000


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="2x8,8x26,64x26,256x100,1024x100,1024x1000", help="ranks x tables, comma-separated")
    p.add_argument("--chains", default="10,100,1000,10000", help="chain lengths (links), comma-separated")
    p.add_argument("--chain-shape", default="8x26", help="ranks x tables of the chain rows")
    p.add_argument("--catalog-every", type=int, default=32, help="as ckpt.sink.catalog_every")
    p.add_argument("--out", type=Path)
    return p


class MemoryMarkers:
    """A markers log in memory, positions counting records (as a Kafka offset does)."""

    def __init__(self) -> None:
        self.records: list[tuple[int, bytes]] = []

    def append_marker(self, payload: bytes) -> int:
        self.records.append((len(self.records), payload))
        return len(self.records) - 1

    def append_markers(self, payloads: Sequence[bytes]) -> list[int]:
        return [self.append_marker(p) for p in payloads]

    def read_markers(self, start: int = 0) -> list[tuple[int, bytes]]:
        return self.records[start:]

    def read_tail(self, records: int) -> TailRead:
        return TailRead(self.records[-records:], len(self.records) <= records)

    def prepare(self, timeout_s: float) -> None: ...
    def check_reachable(self, timeout_s: float) -> None: ...
    def close(self) -> None: ...


def _shape(text: str) -> tuple[int, int]:
    ranks, tables = text.split("x")
    return int(ranks), int(tables)


def _link(cid: int, full: bool, ranks: int, tables: int) -> ChainLink:
    return ChainLink(
        checkpoint_id=cid,
        full=full,
        generation=1,
        ranges={r: [OffsetRange(10_000 * cid, 10_000 * cid + tables)] for r in range(ranks)},
        rows=1_000 * ranks * tables,
        bytes=4_096 * ranks * tables,
        index=[
            IndexEntry(r, 10_000 * cid + t, 10_000 * cid + t + 2, f"table_{t:04d}", 0, 1_000 * r, 1_000 * r + 999, 128)
            for r in range(ranks)
            for t in range(tables)
        ],
        epoch=1,
    )


def _marker(chain: list[ChainLink], ranks: int, tables: int) -> Marker:
    cid = chain[-1].checkpoint_id
    return Marker(
        kind="commit",
        run_id=RUN,
        checkpoint_id=cid,
        step=cid,
        world_size=ranks,
        chain=chain,
        policy="incremental",
        plan={f"table_{t:04d}": "row_wise" for t in range(tables)},
        tables={f"table_{t:04d}": [1_000 * ranks, 128] for t in range(tables)},
        encodings={"weights": "adaptive4", "optimizer": "fp32"},
        dense={"path": f"/runs/x/dense/ckpt_{cid}.pt", "sha256": "ab" * 32, "bytes": 123_456},
        stall_ms=[12.5] * ranks,
        attempt="host:1:abcd",
        created_unix=1.7e9 + cid,
    )


def shape_row(ranks: int, tables: int) -> dict[str, Any]:
    """One full checkpoint of `ranks` x `tables` written by reference, then folded."""
    link = _link(1, True, ranks, tables)
    marker = _marker([link], ranks, tables)
    inline = len(encode_marker(replace(marker, format=1)))
    markers = MemoryMarkers()
    t0 = time.perf_counter()
    append_with_link(markers, marker, "host:1:abcd")
    write_s = time.perf_counter() - t0
    sizes = [len(data) for _, data in markers.records]
    t0 = time.perf_counter()
    found = Catalog(RUN).feed(markers.records).restorable()
    fold_s = time.perf_counter() - t0
    row = {
        "ranks": ranks,
        "tables": tables,
        "index_entries": len(link.index),
        "commit_bytes": sizes[-1],
        "link_records": len(sizes) - 1,
        "largest_link_record_bytes": max(sizes[:-1]),
        "link_bytes": sum(sizes[:-1]),
        "inline_commit_bytes": inline,
        "under_kafka_limit": max(sizes) < KAFKA_LIMIT,
        "write_s": write_s,
        "fold_s": fold_s,
        "joined_exactly": len(found) == 1 and list(found[0].chain) == [link],
    }
    log(
        f"{ranks} x {tables}: COMMIT {sizes[-1]:,} B (inline {inline:,} B), {len(sizes) - 1} link records of at most "
        f"{max(sizes[:-1]):,} B, fold {fold_s:.3f} s"
    )
    return row


def chain_rows(lengths: list[int], ranks: int, tables: int, every: int) -> list[dict[str, Any]]:
    """One log grown to each length in turn: a full checkpoint, then one-step deltas."""
    markers, fold, rows = MemoryMarkers(), Catalog(RUN), []
    since = 0
    for cid in range(1, max(lengths) + 1):
        n = len(markers.records)
        own = _link(cid, cid == 1, ranks, tables)
        link_at = [markers.append_marker(encode_marker(r)) for r in link_records(own, run_id=RUN, writer="host:1:abcd")]
        # the marker `append_with_link` writes for the chain [1, 2, .., cid], without building that chain
        named = replace(_marker([own], ranks, tables), base=[1, 1], links=[[2, cid]] if cid > 1 else [], link_at=link_at)
        markers.append_marker(encode_marker(named))
        fold.feed(markers.records[n:])
        since += 1
        if since >= every:
            markers.append_marker(encode_marker(summarize(fold)))
            since = 0
        if cid in lengths:
            rows.append(_chain_row(markers, named, ranks, tables))
    return rows


def _chain_row(markers: MemoryMarkers, named: Marker, ranks: int, tables: int) -> dict[str, Any]:
    cid = named.checkpoint_id
    t0 = time.perf_counter()
    whole = Catalog(RUN).feed(markers.records)
    newest = whole.restorable()[0]
    whole_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    recent = read_recent_catalog(markers, RUN)
    recent_newest = recent.restorable()[0]
    recent_s = time.perf_counter() - t0
    one_link = len(encode_marker(replace(_marker([_link(cid, False, ranks, tables)], ranks, tables), format=1)))
    inline = len(encode_marker(replace(_marker(list(newest.chain), ranks, tables), format=1)))
    row = {
        "links": cid,
        "records": len(markers.records),
        "commit_bytes": len(encode_marker(named)),
        "inline_commit_bytes": inline,
        "inline_one_link_bytes": one_link,
        "whole_fold_s": whole_s,
        "whole_fold_us_per_link": whole_s / cid * 1e6,
        "recent_fold_s": recent_s,
        "recent_records_read": recent.read,
        "chains_whole": len(newest.chain) == cid and recent_newest.chain == newest.chain,
    }
    log(
        f"{cid} links: COMMIT {row['commit_bytes']:,} B (inline {inline:,} B), whole fold {whole_s:.3f} s, "
        f"from the newest catalog record {recent_s * 1e3:.1f} ms ({recent.read} records)"
    )
    return row


def run(argv: list[str], prog: str = "python -m bench.run --suite marker-scale") -> dict[str, Any]:
    args = parser(prog).parse_args(argv)
    shapes = [_shape(s) for s in args.shapes.split(",")]
    lengths = sorted(int(x) for x in args.chains.split(","))
    ranks, tables = _shape(args.chain_shape)
    result = {
        **document_head("marker-scale", prog, argv, machine_info()),
        "settings": {
            "shapes": args.shapes,
            "chains": lengths,
            "chain_shape": args.chain_shape,
            "catalog_every": args.catalog_every,
        },
        "shapes": [shape_row(r, t) for r, t in shapes],
        "chains": chain_rows(lengths, ranks, tables, args.catalog_every),
    }
    print("| ranks x tables | index entries | COMMIT | link records (largest) | inline (format 1) | fold |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in result["shapes"]:
        print(
            f"| {r['ranks']:,} x {r['tables']:,} | {r['index_entries']:,} | {r['commit_bytes'] / 1e6:.3f} MB | "
            f"{r['link_records']} ({r['largest_link_record_bytes'] / 1e6:.3f} MB) | {r['inline_commit_bytes'] / 1e6:.3f} MB | "
            f"{r['fold_s']:.3f} s |"
        )
    print(f"\n| links ({args.chain_shape}) | COMMIT | inline (format 1) | whole log's fold | from the newest catalog record |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in result["chains"]:
        print(
            f"| {r['links']:,} | {r['commit_bytes']:,} B | {r['inline_commit_bytes'] / 1e6:.2f} MB | {r['whole_fold_s']:.3f} s "
            f"({r['whole_fold_us_per_link']:.0f} us/link) | {r['recent_fold_s'] * 1e3:.1f} ms |"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


def measurements(result: dict[str, Any]) -> list[Measurement]:
    out = []
    for r in result["shapes"]:
        out += scalars({k: v for k, v in r.items() if k not in ("ranks", "tables")}, {"ranks": r["ranks"], "tables": r["tables"]})
    for r in result["chains"]:
        out += scalars({k: v for k, v in r.items() if k != "links"}, {"links": r["links"]})
    return out
