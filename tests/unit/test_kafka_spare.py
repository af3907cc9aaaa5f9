"""The connected consumer a Kafka reader keeps for its next read (`ckpt.stream.kafka.consumer._ConnectAhead`)
and the topic listing it carries, with stand-in consumers: no broker needed."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError, KafkaException

from ckpt.stream.kafka import consumer as kafka_consumer
from ckpt.stream.kafka.consumer import _ConnectAhead, _ConnectedConsumer, _topics_for
from ckpt.stream.sink import SourceError


class FakeConsumer:
    def __init__(self, topics: dict[str, int] | None = None) -> None:
        self.closed = 0
        self.listings = 0
        self.topics = topics or {}

    def close(self) -> None:
        self.closed += 1

    def list_topics(self, timeout: float) -> SimpleNamespace:
        self.listings += 1
        return SimpleNamespace(
            topics={name: SimpleNamespace(partitions=list(range(n)), error=None) for name, n in self.topics.items()}
        )


def done(consumer: FakeConsumer) -> Future:
    f: Future = Future()
    f.set_result(_ConnectedConsumer(consumer, {}))
    return f


def test_a_spare_is_taken_once_and_a_replaced_or_untaken_one_is_closed() -> None:
    spare = _ConnectAhead()
    assert spare.take() is None
    a, b, c = FakeConsumer(), FakeConsumer(), FakeConsumer()
    spare.put(done(a))
    spare.put(done(b))  # a second prepare: the first consumer goes
    assert (a.closed, b.closed) == (1, 0)
    assert spare.take().consumer is b
    assert spare.take() is None
    assert b.closed == 0  # the reader that took it closes it
    spare.put(done(c))
    spare.close()
    assert c.closed == 1


def test_a_spare_still_connecting_is_closed_when_its_connect_ends() -> None:
    spare, pending, late = _ConnectAhead(), Future(), FakeConsumer()
    spare.put(pending)
    spare.close()  # returns at once, not after the connect's timeout
    assert late.closed == 0
    pending.set_result(_ConnectedConsumer(late, {}))
    assert late.closed == 1


def test_a_failed_connect_is_raised_to_the_reader_that_takes_it() -> None:
    spare, failed = _ConnectAhead(), Future()
    failed.set_exception(KafkaException(KafkaError(KafkaError._TRANSPORT)))
    spare.put(failed)
    with pytest.raises(KafkaException):
        spare.take()
    assert spare.take() is None
    spare.put(failed)
    spare.close()  # nothing to close, nothing raised


def test_a_spare_listing_is_trusted_for_topics_it_names_and_refreshed_for_one_it_lacks() -> None:
    client = FakeConsumer({"run.rows.g0": 2, "run.rows.g1": 2})
    spare = _ConnectedConsumer(client, {"run.rows.g0": 2})
    admin = FakeConsumer({"run.rows.g0": 2})
    assert _topics_for(spare, admin, ["run.rows.g0"], 1.0) == {"run.rows.g0": 2}
    assert client.listings == 0
    assert _topics_for(spare, admin, ["run.rows.g0", "run.rows.g1"], 1.0) == {"run.rows.g0": 2, "run.rows.g1": 2}
    assert (client.listings, admin.listings, client.closed) == (1, 0, 0)
    assert _topics_for(None, admin, ["run.rows.g0"], 1.0) == {"run.rows.g0": 2}  # no spare: the admin client
    assert admin.listings == 1


def test_a_spare_whose_listing_fails_is_closed() -> None:
    class Failing(FakeConsumer):
        def list_topics(self, timeout: float) -> SimpleNamespace:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT))

    client = Failing()
    with pytest.raises(SourceError, match="cannot list topics"):
        _topics_for(_ConnectedConsumer(client, {}), FakeConsumer(), ["run.markers"], 1.0)
    assert client.closed == 1


@pytest.mark.parametrize("user", [{}, {"enable.sparse.connections": True}])
def test_a_spare_connects_to_the_named_brokers_at_once_unless_the_user_says_otherwise(
    monkeypatch: pytest.MonkeyPatch, user: dict
) -> None:
    made: list[dict] = []

    class Recording(FakeConsumer):
        def __init__(self, conf: dict) -> None:
            super().__init__({"run.markers": 1})
            made.append(conf)

    monkeypatch.setattr(kafka_consumer, "Consumer", Recording)
    connected = kafka_consumer._connect({"bootstrap.servers": "127.0.0.1:9", **user}, 1.0)
    assert connected.topics == {"run.markers": 1}
    assert made[0]["enable.sparse.connections"] is user.get("enable.sparse.connections", False)
    assert made[0]["bootstrap.servers"] == "127.0.0.1:9"
