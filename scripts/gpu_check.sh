#!/usr/bin/env bash
# One prepared run for a machine with an NVIDIA GPU (the `device` tool, or any CUDA box). Steps, in
# the order of what matters most if the budget runs short:
#   1. losslessness on CUDA (tests/core/test_cuda.py: every architecture x cache x copy engine, the
#      ordering of asynchronous copies by CUDA events; the pinned store, dense weights on the GPU),
#   2. pinned-host-to-device bandwidth of the copy engines for Qwen3-30B-A3B-sized experts, against
#      one contiguous cudaMemcpy of the same bytes,
#   3. real copy/compute overlap of the asynchronous copy engines (scripts/overlap_check.py): a pass of
#      layers whose next layer's experts are copied while this layer computes, against the same copies
#      and compute in series; hidden_fraction 1.0 = the smaller of the two fully hidden,
#   4. decoding at Qwen3-30B-A3B's layer dims with offloaded experts and real transfers
#      (scripts/real_dims_decode.py): every expert resident, an LRU cache, the LRU cache with the
#      look-ahead prefetch (torch copy engine; the Triton one in step 8),
#   5. issue 14's bar (`specfit bench`, the command of docs/results.md) with the demo pair computing on
#      the GPU and copies charged by the emulated link; 6. issue 15's live check on that setup,
#   7. the expert compute at Qwen3-30B-A3B layer dims (specfit.bench.real_dims --device cuda): the
#      Triton kernel, torch's grouped GEMM and the Python loop against transformers' grouped_mm,
#   9. the fitted next-layer router's cost at Qwen3-30B-A3B's router dims (scripts/next_router_cost.py),
#   10. step 7 in float32, where every implementation must give output identical to the loop,
#   11. the whole test suite on the GPU machine (Engine's device defaults to CUDA there), if time is left.
# Everything goes to one results folder, ${OUT:-gpu-results}/ (NAME.txt per step, JSONL beside it).
# ONLY=REGEX runs just the steps whose names match (ONLY='test-cuda|decode').
# The whole run stays under BUDGET seconds (default 570, under 10 minutes): each step runs with a
# timeout of its cap or what is left, whichever is less; a step the budget no longer allows is
# skipped and says so.
#
# A dry run of everything that can run without a GPU, with tiny settings (a few minutes):
#   DEVICE=cpu SMALL=1 OUT=/tmp/gpu-dry bash scripts/gpu_check.sh
#
# The device image has its own torch/triton/transformers and no network: the pure-Python
# packages specfit needs beyond it travel as wheels in .gpu-wheels/, and issue 14/15's bar steps
# read the held-out text from a copy of ../shared/data in .shared-data/ (it does not travel with
# the working tree; SPECFIT_DATA_DIR then points there). scripts/gpu_bundle.sh makes both (ignored
# by git; name both in the run's `carry`) and shows the device command.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
DEVICE=${DEVICE:-cuda}  # cpu: the dry run (Triton and the bandwidth need CUDA: they report that and stop)
SMALL=${SMALL:-0}  # 1: tiny dimensions and short runs (the dry run)
BUDGET=${BUDGET:-570}
WORK=${WORK:-${TMPDIR:-/tmp}/specfit-real-dims}  # the real-dims checkpoint (GBs): kept out of $OUT
COPIES=${COPIES:-$([ "$DEVICE" = cpu ] && echo torch || echo "triton torch")}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export SPECFIT_HOME=${SPECFIT_HOME:-$OUT/specfit-home}  # the bench's calibrations, kept with the results
if [ -d .shared-data ]; then export SPECFIT_DATA_DIR=${SPECFIT_DATA_DIR:-$PWD/.shared-data}; fi
PY=${PYTHON:-python3}

# step CAP NAME COMMAND...: COMMAND with a timeout of CAP seconds or the budget left, its output
# shown and kept in $OUT/NAME.txt (last line: its exit status).
step() {
  local cap=$1 name=$2 left limit status
  shift 2
  left=$((BUDGET - SECONDS))
  limit=$((cap < left ? cap : left))
  if [ -n "${ONLY:-}" ] && ! [[ "$name" =~ $ONLY ]]; then
    return
  fi
  if [ "$limit" -lt 15 ]; then
    echo "== $name: skipped, ${left}s of the ${BUDGET}s budget left" | tee "$OUT/$name.txt"
    return
  fi
  echo "== $name (at most ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
  status=${PIPESTATUS[0]}
  echo "# exit $status$([ "$status" = 124 ] && echo " (timed out after ${limit}s)")" | tee -a "$OUT/$name.txt"
}

if [ "$SMALL" = 1 ]; then
  DIMS=(--hidden 64 --experts 8 --intermediate 32 --top-k 2 --heads 4 --kv-heads 2 --head-dim 16 --vocab 256
        --tokens 12 --repeats 2)
  H2D=(--experts 8 --hidden 64 --intermediate 32 --batches 1,4 --iters 2 --warmup 1)
  BAR=(workload.num_prompts=1 max_new_tokens=8 repeats=1)
  LIVE=(workload.num_prompts=1 max_new_tokens=8 repeats=1)
  OVERLAP=(--layers 3 --experts 2 --expert-mb 0.25 --dim 128 --matmuls 2 --repeats 2)
  DECODE=(--layers 3 --hidden 128 --experts 16 --intermediate 32 --capacity 8 --prompts 1 --prompt-len 16
          --new-tokens 8 --repeats 1)
else
  DIMS=(--repeats 10)
  H2D=(--batches 1,8,32,64)
  BAR=(workload.num_prompts=4 max_new_tokens=48 repeats=2)
  LIVE=(workload.num_prompts=8 max_new_tokens=48 repeats=3)
  OVERLAP=()
  # the expert compute: grouped, as the Triton kernel autotunes every new shape in each process (step 7)
  DECODE=(--layers 4 --capacity 32 --prompts 2 --prompt-len 64 --new-tokens 32 --repeats 2 --expert-compute grouped)
fi

if [ -d .gpu-wheels ]; then  # beside the image's packages, ahead of them on the path
  SITE=${SITE:-/tmp/specfit-site}
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .gpu-wheels/*.whl 2>&1 | tail -2
  export PYTHONPATH=$PYTHONPATH:$SITE
fi
$PY - <<'PY' | tee "$OUT/env.txt"
import platform, torch, transformers
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = None
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
print("torch", torch.__version__, "cuda", torch.version.cuda, gpu)
print("transformers", transformers.__version__, "triton", triton_version, "host", platform.node())
PY

XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-6}")
step 120 1-test-cuda $PY -m pytest -q -p no:cacheprovider -rfE $XDIST tests/core/test_cuda.py \
  tests/core/test_streaming_load.py::test_dense_weights_land_on_the_gpu_and_the_store_is_pinned \
  tests/core/test_copy_engines.py::test_triton_cuda_rejects_pageable_store
step 30 2-h2d-bandwidth $PY -m specfit.bench.h2d_bandwidth --out "$OUT/h2d_bandwidth.jsonl" "${H2D[@]}"
step 30 3-overlap $PY scripts/overlap_check.py --device "$DEVICE" --copies "$(echo $COPIES | tr ' ' ,)" \
  --out "$OUT/overlap.jsonl" "${OVERLAP[@]}"
read -r -a ENGINES <<< "$COPIES"
MAIN_COPY=torch  # the engine that overlaps copies with compute; the others run later (step 8)
[[ " ${ENGINES[*]} " == *" torch "* ]] || MAIN_COPY=${ENGINES[0]}
step 120 "4-real-dims-decode-$MAIN_COPY" $PY scripts/real_dims_decode.py --device "$DEVICE" --copy "$MAIN_COPY" \
  --workdir "$WORK" --out "$OUT/real-dims-decode-$MAIN_COPY" "${DECODE[@]}"
# Issue 14's bar and issue 15's live check, as docs/results.md runs them on the CPU, with the target on
# this device: the demo pair's compute on the GPU, its expert copies charged by the emulated link
# (Qwen3-30B-A3B experts over PCIe 4.0). The second run builds fresh engines on the setup the first
# calibrated (issue 15: "a fresh engine on a calibrated setup").
step 150 5-bar-issue14 env SPECFIT_HOME="$OUT/bar-home" $PY -m specfit.cli bench model=demo workloads=[prose,gsm] \
  methods=[ar,ar_prefetch,specfit,specfit_prefetch,eagle3,eagle3_prefetch] cache.capacity=8 cache.copy=emulated \
  "${BAR[@]}" warmup=1 model.device="$DEVICE" hydra.run.dir="$OUT/bar-issue14"
step 90 6-live-issue15 env SPECFIT_HOME="$OUT/bar-home" $PY -m specfit.cli bench model=demo workloads=[prose,gsm] \
  methods=[ar,specfit] cache.capacity=8 cache.copy=emulated "${LIVE[@]}" warmup=1 model.device="$DEVICE" \
  hydra.run.dir="$OUT/live-issue15"
step 90 7-real-dims $PY -m specfit.bench.real_dims --device "$DEVICE" --workdir "$WORK" --measures ops,time \
  --out "$OUT/real_dims.jsonl" "${DIMS[@]}"
for copy in "${ENGINES[@]}"; do  # the other copy engine (triton), where both run
  [ "$copy" = "$MAIN_COPY" ] && continue
  step 90 "8-real-dims-decode-$copy" $PY scripts/real_dims_decode.py --device "$DEVICE" --copy "$copy" \
    --workdir "$WORK" --out "$OUT/real-dims-decode-$copy" "${DECODE[@]}"
done
step 20 9-next-router $PY scripts/next_router_cost.py --device "$DEVICE"
step 60 10-real-dims-fp32 $PY -m specfit.bench.real_dims --device "$DEVICE" --workdir "$WORK" --dtype float32 \
  --numerics native --measures ops,time --out "$OUT/real_dims_fp32.jsonl" "${DIMS[@]}"
if [ "$DEVICE" != cpu ]; then  # the dry run leaves the suite to `make test`
  step 240 11-test-suite $PY -m pytest -q -p no:cacheprovider -rfE --maxfail=20 $XDIST tests
fi
echo "== done in ${SECONDS}s; results in $OUT/"
