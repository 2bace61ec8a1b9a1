#!/usr/bin/env bash
# Prepares what scripts/gpu_check.sh needs on a GPU machine that has its own torch, Triton and
# transformers but no network (this workplace's `device` tool): the pure-Python packages specfit
# needs beyond them, as wheels in .gpu-wheels/, and the held-out text of ../shared/data (which does
# not travel with the working tree) in .shared-data/. Both are ignored by git; name both in the
# run's `carry`. Run it here, where PyPI is reachable:
#   bash scripts/gpu_bundle.sh
# then, on the device (one call; only 8 files come back, so the results folder is packed):
#   BUDGET=560 OUT=/tmp/gr bash scripts/gpu_check.sh 2>&1 | tee /tmp/gr-log.txt; cp /tmp/gr-log.txt /tmp/gr/log.txt;
#   tar czf "$OUT/gpu-results.tgz" -C /tmp gr
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-python3 -m pip}
mkdir -p .gpu-wheels
$PIP download -q --no-deps -d .gpu-wheels hydra-core==1.3.8 "omegaconf==2.3.0" transformers==5.24.0 pluggy==1.7.0
$PIP wheel -q --no-deps -w .gpu-wheels antlr4-python3-runtime==4.9.3  # an sdist on PyPI: built here, pure Python
rm -rf .shared-data
cp -r ../shared/data .shared-data
du -sh .gpu-wheels .shared-data
