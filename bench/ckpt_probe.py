"""One rank of `bench.ckpt_bench`'s in-process measurements (suite `checkpoint`; spawned like a
trainer rank).

    python -m bench.ckpt_probe --config C --fp32-run RUN --quant-run RUN --out-dir DIR \
        --dcp-dir DIR [--quant-override key=value ...] [--repeats 3] [--interval 50] [key=value ...]

Builds the job exactly as `trainer.main` does (`bench.job.start_job`: same config, same world
size), then:

1. Restore vs DCP. `Checkpointer.restore()` of the fp32 run's newest checkpoint
   (marker lookup, chain replay from Kafka, dense file, reader/RNG state), timed across
   ranks (barrier, restore, barrier); `dcp.save` of the restored model's state
   (`{"model": DMP.state_dict(), "optim": optimizer.state_dict()}`: sharded weights and
   momentum, dense params and dense optimizer) to a local directory; then rounds of
   `dcp.load` + `load_state_dict` and `restore()` alternating in order, each loading into
   a perturbed model, each checked to give back the same state, and a plain consumer
   reading the very Kafka segments this rank's restore reads (transport alone, no
   decoding, no scatter). Also the quantized run's newest checkpoint (with the
   relative error of its rows against the fp32 restore when both are at the same step), and
   the newest checkpoint with the other kind of chain (full only / base + delta).
2. Stall vs bare copy, controlled: `SnapshotTaker.take` of a full snapshot and of a delta
   (`--interval` steps of training after a base), alternating with `BareCopier.copy` (into
   reused buffers) of the same rows: max(3 x `--repeats`, 12) rounds after 2 warm-up rounds,
   both ranks at once.
3. Writer vs raw producer. For (full, fp32), (delta, fp32) and (full, quant): deltarec's
   writer path on a real snapshot (`write_rows`, what `RankWriter` runs: encode, frame,
   produce, flush, delivery reports -> ranges) against a raw confluent-kafka `Producer` (acks=all,
   idempotence on, librdkafka defaults like the sink) sending the very same frames to
   the same broker and partition (produce + poll(0) + flush, at most 5 messages outstanding as
   the sink keeps: more spin librdkafka's thread, docs/design/kafka.md). Both ranks run each side
   at once (barriers), as they do in training; the first round is a warm-up; topics are
   created before the timed part and deleted after each round. `sink_s` is the part of the
   writer's run spent in the sink (produce + flush); the rest is encoding and framing.

Writes ``<out-dir>/probe_rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.ckpt_rank import BareCopier, find_rows
from bench.job import fingerprint, perturb, start_job, stop_job, timed
from common.process import run_main

WARMUP_ROUNDS = 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--fp32-run", required=True)
    p.add_argument("--quant-run", required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--dcp-dir", type=Path, required=True)
    p.add_argument("--quant-override", action="append", default=[], help="key=value for the quantized run's config")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--interval", type=int, default=50)
    args, overrides = p.parse_known_args(sys.argv[1:] if argv is None else argv)

    import torch.distributed.checkpoint as dcp
    from confluent_kafka import Consumer, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient

    from ckpt.log.catalog import commits
    from ckpt.restore.replay import frame_overlaps
    from ckpt.stream.kafka import KafkaSink, delete_topic, ensure_topic
    from ckpt.stream.kafka import consumer as kafka_consumer
    from ckpt.stream.kafka import partitions as kafka_partitions
    from ckpt.stream.kafka.producer import MAX_OUTSTANDING
    from ckpt.stream.sink import rows_name
    from ckpt.write.writer import RankWriter, WriteJob, encode_frames, write_rows
    from trainer.config import load_config
    from trainer.main import make_checkpointer

    base = ["ckpt.enabled=true", "ckpt.restore.resume=latest", "ckpt.schedule.final=false", "train.eval_batches=0", *overrides]
    cfg = load_config(args.config, [*base, f"ckpt.run_id={args.fp32_run}"])
    cfg_q = load_config(args.config, [*base, f"ckpt.run_id={args.quant_run}", *args.quant_override])
    env, device, sharded, trainer, no_metrics = start_job(cfg)
    rank, R = env.rank, args.repeats
    mgr = make_checkpointer(cfg, env, device, sharded, trainer, no_metrics)
    mgr_q = make_checkpointer(cfg_q, env, device, sharded, trainer, no_metrics)
    mgr_q.stages.tracker.detach()  # one tracker hook is enough
    quant = mgr_q.codecs()[0]  # the quantized run's weight codec (before any restore changes the count)
    smap = mgr.stages.shard_map
    out: dict[str, Any] = {"rank": rank, "threads": torch.get_num_threads()}

    def report(rep: Any) -> dict[str, Any]:
        return {
            "checkpoint_id": rep.checkpoint_id,
            "step": rep.step,
            "chain": rep.chain,
            "frames": rep.frames,
            "rows": rep.rows,
            "bytes": rep.bytes,
            "rows_seconds": rep.seconds,
        }

    # -- 1. restore vs dcp ------------------------------------------------------------
    first_s, rep = timed(mgr.restore)
    assert rep is not None, f"no checkpoint of run {args.fp32_run} to restore"
    latest = report(rep)
    reference = fingerprint(smap, sharded)
    ref_weights = [v.weight.detach().clone() for v in smap.shards]
    found: list[Any] = [None]
    if rank == 0:
        found[0] = [m for _, m in commits(mgr.stages.backend.markers.read_markers(), mgr.run_id)]
    dist.broadcast_object_list(found, src=0)
    markers = {m.checkpoint_id: m for m in found[0]}
    conf = cfg.ckpt.sink.kafka_conf()

    def dcp_state() -> dict[str, Any]:
        return {"model": sharded.model.state_dict(), "optim": sharded.optimizer.state_dict()}

    def dcp_load() -> None:
        st = dcp_state()
        dcp.load(st, checkpoint_id=str(args.dcp_dir))
        sharded.model.load_state_dict(st["model"])
        sharded.optimizer.load_state_dict(st["optim"])

    def raw_kafka_read(marker: Any) -> int:
        """A plain consumer reading the very Kafka segments this rank's restore reads (no
        decode, no checks, no scatter): adjacent segments merged into one span, one consumer
        per span, the fetch settings of deltarec's reader."""
        spans: dict[tuple[str, int], list[list[int]]] = {}
        for link in marker.chain:
            for e in link.index:
                if any(frame_overlaps(s, e.col_offset, e.cols, e.min_row, e.max_row) for s in smap.of_table(e.table)):
                    spans.setdefault((rows_name(mgr.run_id, link.generation), e.partition), []).append([e.first, e.last])
        n = 0
        for (topic, part), ranges in spans.items():
            merged: list[list[int]] = []
            for first, last in sorted(ranges):
                if merged and first <= merged[-1][1] + 1:
                    merged[-1][1] = max(merged[-1][1], last)
                else:
                    merged.append([first, last])
            for first, last in merged:
                consumer = Consumer(
                    {
                        **conf,
                        "group.id": f"ckpt-bench-{uuid.uuid4().hex}",
                        "enable.auto.commit": False,
                        "fetch.wait.max.ms": 100,
                        "queued.max.messages.kbytes": 16 * 1024,
                    }
                )
                try:
                    consumer.assign([TopicPartition(topic, part, first)])
                    while True:
                        msg = consumer.poll(30.0)
                        assert msg is not None, f"raw read of {topic}[{part}] stalled before offset {last}"
                        if msg.error():
                            raise RuntimeError(f"raw read of {topic}[{part}]: {msg.error()}")
                        n += len(msg.value())
                        if msg.offset() >= last:
                            break
                finally:
                    consumer.close()
        return n

    # time deltarec's reader spends waiting in Consumer.poll (this process only)
    poll_s = [0.0]

    class _TimedConsumer(Consumer):
        def poll(self, *a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return super().poll(*a, **kw)
            finally:
                poll_s[0] += time.perf_counter() - t

    kafka_consumer.Consumer = _TimedConsumer  # a consumer connected ahead of a read
    kafka_partitions.Consumer = _TimedConsumer  # one a read makes

    save_s = [timed(lambda: dcp.save(dcp_state(), checkpoint_id=str(args.dcp_dir)))[0] for _ in range(2)]
    dcp_bytes = sum(f.stat().st_size for f in args.dcp_dir.rglob("*") if f.is_file())
    times: dict[str, list[float]] = {"deltarec": [], "dcp": [], "raw_kafka": []}
    rows_s, kafka_s, matches, raw_bytes = [], [], [], 0
    kinds = ["dcp", "deltarec", "raw_kafka"]
    for r in range(R):
        for kind in kinds[r % 3 :] + kinds[: r % 3]:  # rotate the order
            if kind == "raw_kafka":
                t, raw_bytes = timed(lambda: raw_kafka_read(markers[latest["checkpoint_id"]]))
                times[kind].append(t)
                continue
            perturb(smap, sharded)
            if kind == "dcp":
                times[kind].append(timed(dcp_load)[0])
            else:
                poll_s[0] = 0.0
                t, rp = timed(mgr.restore)
                times[kind].append(t)
                rows_s.append(rp.seconds)
                kafka_s.append(poll_s[0])
            matches.append(fingerprint(smap, sharded) == reference)
    out["restore"] = {
        "latest": latest,
        "first_restore_s": first_s,
        "restore_s": times["deltarec"],
        "rows_s": rows_s,
        "kafka_poll_s": kafka_s,
        "dcp_load_s": times["dcp"],
        "raw_kafka_read_s": times["raw_kafka"],
        "raw_kafka_bytes": raw_bytes,
        "dcp_save_s": save_s,
        "dcp_bytes_on_disk": dcp_bytes,
        "same_state_after_each": all(matches),
    }

    # the other kind of chain: the newest base + delta checkpoint if the newest one is a full
    # checkpoint, else the newest full one
    newest_is_full = len(latest["chain"]) == 1
    other_id = max((m.checkpoint_id for m in markers.values() if (len(m.chain) > 1) == newest_is_full), default=None)
    if other_id is not None:
        mgr.cfg.restore.resume = str(other_id)
        chain_times, reps = [], []
        for _ in range(R):
            perturb(smap, sharded)
            t, rp = timed(mgr.restore)
            chain_times.append(t)
            reps.append(rp)
        out["restore"]["other_chain"] = {**report(reps[-1]), "restore_s": chain_times, "rows_s": [x.seconds for x in reps]}
        mgr.cfg.restore.resume = "latest"

    # the quantized run's newest checkpoint
    q_times, q_rows = [], []
    for _ in range(R):
        perturb(smap, sharded)
        t, rq = timed(mgr_q.restore)
        q_times.append(t)
        q_rows.append(rq.seconds)
    q = {**report(rq), "restore_s": q_times, "rows_s": q_rows}
    if rq.step == latest["step"]:
        num = sum(float((v.weight.detach() - w).double().pow(2).sum()) for v, w in zip(smap.shards, ref_weights))
        den = sum(float(w.double().pow(2).sum()) for w in ref_weights)
        q["weights_rel_l2_error_sq_parts"] = [num, den]
    out["restore"]["quant"] = q
    del ref_weights

    # back to the fp32 state for the rest
    mgr.restore()

    # -- 2. take vs bare copy (controlled, repeated) ------------------------------------
    step = trainer.step
    full_snap = mgr.stages.taker.take(0, step, full=True, since_base=False)
    mgr.stages.tracker.mark_base()
    for _ in range(args.interval):
        trainer.train_step()
    locals_ = [mgr.stages.tracker.touched_rows(i, False) for i in range(len(smap.shards))]
    pairs: dict[str, list[float]] = {"take_delta": [], "bare_delta": [], "take_full": [], "bare_full": [], "find_delta": []}
    delta_snap = None
    copier = BareCopier()
    rounds = max(3 * R, 12)
    for r in range(WARMUP_ROUNDS + rounds):
        for full in (False, True):
            dist.barrier()  # both ranks copy at the same moment, as at a real checkpoint
            for name in ("take", "bare") if r % 2 == 0 else ("bare", "take"):
                key = f"{name}_{'full' if full else 'delta'}"
                if name == "take":
                    snap = mgr.stages.taker.take(0, trainer.step, full=full, since_base=False)
                    dt = snap.stall_s * 1e3
                    if full:
                        snap.release()  # as the writer does: the next take reuses its memory
                    else:
                        if delta_snap is not None:
                            delta_snap.release()
                        delta_snap = snap
                    del snap
                else:
                    dt = copier.copy(smap.shards, [None] * len(locals_) if full else locals_) * 1e3
                if r >= WARMUP_ROUNDS:
                    pairs[key].append(dt)
            if not full and r >= WARMUP_ROUNDS:  # the bitmap scan a delta take starts with
                pairs["find_delta"].append(find_rows(mgr.stages.tracker, len(smap.shards), False) * 1e3)
    assert delta_snap is not None
    out["take_vs_bare"] = {
        "delta_rows": delta_snap.rows,
        "delta_bytes": delta_snap.nbytes,
        "full_rows": full_snap.rows,
        "full_bytes": full_snap.nbytes,
        **{f"{k}_ms": v for k, v in pairs.items()},
    }

    # -- 3. writer vs raw producer ------------------------------------------------------
    bench_run = f"{args.fp32_run}-wbench"
    sink = KafkaSink(bench_run, conf, num_partitions=env.world_size, delivery_timeout_s=cfg.ckpt.sink.flush_timeout_s)
    group = dist.new_group(backend="gloo")
    writer = RankWriter(
        run_id=bench_run,
        rank=rank,
        sink=sink,
        group=group,
        max_frame_bytes=cfg.ckpt.sink.max_frame_bytes,
        flush_timeout_s=cfg.ckpt.sink.flush_timeout_s,
        committer=(lambda job, reports: None) if rank == 0 else None,
    )
    producer = Producer(
        {**conf, "acks": "all", "enable.idempotence": True, "delivery.timeout.ms": int(cfg.ckpt.sink.flush_timeout_s * 1000)}
    )
    admin = AdminClient(conf)
    # time the writer spends inside the sink (produce + flush), within its own timed run
    in_sink = [0.0]

    def _timed_sink(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                in_sink[0] += time.perf_counter() - t

        return call

    sink.write, sink.flush = _timed_sink(sink.write), _timed_sink(sink.flush)  # type: ignore[method-assign]
    cases = [("full", "fp32", full_snap), ("delta", "fp32", delta_snap), ("full", quant, full_snap)]
    generation = 1000
    writer_rows: list[dict[str, Any]] = []
    for kind, codec, snap in cases:
        res: dict[str, list[float]] = {"writer_s": [], "raw_s": [], "sink_s": []}
        nbytes = nframes = 0
        for r in range(R + 1):  # round 0: warm-up
            generation += 1
            job = WriteJob(
                checkpoint_id=generation,
                step=step,
                generation=generation,
                chain=[generation],
                snapshot=snap,
                trainer_state={},
                weight_codec=codec,
                optimizer_codec="fp32",
            )
            frames = [
                f.data
                for shard in snap.shards
                if shard.global_rows.numel()
                for f in encode_frames(job, shard, {}, writer.run_id, rank, writer.max_frame_bytes)
            ]
            raw_topic = f"{bench_run}.raw.g{generation}"
            if rank == 0:
                ensure_topic(admin, raw_topic, env.world_size)
            sink.writable_topic(generation, rank)  # create the generation's topic outside the timed part
            dist.barrier()
            errors: list[Any] = []

            def raw() -> float:
                t0 = time.perf_counter()
                for f in frames:
                    while len(producer) >= MAX_OUTSTANDING:  # librdkafka's idempotent in-flight limit
                        producer.poll(0.1)  # (more queued behind it: its thread spins; docs/design/kafka.md)
                    while True:
                        try:
                            producer.produce(
                                raw_topic, f, partition=rank, on_delivery=lambda err, msg: errors.append(err) if err else None
                            )
                            break
                        except BufferError:
                            producer.poll(0.05)
                    producer.poll(0)
                left = producer.flush(cfg.ckpt.sink.flush_timeout_s)
                assert left == 0 and not errors, f"raw producer: {left} left, errors {errors[:3]}"
                return time.perf_counter() - t0

            def deltarec() -> float:
                in_sink[0] = 0.0
                t0 = time.perf_counter()
                rr = write_rows(
                    job,
                    run_id=writer.run_id,
                    rank=rank,
                    sink=sink,
                    max_frame_bytes=writer.max_frame_bytes,
                    flush_timeout_s=writer.flush_timeout_s,
                )
                assert rr.ok, rr.error
                nonlocal nbytes
                nbytes = rr.bytes
                return time.perf_counter() - t0

            for side in ("writer", "raw") if r % 2 == 0 else ("raw", "writer"):
                dist.barrier()
                dt = deltarec() if side == "writer" else raw()
                if r > 0:
                    res[f"{side}_s"].append(dt)
                    if side == "writer":
                        res["sink_s"].append(in_sink[0])
            nframes = len(frames)
            raw_bytes = sum(len(f) for f in frames)
            assert raw_bytes == nbytes, (raw_bytes, nbytes)
            frames = []  # this generation's frames released (the closure above holds the name)
            dist.barrier()
            if rank == 0:
                sink.drop_generation(generation)
                delete_topic(admin, raw_topic, 10.0)
            dist.barrier()
        writer_rows.append(
            {
                "snapshot": kind,
                "codec": codec,
                "rows": snap.rows,
                "snapshot_bytes": snap.nbytes,
                "bytes": nbytes,
                "frames": nframes,
                **res,
            }
        )
    out["writer"] = writer_rows
    writer.close()
    sink.close()
    producer.flush(5)
    producer = admin = None

    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"probe_rank{rank}.json").write_text(json.dumps(out, indent=1) + "\n")
    mgr.close(trainer.step)
    mgr_q.close(trainer.step)
    mgr = mgr_q = trainer = sharded = full_snap = delta_snap = None  # released before the process group goes
    stop_job()
    return 0


if __name__ == "__main__":
    run_main(main)
