#!/usr/bin/env bash
# One GPU session's device checks (issues 44 and 45), run from the repository root on the GPU machine; every step
# has its own timeout and writes its log under $OUT, so a step that fails or overruns leaves the others' results.
#
#   bash benchmarks/gpu_session.sh suite    # wheels from .whl/ into .site/, then benchmarks/gpu_suite.py
#   bash benchmarks/gpu_session.sh tests    # the GPU tests (kernel parity, engines with the kernel)
#   bash benchmarks/gpu_session.sh tlt      # join the real weights (.xfer/), then benchmarks/gpu_tlt.py with the
#                                           # prompts of .xfer/p3/data (gpu_tlt.py --prepare_data, made here)
#
# Made here first: `python benchmarks/gpu_weights.py split`, `python benchmarks/gpu_tlt.py --prepare_data=.xfer/p3/data`
# (the GPU image has no reasoning-gym). Then three `run` calls on one warm machine, each carrying one piece (sizes with
# the 19.8 MiB working tree, limit 64 MiB): suite with carry [".whl", ".xfer/p1"] (56.1 MiB), tests with [".xfer/p2"]
# (51.1 MiB), tlt with [".xfer/p3"] (51.2 MiB); .whl, .site and the earlier pieces stay while the machine is warm.
#
# The GPU image (Python 3.12, jax 0.11.2, flax 0.12.10, optax, orbax, chex, torch) lacks some of this project's
# packages: .whl/ (ignored: echo /.whl/ >> .git/info/exclude) holds their py3.12 manylinux wheels, made here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl flax==0.12.12 ml-collections==1.1.0 \
#     grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 tensorboardX==2.6.5 gguf==0.19.0     # 5.3 MB
# and installed there into the ignored .site/ (kept while the machine stays warm).
# SUITE_ARGS / TLT_ARGS add flags (e.g. --smoke for a dry run of this script on a CPU machine); TLT_DATA names another
# data folder; JAX_PLATFORMS=cpu runs the tests step on a CPU stand-in (they skip). Exits with the step's status.
set -u
step=${1:?usage: gpu_session.sh suite|tests|tlt}
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
    >"$OUT/setup.log" 2>&1 || { echo "wheel install failed"; tail -20 "$OUT/setup.log"; }
fi
export PYTHONPATH="$PWD/.site:$PWD"
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" \
  >>"$OUT/setup.log" 2>&1
cat "$OUT/setup.log" | tail -3
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >>"$OUT/setup.log" 2>&1

case "$step" in
  suite)
    timeout 300 python3 benchmarks/gpu_suite.py --out "$OUT/suite.json" --time_budget_s "${SUITE_BUDGET:-220}" \
      ${SUITE_ARGS:-} >"$OUT/suite.log" 2>&1
    rc=$?
    echo "gpu_suite rc=$rc"
    tail -30 "$OUT/suite.log"
    ;;
  tests)
    JAX_PLATFORMS=${JAX_PLATFORMS:-cuda,cpu} timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_kernels.py >"$OUT/tests.log" 2>&1
    rc=$?
    # 0: passed (or, without a GPU, every test skipped); 5: no test selected at all (the gpu marks are gone)
    [ "$rc" = 5 ] && echo "no gpu-marked test collected: check tests/test_kernels.py"
    echo "gpu tests rc=$rc"
    tail -15 "$OUT/tests.log"
    ;;
  tlt)
    python3 benchmarks/gpu_weights.py join >"$OUT/join.log" 2>&1 || { cat "$OUT/join.log"; exit 1; }
    tail -2 "$OUT/join.log"
    timeout "${TLT_TIMEOUT:-240}" python3 benchmarks/gpu_tlt.py --model=.xfer/SmolLM2-135M-Instruct.Q4_1.gguf \
      --data_dir="${TLT_DATA:-.xfer/p3/data}" --out "$OUT/tlt_smollm2.json" --time_budget_s "${TLT_BUDGET:-200}" \
      ${TLT_ARGS:-} >"$OUT/tlt.log" 2>&1
    rc=$?
    echo "gpu_tlt rc=$rc"
    tail -40 "$OUT/tlt.log"
    ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
exit "$rc"
