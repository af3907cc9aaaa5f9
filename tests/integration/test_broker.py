from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from launch.broker import BrokerError, EmbeddedBroker, pid_alive

if TYPE_CHECKING:
    from tests.conftest import CliResult, CliRunner

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
def cli(run_cli: CliRunner) -> Callable[..., CliResult]:
    """`cli(*args, state_dir=..., expect_rc=None)`: `deltarec-broker` on one state dir; the tests
    check the exit status themselves (3 is "not running")."""

    def call(*args: str, state_dir: Path, expect_rc: int | None = None) -> CliResult:
        return run_cli("launch.broker", *args, "--state-dir", state_dir, expect_rc=expect_rc, timeout_s=60)

    return call


def answers(bootstrap: str) -> bool:
    """Does a Kafka Metadata request to ``bootstrap`` succeed (within 3 s)?"""
    admin = AdminClient({"bootstrap.servers": bootstrap, "logger": logging.getLogger("test.kafka")})
    try:
        admin.list_topics(timeout=3)
        return True
    except KafkaException:
        return False


def test_cli_start_status_stop(tmp_path, cli):
    state = tmp_path / "broker"
    r = cli("status", state_dir=state)
    assert (r.rc, r.stdout.strip()) == (3, "not running")

    r = cli("start", state_dir=state)
    try:
        assert r.rc == 0, r.stderr
        bootstrap = r.stdout.strip()
        host, port = bootstrap.rsplit(":", 1)
        assert host == "127.0.0.1"
        rec = json.loads((state / "broker.json").read_text())
        assert rec["bootstrap"] == bootstrap and rec["port"] == int(port) and pid_alive(rec["pid"])
        assert Path(rec["log"]).exists()
        assert answers(bootstrap)  # detached: outlived the CLI process and serves Kafka

        r2 = cli("start", state_dir=state)
        assert r2.rc == 0 and r2.stdout.strip() == bootstrap
        assert "already running" in r2.stderr

        r = cli("status", state_dir=state)
        assert r.rc == 0
        assert r.stdout.strip() == f"running {bootstrap} pid {rec['pid']}"
    finally:
        r = cli("stop", state_dir=state)
    assert r.rc == 0 and r.stdout.strip() == f"stopped pid {rec['pid']}"
    assert not pid_alive(rec["pid"])
    assert not (state / "broker.json").exists()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=3).close()
    assert cli("status", state_dir=state).rc == 3
    r = cli("stop", state_dir=state)  # idempotent
    assert (r.rc, r.stdout.strip()) == (0, "not running")


@pytest.mark.parametrize("who", ["dead pid", "reused pid"])
def test_cli_stale_record_is_detected_and_cleaned(tmp_path, who, cli):
    state = tmp_path / "broker"
    state.mkdir()
    if who == "dead pid":
        p = subprocess.Popen([sys.executable, "-c", "pass"])
        p.wait()
        pid = p.pid
    else:  # a live process that is not our broker (pid reused after a reboot)
        pid = os.getpid()
    (state / "broker.json").write_text(json.dumps({"bootstrap": "127.0.0.1:9", "port": 9, "pid": pid}))
    r = cli("status", state_dir=state)
    assert r.rc == 3 and "stale" in r.stderr
    assert not (state / "broker.json").exists()
    assert pid_alive(os.getpid())  # status never signals a pid it does not own

    (state / "broker.json").write_text(json.dumps({"bootstrap": "127.0.0.1:9", "port": 9, "pid": pid}))
    r = cli("start", state_dir=state)
    try:
        assert r.rc == 0 and "stale" in r.stderr
        assert r.stdout.strip() != "127.0.0.1:9" and answers(r.stdout.strip())
    finally:
        assert cli("stop", state_dir=state).rc == 0


def test_cli_start_on_a_busy_port_fails_clearly(tmp_path, cli):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = cli("start", "--port", str(port), state_dir=tmp_path)
    assert r.rc == 1
    assert len(r.stderr.strip().splitlines()) == 1 and "address in use" in r.stderr
    assert not (tmp_path / "broker.json").exists()


def test_python_api_round_trip(broker, unique_name):
    topic = unique_name("api")
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])[topic].result(10)
    got_offsets = []
    p = Producer({"bootstrap.servers": broker.bootstrap, "enable.idempotence": True, "acks": "all"})
    for i in range(6):
        p.produce(
            topic,
            f"v{i}".encode(),
            partition=i % 2,
            on_delivery=lambda err, m: got_offsets.append((err, m.partition(), m.offset())),
        )
    assert p.flush(10) == 0
    assert sorted(got_offsets) == [(None, 0, 0), (None, 0, 1), (None, 0, 2), (None, 1, 0), (None, 1, 1), (None, 1, 2)]
    c = Consumer(
        {
            "bootstrap.servers": broker.bootstrap,
            "group.id": unique_name("g"),
            "enable.partition.eof": True,
            "auto.offset.reset": "error",
        }
    )
    c.assign([TopicPartition(topic, 1, 1)])
    values = []
    while True:
        m = c.poll(10)
        assert m is not None, "no end-of-partition event"
        if m.error():
            assert m.error().code() == KafkaError._PARTITION_EOF and m.offset() == 3
            break
        values.append((m.offset(), m.value()))
    c.close()
    assert values == [(1, b"v3"), (2, b"v5")]


def test_embedded_broker_lifecycle_and_errors(tmp_path):
    b = EmbeddedBroker(state_dir=tmp_path / "b")
    with b:
        pid, port = b.pid, b.port
        assert b.bootstrap == f"127.0.0.1:{port}" and answers(b.bootstrap)
        assert b.log_path.exists()
        with pytest.raises(BrokerError, match="address in use"):
            EmbeddedBroker(port=port).start()
        b.kill()
        assert not pid_alive(pid) and not b.alive()
    # the same port can be served again at once (what a broker restart looks like)
    with EmbeddedBroker(port=port) as again:
        assert answers(again.bootstrap)

    bad = tmp_path / "not-tansu"
    bad.write_text("#!/bin/sh\necho 'boom: cannot start' >&2\nexit 7\n")
    bad.chmod(0o755)
    with pytest.raises(BrokerError) as e:
        EmbeddedBroker(binary=str(bad), state_dir=tmp_path / "c").start()
    msg = str(e.value)
    assert "\n" not in msg and "exit code 7" in msg and "boom: cannot start" in msg
    assert str(tmp_path / "c" / "tansu.log") in msg
