"""The job that bench/jobs_vs_processes.py runs, once on corral's JobPool and once per process.

Why a module of its own: a process-per-job controller started with ``spawn`` or ``forkserver``
must import the job's module in every child before the job can start, and in real code that
module pulls in the controller's dependency set. The heavy imports below are therefore at module
level ON PURPOSE: they are the import cost each spawned child pays, exactly as it would in
production. ``fork`` children inherit them already imported from the parent, and the JobPool pays
them once, in the daemon.

Both variants run the same :func:`job_body`; only the plumbing differs (how output reaches the
job's log, how the child command and the I/O wait are run).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO

# The realistic dependency set: corral's own runtime dependencies (see pyproject.toml), with the
# submodules a controller actually touches.
import aiohttp
import aiohttp.web
import click
import prometheus_client
import psutil
import pydantic
import rich.console
import rich.table
import yaml

from corral import jobs

LOGGER_NAME = "bench.job"
START = "START"
END = "END"

# Named so the imports above are visibly the point of this module, not leftovers.
DEPENDENCIES = (aiohttp, click, prometheus_client, psutil, pydantic, rich, yaml)


class LaunchSpec(pydantic.BaseModel):
    """A tiny model built at import time, as a real job module defines its specs."""

    job_id: int
    lines: int
    io_seconds: float


def configure_logging(stream: IO[str]) -> logging.Logger:
    """Give the job logger one StreamHandler writing to ``stream`` (re-pointing it if present).

    The parent calls this with ``sys.stderr`` before any run, which is how a daemon configures
    logging once at start (corral's capture later re-points that handler at its router). A
    process-per-job child must call it again with its own log, because the inherited handler
    (fork) still holds the parent's stderr and a spawned child has no handler at all.
    """
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(stream)
            return logger
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    logger.addHandler(handler)
    return logger


def expected_body(job_id: int, lines: int) -> list[str]:
    """The lines between START and END that a correct log of ``job_id`` holds, in order."""
    out: list[str] = []
    half = lines // 4
    for k in range(lines // 2):
        if k == half:
            out.append(f"child-{job_id}")
        out.append(f"job {job_id} print {k}")
        out.append(f"INFO {LOGGER_NAME} job {job_id} log {k}")
    return out


def job_body(
    job_id: int,
    lines: int,
    io_seconds: float,
    run_child: Callable[[int], object],
    wait: Callable[[float], object],
) -> None:
    """The job: ~``lines`` lines through print and logging, one short command, simulated I/O.

    The first statement takes the start timestamp (the benchmark's side channel is the log's
    first line), the last line carries the end timestamp used for the makespan.
    """
    started = time.time()
    print(f"{START} {started:.6f} job={job_id}")
    spec = LaunchSpec(job_id=job_id, lines=lines, io_seconds=io_seconds)
    logger = logging.getLogger(LOGGER_NAME)
    half = spec.lines // 4
    for k in range(spec.lines // 2):
        if k == half:
            run_child(job_id)
            wait(spec.io_seconds)
        print(f"job {job_id} print {k}")
        logger.info("job %d log %d", job_id, k)
    print(f"{END} {time.time():.6f} job={job_id}")


def _child_command(job_id: int) -> list[str]:
    return ["sh", "-c", f"echo child-{job_id}"]


def pool_job(job_id: int, lines: int, io_seconds: float) -> None:
    """JobPool variant: output is routed by corral.capture, the command by run_command."""
    job_body(
        job_id,
        lines,
        io_seconds,
        run_child=lambda i: jobs.run_command(_child_command(i)),
        wait=jobs.sleep,
    )


def process_entry(job_id: int, log_path: str, lines: int, io_seconds: float) -> None:
    """Process-per-job variant: the child swaps sys.stdout/sys.stderr to its own log file.

    This is the style corral replaces: one process per job gets per-job output "for free" by
    pointing the process-wide streams (and the logging handler) at the log, and hands the command
    the log's descriptor.
    """
    original = sys.stdout, sys.stderr
    with open(log_path, "a", encoding="utf-8", errors="backslashreplace", buffering=1) as log:
        sys.stdout = sys.stderr = log
        configure_logging(log)

        def run_child(i: int) -> None:
            log.flush()
            subprocess.run(_child_command(i), stdout=log, stderr=log, check=True)

        try:
            job_body(job_id, lines, io_seconds, run_child=run_child, wait=time.sleep)
        finally:
            sys.stdout, sys.stderr = original
