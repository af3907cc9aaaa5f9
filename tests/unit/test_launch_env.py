"""Launcher detection (torchrun, srun, lone process), the torchrun wrapper's command, and
how the wrapper reports a failed rank."""

from __future__ import annotations

import logging
import sys

import pytest

from launch.torchrun import AGENT_LOGGER, FAILED_RECORD, RankFailures, build_command, rank_outcome, root_cause
from sharding.process_group import detect_env
from trainer.console import EXIT_PEER_LOST, EXIT_STALLED


def test_torchrun_variables() -> None:
    env = detect_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.launcher) == (3, 8, 1, 2, "torchrun")
    assert env.num_nodes == 4


def test_slurm_variables_without_torchrun() -> None:
    env = detect_env(
        {
            "SLURM_PROCID": "9",
            "SLURM_NTASKS": "16",
            "SLURM_LOCALID": "1",
            "SLURM_JOB_NUM_NODES": "2",
            "SLURM_NTASKS_PER_NODE": "8(x2)",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.launcher) == (9, 16, 1, 8, "slurm")


def test_torchrun_wins_over_slurm() -> None:
    env = detect_env({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert env.launcher == "torchrun" and env.rank == 1


def test_lone_process() -> None:
    env = detect_env({})
    assert (env.rank, env.world_size, env.launcher) == (0, 1, "single")


def test_wrapper_builds_torchrun_command() -> None:
    cmd = build_command(["--nproc-per-node", "4", "--max-restarts", "2", "--config", "c.yaml", "train.steps=5"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=4" in cmd and "--max-restarts=2" in cmd and "--standalone" in cmd
    assert cmd[-5:] == ["-m", "trainer.main", "--config", "c.yaml", "train.steps=5"]


def test_wrapper_builds_a_multi_node_c10d_rendezvous() -> None:
    cmd = build_command(
        [
            "--nnodes",
            "2",
            "--rdzv-endpoint",
            "127.0.0.2:29400",
            "--rdzv-id",
            "j1",
            "--local-addr",
            "127.0.0.3",
            "--config",
            "c.yaml",
        ]
    )
    assert "--standalone" not in cmd
    for flag in [
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.2:29400",
        "--rdzv-id=j1",
        "--local-addr=127.0.0.3",
    ]:
        assert flag in cmd
    assert cmd[-4:] == ["-m", "trainer.main", "--config", "c.yaml"]
    assert "--local-addr" not in " ".join(build_command(["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-id", "j"]))


def test_wrapper_refuses_several_nodes_without_a_rendezvous(capsys) -> None:
    with pytest.raises(SystemExit):
        build_command(["--nnodes", "2", "--config", "c.yaml"])
    assert "--nnodes > 1 needs --rdzv-endpoint" in capsys.readouterr().err


def test_wrapper_passes_verbose_to_the_trainer() -> None:
    cmd = build_command(["--verbose", "--nproc-per-node", "2", "--config", "c.yaml"])
    assert cmd[-4:] == ["trainer.main", "--verbose", "--config", "c.yaml"]
    assert "--verbose" not in build_command(["--config", "c.yaml"])


def test_root_cause_is_the_rank_that_died_not_those_it_took_along() -> None:
    """Rank 0 lost its peers (its own exit status), rank 2 was stopped by the agent (SIGTERM):
    rank 1, killed, is the cause whatever the timestamps say."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failures = {
        0: ProcessFailure(local_rank=0, pid=100, exitcode=EXIT_PEER_LOST, error_file="<N/A>"),
        1: ProcessFailure(local_rank=1, pid=101, exitcode=-9, error_file="<N/A>"),
        2: ProcessFailure(local_rank=2, pid=102, exitcode=-15, error_file="<N/A>"),
    }
    failures[1].timestamp = failures[0].timestamp + 5  # seen last
    rank, failure = root_cause(failures)
    assert (rank, failure.exitcode) == (1, -9)
    assert rank_outcome(rank, failure.exitcode) == "rank 1 exited (SIGKILL)"
    assert rank_outcome(0, EXIT_PEER_LOST) == "rank 0 stopped (another rank of the job is gone)"
    assert rank_outcome(3, 1) == "rank 3 exited (exit code 1)"


def _agent_record(msg: str, args: tuple) -> logging.LogRecord:
    return logging.LogRecord(AGENT_LOGGER, logging.ERROR, "api.py", 1, msg, args, None)


def test_the_agents_failure_record_becomes_one_deltarec_line(capsys: pytest.CaptureFixture[str]) -> None:
    failures = RankFailures(max_restarts=1)
    assert failures.filter(_agent_record(FAILED_RECORD, (-9, 1, 4321, "/usr/bin/python"))) is False
    assert capsys.readouterr().err == ("deltarec-launch: rank 1 exited (SIGKILL); torchrun restarts the job, attempt 2/2\n")
    # the last attempt's failure is dropped here: `launch` reports it with every rank's status
    assert failures.filter(_agent_record(FAILED_RECORD, (1, 0, 4322, "/usr/bin/python"))) is False
    assert capsys.readouterr().err == ""
    assert failures.filter(_agent_record("Unable to shutdown process %s via %s", (4323, "SIGTERM"))) is True


def test_a_rank_whose_collective_timed_out_is_not_the_root_cause() -> None:
    """Rank 0 exits after its collective timed out (EXIT_STALLED); rank 1, stopped, is killed by
    the agent: neither failed of its own accord, so the first to exit is named, and says why."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    assert rank_outcome(0, EXIT_STALLED) == "rank 0 stopped (a collective timed out: another rank does not answer)"
    failures = {
        0: ProcessFailure(local_rank=0, pid=100, exitcode=EXIT_STALLED, error_file="<N/A>"),
        1: ProcessFailure(local_rank=1, pid=101, exitcode=-15, error_file="<N/A>"),
    }
    failures[0].timestamp, failures[1].timestamp = 10, 11
    assert root_cause(failures)[0] == 0
