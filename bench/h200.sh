#!/usr/bin/env bash
# Measurements on an NVIDIA H200 with MLX's CUDA backend. Run from the repo root on the
# device machine, MLX unpacked in /tmp/site (see ../shared/gpu/README.md of the workspace):
#   bash bench/h200.sh STAGE [STAGE ...]
# Stages:
#   env        versions and the GPU
#   cuda       the tests marked cuda (kernels against their references; CUDA_S seconds, default
#              300; CUDA_TESTS the paths, default tests); a failure ends the call
#   headline   the README's headline figures (bench/RESULTS.md), each row for every side in turn
#   headline7b the 7B shape's rows of the same (the weights alone take a minute to build)
#   quantized  random-weight shapes quantized (QSHAPES, default 0.5B 1.5B 7B; QBITS, default
#              "4 8"; QROWS, default 1,32,auto): batchgen against batch_generate, one process each
#   quantized_one  the same shapes and bits one job at a time (16 jobs), against mlx-lm's
#              stream_generate over the same quantized model
#   quantized_pld  one job at a time, PLD on the demo model's edits at 4 and 8 bits (mlx-lm's
#              convert), against mlx-lm's stream_generate on the same quantized model
#   quantized_runs whole `batchgen run` processes on the 7B shape at 4 bits (QRUN_SHAPE), 256
#              jobs, auto rows, --dense-weights on and off in turn (QRUN_ROUNDS, default 2)
#   load       where a fresh `batchgen run` process's load goes (the summary's load_parts): two
#              rounds of jobs/example.jsonl, torch hidden from mlx-lm's import then visible
#              (BATCHGEN_IMPORT_TORCH=1), and the import of torch alone
#   tqprobe    TurboQuant one at a time: bench/turboquant_passes.py (plain steps and short verify
#              passes against fp16 at 300 and 2,000 tokens of history), then bench/first_line.py
#              over the first 40 edit jobs, fp16 and TurboQuant, fresh processes (TQ_ROUNDS
#              rounds; with BASELINE the TurboQuant rows of each side in turn, the order reversed
#              every other round; TQ_WARM=1 runs a TurboQuant process first, which pays a fresh
#              machine's kernel builds; TQ_PASSES=0 skips the passes bench)
#   plans      mx.fast attention's first call of each (queries, keys) shape against a repeat, causal,
#              bias and bias padded to `fused_shape` (bench/attention_plans.py; the 0.5B, 7B and
#              demo model's heads)
#   builds     batchgen's kernel builds kept on disk or not (kernels/builds.py): its cuda test
#              (MLX loads a kept build), then fresh TurboQuant one-at-a-time processes over the
#              first 40 edit jobs: BATCHGEN_KERNEL_BUILDS=0 (MLX compiles them in every process),
#              then kept, twice (the first writes them, the second loads them); fp16 for scale
#   features   batched JSON-schema rows against free ones, logprobs on against off, n=8
#              samples against separate jobs (FEATURES_SHAPE, default the 0.5B shape, whose
#              step is bound by the host; qwen2.5-7b for one bound by the GPU). Needs
#              llguidance: its abi3 wheel (pip download llguidance==1.9.1 --no-deps
#              --only-binary=:all: --platform manylinux_2_31_x86_64 --python-version 3.12
#              -d .gpu/) is unpacked into /tmp/site.
#   phases     where a batched step's host time goes, free against JSON-schema and logprobs rows
#              (bench/feature_phases.py; PHASE_SHAPES, default the 0.5B and 7B shapes;
#              PHASE_VARIANTS=free,json: only those; PHASE_SYNTHETIC=N: random prompts of N tokens,
#              rows over long contexts; PHASE_REPEATS, default 2; needs llguidance as features does).
#              With VOCAB=N (phases and features) the shapes take a trained N-token tokenizer
#              (bench/grammar_masks.py --save-tokenizer): the demo's 4,096 tokens understate a real
#              vocabulary's mask cost
#   fresh      a machine's first `batchgen run` process (fp16, one at a time, the first 40 edit jobs: run this
#              stage first on a new machine), then the next; after each, the kept builds (MLX's and batchgen's,
#              kernels/registry.py keep_builds) listed in the order they were written, and the longest gaps
#              between them (each about one build's compile): what the first process's first line waits for
#   steps      the 7B step (bench/kernel_profile.py sweep, context 400): the attention kernels' warps a block
#              (16, 8, 4) at 32, 64 and 128 rows, where `attention.WIDE_GRID` keeps 16 unmeasured; then 256 rows
#              with host work between steps (0, 8 ms). (MLX's graph commits by size, MLX_MAX_MB_PER_BUFFER, were
#              measured not to set the 7B step: bench/RESULTS.md "Dataset-generation features on the batch path")
#   peer       transformers' continuous batching (bench/peer_transformers.py, generate_batch) over the same 256
#              jobs x 128 tokens as cron_runs, on the same shapes (PEER_SHAPES; PEER_ATTN, default paged|sdpa):
#              needs no MLX, so it can run while the MLX parts are still being carried over
#   cron_one   fresh `batchgen run` processes as cron starts them, run first on a new machine: the first 40 edit
#              jobs one at a time (bench/first_line.py), in CRON_ONE's order (default fp16_1 tq_1 fp16_2 tq_2
#              tq_3 fp16_3: fp16 or TurboQuant processes; `warmup` runs `batchgen warm-up` there); after each
#              process its new kept builds (NAME_builds.txt) and how long MLX's and batchgen's took (bench/build_times.py;
#              LAST_BUILDS=FILE: an earlier call's last listing, which the first process's builds are counted against;
#              CRON_FRESH=1: the kept builds and the driver's compute cache deleted first, as on a fresh machine, so that
#              e.g. CRON_KINDS="warmup lp_1 fp16_1 tq_1" shows what a warm-up leaves a machine's first runs to build)
#   cron_runs  the same for 256 jobs x 128 tokens, auto rows, on random-weight shapes written to /tmp/shapes
#              (CRON_SHAPES, default the 0.5B and 7B shapes; CRON_KINDS as CRON_ONE, default fp16_1 fp16_2 tq_1 tq_2,
#              and lp_N: the fp16 cache, the jobs asking for logprobs with 5 alternatives; with BASELINE, each side in turn)
#   grammar_threads  llguidance's mask time a step for 256 and 32 rows, matchers copied from one
#              kept matcher or from several (bench/grammar_threads.py; host work, no GPU)
# A/B: BASELINE=DIR (another checkout of batchgen, e.g. .gpu/old) adds it as a side, run
# in turn with this tree in the same call (SIDES="old new" for the other order, PLD_ROUNDS=N
# to repeat the PLD row). OLD_ENV="NAME=VALUE ..." runs that side with those settings, with
# or without BASELINE (e.g. MLX_MAX_OPS_PER_BUFFER=1000: the ops MLX records into one CUDA
# graph). Only ratios within one call are compared; bench/RESULTS.md ("How to measure")
# says how to read them.
# Results land under $OUT/results (logs and JSON), packed as results.tgz.
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
OUT=${OUT:-/tmp/out}
R=$OUT/results
mkdir -p "$R"
DEADLINE=$((SECONDS + ${BUDGET_S:-570}))  # the whole call's time; results are packed after it

. "$(dirname "$0")/step.sh"  # step NAME SECONDS CMD...

sides() {  # "new" (this tree) and, with BASELINE or OLD_ENV, "old", in the order SIDES gives (default: new old)
  local s
  for s in ${SIDES:-new old}; do
    [[ $s == new || -n ${BASELINE:-} || -n ${OLD_ENV:-} ]] && echo "$s"
  done
}

side() {  # the command prefix that runs that side: BASELINE's tree and/or OLD_ENV's settings (none for new)
  [[ $1 == old ]] && echo "env ${BASELINE:+-C $BASELINE} ${OLD_ENV:-} ${BASELINE:+PYTHONPATH=/tmp/site:$BASELINE}"
}

stage_env() {
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv >"$R/nvidia-smi.txt" 2>&1
  step env 60 python3 -c "import mlx.core as mx, mlx_lm; print(mx.__version__, mlx_lm.__version__, mx.default_device(), mx.device_info())"
}

stage_cuda() {  # every test marked cuda (kernels against their references), wherever it lives
  step cuda_tests "${CUDA_S:-300}" python3 -m pytest -q -x -p no:cacheprovider -m cuda ${CUDA_TESTS:-tests}
}

stage_headline() {  # PLD on the demo model's edits; whole-file throughput, 0.5B shape, auto rows
  local s
  for round in $(seq "${PLD_ROUNDS:-1}"); do
    for s in $(sides); do
      step "pld_edits_${s}_$round" 120 $(side "$s") python3 -m batchgen bench jobs/edits.jsonl --max-jobs 40 \
        --no-fuse --no-prompt-cache --no-png --out "$R/pld_edits_${s}_$round.json"
    done
  done
  for s in $(sides); do
    step "tp05_${s}" 200 $(side "$s") python3 -m batchgen bench jobs/freeform.jsonl --shape qwen2.5-0.5b \
      --throughput auto --jobs-total 256 --max-tokens 128 --out "$R/tp05_${s}.json"
  done
}

stage_headline7b() {  # whole-file throughput, 7B shape, auto rows; TurboQuant one-job decode at 32k
  local s
  for s in $(sides); do
    step "tp7b_${s}" 240 $(side "$s") python3 -m batchgen bench jobs/freeform.jsonl --shape qwen2.5-7b \
      --throughput auto --jobs-total 256 --max-tokens 128 --out "$R/tp7b_${s}.json"
  done
  for s in $(sides); do
    step "tqd7b_${s}" 150 $(side "$s") python3 bench/turboquant_decode.py qwen2.5-7b 32768 --rounds 5 \
      --out "$R/tqd7b_${s}.jsonl"
  done
}

stage_quantized() {
  local shape bits
  for shape in ${QSHAPES:-qwen2.5-0.5b qwen2.5-1.5b qwen2.5-7b}; do
    for bits in ${QBITS:-4 8}; do
      step "q_${shape}_$bits" "${QSTEP_S:-400}" python3 -m batchgen bench jobs/freeform.jsonl --shape "$shape" \
        --quantize "$bits" --throughput "${QROWS:-1,32,auto}" --jobs-total 256 --max-tokens 128 --no-png \
        --out "$R/q_${shape}_$bits.json"
    done
  done
  return 0  # a row past its time is in its log; the next shape still runs
}

stage_quantized_one() {
  local shape bits
  for shape in ${QSHAPES:-qwen2.5-0.5b qwen2.5-1.5b qwen2.5-7b}; do
    for bits in ${QBITS:-4 8}; do
      step "q1_${shape}_$bits" "${QSTEP_S:-200}" python3 -m batchgen bench jobs/freeform.jsonl --shape "$shape" \
        --quantize "$bits" --max-jobs 16 --max-tokens 128 --no-png --out "$R/q1_${shape}_$bits.json"
    done
  done
  return 0
}

stage_quantized_pld() {
  local bits
  for bits in 4 8; do
    step "convert_demo_q$bits" 60 python3 -m mlx_lm convert --hf-path batchgen/demo --mlx-path "/tmp/demo-q$bits" \
      -q --q-bits "$bits" --q-group-size 64 || continue
    cp batchgen/demo/chat_template.jinja "/tmp/demo-q$bits/" 2>/dev/null
    step "pld_demo_q$bits" 150 python3 -m batchgen bench jobs/edits.jsonl --model "/tmp/demo-q$bits" \
      --max-jobs 40 --no-png --out "$R/pld_demo_q$bits.json"
  done
  return 0
}

stage_quantized_runs() {  # a cron user's view: fresh processes, load included and reported apart
  local shape=${QRUN_SHAPE:-qwen2.5-7b} dir=/tmp/shapes/q4 round dense
  [[ -d $dir ]] || step "shape_model_q4" 240 python3 bench/shape_model.py "$shape" "$dir" --quantize 4 || return 0
  jobs256
  for round in $(seq "${QRUN_ROUNDS:-2}"); do
    for dense in on off; do
      step "run_${dense}_$round" 200 python3 -m batchgen run /tmp/jobs256.jsonl --model "$dir" --max-tokens 128 \
        --batch-size auto --dense-weights "$dense" -o "/tmp/run_${dense}_$round.jsonl" \
        --summary "$R/run_${dense}_$round.summary.json"
    done
  done
  return 0
}

jobs256() {  # /tmp/jobs256.jsonl: the header line, then 256 jobs cycling freeform's, each of 128 tokens (a job's own
  python3 - <<'EOF'  # max_tokens outranks --max-tokens; the peer's are 128); /tmp/jobs256lp.jsonl the same asking for logprobs
import itertools, json
lines = open("jobs/freeform.jsonl").read().splitlines()
for path, extra in (("/tmp/jobs256.jsonl", {}), ("/tmp/jobs256lp.jsonl", {"logprobs": True, "top_logprobs": 5})):
    with open(path, "w") as f:
        print(lines[0], file=f)
        for i, line in zip(range(256), itertools.cycle(lines[1:])):
            job = json.loads(line)
            job["id"] = f"{job['id']}-{i}"
            print(json.dumps({**job, "max_tokens": 128, **extra}), file=f)
EOF
}

stage_peer() {  # needs torch and transformers only (orjson for batchgen's job reader from its wheel in .gpu/)
  python3 -c "import orjson" 2>/dev/null || python3 -m zipfile -e "$(ls .gpu/orjson-*.whl | head -n 1)" /tmp/site
  jobs256
  local shape attn
  for shape in ${PEER_SHAPES:-qwen2.5-0.5b qwen2.5-7b}; do
    for attn in ${PEER_ATTN:-paged|sdpa}; do
      step "peer_${shape}_${attn//[|]/_}" "${PEER_S:-240}" python3 bench/peer_transformers.py /tmp/jobs256.jsonl \
        --model "$shape" --max-tokens 128 --repeats "${PEER_REPEATS:-2}" --attn "$attn" \
        --out "$R/peer_${shape}_${attn//[|]/_}.json"
    done
  done
  return 0
}

cron_step() {  # cron_step NAME KIND SIDE JOBS [run options]: KIND fp16_N or tq_N a fresh first_line.py process,
  local name=$1 kind=$2 s=$3 jobs=$4  # warmup `batchgen warm-up` (with the run's --model, if any)
  shift 4
  if [[ $kind == warmup ]]; then
    step "$name" 300 $(side "$s") python3 -m batchgen warm-up $(printf '%s\n' "$@" | grep -A1 -x -- --model | tr '\n' ' ')
  else
    step "$name" 200 $(side "$s") python3 bench/first_line.py "$jobs" --runs 1 --out "$R/$name.json" -- "$@" \
      $([[ $kind == tq* ]] && echo --kv-cache turboquant)
  fi
  builds_list "$R/${name}_builds.txt"
}

builds_list() {  # builds_list FILE: the kept builds so far (write time, bytes, name), oldest first, and how
  find ~/.cache/batchgen/mlx-kernels -type f -name '*.ptx' -printf '%T@ %s %P\n' 2>/dev/null | sort -n >"$1"
  python3 bench/build_times.py "$1" ${LAST_BUILDS:-} --json "${1%.txt}.json"  # long the process's new builds took
  LAST_BUILDS=$1  # MLX's own and batchgen's (custom_kernel_*)
}

cron_fresh() {  # CRON_FRESH=1: no kept build, no driver-compiled code: the next process builds as a new machine's
  [[ ${CRON_FRESH:-0} == 1 ]] && rm -rf ~/.cache/batchgen/mlx-kernels ~/.nv/ComputeCache
  return 0
}

stage_cron_one() {  # a fresh machine's first processes, one job at a time (CRON_ONE: fp16_N, tq_N and warmup in order)
  cron_fresh
  head -41 jobs/edits.jsonl >/tmp/edits40.jsonl
  local k
  for k in ${CRON_ONE:-fp16_1 tq_1 fp16_2 tq_2 tq_3 fp16_3}; do
    cron_step "cron_one_$k" "$k" new /tmp/edits40.jsonl --batch-size 1
  done
  return 0
}

stage_cron_runs() {  # whole-file processes on random-weight shapes (CRON_SHAPES): 256 jobs x 128 tokens, auto rows
  cron_fresh
  jobs256
  local shape k s
  for shape in ${CRON_SHAPES:-qwen2.5-0.5b qwen2.5-7b}; do
    [[ -d /tmp/shapes/$shape ]] || step "shape_model_$shape" 300 python3 bench/shape_model.py "$shape" \
      "/tmp/shapes/$shape" || continue
    for k in ${CRON_KINDS:-fp16_1 fp16_2 tq_1 tq_2}; do  # a shape's first process pays its kernel builds
      for s in $(sides); do  # with BASELINE, each side in turn (each side's first process pays its own builds)
        cron_step "cron_${shape}_${s}_$k" "$k" "$s" "/tmp/jobs256$([[ $k == lp* ]] && echo lp).jsonl" \
          --model "/tmp/shapes/$shape" --max-tokens 128 --batch-size auto
      done
    done
  done
  return 0
}

stage_load() {  # each round: torch hidden from mlx-lm's import (the default), then left visible
  local i t
  for i in 1 2; do
    for t in 0 1; do
      step "load_run_${i}_torch$t" 120 env BATCHGEN_IMPORT_TORCH=$t python3 -m batchgen run jobs/example.jsonl \
        -o "/tmp/load_${i}_$t.jsonl" --summary "$R/load_run_${i}_torch$t.summary.json"
    done
  done
  step load_torch 60 python3 -c "import time; t = time.perf_counter(); import torch; print('torch import', round(time.perf_counter() - t, 2), 's')"
  return 0
}

stage_tqprobe() {  # with BASELINE, each side in turn; TQ_ROUNDS (default 1) fresh-process rounds
  local s round order
  if [[ ${TQ_PASSES:-1} == 1 ]]; then
    for s in $(sides); do
      step "tq_passes_$s" 200 $(side "$s") python3 bench/turboquant_passes.py --contexts 300,2000 --lengths 1,6 \
        --out "$R/tq_passes_$s.json"
    done
  fi
  head -41 jobs/edits.jsonl >/tmp/edits40.jsonl
  if [[ ${TQ_WARM:-0} == 1 ]]; then  # a machine's first TurboQuant process pays its kernel builds: not a side's
    step fl_tq_warm 200 python3 bench/first_line.py /tmp/edits40.jsonl --runs 1 --out "$R/fl_tq_warm.json" \
      -- --batch-size 1 --kv-cache turboquant
  fi
  for round in $(seq "${TQ_ROUNDS:-1}"); do
    step "fl_fp16_$round" 120 python3 bench/first_line.py /tmp/edits40.jsonl --runs 1 --out "$R/fl_fp16_$round.json" \
      -- --batch-size 1
    order=$(sides)
    ((round % 2 == 0)) && order=$(echo "$order" | tac)  # the sides' order reversed every other round
    for s in $order; do
      step "fl_tq_${s}_$round" 200 $(side "$s") python3 bench/first_line.py /tmp/edits40.jsonl --runs 1 \
        --out "$R/fl_tq_${s}_$round.json" -- --batch-size 1 --kv-cache turboquant
    done
  done
  return 0
}

stage_plans() {
  local h
  for h in "05b 14,2 64" "7b 28,4 128" "demo 4,2 32"; do
    set -- $h
    step "plans_$1" 60 python3 bench/attention_plans.py --heads "$2" --dim "$3" --out "$R/plans_$1.json"
  done
  return 0
}

stage_builds() {
  step builds_test 300 python3 -m pytest -q -x -p no:cacheprovider -m cuda tests/test_kernel_builds.py || return 1
  head -41 jobs/edits.jsonl >/tmp/edits40.jsonl
  step fl_fp16 120 python3 bench/first_line.py /tmp/edits40.jsonl --runs 1 --out "$R/fl_fp16.json" -- --batch-size 1
  find ~/.cache/batchgen/mlx-kernels -name 'custom_kernel_*' -delete 2>/dev/null
  local k
  for k in off kept1 kept2; do
    step "fl_tq_$k" 200 env BATCHGEN_KERNEL_BUILDS=$([[ $k == off ]] && echo 0 || echo 1) python3 bench/first_line.py \
      /tmp/edits40.jsonl --runs 1 --out "$R/fl_tq_$k.json" -- --batch-size 1 --kv-cache turboquant
  done
  find ~/.cache/batchgen/mlx-kernels -name 'custom_kernel_*.ptx' | wc -l >"$R/kept_builds.txt"
  return 0
}

grammar_engine() {  # llguidance from its abi3 wheel in .gpu/, where the machine lacks it
  if ! python3 -c "import llguidance" 2>/dev/null; then
    local wheel
    wheel=$(ls .gpu/llguidance-*.whl 2>/dev/null | head -n 1)
    [[ -n $wheel ]] && python3 -m zipfile -e "$wheel" /tmp/site
  fi
}

vocab_tokenizer() {  # VOCAB=N: a trained N-token tokenizer folder's --model/--tokenizer option (else none)
  [[ -z ${VOCAB:-} ]] && return
  [[ -d /tmp/tok$VOCAB ]] || python3 bench/grammar_masks.py --train-vocab "$VOCAB" --save-tokenizer "/tmp/tok$VOCAB" >&2
  echo "$1 /tmp/tok$VOCAB"
}

stage_phases() {  # VOCAB=N: the shapes with a trained tokenizer of N tokens (a real model's mask cost)
  grammar_engine
  local s shape tok
  tok=$(vocab_tokenizer --tokenizer)
  for shape in ${PHASE_SHAPES:-qwen2.5-0.5b qwen2.5-7b}; do
    for s in $(sides); do
      step "phases_${shape}_$s" 240 $(side "$s") python3 bench/feature_phases.py --shape "$shape" --jobs 256 \
        --rows auto --repeats "${PHASE_REPEATS:-2}" ${PHASE_VARIANTS:+--variants $PHASE_VARIANTS} \
        ${PHASE_SYNTHETIC:+--synthetic $PHASE_SYNTHETIC} $tok --out "$R/phases_${shape}_$s.json"
    done
  done
  return 0
}

stage_fresh() {
  local i
  head -41 jobs/edits.jsonl >/tmp/edits40.jsonl
  for i in 1 2; do
    step "fresh_fl_$i" 150 python3 bench/first_line.py /tmp/edits40.jsonl --runs 1 --out "$R/fresh_fl_$i.json" \
      -- --batch-size 1
    builds_list "$R/fresh_builds_$i.txt"
    python3 - "$R/fresh_builds_$i.txt" <<'PY'
import sys
rows = [line.strip().split(maxsplit=2) for line in open(sys.argv[1]) if line.strip()]
t = [float(r[0]) for r in rows]
gaps = sorted(((b - a, rows[i + 1][2]) for i, (a, b) in enumerate(zip(t, t[1:]))), reverse=True)
print(f"{len(rows)} builds kept over {t[-1] - t[0] if t else 0:.1f} s; longest gaps before a build:")
for gap, name in gaps[:12]:
    print(f"  {gap:6.2f} s  {name[:100]}")
PY
  done
  return 0
}

stage_steps() {
  local s
  step steps_7b_warps 300 python3 bench/kernel_profile.py sweep --shape qwen2.5-7b --rows 32,64,128 --context 400 \
    --warps 16,8,4 --host-ms 0
  step steps_7b_host 180 python3 bench/kernel_profile.py sweep --shape qwen2.5-7b --rows 256 --context 400 --warps 4 \
    --host-ms 0,8
  for s in steps_7b_warps steps_7b_host; do grep rows= "$R/$s.log"; done
  return 0
}

stage_grammar_threads() {
  grammar_engine
  local rows
  for rows in 256 32; do
    step "grammar_threads_$rows" 90 python3 bench/grammar_threads.py --n-vocab 151936 --rows "$rows" --threads 0,1 \
      --out "$R/grammar_threads_$rows.json"
  done
  return 0
}

stage_features() {
  grammar_engine
  local s shape=${FEATURES_SHAPE:-qwen2.5-0.5b} tok
  tok=$(vocab_tokenizer --model)  # VOCAB=N, as phases
  for s in $(sides); do  # FEATURES_ARGS, e.g. "--samples 8x2x64 --throughput-repeats 3" for a short A/B
    step "features_${shape}_$s" "${FEATURES_S:-540}" $(side "$s") python3 -m batchgen bench jobs/freeform.jsonl \
      --shape "$shape" $tok --features --throughput 32,auto --jobs-total 256 --max-tokens 128 \
      ${FEATURES_ARGS:---samples 64x8x1536 --throughput-repeats 3} --out "$R/features_${shape}_$s.json"
  done
}

for s in "$@"; do "stage_$s" || break; done  # a stage that fails its check ends the call
(cd "$OUT" && tar czf results.tgz results && rm -rf results)
