"""A local replica gets SkyPilot's own variables, as a SkyServe replica of one node does.

SkyServe's examples read them in `run` (its quickstart: ``--tensor-parallel-size
$SKYPILOT_NUM_GPUS_PER_NODE``); unset, they expand to nothing and the engine fails on its own
arguments. The GPU count is that of the devices the replica was given.
"""

from __future__ import annotations

from pathlib import Path

from corral.infra.base import LaunchRequest
from corral.infra.local_env import replica_env


def _request(envs: dict[str, str], display_id: int | None = 3) -> LaunchRequest:
    return LaunchRequest(
        service="svc",
        replica_id=17,
        version=2,
        run="true",
        setup=None,
        envs=envs,
        workdir=None,
        replica_dir=Path("/nonexistent/replica"),
        log_path=Path("/nonexistent/replica.log"),
        port=None,
        resources={},
        home_marker="marker",
        on_started=lambda handle: None,
        display_id=display_id,
    )


def test_a_replica_with_two_gpus_is_told_so_and_its_serve_replica_id() -> None:
    env = replica_env(_request({"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}), 8000, "key")
    assert env["SKYPILOT_NUM_GPUS_PER_NODE"] == "2"
    # The id `corral status` shows (and CORRAL_REPLICA_ID), not the internal uid.
    assert env["SKYPILOT_SERVE_REPLICA_ID"] == env["CORRAL_REPLICA_ID"] == "3"
    assert env["SKYPILOT_NUM_NODES"] == "1"
    assert env["SKYPILOT_NODE_RANK"] == "0"
    assert env["SKYPILOT_NODE_IPS"] == "127.0.0.1"


def test_a_replica_without_gpus_counts_zero() -> None:
    # No device variable (a machine without GPUs) and a hidden one (GPUs, none given) alike.
    for envs in ({}, {"CUDA_VISIBLE_DEVICES": "", "NVIDIA_VISIBLE_DEVICES": "void"}):
        assert replica_env(_request(envs), 8000, "key")["SKYPILOT_NUM_GPUS_PER_NODE"] == "0"
