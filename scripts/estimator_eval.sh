#!/usr/bin/env bash
# Issue 15's estimator measurements: record held-out traces of both demo workloads (seed 0 to fit,
# seed 1 held out) unless DIR already has them, fit the learned estimator, and replay the held-out
# traces with GPU-like and recorded costs, with and without the draft prefetch, and with oracle
# acceptance estimates and experts (where the rest of the gap is).
#   scripts/estimator_eval.sh [DIR]      (default /tmp/specfit-estimators; SPECFIT_HOME=DIR/home)
#   HELD_PROMPTS=12 scripts/estimator_eval.sh NEW_DIR   more held-out prompts (default 4): a trace of 4
#       prompts moves the fractions of the oracle by a few hundredths with the prompts drawn
#       (docs/results.md, "Issue 15 on more held-out prompts"); traces already in DIR are reused as they are
# Figures: docs/results.md, "Acceptance from the sequence itself". Takes 5-10 minutes on 2 cores
# (recording included).
set -euo pipefail
cd "$(dirname "$0")/.."
D=${1:-/tmp/specfit-estimators}; mkdir -p "$D"; D=$(cd "$D" && pwd)
export SPECFIT_HOME=$D/home
S=$PWD/.venv/bin/specfit
cd "$D"  # the commands' run folders (outputs/) land beside the traces, not in the repository
GPU="replay.cost_profile=gpu-like replay.draft_time=modelled"
for w in prose gsm; do
  for seed in 0 1; do
    n=$([ $seed = 0 ] && echo 4 || echo "${HELD_PROMPTS:-4}")
    [ -f "$D/$w-$seed/meta.json" ] || $S record model=demo workload=$w workload.num_prompts=$n workload.seed=$seed \
        max_new_tokens=96 cache.capacity=8 cache.copy=emulated trace.path="$D/$w-$seed" > "$D/record-$w-$seed.log" 2>&1
  done
  $S fit-acceptance trace.path="$D/$w-0" held_out=["$D/$w-1"] out_dir="$D/fit-$w" > "$D/fit-$w.log" 2>&1
  FITTED="methods=[specfit_learned] acceptance=learned acceptance.state_file=$D/fit-$w/learned.json"
  R="$S replay trace.path=$D/$w-1 cache.capacity=8"
  $R methods=[ar,specfit,specfit_calibrated,specfit_learned] $GPU > "$D/gpu-$w.log" 2>&1
  $R $FITTED $GPU > "$D/gpu-fitted-$w.log" 2>&1
  $R methods=[specfit_learned] prefetch=draft $GPU > "$D/gpu-draft-$w.log" 2>&1
  $R $FITTED prefetch=draft $GPU > "$D/gpu-draft-fitted-$w.log" 2>&1
  $R methods=[ar,specfit,specfit_learned] > "$D/recorded-$w.log" 2>&1
  $R $FITTED > "$D/recorded-fitted-$w.log" 2>&1
  # where the rest of the gap is: oracle estimates, oracle experts, both (draft prefetch; results.md)
  P="methods=[specfit] prefetch=draft"
  for costs in gpu recorded; do
    C=$([ $costs = gpu ] && echo "$GPU" || true)
    $R $P acceptance=learned acceptance.state_file=$D/fit-$w/learned.json predictor=oracle $C > "$D/$costs-oracle-experts-$w.log" 2>&1
    $R $P acceptance=oracle $C > "$D/$costs-oracle-acceptance-$w.log" 2>&1
    $R $P acceptance=oracle predictor=oracle $C > "$D/$costs-oracle-both-$w.log" 2>&1
  done
  echo "== $w"
  tail -7 "$D/fit-$w.log" | head -5
  for f in gpu gpu-fitted gpu-draft gpu-draft-fitted recorded recorded-fitted gpu-oracle-experts gpu-oracle-acceptance \
           gpu-oracle-both recorded-oracle-experts recorded-oracle-acceptance recorded-oracle-both; do
    grep -E '^ *(ar|specfit|specfit_calibrated|specfit_learned|oracle) ' "$D/$f-$w.log" | sed "s/^/$f: /"
  done
done
