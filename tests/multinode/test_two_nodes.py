"""Two "nodes" on loopback: two torchrun agents (`deltarec-launch --nnodes 2`), one at
127.0.0.2 and one at 127.0.0.3, checkpointing to the embedded broker. Every rank of the second
node is SIGKILLed from outside mid-run; torchrun's elastic restart brings the job back and it
ends bit-identical to a run never interrupted; then one node alone restores the same checkpoint.

Everything runs in a network namespace of its own (`ip netns`), which has nothing but a
loopback interface: torchrun's c10d stores listen on the wildcard address (torch offers no
knob for it), and the namespace is what keeps every listener and every packet on
127.0.0.0/8. The two node addresses are labels on that loopback (`lo:node0`, `lo:node1`), so
gloo is told its address the standard way, `GLOO_SOCKET_IFNAME`. Needs root for `ip netns`;
skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from launch.ranks import REPO, kill_tree, rank_pids, read_jsonl, spawn_ranks

if TYPE_CHECKING:
    from tests.conftest import DebugConfig

pytestmark = [pytest.mark.integration, pytest.mark.multirank]

STEPS = 100
NODES = {0: "127.0.0.2", 1: "127.0.0.3"}
RDZV_PORT = 29400  # any port: nothing else listens in the namespace
KILL_AFTER_STEP = 20  # the second node dies once this step's checkpoint committed
# One thread per rank in the reference and in the two-node job: a rank alone on its node would
# otherwise take every core (`train.threads_per_rank=0`) where the reference's two ranks share
# them, and the CPU kernels then sum in another order (bit-exact resume compares runs of one
# configuration; this differed on a 2-core VM of 2026-11-27 even at the commit before it).
THREADS = "train.threads_per_rank=1"
DEADLINE_S = 300


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@dataclass
class Namespace:
    """A network namespace with loopback only, the node addresses labelled on it."""

    name: str

    def wrap(self, cmd: Sequence[str]) -> list[str]:
        """`cmd` run inside the namespace (`ip netns exec` execs it: same pid)."""
        return ["ip", "netns", "exec", self.name, *cmd]


@pytest.fixture(scope="module")
def netns() -> Iterator[Namespace]:
    if os.geteuid() != 0:
        pytest.skip("two nodes on loopback need root for `ip netns` (a namespace of their own)")
    name = f"deltarec-{uuid.uuid4().hex[:8]}"
    made = _sh("ip", "netns", "add", name)
    if made.returncode != 0:
        pytest.skip(f"`ip netns add` failed here: {made.stderr.strip()}")
    ns = Namespace(name)
    try:
        setup = [["ip", "link", "set", "lo", "up"]] + [
            ["ip", "addr", "add", f"{addr}/8", "dev", "lo", "label", f"lo:node{node}"] for node, addr in NODES.items()
        ]
        for cmd in setup:
            done = _sh(*ns.wrap(cmd))
            assert done.returncode == 0, f"{' '.join(cmd)}: {done.stderr}"
        yield ns
    finally:
        _sh("ip", "netns", "del", name)


@pytest.fixture(scope="module")
def ns_broker(netns: Namespace, tmp_path_factory) -> Iterator[str]:
    """The embedded broker, started inside the namespace by its own CLI; its bootstrap."""
    state = tmp_path_factory.mktemp("ns-broker")
    cli = [sys.executable, "-m", "launch.broker"]
    started = subprocess.run(
        netns.wrap([*cli, "start", "--state-dir", str(state)]), cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert started.returncode == 0, started.stderr
    try:
        yield started.stdout.strip()
    finally:
        subprocess.run(netns.wrap([*cli, "stop", "--state-dir", str(state)]), cwd=REPO, capture_output=True, timeout=60)


class Agents:
    """torchrun agents started for one test; every one (and its ranks) is killed at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def cleanup(self) -> None:
        """SIGKILL every agent still running and every process below it, by pid (torchrun
        starts each rank in a session of its own, so the agent's group does not hold them)."""
        for proc in self.procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait(timeout=30)


@pytest.fixture
def agents() -> Iterator[Agents]:
    a = Agents()
    try:
        yield a
    finally:
        a.cleanup()


def _job(run_dir: Path, bootstrap: str, run_id: str) -> list[str]:
    return [
        f"run.dir={run_dir}",
        "train.progress=log",
        f"train.steps={STEPS}",
        "train.save_params=true",
        "train.eval_batches=1",
        THREADS,
        "ckpt.enabled=true",
        "ckpt.sink.kind=kafka",
        f"ckpt.sink.bootstrap_servers={bootstrap}",
        f"ckpt.run_id={run_id}",
        "ckpt.schedule.interval_steps=10",
        "ckpt.sink.flush_timeout_s=30",
        "ckpt.restore.resume=latest",
    ]


def _node_cmd(netns: Namespace, node: int, config: Path, job: list[str], rdzv_id: str) -> list[str]:
    return netns.wrap([
        sys.executable, "-m", "launch.torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1",
        "--rdzv-endpoint", f"{NODES[0]}:{RDZV_PORT}", "--rdzv-id", rdzv_id, "--local-addr", NODES[node],
        "--config", str(config), *job,
    ])  # fmt: skip


def _wait_committed(run_dir: Path, step: int, agents: Sequence[subprocess.Popen], logs: Sequence[Path]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        records = read_jsonl(run_dir / "metrics.jsonl", live=True)
        if any(r.get("ckpt_committed") is True and r["step"] >= step for r in records):
            return
        if any(a.poll() is not None for a in agents):
            pytest.fail(
                "an agent ended before the checkpoint of step "
                f"{step} committed:\n" + "\n".join(p.read_text()[-3000:] for p in logs)
            )
        time.sleep(0.05)  # polling a file another process writes
    pytest.fail(f"no checkpoint of step {step} committed within {DEADLINE_S} s")


def _wait_all(procs: Sequence[subprocess.Popen], logs: Sequence[Path]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    for proc, log in zip(procs, logs):
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"{log.name}: still running after {DEADLINE_S} s:\n{log.read_text()[-3000:]}")
        assert rc == 0, f"{log.name}: exit {rc}\n{log.read_text()[-4000:]}"


def _dumps(run_dir: Path) -> list[dict[str, torch.Tensor]]:
    return [torch.load(run_dir / "params" / f"rank{r}.pt") for r in range(2)]


def _assert_identical(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]], what: str) -> None:
    for rank, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), f"{what}: rank {rank} holds other parameters"
        for key in w:
            assert torch.equal(g[key], w[key]), f"{what}: rank {rank} {key} differs from the uninterrupted run"


def test_second_node_killed_resumes_bit_identical_then_one_node_restores(
    tmp_path, netns: Namespace, ns_broker: str, agents: Agents, debug_config: DebugConfig
):
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    spawn_ranks(debug_config.path, [f"train.steps={STEPS}", "train.save_params=true", "train.eval_batches=1", THREADS],
                reference_dir)  # fmt: skip
    reference = _dumps(reference_dir / "run")

    run_dir, run_id = tmp_path / "run", f"two-nodes-{uuid.uuid4().hex[:8]}"
    job = _job(run_dir, ns_broker, run_id)
    logs = [tmp_path / f"node{n}.log" for n in NODES]
    nodes = [
        agents.start(_node_cmd(netns, n, debug_config.path, job, run_id), logs[n],
                     {"GLOO_SOCKET_IFNAME": f"lo:node{n}", "OMP_NUM_THREADS": "1"})
        for n in NODES
    ]  # fmt: skip
    _wait_committed(run_dir, KILL_AFTER_STEP, nodes, logs)
    victims = list(rank_pids(nodes[1].pid).values())
    assert victims, "the second node runs no trainer rank"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    _wait_all(nodes, logs)

    second = logs[1].read_text()
    assert "deltarec-launch: local rank 0 exited (SIGKILL); torchrun restarts the job, attempt 2/2" in second, second
    first = logs[0].read_text()
    resumed = [line for line in first.splitlines() if line.startswith("deltarec: resumed from checkpoint")]
    assert len(resumed) == 1 and int(resumed[0].split()[4]) >= KILL_AFTER_STEP // 10, first[-3000:]
    assert f"deltarec: trained {STEPS} steps" in first
    _assert_identical(_dumps(run_dir), reference, "two nodes, the second killed and restarted")

    # The same checkpoint into one node: both ranks on one agent, nothing left to train.
    for rank_dump in (run_dir / "params").iterdir():
        rank_dump.unlink()
    one_log = tmp_path / "one-node.log"
    one = agents.start(netns.wrap([sys.executable, "-m", "launch.torchrun", "--nproc-per-node", "2",
                                   "--config", str(debug_config.path), *job]),
                       one_log, {"OMP_NUM_THREADS": "1"})  # fmt: skip
    _wait_all([one], [one_log])
    assert re.search(rf"resumed from checkpoint \d+ at step {STEPS}\b", one_log.read_text()), one_log.read_text()[-3000:]
    _assert_identical(_dumps(run_dir), reference, "one node restoring the two nodes' checkpoint")
