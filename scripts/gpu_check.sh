#!/usr/bin/env bash
# One prepared run for a machine with an NVIDIA GPU (the `device` tool, or any CUDA box):
#   1. pinned-host-to-device bandwidth of the copy engines for Qwen3-30B-A3B-sized experts,
#   2. losslessness on CUDA (tests/core/test_cuda.py: every architecture x cache x copy engine),
#   3. the end-to-end comparison with real transfers (no emulation) on the demo pair.
# Results go to ${OUT:-gpu-results}/. Fits in about 10 minutes on an H200.
#
# The device image has its own torch/triton/transformers and no network: the pure-Python
# packages specfit needs beyond it travel as wheels made here with
#   pip download --no-deps -d .gpu-wheels hydra-core==1.3.8 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 transformers==5.24.0
# (named in the run's `carry`).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
PY=${PYTHON:-python3}
if [ -d .gpu-wheels ]; then $PY -m pip install -q --no-index --no-deps .gpu-wheels/*.whl 2>&1 | tail -2; fi
$PY - <<'PY' | tee "$OUT/env.txt"
import torch, transformers, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
print("transformers", transformers.__version__, "triton", triton.__version__)
PY
echo "== 1. H2D bandwidth"
timeout 180 $PY -m specfit.bench.h2d_bandwidth --out "$OUT/h2d_bandwidth.jsonl" 2>&1 | tee "$OUT/h2d_bandwidth.txt"
echo "== 2. lossless on CUDA"
timeout 240 $PY -m pytest -q -p no:cacheprovider tests/core/test_cuda.py 2>&1 | tail -5 | tee "$OUT/test_cuda.txt"
echo "== 3. end-to-end, real transfers"
for copy in torch triton; do
  timeout 150 $PY -m specfit.cli bench model=demo workloads=[prose] methods=[ar,eagle3_nocache,eagle3,specfit] \
    workload.num_prompts=2 max_new_tokens=64 cache.copy=$copy model.device=cuda \
    hydra.run.dir="$OUT/bench-$copy" 2>&1 | tail -12 | tee "$OUT/bench-$copy.txt"
done
