"""The markers log at the scale of a thousand-GPU job: a full checkpoint of 1,024 ranks x 1,000
tables commits under Kafka's default message limit (the unit tests hold the rest:
tests/unit/test_links.py)."""

from __future__ import annotations

from ckpt.log.catalog import Catalog
from ckpt.log.links import PART_BYTES, append_with_link
from tests.unit.test_catalog_record import MemoryLog
from tests.unit.test_links import RUN, _link, _marker

#: Kafka's default limit on a produced message (librdkafka's message.max.bytes)
KAFKA_LIMIT = 1_000_000


def test_a_full_checkpoint_of_1024_ranks_by_1000_tables_commits_under_the_broker_limit() -> None:
    """One index entry per (rank, table), a million in all: every record written is under
    Kafka's default message limit, the marker itself a small part of it, and the fold joins the
    link back entry for entry."""
    link = _link(1, 1, True, ranks=1024, tables=1000)
    marker = _marker([link], ranks=1024, tables=1000)
    log = MemoryLog()
    append_with_link(log, marker, "host:1:abcd")
    sizes = [len(data) for _, data in log.records]
    assert max(sizes) < KAFKA_LIMIT and len(sizes) > 40, (len(sizes), max(sizes))
    assert sizes[-1] < 150_000  # the COMMIT: its plan, table shapes and stalls, linear in ranks + tables
    assert max(sizes[:-1]) <= PART_BYTES + 32 * 1024
    fold = Catalog(RUN).feed(log.records)
    (restored,) = fold.restorable()
    assert restored.chain == [link]
