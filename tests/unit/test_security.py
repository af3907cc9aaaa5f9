"""Security: a dense file that carries a pickle payload is refused, never
run; run ids and table names cannot reach outside the filesystem sink's root; librdkafka's
security settings reach every Kafka client unchanged (checked without a broker: the clients
are replaced by recorders of the configuration they are given)."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import yaml

import ckpt.stream.kafka.admin as kafka_admin
import ckpt.stream.kafka.consumer as kafka_consumer
import ckpt.stream.kafka.partitions as kafka_partitions
import ckpt.stream.kafka.producer as kafka_producer
from ckpt.config import REDACTED
from ckpt.dense.store import DenseRef, DenseStore, DenseStoreError
from ckpt.log.backend import open_backend
from ckpt.stream.filesystem import FsMarkers, FsSink, FsSource
from ckpt.stream.frames import encode_frame
from common.errors import ConfigError
from trainer.config import load_config

if TYPE_CHECKING:
    from tests.conftest import DebugConfig

# --- dense files: weights-only ------------------------------------------------------------------


class _Payload:
    """Unpickling this calls os.makedirs(target): the canary a code-running load would leave."""

    def __init__(self, target: Path) -> None:
        self.target = str(target)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.makedirs, (self.target,)


@pytest.mark.parametrize("form", ["torch.save", "raw pickle"])
def test_a_dense_file_carrying_a_pickle_payload_is_refused_not_run(tmp_path: Path, form: str) -> None:
    """The file even has the sha256 its marker records (whoever wrote it could write both):
    the weights-only load refuses it with the store's one-line error, and nothing runs."""
    canary = tmp_path / "payload-ran"
    state = {"step": 7, "dense": {"w": torch.ones(2)}, "rng": _Payload(canary)}
    buf = io.BytesIO()
    if form == "torch.save":
        torch.save(state, buf)
    else:
        pickle.dump(state, buf)
    store = DenseStore(tmp_path / "dense")
    path = store.path_for(3)
    path.parent.mkdir()
    path.write_bytes(buf.getvalue())
    ref = DenseRef(str(path), hashlib.sha256(buf.getvalue()).hexdigest(), len(buf.getvalue()))
    with pytest.raises(DenseStoreError) as err:
        store.read(ref)
    message = str(err.value)
    assert message.startswith(f"dense file {path}: refused: ") and "\n" not in message, message
    assert "weights_only=False" not in message  # torch's advice to load it unsafely is not passed on
    assert "makedirs" in message or "Unsupported operand" in message, message  # what was refused
    assert not canary.exists()


# --- run ids and table names stay inside the sink's root ----------------------------------------

ESCAPING_IDS = ["../x", "..", ".", "a/b", "/abs", "x/../../y", "a\\b", "a b", "x" * 201, "r\u00e9", "topic:1"]


@pytest.mark.parametrize("run_id", ESCAPING_IDS)
def test_a_run_id_that_is_no_topic_or_directory_name_is_refused_at_load(run_id: str, debug_config: DebugConfig) -> None:
    with pytest.raises(ConfigError) as err:
        debug_config.load(["ckpt.enabled=true", "ckpt.sink.kind=filesystem", f"ckpt.run_id={run_id!r}"])
    message = str(err.value)
    assert "ckpt.run_id" in message and "[A-Za-z0-9._-]" in message and "\n" not in message, message
    assert message.startswith(str(debug_config.path)), message  # names the file too


def test_a_run_name_used_as_the_run_id_is_checked_the_same_way(debug_config: DebugConfig) -> None:
    with pytest.raises(ConfigError, match=r"run id '\.\./x' \(ckpt\.run_id, default run\.name\)"):
        debug_config.load(["ckpt.enabled=true", "ckpt.sink.kind=filesystem", "run.name=../x"])


@pytest.mark.parametrize("name", ["../evil", "a/b", "a.b", "", "t u", "/etc", "t\u00e9"])
def test_a_table_name_that_is_no_plain_name_is_refused_at_load(name: str, debug_config: DebugConfig) -> None:
    with pytest.raises(ConfigError) as err:
        debug_config.load([f"model.tables.1.name={name!r}"])
    assert "model.tables.1.name" in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("run_id", [*ESCAPING_IDS, ""])  # in a config, "" means the default: run.name
def test_the_filesystem_sink_refuses_an_escaping_run_id_and_creates_nothing(run_id: str, tmp_path: Path) -> None:
    """The sink checks on its own too (tools open it with ids from markers and command lines)."""
    root = tmp_path / "root" / "stream"
    for opener in (FsSink, FsSource, FsMarkers):
        with pytest.raises(ConfigError, match="ckpt.run_id"):
            opener(root, run_id)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == []


def test_a_frame_table_name_never_becomes_a_path(tmp_path: Path) -> None:
    """Segments are named by run id, generation and partition only: whatever a frame's table
    name says, every file the sink writes is under its root, and the frame reads back."""
    root = tmp_path / "root"
    sink = FsSink(root, "run")
    frame = encode_frame(
        run_id="run",
        checkpoint_id=1,
        rank=0,
        table="../../outside",
        col_offset=0,
        dim=4,
        encoding=1,
        row_ids=torch.arange(3),
        payload=torch.ones(3, 4),
    )
    sink.write(frame, generation=1, partition=0)
    ((first, last),) = sink.flush().raise_for_error().ranges[(1, 0)]
    sink.close()
    assert [p.relative_to(tmp_path).as_posix() for p in sorted(tmp_path.rglob("*"))] == [
        "root",
        "root/run.rows.g1",
        "root/run.rows.g1/0.seg",
    ]
    ((_, back),) = list(FsSource(root, "run").read_range(1, 0, first, last))
    assert back.table == "../../outside"


# --- librdkafka security settings pass through --------------------------------------------------

SECURITY = {
    "security.protocol": "SASL_SSL",
    "sasl.mechanisms": "SCRAM-SHA-512",
    "sasl.username": "svc-deltarec",
    "sasl.password": "p@ss: w0rd#1 'quoted'",
    "ssl.ca.location": "/etc/pki/kafka/ca.pem",
    "ssl.certificate.location": "/etc/pki/kafka/client.pem",
    "ssl.key.location": "/etc/pki/kafka/client.key",
    "ssl.key.password": "k3y",
    "ssl.endpoint.identification.algorithm": "https",
}


class _Stop(Exception):
    """Raised by the recording consumer: reading goes no further than the client's creation."""


class _Recorder:
    """Stands in for a confluent-kafka client: records its configuration, talks to no broker."""

    made: list[tuple[str, dict[str, Any]]] = []
    kind = ""

    def __init__(self, conf: dict[str, Any]) -> None:
        _Recorder.made.append((self.kind, dict(conf)))


class _Producer(_Recorder):
    kind = "producer"

    def purge(self, **_: Any) -> None: ...

    def poll(self, _: float) -> int:
        return 0


class _Consumer(_Recorder):
    kind = "consumer"

    def __init__(self, conf: dict[str, Any]) -> None:
        super().__init__(conf)
        raise _Stop


class _Admin(_Recorder):
    kind = "admin"

    def list_topics(self, timeout: float) -> Any:
        from types import SimpleNamespace

        topic = SimpleNamespace(partitions={0: None, 1: None}, error=None)
        return SimpleNamespace(topics={"secure.rows.g1": topic, "secure.markers": topic})


def test_sasl_ssl_settings_reach_every_producer_and_consumer_unchanged(
    tmp_path: Path, debug_config: DebugConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = debug_config.raw()
    data["run"]["name"] = "secure"
    data["ckpt"] = {"enabled": True, "sink": "kafka", "bootstrap_servers": "broker-1:9093,broker-2:9093", "kafka": dict(SECURITY)}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    assert cfg.ckpt.sink.kafka_conf() == {**SECURITY, "bootstrap.servers": "broker-1:9093,broker-2:9093"}

    _Recorder.made = []
    monkeypatch.setattr(kafka_producer, "Producer", _Producer)
    for module in (kafka_consumer, kafka_partitions):  # a consumer connected ahead, or one a read makes
        monkeypatch.setattr(module, "Consumer", _Consumer)
    monkeypatch.setattr(kafka_admin, "AdminClient", _Admin)
    # the sink, the source and the markers log (one shared admin)
    backend = open_backend(cfg.ckpt.run_id, cfg.ckpt.sink, world_size=2)
    with pytest.raises(_Stop):
        list(backend.source.read_range(1, 0, 0, 3))
    with pytest.raises(_Stop):
        backend.markers.read_markers()
    kinds = [kind for kind, _ in _Recorder.made]
    assert kinds.count("producer") == 2 and kinds.count("consumer") == 2 and kinds.count("admin") == 1, kinds
    for kind, conf in _Recorder.made:
        assert {k: conf.get(k) for k in SECURITY} == SECURITY, kind  # every setting, value unchanged
        assert conf["bootstrap.servers"] == "broker-1:9093,broker-2:9093", kind
    admin = next(conf for kind, conf in _Recorder.made if kind == "admin")
    assert admin["reconnect.backoff.ms"] == 10  # docs/design/kafka.md: the second Metadata request waits 11 ms, not 50
    for conf in (conf for kind, conf in _Recorder.made if kind == "consumer"):  # docs/design/kafka.md: no 1 s fetch pause
        assert conf["fetch.queue.backoff.ms"] == kafka_consumer.FETCH_QUEUE_BACKOFF_MS
    producer = next(conf for kind, conf in _Recorder.made if kind == "producer")
    assert producer["acks"] == "all" and producer["enable.idempotence"] is True  # what deltarec adds, beside them
    backend.close()


def test_a_users_reconnect_backoff_wins_over_the_admin_default(monkeypatch: pytest.MonkeyPatch) -> None:
    _Recorder.made = []
    monkeypatch.setattr(kafka_admin, "AdminClient", _Admin)
    kafka_admin.new_admin({"bootstrap.servers": "b:9092", "reconnect.backoff.ms": 250})
    kafka_admin.new_admin({"bootstrap.servers": "b:9092"})
    assert [conf["reconnect.backoff.ms"] for _, conf in _Recorder.made] == [250, 10]


def test_the_resolved_config_in_the_run_directory_holds_no_secret(tmp_path: Path, debug_config: DebugConfig) -> None:
    """`<run_dir>/config.yaml` is JobConfig.to_yaml(): passwords and keys are redacted there,
    the other settings are kept, and the clients still get the real values."""
    data = debug_config.raw()
    data["ckpt"] = {
        "enabled": True,
        "sink": "kafka",
        "bootstrap_servers": "b:9093",
        "kafka": {**SECURITY, "sasl.oauthbearer.client.secret": "oauth-s3cret"},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    text = cfg.to_yaml()
    for secret in ("p@ss: w0rd#1 'quoted'", "k3y", "oauth-s3cret"):
        assert secret not in text
    written = yaml.safe_load(text)["ckpt"]["sink"]["kafka"]
    assert written["sasl.password"] == written["ssl.key.password"] == REDACTED
    assert written["sasl.oauthbearer.client.secret"] == REDACTED
    assert {k: v for k, v in written.items() if v != REDACTED} == {
        k: v for k, v in SECURITY.items() if k not in ("sasl.password", "ssl.key.password")
    }
    assert cfg.ckpt.sink.kafka_conf()["sasl.password"] == SECURITY["sasl.password"]  # the clients get the real one
