"""Multi-process start-up: where ``jax.distributed`` gets its coordinator, process count and process id.

Three sources, first match wins: explicit arguments (``--coordinator_address --num_processes --process_id``), the
variables ``launch/local.sh`` exports (``TLT_JAX_COORDINATOR``, ``TLT_JAX_NUM_PROCESSES``, ``TLT_JAX_PROCESS_ID``),
and SLURM's (``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_STEP_NODELIST``/``SLURM_JOB_NODELIST``, ``SLURM_JOB_ID``).
None of them (or a count of 1): a single process, and ``jax.distributed`` is never started. On CPU the
cross-process collectives go through gloo. The heartbeat timeout bounds how long survivors wait for a dead peer.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping

__all__ = ["LaunchSpec", "first_slurm_host", "initialize", "resolve_launch"]

log = logging.getLogger("tlt_jax")

ENV_COORDINATOR = "TLT_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "TLT_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "TLT_JAX_PROCESS_ID"
ENV_HEARTBEAT = "TLT_JAX_HEARTBEAT_TIMEOUT_S"
ENV_INIT_TIMEOUT = "TLT_JAX_INIT_TIMEOUT_S"
DEFAULT_HEARTBEAT_S = 60
DEFAULT_INIT_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """One process's place in a multi-process job."""

    coordinator: str  # host:port of process 0's coordination service
    num_processes: int
    process_id: int
    source: str  # "flags", "launch/local.sh" or "slurm"
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_S
    init_timeout_s: int = DEFAULT_INIT_TIMEOUT_S

    def __post_init__(self):
        if self.num_processes < 1:
            raise ValueError(f"{self.source}: num_processes must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"{self.source}: process_id {self.process_id} is not in [0, {self.num_processes}); give each process "
                "a distinct id from 0 to num_processes - 1"
            )
        if not re.fullmatch(r"\[?[A-Za-z0-9_.:-]+\]?:\d+", self.coordinator):
            raise ValueError(
                f"{self.source}: coordinator address {self.coordinator!r} is not host:port (e.g. node001:12345)"
            )


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'n1,n2' -> n1, 'gpu[07-09,12],cpu3' -> gpu07."""
    m = re.match(r"([^,\[]+)(?:\[([^\],-]+))?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot read a host name from SLURM node list {nodelist!r}")
    return m.group(1) + (m.group(2) or "")


def _int(value, name: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def resolve_launch(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    env: Mapping[str, str] | None = None,
) -> LaunchSpec | None:
    """The launch spec from explicit values, else launch/local.sh's or SLURM's environment; None = one process."""
    env = os.environ if env is None else env
    timeouts = dict(
        heartbeat_timeout_s=_int(env.get(ENV_HEARTBEAT, DEFAULT_HEARTBEAT_S), ENV_HEARTBEAT),
        init_timeout_s=_int(env.get(ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT_S), ENV_INIT_TIMEOUT),
    )
    given = [coordinator_address is not None, num_processes is not None, process_id is not None]
    if any(given):
        if not all(given):
            raise ValueError(
                "give all of --coordinator_address, --num_processes and --process_id (or none of them, to take "
                "them from launch/local.sh's or SLURM's environment)"
            )
        spec = LaunchSpec(coordinator_address, int(num_processes), int(process_id), "flags", **timeouts)
    elif ENV_COORDINATOR in env:
        spec = LaunchSpec(
            env[ENV_COORDINATOR],
            _int(env.get(ENV_NUM_PROCESSES), ENV_NUM_PROCESSES),
            _int(env.get(ENV_PROCESS_ID), ENV_PROCESS_ID),
            "launch/local.sh",
            **timeouts,
        )
    elif "SLURM_NTASKS" in env and "SLURM_PROCID" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise ValueError("SLURM_NTASKS is set but neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is")
        # A port derived from the job id: the same on every task, different between jobs sharing a node.
        port = 20000 + _int(env.get("SLURM_JOB_ID", "0"), "SLURM_JOB_ID") % 20000
        spec = LaunchSpec(
            f"{first_slurm_host(nodelist)}:{port}",
            _int(env["SLURM_NTASKS"], "SLURM_NTASKS"),
            _int(env["SLURM_PROCID"], "SLURM_PROCID"),
            "slurm",
            **timeouts,
        )
    else:
        return None
    return spec if spec.num_processes > 1 else None


def initialize(spec: LaunchSpec | None) -> None:
    """Start ``jax.distributed`` for ``spec`` (nothing for None) and log this process's place and devices.

    Must run before anything touches a JAX backend (device lists, arrays, jit)."""
    import jax

    if spec is not None:
        if jax.distributed.is_initialized():
            raise RuntimeError("jax.distributed is already initialized; call tlt_jax.distributed.initialize once")
        # CPU devices (tests, launch/local.sh) need a cross-process collectives backend; GPUs/TPUs ignore it.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            spec.coordinator,
            spec.num_processes,
            spec.process_id,
            initialization_timeout=spec.init_timeout_s,
            heartbeat_timeout_seconds=spec.heartbeat_timeout_s,
        )
    log.info(
        "process %d of %d (%s): %d local / %d global %s devices",
        jax.process_index(),
        jax.process_count(),
        "single process" if spec is None else f"{spec.source}, coordinator {spec.coordinator}",
        jax.local_device_count(),
        jax.device_count(),
        jax.devices()[0].platform,
    )
