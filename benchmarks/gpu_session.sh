#!/usr/bin/env bash
# One GPU session (issues 24, 29 and 37), at most 9 minutes: every CUDA test (within 150
# s), then bench_gpu.py --quick (under 4 minutes on an H100/H200: capture rows, the loader
# into CUDA in process / with workers / through `serve`, and SAE training fed by each of
# them against resident batches, fp32 and bf16 autocast), then the warm verified loader
# on all cores against the best page-cache read (bench_loader.py, 2 GiB, in process and
# 4 workers, 90 s) and the read path's stage table (bench_read_stages.py: CPU s/GB per
# stage, cold and warm, 80 s). From the repository root on the GPU machine, as one
# command:
#
#   bash benchmarks/gpu_session.sh
#
# Logs and bench_gpu.json go to $OUT (the device tool's folder) or /tmp/actstore-gpu-session.
# LOADER=0 skips the two loader benchmarks; FULL=1 runs bench_gpu.py without --quick
# (every format and the heavy case: 4-7 minutes more). BENCH_ARGS=--small tries the
# benchmark on a CPU.
#
# The machine has torch, transformers, numpy, xxhash, typer, pytest and hypothesis but not
# zarr or datasets: without them the zarr and saelens rows say "skipped" (only with FULL=1;
# to measure them, carry wheels made here and pass WHEELS=.whl: see
# /work/.library/device/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/actstore-gpu-session}
mkdir -p "$out"
if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/actstore-site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/actstore-site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_DISABLE=1
started=$(date +%s)
stamp() { echo "[t+$(($(date +%s) - started))s] $*" | tee -a "$out/times.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 - <<'EOF' | tee -a "$out/gpu.txt"
import importlib.util, os, sys, torch
missing = [m for m in ("zarr", "datasets", "xxhash", "typer") if importlib.util.find_spec(m) is None]
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} cores; "
      f"missing: {', '.join(missing) or 'none'}; ulimit -l: ", end="")
EOF
ulimit -l | tee -a "$out/gpu.txt"
status=0
# 1. every CUDA test first (the modules holding them; the others import test-only packages)
stamp "pytest -m cuda"
timeout --kill-after=10 "${TEST_TIMEOUT:-150}" python3 -m pytest -m cuda -v -p no:cacheprovider \
    -o addopts="" --durations=10 tests/test_gpu.py tests/test_loader.py tests/test_loader_device.py \
    2>&1 | tee "$out/pytest_cuda.log" || status=1
# 2. the quick benchmark
stamp "bench_gpu.py"
quick=--quick
[ -n "${FULL:-}" ] && quick=
timeout --kill-after=10 "${BENCH_TIMEOUT:-240}" python3 benchmarks/bench_gpu.py $quick ${BENCH_ARGS:-} \
    --json "$out/bench_gpu.json" 2>&1 | tee "$out/bench_gpu.log" || status=1
# 3. verified warm reads on all cores, against the best page-cache read; the stage table
if [ "${LOADER:-1}" != 0 ]; then
    stamp "bench_loader.py"
    timeout --kill-after=10 "${LOADER_TIMEOUT:-90}" python3 benchmarks/bench_loader.py \
        --data-dir /tmp/actstore-bl --gib 2 --repeats 2 --skip-naive --skip-cold --skip-mixing \
        --workers 4 --mix "" 2>&1 | tee "$out/bench_loader_warm.log" || status=1
    stamp "bench_read_stages.py"
    timeout --kill-after=10 "${STAGES_TIMEOUT:-80}" python3 benchmarks/bench_read_stages.py \
        --data-dir /tmp/actstore-bl --gib 2 --torch-threads 4 --configs mapped,bf16,workers \
        --json "$out/bench_read_stages.json" 2>&1 | tee "$out/bench_read_stages.log" || status=1
fi
stamp "done (status $status)"
exit $status
