#!/usr/bin/env bash
# One prepared check for a lent GPU (one H200): `jaxcnn bench` and `jaxcnn compare` at 224x224x3
# for the default CNN and resnet50, fp32 and bf16, on one device, in under 8 minutes.
#
#   bash experiments/gpu_check.sh                     # on the GPU machine, from the repo root
#   GPU_CHECK_SMOKE=1 PYTHON=.venv/bin/python bash experiments/gpu_check.sh   # every step, tiny, on CPU
#   bash experiments/gpu_check.sh fetch-wheels        # here, with network: what the GPU image lacks -> .whl/
#
# Steps, in order of importance (each under `timeout`; a failed or timed-out step is logged and the
# next one runs; the script exits 1 at the end if any failed). Steps that no longer fit the budget
# (GPU_CHECK_BUDGET_S, default 440 s) are skipped and count as failed:
#   env             nvidia-smi, jax.devices(), versions                     -> gpu_h200_env.log
#   bench_fp32      bench --configs default,28,224,resnet18-32, fp32        -> gpu_h200_bench_fp32.csv
#                   (its "dp on data=1 at X% of plain-jit" lines: the 3% target, CNN and resnet18)
#   bench_fill      bench --configs 224 --batch fill: the largest batch whose compiled step fits 70% of
#                   the GPU's memory (jaxcnn.autobatch); that batch is the CNN's below (fallback 256)
#   compare_*       compare --layouts dp[,fsdp] --devices 1 (single is always the baseline) at 224:
#                   the CNN at the fill batch, resnet50 at batch 256 (no fill search: each resnet50
#                   compile is tens of seconds, a search about ten of them), fp32 then bf16
#                   (bf16 at fp32's fill batch: it needs less memory, so the CNN's is not quite full)
#   bench_bf16      bench --configs 224,resnet18-32, bf16
# Results: results/gpu_h200_*.csv, .png and .log, and gpu_h200_summary.txt (each step first deletes
# its own old files); with $OUT set, a tarball of them and the summary are copied there too.
#
# The GPU machine has no network. Its python3 holds jax (with the CUDA plugin), flax, optax,
# orbax, pandas, matplotlib. It lacks grain (jaxcnn.data imports it), array-record and
# portpicker: `fetch-wheels` downloads them here into .whl/ (git-ignored), to be carried along
# (device tool: carry [".whl"]); this script installs .whl/*.whl with pip --target into
# GPU_CHECK_SITE and puts that and the checkout on PYTHONPATH. Where no jax is found at all, it
# falls back to `pip install --target ... '.[cuda12]'` (needs network).
#
# Knobs (environment): PYTHON (python3), GPU_CHECK_SITE (/tmp/gpu_check_site), GPU_CHECK_WHEELS (.whl),
# GPU_CHECK_RESULTS
# (results; smoke: /tmp/gpu_check_smoke), GPU_CHECK_BUDGET_S (440), GPU_CHECK_CNN_BATCH (fill, or
# N), GPU_CHECK_RESNET50_BATCH (256), GPU_CHECK_SMOKE (1: CPU, tiny sizes and models, the same steps).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

WHEELS=(grain==0.2.18 array-record==0.8.6 portpicker==1.6.0)
WHEEL_DIR=${GPU_CHECK_WHEELS:-.whl}

if [[ ${1:-} == fetch-wheels ]]; then
  platforms=()
  for n in 2_28 2_27 2_24 2_17; do platforms+=(--platform "manylinux_${n}_x86_64"); done
  "${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 --platform any -d "$WHEEL_DIR" "${WHEELS[@]}"
  ls -l "$WHEEL_DIR"
  exit 0
fi

SMOKE=${GPU_CHECK_SMOKE:-0}
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
BUDGET=${GPU_CHECK_BUDGET_S:-440}
RESNET50_BATCH=${GPU_CHECK_RESNET50_BATCH:-256}
CNN_BATCH=${GPU_CHECK_CNN_BATCH:-fill}
PREFIX=gpu_h200_
export PYTHONUNBUFFERED=1
if [[ $SMOKE == 1 ]]; then
  RESULTS=${GPU_CHECK_RESULTS:-/tmp/gpu_check_smoke}
  export JAX_PLATFORMS=cpu
  IMAGE=16x16x3 RESNET=resnet_tiny_bottleneck STEPS=1 FILL_CONFIG=default
  BENCH_CONFIGS=default BENCH_BF16_CONFIGS=default
  BENCH_FLAGS=(--steps 2 --rounds 1) FILL_FLAGS=(--fill-memory 16MiB --steps 2 --rounds 1)
  RESNET50_BATCH=8
else
  RESULTS=${GPU_CHECK_RESULTS:-results}
  export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/gpu_check_jax_cache}  # a rerun compiles less
  IMAGE=224x224x3 RESNET=resnet50 STEPS=10 FILL_CONFIG=224
  BENCH_CONFIGS=default,28,224,resnet18-32 BENCH_BF16_CONFIGS=224,resnet18-32
  BENCH_FLAGS=() FILL_FLAGS=(--steps 20 --rounds 4)
fi
mkdir -p "$RESULTS"
START=$SECONDS
SUMMARY="$RESULTS/${PREFIX}summary.txt"
: >"$SUMMARY"
failures=()

note() { echo "$*" | tee -a "$SUMMARY"; }

package() {  # copy what was written to $OUT as one tarball and the summary (the device tool brings back 8 files)
  [[ -n ${OUT:-} ]] || return 0
  mkdir -p "$OUT"
  local out
  out=$(cd "$OUT" && pwd)
  (cd "$RESULTS" && tar -czf "$out/${PREFIX}results.tar.gz" "$PREFIX"*) || true
  cp "$SUMMARY" "$out/" || true
}
trap package EXIT

# step NAME CAP_SECONDS COMMAND...: run under `timeout` (the smaller of CAP and the budget left),
# output to the terminal and results/gpu_h200_NAME.log; a failure is noted and the script goes on.
step() {
  local name=$1 cap=$2 left limit rc=0 began=$SECONDS
  shift 2
  rm -f "$RESULTS/${PREFIX}${name}".*  # no stale result may pass for this run's
  left=$((BUDGET - (SECONDS - START)))
  limit=$((cap < left ? cap : left))
  if ((limit < 20)); then
    note "SKIPPED $name: ${left}s of the ${BUDGET}s budget left"
    failures+=("$name (skipped)")
    return 0
  fi
  echo "=== $name (timeout ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$RESULTS/${PREFIX}${name}.log" || rc=$?
  if ((rc == 0)); then
    note "ok      $name ($((SECONDS - began)) s)"
  else
    note "FAILED  $name (exit $rc$( ((rc == 124)) && echo ", timed out after ${limit}s"), $((SECONDS - began)) s)"
    failures+=("$name")
  fi
}

setup() {  # run in a pipeline (a subshell, where set -e is off): every command checks its own status
  # The device README's way: wheels into a --target folder on PYTHONPATH, nothing built, no venv
  # (its python3.12 may lack ensurepip); the checkout itself is on PYTHONPATH too (see below).
  if compgen -G "$WHEEL_DIR/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEEL_DIR"/*.whl || return 1
  fi
  if ! PYTHONPATH=$SITE "$PY" -c 'import jax, flax, optax' 2>/dev/null; then
    "$PY" -m pip install -q --target "$SITE" '.[cuda12]' || return 1  # needs network
  fi
  PYTHONPATH=$SITE "$PY" -c 'import grain' || {
    echo "grain is missing: run 'bash experiments/gpu_check.sh fetch-wheels' where pip has network, carry .whl"
    return 1
  }
}

env_report() {
  if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "no nvidia-smi"; fi
  "$VPY" - "$SMOKE" <<'EOF'
import sys

import flax
import jax
import jaxlib

print("python", sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__, "flax", flax.__version__)
print("devices", jax.devices())
device = jax.devices()[0]
print("memory_stats", device.memory_stats())
if sys.argv[1] != "1" and device.platform != "gpu":
    sys.exit(f"no GPU: JAX runs on {device.platform}; the sizes here are for a GPU (GPU_CHECK_SMOKE=1 for a CPU)")
EOF
}

fill_batch_of() {  # the batch `bench --batch fill` chose, from its CSV; the fallback when that failed
  "$VPY" -c 'import sys, pandas; print(int(pandas.read_csv(sys.argv[1])["global_batch_size"].iloc[0]))' "$1" \
    2>/dev/null || echo "$2"
}

compare() {  # compare NAME MODEL DTYPE BATCH LAYOUTS
  step "compare_$1" 180 "$VPY" experiments/compare_layouts.py --model "$2" --dtype "$3" --synthetic "$IMAGE" \
    --batch-size "$4" --layouts "$5" --devices 1 --steps "$STEPS" \
    --out "$RESULTS/${PREFIX}compare_$1.csv" --plot "$RESULTS/${PREFIX}compare_$1.png"
}

note "gpu_check $(date -u +%FT%TZ) smoke=$SMOKE budget=${BUDGET}s results=$RESULTS"
if ! setup 2>&1 | tee "$RESULTS/${PREFIX}setup.log"; then
  note "FAILED  setup (see ${PREFIX}setup.log)"
  exit 1
fi
VPY=$PY
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}  # the wheels, then jaxcnn from this checkout
export VPY SMOKE
export -f env_report
step env 60 bash -c env_report
if [[ ${failures[*]-} == *env* ]]; then exit 1; fi  # no GPU, or JAX broken: nothing below would mean anything

step bench_fp32 150 "$VPY" experiments/bench.py --configs "$BENCH_CONFIGS" "${BENCH_FLAGS[@]}" \
  --out "$RESULTS/${PREFIX}bench_fp32.csv"
cnn_batch=$CNN_BATCH
if [[ $cnn_batch == fill ]]; then
  step bench_fill 120 "$VPY" experiments/bench.py --configs "$FILL_CONFIG" --batch fill "${FILL_FLAGS[@]}" \
    --out "$RESULTS/${PREFIX}bench_fill.csv"
  cnn_batch=$(fill_batch_of "$RESULTS/${PREFIX}bench_fill.csv" "$([[ $SMOKE == 1 ]] && echo 8 || echo 256)")
  note "        the CNN's batch at $IMAGE: $cnn_batch"
fi
compare cnn224_fp32 cnn2d_3layer_fullconnected_3layer float32 "$cnn_batch" dp,fsdp
compare cnn224_bf16 cnn2d_3layer_fullconnected_3layer bfloat16 "$cnn_batch" dp,fsdp
compare resnet50_224_fp32 "$RESNET" float32 "$RESNET50_BATCH" dp
compare resnet50_224_bf16 "$RESNET" bfloat16 "$RESNET50_BATCH" dp
step bench_bf16 120 "$VPY" experiments/bench.py --configs "$BENCH_BF16_CONFIGS" --dtype bfloat16 \
  "${BENCH_FLAGS[@]}" --out "$RESULTS/${PREFIX}bench_bf16.csv"

note "total $((SECONDS - START)) s; ${#failures[@]} failed${failures[*]:+: ${failures[*]}}"
((${#failures[@]} == 0))
