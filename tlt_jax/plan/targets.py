"""Compile-only devices of real accelerators, so a run's programs can be compiled by the compiler that will run them.

``compile_only_devices("h100:1x8")`` gives 8 H100s of one process for XLA:GPU (needs ``jax-cuda12-plugin`` and
``jax-cuda12-pjrt``, no CUDA libraries and no GPU); ``"h100:4x8"`` 32 H100s over 4 processes (nodes);
``"v5p:4x4x2"`` / ``"v5e:16x16"`` a TPU pod slice for libtpu (needs ``libtpu``). The devices take
``jit(...).lower(...).compile()`` (``memory_analysis()``, ``as_text()``), never an execution. Install the compilers
with ``pip install -e '.[plan-gpu]'`` / ``'.[plan-tpu]'``.

With either plugin installed JAX tries to start that backend in every process; ``quiet_platforms`` keeps JAX on the
CPU (call it before JAX starts a backend) so a target works with no environment variable set.
"""

from __future__ import annotations

import dataclasses
import os
import re

__all__ = ["GPU_SPECS", "Target", "compile_only_devices", "parse_target", "quiet_platforms"]


def _gpu_spec(*, name: str, memory_bytes: int, bandwidth: int, cores: int, clock_ghz: float, l2_bytes: int) -> str:
    """A ``GpuTargetConfig`` text proto for a Hopper GPU (compute capability 9.0): what XLA:GPU needs to compile."""
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {cores}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: {l2_bytes}
  clock_rate_ghz: {clock_ghz}
  device_memory_size: {memory_bytes}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 1 patch: 0 }}
device_description_str: "{name}"
"""


# NVIDIA's published SXM figures: H100 80 GB HBM3 at 3.35 TB/s, H200 141 GB HBM3e at 4.8 TB/s; 132 SMs, 50 MB L2.
GPU_SPECS = {
    "h100": _gpu_spec(name="NVIDIA H100 80GB HBM3", memory_bytes=84_942_979_072, bandwidth=3_352_320_000_000,
                      cores=132, clock_ghz=1.98, l2_bytes=52_428_800),
    "h200": _gpu_spec(name="NVIDIA H200", memory_bytes=150_754_820_096, bandwidth=4_800_000_000_000,
                      cores=132, clock_ghz=1.98, l2_bytes=52_428_800),
}
GPU_MEMORY_GB = {"h100": 80.0, "h200": 141.0}
TPU_MEMORY_GB = {"v5p": 95.0, "v5e": 16.0, "v6e": 32.0, "v4": 32.0}


@dataclasses.dataclass(frozen=True)
class Target:
    """A parsed ``--target``: ``kind`` (h100, h200, v5p, ...), its topology, the platform, memory per device."""

    name: str  # as given, e.g. "h100:1x8"
    kind: str
    topology: str
    platform: str  # "gpu" or "tpu"
    device_memory_gb: float

    @property
    def processes(self) -> int | None:
        """GPU: the processes (nodes) of ``PxD``; TPU: None (libtpu decides)."""
        return int(self.topology.split("x")[0]) if self.platform == "gpu" else None


def parse_target(name: str) -> Target:
    """``h100:PxD`` / ``h200:PxD`` (P processes x D GPUs each) or a TPU topology such as ``v5p:4x4x2``, ``v5e:16x16``;
    a ValueError naming the accepted forms otherwise."""
    m = re.fullmatch(r"(h100|h200):(\d+)x(\d+)", name.strip().lower())
    if m:
        kind, p, d = m.group(1), int(m.group(2)), int(m.group(3))
        if p < 1 or d < 1:
            raise ValueError(f"target {name!r}: processes and GPUs per process must be >= 1")
        return Target(name, kind, f"{p}x{d}", "gpu", GPU_MEMORY_GB[kind])
    m = re.fullmatch(r"(v5p|v5e|v6e|v4):(\d+(?:x\d+){1,2})", name.strip().lower())
    if m:
        return Target(name, m.group(1), m.group(2), "tpu", TPU_MEMORY_GB[m.group(1)])
    raise ValueError(
        f"unknown target {name!r}: use h100:PxD or h200:PxD (P processes x D GPUs, e.g. h100:1x8) for XLA:GPU, or a "
        "TPU topology such as v5p:4x4x2 or v5e:16x16 for libtpu"
    )


def quiet_platforms() -> None:
    """Keep JAX on the CPU in this process unless the user chose platforms: with jax-cuda12-plugin or libtpu installed
    JAX would otherwise try (and fail) to start a GPU / TPU backend. Effective before JAX starts a backend."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")  # silences libtpu's start-up probe of a TPU VM
    import jax

    try:
        if not jax.config.jax_platforms:
            jax.config.update("jax_platforms", "cpu")
    except Exception:  # a backend already runs: nothing to change
        pass


def compile_only_devices(target: Target | str) -> list:
    """The target's devices, compile-only, in process-major order (an ImportError naming the package to install when
    its compiler is missing)."""
    if isinstance(target, str):
        target = parse_target(target)
    quiet_platforms()
    if target.platform == "gpu":
        try:
            import jax_plugins.xla_cuda12  # noqa: F401
        except ImportError as e:
            raise ImportError(
                f"target {target.name}: XLA:GPU is not installed; pip install -e '.[plan-gpu]' (jax-cuda12-plugin and "
                "jax-cuda12-pjrt of this jax's version; no GPU or CUDA libraries needed)"
            ) from e
        from jax._src import xla_bridge

        topo = f"1x{target.topology}"  # slices x hosts x devices per host
        desc = xla_bridge.make_pjrt_topology("cuda", topo, target_config=GPU_SPECS[target.kind], topology=topo)
        devices = list(desc._make_compile_only_devices())
    else:
        try:
            import libtpu  # noqa: F401
        except ImportError as e:
            raise ImportError(f"target {target.name}: libtpu is not installed; pip install -e '.[plan-tpu]'") from e
        from jax.experimental import topologies

        devices = list(topologies.get_topology_desc(platform="tpu", topology_name=f"{target.kind}:"
                                                    f"{target.topology}").devices)
    return sorted(devices, key=lambda d: (d.process_index, d.id))
