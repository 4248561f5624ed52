#!/usr/bin/env bash
# Every GPU check of KV Lens in one run of about 8 minutes, each step under its own time limit and in order of
# importance, every figure written to OUT (default ./gpu-out); or only the steps named after OUT:
#   tests      the CUDA tests (tests/test_engine_cuda.py in float32 and bfloat16 on two model shapes, the kernels');
#   walk       the eviction walk alone (benchmarks/walk.py) for 1 and 4 rows in one launch, at the kernel's own
#              warps and at 4, and its launches alone, on Gemma 3 270M's and Llama 3.2 1B's attention shapes;
#   scaling    benchmarks/scaling.py at 8k, 16k and 32k tokens on Gemma 3 270M's shape: four eviction policies and
#              Full at budget 1024, bfloat16, random weights (benchmarks/random_model.py);
#   profile    the same at 8k, then one more run under cProfile (where the host's time goes);
#   chunks     the same at 8k in blocks of 1,024 tokens, not 256: a quarter of the blocks, and of the launches the
#              model and the engine send per block (benchmarks/launches.py counts them on a CPU);
#   llama      the same at 32k on Llama 3.2 1B's shape; llama8k at 8k;
#   task       one RULER sample at 4k (niah_single_1, saved by `task_cost --save-request`, 32 new tokens) under
#              TASK_POLICIES (default tova,snapkv) at the shipped ratios, on SmolLM2's shape;
#   kernels    the kernels' table (benchmarks/kernels_bench.py --quick);
#   selection  SparQ and ReAttention through scaling.py at 2k, then 8k, on Gemma 3 270M's shape.
# The machine it was written for has no network: the packages it lacks travel as wheels in .whl/ (transformers
# at our pin, lm-eval, diskcache), SmolLM2's tokenizer and the saved requests in .gpu/ (docs/performance.md,
# "On a GPU").
#
#     bash benchmarks/gpu_check.sh [OUT [STEP...]]
set -u
OUT=${1:-${OUT:-gpu-out}}
shift || true
STEPS=${*:-tests selection llama kernels}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
PY=${PYTHON:-python3}
MODELS=${MODELS:-/tmp/kvlens-random}
LOG=$OUT/steps.log
quiet() { tr '\r' '\n' | grep -v -e 'it/s]' -e 's/it]' -e '^\s*$'; }  # progress bars dropped
step() {  # step NAME SECONDS COMMAND...: run with a time limit, its output to OUT/steps.log
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "== $name (at most ${limit}s): $*" >>"$LOG"
  timeout "$limit" "$@" 2>&1 | quiet >>"$LOG"
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start))s" | tee -a "$LOG"
}
models() {  # random-weight models of these shapes, once each
  for shape in "$@"; do
    [ -d "$MODELS/$shape" ] || $PY -m benchmarks.random_model --shape "$shape" --tokenizer .gpu \
      --out "$MODELS/$shape" --device cuda --dtype bfloat16 2>&1 | quiet >>"$LOG"
  done
}
{ nvidia-smi -L; $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
  'transformers', transformers.__version__, torch.cuda.get_device_name())"; } >>"$LOG" 2>&1
SCALE="-m benchmarks.scaling --policies sinks,h2o,tova,a2sf --budget 1024 --pairs 1 --plain-head last --device cuda
  --dtype bfloat16 --json $OUT/scaling.jsonl"

for name in $STEPS; do
  case $name in
    tests) # -v names each failure as it happens (a step cut by its limit prints no summary); passes are dropped
           step tests 150 bash -c "$PY -m pytest -v -rfEs --tb=short -p no:cacheprovider -n 14 tests/test_engine_cuda.py \
             tests/test_kernels_sparq.py tests/test_kernels_reattention.py | grep -v -e ' PASSED ' -e Benchmark" ;;
    walk) step walk 40 bash -c "for shape in 1,4,256 8,4,64; do $PY -m benchmarks.walk --device cuda --shape \$shape \
            --budget 1024 --tokens 4096 --chunk 256 --policies h2o,tova --warps auto,4 --rows 1,4 --repeat 1; done" ;;
    scaling) models gemma3-270m
             step scaling_gemma 150 $PY $SCALE --model "$MODELS/gemma3-270m" --lengths 8192,16384,32768 ;;
    chunks) models gemma3-270m
            step scaling_chunks 90 $PY $SCALE --model "$MODELS/gemma3-270m" --lengths 8192 --chunk 1024 ;;
    profile) models gemma3-270m
             step profile 60 $PY $SCALE --model "$MODELS/gemma3-270m" --lengths 8192 --profile ;;
    llama) models llama-3.2-1b
           step scaling_llama 120 $PY $SCALE --model "$MODELS/llama-3.2-1b" --lengths 32768 ;;
    llama8k) models llama-3.2-1b
             step scaling_llama8k 70 $PY $SCALE --model "$MODELS/llama-3.2-1b" --lengths 8192 ;;
    task) models smollm2-135m
          step task_4k 120 $PY -m benchmarks.task_cost --request .gpu/niah_4096_32.json \
            --model "$MODELS/smollm2-135m" --device cuda --dtype bfloat16 --policies "${TASK_POLICIES:-tova,snapkv}" \
            --seconds 1 --json "$OUT/task.jsonl" ;;
    kernels) step kernels 45 $PY -m benchmarks.kernels_bench --quick ;;
    selection) models gemma3-270m
               step scaling_selection 120 $PY $SCALE --model "$MODELS/gemma3-270m" --lengths 2048,8192 \
                 --policies sparq,reattention ;;
    *) echo "unknown step $name" | tee -a "$LOG" ;;
  esac
done
echo "== done after ${SECONDS}s" | tee -a "$LOG"
