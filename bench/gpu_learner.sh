#!/usr/bin/env bash
# One bounded GPU pass of bench/learner.py for issue 40 (packing, checkpointing, ZeRO-2 offload).
# Run ONCE on a lent H100 from the repository root, with bench/wheels-gpu/ carried (built on the CPU
# machine by tools/gpu_wheels.sh):   bash bench/gpu_learner.sh      (writes its tables under $OUT)
# Whole script: under 8 minutes (a hard bound of BUDGET_S, default 450 s; each variant killed
# after VARIANT_S, default 80 s on CUDA; 2 timed updates per variant after one warm-up).
# Without CUDA it runs a tiny CPU smoke of the same steps (1 update per variant) and says so.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-/tmp/gpu-learner-out}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-480}
START=$(date +%s)
PY=${PY:-python3}
log() { echo "[gpu_learner $(( $(date +%s) - START ))s] $*" | tee -a "$OUT/summary.txt"; }

# 1. the carried wheels into /tmp/site (no registry on the GPU image; cp312 wheels, so only where
#    CUDA is: a CPU machine uses its own environment), the worktree's code first on the path
CUDA=$($PY -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [ "$CUDA" != "1" ]; then
  log "no CUDA: wheels not installed (the CPU machine's environment is used)"
elif ls bench/wheels-gpu/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/site bench/wheels-gpu/*.whl 2>&1 | tail -3
  log "wheels installed: $(ls bench/wheels-gpu/*.whl | wc -l)"
else
  log "no bench/wheels-gpu/*.whl (build them with tools/gpu_wheels.sh): using the installed packages"
fi
SRC=/tmp/wl_src/worldloop
rm -rf /tmp/wl_src && mkdir -p "$SRC"
for f in "$ROOT"/worldloop/*; do ln -s "$f" "$SRC/"; done
for d in common actor judge learner envs configs deploy; do ln -sfn "$ROOT/$d" "$SRC/$d"; done
export PYTHONPATH=/tmp/wl_src:/tmp/site:${PYTHONPATH:-}
export TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/torch_ext PYTHONUNBUFFERED=1
(cd /tmp && $PY -c "import torch, transformers, deepspeed, worldloop.learner.microbatch as m; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, 'cuda', torch.cuda.is_available())") \
  2>&1 | tee -a "$OUT/summary.txt" | tail -1

VARIANT_S=${VARIANT_S:-$([ "$CUDA" = "1" ] && echo 80 || echo 300)}  # a loaded 2-core CPU needs longer

left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

# 2. one bench invocation, bounded by what is left of the budget; its table and rows under $OUT
bench() {
  local name=$1; shift
  local rest; rest=$(left)
  if [ "$rest" -lt 40 ]; then log "skip $name: ${rest}s left of ${BUDGET_S}s"; return; fi
  log "run $name: bench/learner.py $*"
  timeout "$rest" $PY bench/learner.py "$@" --timeout "$VARIANT_S" --json "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1
  log "$name exit $? ($(grep -c '^| ' "$OUT/$name.log" 2>/dev/null || echo 0) table lines)"
  sed -n '/^lengths:/,$p' "$OUT/$name.log" >> "$OUT/tables.md"
}

if [ "$CUDA" = "1" ]; then
  S=(--steps 2 --lengths varied --micro-tokens auto)
  # 3B (GRPO, reference, vision tower frozen): torch packed vs padded, then the recompute variants
  bench 3b-torch-packing --size 3b --engines torch --packing on,off "${S[@]}"
  bench 3b-torch-ckpt --size 3b --engines torch --packing on --checkpointing selective,none "${S[@]}"
  bench 3b-zero2 --size 3b --engines zero2 --packing on,off "${S[@]}"
  # ZeRO-2 with the vision tower trained: the memory model's setting (offload_optimizer cpu)
  bench 3b-zero2-vision --size 3b --engines zero2 --train-vision --offload cpu --packing on "${S[@]}"
  [ "${SKIP_WEIGHTS:-0}" = "1" ] || {
  # issue 41: weight versions of a 0.5B-shape model on this machine's CPUs (real AdamW steps, bf16)
  rest=$(left)
  if [ "$rest" -gt 100 ]; then
    log "run weights-0.5b: bench/weights.py --sizes 0.5b --lrs 1e-6,1e-5 --steps 2"
    timeout 150 $PY bench/weights.py --sizes 0.5b --lrs 1e-6,1e-5 --steps 2 > "$OUT/weights-0.5b.log" 2>&1
    log "weights-0.5b exit $?"
    grep -v "^\[\|Warning\|warn" "$OUT/weights-0.5b.log" | tail -8 >> "$OUT/tables.md"
  fi
  }
  bench 0.5b --size 0.5b --engines torch,zero2 --packing on,off "${S[@]}"
else
  log "no CUDA: CPU smoke of the same steps on the tiny model (not a measurement)"
  bench tiny-smoke --size tiny --engines torch --packing on,off --checkpointing default,selective \
    --steps 1 --lengths varied --micro-tokens auto
fi
log "done in $(( $(date +%s) - START ))s; tables in $OUT/tables.md"
# few files come back from a lent machine: the raw logs and JSON rows go into one archive
(cd "$OUT" && tar czf raw.tgz --remove-files $(ls *.json *.log 2>/dev/null) 2>/dev/null)
cat "$OUT/tables.md" 2>/dev/null
