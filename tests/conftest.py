"""Test-wide setup: 8 simulated CPU devices and a persistent compilation cache, set before JAX is imported."""

import os
from importlib.metadata import version

# Tiny models: XLA's CPU backend spends far longer compiling a program than running it, so the tests (and the
# processes they start, which inherit the environment) compile with LLVM's cheap pipeline and XLA's older fusion
# emitters, whose code generation is several times cheaper than the default MLIR emitters' (a cold 2-slice online run,
# tests/test_online_tail.py: 74 s of compiles -> 24 s); CI starts cold. jaxlib 0.11 (the Python 3.12 set) no
# longer has the --xla_cpu_use_fusion_emitters flag (an unknown XLA flag aborts the process): LLVM's pipeline only.
_FAST_COMPILE = " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# No Eigen intra-op thread pool: on 2 shared cores, two pytest workers and the processes they start already fill the
# machine, and the pool's threads only contend with them (`/usr/bin/time pytest tests/test_rollout.py`, warm cache,
# 4 runs each: 14.0-17.1 s of CPU without the pool, 18.7-21.3 s with it).
_FAST_COMPILE += " --xla_cpu_multi_thread_eigen=false"
if tuple(int(p) for p in version("jaxlib").split(".")[:2]) < (0, 11):
    _FAST_COMPILE += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8" + _FAST_COMPILE
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_CACHE = os.environ.setdefault(
    "TLT_JAX_COMPILATION_CACHE", os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache")
)

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

from absl import flags  # noqa: E402

# grain reads absl flags in worker processes; pytest never parses them.
flags.FLAGS.mark_as_parsed()
