#!/usr/bin/env bash
# A borrowed GPU's whole session in one command: the checks in order of value, each under its own time
# limit, each log under $OUT. The machine has torch, transformers, pyarrow and rich but no pyzmq: carry its
# wheel in .whl/ (ignored by git).
#
#   bash benchmarks/gpu_check.sh                 # on the GPU machine (~7-10 min; STEPS to pick fewer)
#   DEV=cpu SMALL=1 bash benchmarks/gpu_check.sh # dry run of the script itself on a CPU (~4 min)
#   STEPS="cuda_tests spec_greedy" bash benchmarks/gpu_check.sh   # some steps only
set -u
OUT=${OUT:-/tmp/gpu-check}
DEV=${DEV:-cuda}
mkdir -p "$OUT"
if ls .whl/*.whl > /dev/null 2>&1 && ! python3 -c "import zmq" 2> /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
# prompts per set, new tokens, repeats: the full sizes fit a 10-minute call on an H200 host
if [ -n "${SMALL:-}" ]; then P=2; N=16; R=1; else P=8; N=64; R=2; fi

step() {  # name, seconds, command...: runs it, keeps its log, prints its tail
    local name=$1 limit=$2 t0 rc
    shift 2
    case " ${STEPS:-$name} " in *" $name "*) ;; *) return 0 ;; esac
    echo "== $name"
    t0=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name: rc=$rc in $(( $(date +%s) - t0 )) s"
    tail -n "${TAIL:-20}" "$OUT/$name.log"
}

nvidia-smi -L 2> /dev/null
python3 -c "import torch, transformers, zmq; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'pyzmq', zmq.__version__)"
[ "$DEV" = cuda ] && step cuda_tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_probe_cuda.py tests/test_decoder_cuda.py
# cold start and every drafter through the CLI; greedy texts must agree across drafters
TAIL=9 step generate 120 bash -c 'for t in 0 0.8; do for d in none default auto; do
    s=$(date +%s.%N); python3 -m probebus generate --device '"$DEV"' --drafter $d --prompt "def parse(" \
      --max-new-tokens 48 --seed 0 --temperature $t --json > /tmp/gen-$d-$t.json || echo "FAILED $d $t"
    echo "drafter $d T=$t: $(python3 -c "print(round($(date +%s.%N) - $s, 2))") s in a fresh process"
    python3 -c "import json; j = json.loads(open(\"/tmp/gen-$d-$t.json\").readline()); print(repr(j[\"text\"][:80]), \
{k: v for k, v in j.get(\"stats\", {}).items() if k in (\"tau\", \"tokens_per_s\", \"rounds\")})"
  done; done
  for d in default auto; do cmp -s <(python3 -c "import json; print(json.loads(open(\"/tmp/gen-none-0.json\").readline())[\"token_ids\"])") \
    <(python3 -c "import json; print(json.loads(open(\"/tmp/gen-$d-0.json\").readline())[\"token_ids\"])") \
    && echo "greedy $d == none" || echo "GREEDY $d DIFFERS FROM none"; done'
TAIL=40 step spec_greedy 170 python3 benchmarks/speculative.py --device "$DEV" --sets stdlib prose --batches 1 8 \
    --temperatures 0 --prompts $P --repeats $R --new-tokens $N
TAIL=20 step spec_sampled 100 python3 benchmarks/speculative.py --device "$DEV" --sets thirdparty --batches 1 \
    --temperatures 0.8 --prompts $P --repeats $R --new-tokens $N --no-oracle
# issue 46: the compiled path with CUDA graphs (reduce-overhead) and the eager CUDA path, step against step
[ "$DEV" = cuda ] && TAIL=8 step compiled_paired 180 python3 benchmarks/paired_steps.py --device cuda --dtype bfloat16 \
    --compiled --compile-mode reduce-overhead --hidden 2048 --layers 16 --batches 1 8 32 --modes a/a probebus \
    --block 4 --settle 1 --generates 6
[ "$DEV" = cuda ] && TAIL=8 step eager_paired 150 python3 benchmarks/paired_steps.py --device cuda --dtype bfloat16 \
    --hidden 2048 --layers 16 --batches 1 8 32 --modes a/a probebus naive --generates 6
[ "$DEV" = cuda ] && TAIL=60 step cuda_profile 80 python3 benchmarks/cuda_overhead.py --profile --new-tokens 32
# probe overhead, interleaved against plain and naive hooks (the README's "On a GPU" table); last, as the longest
[ "$DEV" = cuda ] && TAIL=12 step cuda_overhead 240 python3 benchmarks/cuda_overhead.py --repeats 5
