#!/usr/bin/env bash
# One GPU session (issue 24): bench_gpu.py, then the CUDA-marked tests. From the repository
# root on the GPU machine, as one command (device time is scarce: about 7-9 minutes):
#
#   bash benchmarks/gpu_session.sh
#
# Logs and bench_gpu.json go to $OUT (the device tool's folder) or /tmp/actstore-gpu-session.
# The machine has torch, transformers, numpy, xxhash, typer, pytest and hypothesis but not
# zarr or datasets: without them the zarr and saelens rows say "skipped". To measure them,
# carry wheels made here first (Python 3.12, x86-64; see /work/.library/device/README.md):
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl zarr==3.1.6 numcodecs==0.16.6 \
#     donfig==0.8.1.post1 google-crc32c datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
#
# and pass WHEELS=.whl (with .whl in the call's carry list). BENCH_ARGS=--small tries it all on a CPU.
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
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 - <<'EOF' | tee -a "$out/gpu.txt"
import importlib.util, os, sys, torch
missing = [m for m in ("zarr", "datasets", "xxhash", "typer") if importlib.util.find_spec(m) is None]
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} cores; "
      f"missing: {', '.join(missing) or 'none'}")
EOF
status=0
timeout "${BENCH_TIMEOUT:-450}" python3 benchmarks/bench_gpu.py ${BENCH_ARGS:-} --json "$out/bench_gpu.json" \
    2>&1 | tee "$out/bench_gpu.log" || status=1
# part 3: verified warm reads on all 16 cores, against the best page-cache read
timeout "${LOADER_TIMEOUT:-120}" python3 benchmarks/bench_loader.py --data-dir /tmp/actstore-bl \
    --gib 2 --repeats 2 --skip-naive --skip-cold --skip-mixing --workers 4 \
    2>&1 | tee "$out/bench_loader_warm.log" || status=1
# only the modules holding CUDA tests: the others import test-only packages (moto, sae-lens)
timeout "${TEST_TIMEOUT:-140}" python3 -m pytest -m cuda -q -p no:cacheprovider \
    tests/test_gpu.py tests/test_loader.py 2>&1 | tee "$out/pytest_cuda.log" || status=1
exit $status
