#!/usr/bin/env bash
# One prepared run for a machine with an NVIDIA GPU (the `device` tool, or any CUDA box):
#   1. the expert compute at Qwen3-30B-A3B layer dims (specfit.bench.real_dims --device cuda): the
#      Triton kernel, torch's grouped GEMM and the Python loop against transformers' grouped_mm, ops
#      and time per pass and per layer, peak host memory of building the engine; then the same in
#      float32, where every implementation must give output identical to the loop,
#   2. pinned-host-to-device bandwidth of the copy engines for Qwen3-30B-A3B-sized experts, against
#      one contiguous cudaMemcpy of the same bytes,
#   3. losslessness on CUDA (tests/core/test_cuda.py: every architecture x cache x copy engine),
#   4. one `specfit bench` of AR / AR + prefetch / EAGLE-3 / SpecFit with offloading and real transfers (no emulation)
#      on the demo pair, per copy engine,
#   5. real copy/compute overlap of the asynchronous copy engines (scripts/overlap_check.py): a pass of
#      layers whose next layer's experts are copied while this layer computes, against the same copies
#      and compute in series; hidden_fraction 1.0 = the smaller of the two fully hidden,
#   6. the fitted next-layer router's cost at Qwen3-30B-A3B's router dims (scripts/next_router_cost.py).
# Everything goes to one results folder, ${OUT:-gpu-results}/ (NAME.txt per step, JSONL beside it).
# The whole run stays under BUDGET seconds (default 570, under 10 minutes): each step runs with a
# timeout of its cap or what is left, whichever is less; a step the budget no longer allows is
# skipped and says so.
#
# A dry run of everything that can run without a GPU, with tiny settings (about two minutes):
#   DEVICE=cpu SMALL=1 OUT=/tmp/gpu-dry bash scripts/gpu_check.sh
#
# The device image has its own torch/triton/transformers and no network: the pure-Python
# packages specfit needs beyond it travel as wheels made here with
#   pip download --no-deps -d .gpu-wheels hydra-core==1.3.8 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 transformers==5.24.0
# (named in the run's `carry`).
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
PY=${PYTHON:-python3}

# step CAP NAME COMMAND...: COMMAND with a timeout of CAP seconds or the budget left, its output
# shown and kept in $OUT/NAME.txt (last line: its exit status).
step() {
  local cap=$1 name=$2 left limit status
  shift 2
  left=$((BUDGET - SECONDS))
  limit=$((cap < left ? cap : left))
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
  BENCH=(workload.num_prompts=1 max_new_tokens=8)
  OVERLAP=(--layers 3 --experts 2 --expert-mb 0.25 --dim 128 --matmuls 2 --repeats 2)
else
  DIMS=(--repeats 10)
  H2D=(--batches 1,8,32,64)
  BENCH=(workload.num_prompts=2 max_new_tokens=64)
  OVERLAP=()
fi

if [ -d .gpu-wheels ]; then $PY -m pip install -q --no-index --no-deps .gpu-wheels/*.whl 2>&1 | tail -2; fi
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

step 150 1-real-dims $PY -m specfit.bench.real_dims --device "$DEVICE" --workdir "$WORK" --measures ops,time \
  --out "$OUT/real_dims.jsonl" "${DIMS[@]}"
step 120 1-real-dims-memory $PY -m specfit.bench.real_dims --device "$DEVICE" --workdir "$WORK" --measures memory \
  --out "$OUT/real_dims.jsonl" "${DIMS[@]}"
step 100 1-real-dims-fp32 $PY -m specfit.bench.real_dims --device "$DEVICE" --workdir "$WORK" --dtype float32 \
  --numerics native --measures ops,time --out "$OUT/real_dims_fp32.jsonl" "${DIMS[@]}"
step 60 2-h2d-bandwidth $PY -m specfit.bench.h2d_bandwidth --out "$OUT/h2d_bandwidth.jsonl" "${H2D[@]}"
step 120 3-test-cuda $PY -m pytest -q -p no:cacheprovider tests/core/test_cuda.py
for copy in $COPIES; do
  step 120 "4-bench-$copy" $PY -m specfit.cli bench model=demo workloads=[prose] methods=[ar,ar_prefetch,eagle3,specfit] \
    "${BENCH[@]}" cache.copy="$copy" model.device="$DEVICE" hydra.run.dir="$OUT/bench-$copy"
done
step 90 5-overlap $PY scripts/overlap_check.py --device "$DEVICE" --copies "$(echo $COPIES | tr ' ' ,)" \
  --out "$OUT/overlap.jsonl" "${OVERLAP[@]}"
step 30 6-next-router $PY scripts/next_router_cost.py --device "$DEVICE"
echo "== done in ${SECONDS}s; results in $OUT/"
