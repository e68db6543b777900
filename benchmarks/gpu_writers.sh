#!/usr/bin/env bash
# The GPU rows of issue 28 (writers at the disk's speed), as one prepared command: at most
# ~8 minutes on an H100/H200 with 16 cores and a 0.9-1.5 GB/s disk. From the repository root:
#
#   bash benchmarks/gpu_writers.sh
#
# In order of priority, each step under its own timeout (seconds, overridable):
#   1. bench_writers.py, part sites24: all 24 sites of a 24-layer model to saev (d=512,
#      ~85 shards) vs raw write + fsync, and the journal's cost per shard  SITES24_TIMEOUT=30
#   2. bench_writers.py, part disk: every writer (saev, activault, saelens, pickle, zarr:
#      zarr last, the slowest) fed bfloat16 and float32 batches (the Qwen2-0.5B shape of
#      issue 28's table: d=896, 1024 tokens, sites 6 and 12) vs raw write + fsync of the
#      same bytes on /tmp (the disk), through the page cache and direct (the faster is the
#      baseline), medians of 2 interleaved repetitions                  WRITERS_TIMEOUT=160
#   3. bench_gpu.py, every format: capture >= 0.95 of max(forward, raw write), every layer
#      >= 0.9 of the raw write (its last row; a timeout cuts it first) GPU_TIMEOUT=180
#   4. bench_large_model.py: the 70B shape, to activault (>= 0.95 of the forward pass) and
#      saev (>= 0.95 of the disk)                                     LARGE_TIMEOUT=90
#   5. bench_writers.py, part stages: CPU seconds per GB per pipeline stage into tmpfs, and
#      throughput at 1, 4 and 16 writer threads (saev, activault, saelens fed bfloat16)
#                                                                     STAGES_TIMEOUT=20
#
# Timeouts sum to 480 s; give the device call timeout_s=560 (startup, pool building).
#
# Logs and JSON go to $OUT (the device tool's folder; 8 files, its limit) or /tmp/actstore-gpu-writers.
# zarr and datasets were not installed on the last GPU machine: without them the zarr and
# saelens rows print "SKIPPED". To measure them, carry wheels as benchmarks/gpu_session.sh's
# header says and pass WHEELS=.whl (with .whl in the call's carry list).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/actstore-gpu-writers}
mkdir -p "$out"
if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/actstore-site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/actstore-site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_DISABLE=1
start=$(date +%s)
stamp() { echo "[t+$(($(date +%s) - start))s] $*" | tee -a "$out/env.txt"; }
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    nproc
    free -g | head -2
    df -h /tmp /dev/shm
    python3 -c 'import importlib.util as u, torch; print(torch.__version__, [m for m in ("zarr", "datasets", "xxhash") if u.find_spec(m) is None], "missing")'
} 2>&1 | tee "$out/env.txt"
status=0
shape=(--d 896 --tokens 1024 --batch-size 8 --sites 6,12)

stamp "bench_writers sites24 start"
timeout "${SITES24_TIMEOUT:-30}" python3 benchmarks/bench_writers.py --parts sites24 \
    --sites24-d 512 --sites24-gib 2 --sites24-tokens 128 --sites24-shard-mib 24 --repeats 2 \
    --dir /tmp --json "$out/writers_sites24.json" 2>&1 | tee "$out/writers_disk.log" || status=1

stamp "bench_writers disk start"
timeout "${WRITERS_TIMEOUT:-160}" python3 benchmarks/bench_writers.py --parts disk \
    --formats saev,activault,saelens,pickle,zarr "${shape[@]}" --gib "${WRITERS_GIB:-1.5}" \
    --pickle-gib 0.5 --repeats 2 --dir /tmp --json "$out/writers_disk.json" 2>&1 \
    | tee -a "$out/writers_disk.log" || status=1

stamp "bench_gpu start"
timeout "${GPU_TIMEOUT:-180}" python3 benchmarks/bench_gpu.py --repeats 1 --dir /tmp \
    --formats saev,activault,zarr,pickle,saelens ${GPU_ARGS:-} --json "$out/bench_gpu.json" \
    2>&1 | tee "$out/bench_gpu.log" || status=1

stamp "bench_large_model start"
timeout "${LARGE_TIMEOUT:-90}" python3 benchmarks/bench_large_model.py --tokens 65536 \
    --budget-s "${LARGE_BUDGET:-75}" --out /tmp 2>&1 | tee "$out/large.log" || status=1

stamp "bench_writers stages start"
timeout "${STAGES_TIMEOUT:-20}" python3 benchmarks/bench_writers.py --parts stages \
    "${shape[@]}" --formats saev,activault,saelens --feeds bfloat16 \
    --stage-gib 0.25 --stage-repeats 1 --threads 1,4,16 \
    --tmpfs /dev/shm 2>&1 | tee "$out/writers_stages.log" || status=1
stamp "done (status $status)"
exit $status
