#!/usr/bin/env bash
# Measurements on an NVIDIA H200 with MLX's CUDA backend (see ../shared/gpu/README.md).
# Run from the repo root on the device machine, with MLX unpacked in /tmp/site:
#   bash bench/h200.sh STAGE [STAGE ...]
#   (stages: env train eval fusion demo shapes pool pooledits poolprofile small pld pldpolicy throughput
#    tpdemo batchkernel batchstep tp05 tp7b tpshapes copyprobe batchprofile turboquant tqkernels tqstep tqprobe
#    stepops bprof8 tqbatch tqfree bpld proj margin tp05edits matrix ncu attn attnprobe attnab tqab ncudetail tp7bwarm tqblocks syncsteps keepbuf tqshared
#    tp7bfull tprest passsplit tqflash tqstepab tqdecode)
# Getting MLX there (30 device-minutes a session, a fresh machine costs ~35 s of them): call 1
# carries .gpu parts aa+ac and copies them to /root/p; call 2, within 30 s, carries part ab,
# unpacks MLX and runs stages (each call <= 9.5 min; later calls on the warm machine need only
# the PYTHONPATH export). `train` needs torch only (the build skips its eval without mlx).
# Every result lands under $OUT/results (logs + JSON). Stages use the shipped demo model
# (batchgen/demo) unless DEMO says otherwise; `train` builds one into /root/demo (kept
# while the machine stays warm, and in $OUT/demo.tar) and uses it from then on.
# The machine's python3 (3.12) now has pytest, with pytest-timeout: carry no .gpu/pysite (an older pytest
# there broke that plugin's start, 2026-12-01).
set -u
export PYTHONPATH=/tmp/site:$PWD:$PWD/.gpu/pysite PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
OUT=${OUT:-/tmp/out}
DEMO=${DEMO:-batchgen/demo}
R=$OUT/results
mkdir -p "$R"
BG="python3 -m batchgen bench${TP_REPEATS:+ --throughput-repeats $TP_REPEATS}"  # TP_REPEATS: each side's run that often

DEADLINE=$((SECONDS + ${BUDGET_S:-540}))  # the whole call's time; results are packed after it

step() {  # step NAME SECONDS CMD...: run, log to $R/NAME.log, print its tail
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  if ((left < 15)); then echo "=== $name skipped: out of time"; return; fi
  ((limit > left)) && limit=$left
  local t0=$SECONDS
  timeout "$limit" "$@" >"$R/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s"
  tail -n 3 "$R/$name.log"
  return $rc
}

stage_env() {
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv >"$R/nvidia-smi.txt" 2>&1
  step env 60 python3 -c "import mlx.core as mx, mlx_lm; print(mx.__version__, mlx_lm.__version__, mx.default_device(), mx.device_info())"
}

stage_train() {
  DEMO=/root/demo
  step train 540 python3 -m recipe.build --out "$DEMO" --minutes "${TRAIN_MINUTES:-5}" --eval-limit 40
  (cd "$DEMO" && tar cf "$OUT/demo.tar" .)
}

stage_eval() {  # the demo model's held-out generation eval (needs mlx; train may have run without)
  step eval 150 python3 -m recipe.evaluate --model "$DEMO" --limit 40 --out "$R/demo_eval.json"
}

stage_fusion() {  # issue 4: fused vs unfused decode, random weights of real shapes
  step fusion 240 python3 bench/fusion_micro.py --shapes "${FUSION_SHAPES:-moe}" --dtypes bf16,4bit \
    --tokens 128 --prompt-tokens 512 --rounds 3 --out "$R/fusion_micro.json"
}

stage_demo() {  # issue 3: the demo model, every default technique on
  step demo_edits 150 $BG jobs/edits.jsonl --model "$DEMO" --max-jobs 40 --out "$R/demo_edits.json"
  step demo_freeform 90 $BG jobs/freeform.jsonl --model "$DEMO" --max-jobs 20 --out "$R/demo_freeform.json"
}

stage_shapes() {  # issue 4: fusion alone on real shapes through batchgen bench
  for s in qwen2.5-0.5b qwen2.5-1.5b qwen2.5-7b; do
    step "shape_${s}" 150 $BG --shape "$s" --model "$DEMO" --synthetic 512 --synthetic-jobs 3 --max-tokens 200 \
      --draft none --no-prompt-cache --out "$R/shape_${s}.json"
  done
}

stage_pld() {  # issue 6: PLD alone (fusion and pool off)
  local alone="--no-fuse --no-prompt-cache"
  step pld_edits 150 $BG jobs/edits.jsonl --model "$DEMO" --max-jobs 40 $alone --out "$R/pld_edits.json"
  step pld_freeform 90 $BG jobs/freeform.jsonl --model "$DEMO" --max-jobs 20 $alone --out "$R/pld_freeform.json"
  step pld_edits_always 90 $BG jobs/edits.jsonl --model "$DEMO" --max-jobs 16 $alone --pld-always \
    --out "$R/pld_edits_always.json"
  step pld_qwen2.5-7b 120 $BG jobs/edits.jsonl --shape qwen2.5-7b --model "$DEMO" --max-jobs 4 --max-tokens 128 \
    $alone --out "$R/pld_qwen2.5-7b.json"
}

stage_pool() {  # issue 5: time to first token with the prewarmed pool against plain mlx-lm
  for f in long-system edits; do
    step "pool_${f}" 90 $BG "jobs/$f.jsonl" --model "$DEMO" --max-jobs 12 --max-tokens 32 --draft none \
      --no-fuse --out "$R/pool_${f}.json"
  done
  step pool_qwen2.5-7b 120 $BG jobs/long-system.jsonl --shape qwen2.5-7b --model "$DEMO" --max-jobs 6 \
    --max-tokens 16 --draft none --no-fuse --out "$R/pool_qwen2.5-7b.json"
}

stage_pooledits() {  # issue 5: the short-system-prompt file on the shapes
  for s in qwen2.5-0.5b qwen2.5-7b; do
    step "pool_edits_${s}" 90 $BG jobs/edits.jsonl --shape "$s" --model "$DEMO" --max-jobs 6 --max-tokens 16 \
      --draft none --no-fuse --out "$R/pool_edits_${s}.json"
  done
}

stage_poolprofile() {  # issue 5: where the first job's TTFT goes (pool fetch, tail prefill, first step)
  for s in qwen2.5-7b qwen2.5-0.5b; do
    step "poolprof_${s}" 120 python3 bench/pool_profile.py jobs/long-system.jsonl --shape "$s" --model "$DEMO" \
      --jobs 4 --out "$R/poolprof_${s}.json"
  done
  step poolprof_7b_nopad 120 python3 bench/pool_profile.py jobs/long-system.jsonl --shape qwen2.5-7b --model "$DEMO" \
    --jobs 4 --no-pad --out "$R/poolprof_7b_nopad.json"
}

stage_small() {  # issues 5 and 6 on the Qwen2.5-0.5B shape
  step pld_qwen2.5-0.5b 60 $BG jobs/edits.jsonl --shape qwen2.5-0.5b --model "$DEMO" --max-jobs 4 --max-tokens 128 \
    --no-fuse --no-prompt-cache --out "$R/pld_qwen2.5-0.5b.json"
  step pool_qwen2.5-0.5b 60 $BG jobs/long-system.jsonl --shape qwen2.5-0.5b --model "$DEMO" --max-jobs 6 \
    --max-tokens 16 --draft none --no-fuse --out "$R/pool_qwen2.5-0.5b.json"
}

stage_pldpolicy() {  # issue 6: the adaptive policy's settings on edits (PLD alone)
  local alone="--no-fuse --no-prompt-cache"
  for p in "min_plain_tokens=16" "min_plain_tokens=8"; do
    step "pldpol_${p//[=,]/_}" 90 $BG jobs/edits.jsonl --model "$DEMO" --max-jobs 16 $alone --pld-policy "$p" \
      --out "$R/pldpol_${p//[=,]/_}.json"
  done
}

stage_tqkernels() {  # issue 7: fused TurboQuant kernels: exactness vs float64, then speed
  step tqk_test 200 python3 -m pytest -q -p no:cacheprovider tests/test_turboquant_kernels.py
  [[ ${TQK_TEST_ONLY:-0} == 1 ]] && return
  tq_attention tqk_attention 200
}

tq_attention() {  # NAME SECONDS: one decode step's attention, fp16 against TurboQuant's paths
  step "$1" "$2" python3 bench/turboquant_attention.py --shapes 0.5b,7b --contexts 1024,8192,32768 \
    --out "$R/turboquant_attention.json"
}

stage_tpdemo() {  # issue 8 on the shipped demo model: both job files
  for f in freeform edits; do
    step "tp_demo_${f}" 150 $BG "jobs/$f.jsonl" --model "$DEMO" --throughput 8,32,auto --jobs-total 256 \
      --max-tokens 128 --out "$R/throughput_demo_${f}.json"
  done
}

stage_throughput() {  # issue 8: whole-file throughput against mlx-lm's batch_generate
  step tp_demo_edits 150 $BG jobs/edits.jsonl --model "$DEMO" --throughput 8,32,auto --jobs-total 256 \
    --max-tokens 128 --out "$R/throughput_demo_edits.json"
  step tp_0.5b 120 $BG jobs/freeform.jsonl --shape qwen2.5-0.5b --model "$DEMO" --throughput 8,32,auto \
    --jobs-total 256 --max-tokens 128 --out "$R/throughput_0.5b.json"
  step tp_7b 150 $BG jobs/freeform.jsonl --shape qwen2.5-7b --model "$DEMO" --throughput 8,32 \
    --jobs-total 128 --max-tokens 64 --out "$R/throughput_7b.json"
}

stage_batchkernel() {  # issue 8: batch_decode_attention against float64 (CUDA-only tests)
  step bk_test 150 python3 -m pytest -q -p no:cacheprovider tests/test_attention_kernels.py
}

stage_batchstep() {  # issue 8: a batched decode step's cost by rows, cache kind and fusion
  step batchstep 200 python3 bench/batch_step.py --shape qwen2.5-0.5b --rows 1,8,32 --context 512 --fused-only \
    --out "$R/batch_step_0.5b.json"
  step batchstep_7b 150 python3 bench/batch_step.py --shape qwen2.5-7b --rows 1,8,32 --context 512 --fused-only --capacities 4096 \
    --out "$R/batch_step_7b.json"
}

stage_bprof8() {  # issue 8: where a 0.5B-shape run's time and memory go at 8 and 32 rows (compiled step);
  # BPROF_COLD=--cold: from an empty prompt pool, as --throughput runs
  for rows in ${BPROF_ROWS:-8 32}; do
    step "bprof_b$rows" 120 python3 bench/batch_profile.py jobs/freeform.jsonl --shape qwen2.5-0.5b --model "$DEMO" \
      --batch "$rows" --jobs-total 256 --max-tokens 128 ${BPROF_COLD:-} --out "$R/batch_profile_b$rows.json"
  done
}

stage_batchprofile() {  # issue 8: where a 0.5B-shape batched run's time goes, compiled step and not
  for mode in compiled uncompiled; do
    local flag=""
    [[ $mode == uncompiled ]] && flag="--uncompiled"
    step "bprof_${mode}" 120 python3 bench/batch_profile.py jobs/freeform.jsonl --shape qwen2.5-0.5b --model "$DEMO" \
      --batch 32 --jobs-total 256 --max-tokens 128 $flag --out "$R/batch_profile_${mode}.json"
  done
}

stage_copyprobe() {  # issue 8: do steps copy whole KV buffers (time growing with capacity)? graph size knob
  step copyprobe_7b 150 python3 bench/batch_step.py --shape qwen2.5-7b --rows 8,32 --context 512 --fused-only \
    --capacities 4096 --out "$R/copyprobe_7b.json"
  MLX_MAX_OPS_PER_BUFFER=400 step opsknob_0.5b 100 python3 bench/batch_step.py --shape qwen2.5-0.5b --rows 8,32 \
    --context 512 --fused-only --out "$R/opsknob_0.5b.json"
}

stage_stepops() {  # issue 8: a batch step's primitives by kind and ms, through the model's layers and through
  # step_forward, 8 and 32 rows (STEPOPS_KINDS=rope,norm,mlp,all: the former with each taken out); then the
  # step under other MLX_MAX_OPS_PER_BUFFER values (STEPOPS_OPS="10 40 100": nodes per CUDA graph, default 20)
  for shape in qwen2.5-0.5b qwen2.5-7b; do
    for rows in 8 32; do
      step "stepops_${shape}_b$rows" 120 python3 bench/step_ops_probe.py --shape "$shape" --rows "$rows" \
        --kinds "${STEPOPS_KINDS:-}" --out "$R/step_ops_${shape}_b$rows.json"
    done
  done
  for n in ${STEPOPS_OPS:-}; do
    MLX_MAX_OPS_PER_BUFFER=$n step "stepops_ops$n" 90 python3 bench/step_ops_probe.py --shape qwen2.5-0.5b --rows 8 \
      --out "$R/step_ops_0.5b_ops$n.json"
  done
}

stage_tp7b() {  # issue 8: the 7B shape
  step tp_7b 200 $BG jobs/freeform.jsonl --shape qwen2.5-7b --model "$DEMO" --throughput 8,32 \
    --jobs-total 128 --max-tokens 64 --out "$R/throughput_7b.json"
}

stage_tpshapes() {  # issue 8: both shapes at equal batch, and the 0.5B shape one job at a time
  step tp_0.5b 200 $BG jobs/freeform.jsonl --shape qwen2.5-0.5b --model "$DEMO" --throughput 1,8,32 \
    --jobs-total 256 --max-tokens 128 --out "$R/throughput_0.5b.json"
  stage_tp7b
}

stage_tp05() {  # issue 8: the 0.5B shape alone, with time to finish
  step tp_0.5b 300 $BG jobs/freeform.jsonl --shape qwen2.5-0.5b --model "$DEMO" --throughput 8,32 \
    --jobs-total 256 --max-tokens 128 --out "$R/throughput_0.5b.json"
}

stage_tqstep() {  # issue 7: the one-kernel decode step against its reference (stops the call if it fails), speed
  step tqs_test 200 python3 -m pytest -q -p no:cacheprovider tests/test_turboquant_step.py || return 1
  tq_attention tqs_attention 150
}

stage_tqprobe() {  # issue 7: where a step-mode step's time goes (launches, phases, fp16 alongside)
  step tqprobe 240 python3 bench/turboquant_step_probe.py ${TQ_PROBE_SHAPES:-0.5b,7b} ${TQ_PROBE_CONTEXTS:-1024,32768}
}

stage_turboquant() {  # issue 7: decode speed and KV bytes against the fp16 cache (TQ_RUNS: shape:context ...;
  # TQ_DRAFT=pld: both sides with prompt lookup, files tq_pld_*)
  local runs=${TQ_RUNS:-"qwen2.5-0.5b:1024 qwen2.5-0.5b:8192 qwen2.5-0.5b:32768 qwen2.5-7b:1024 qwen2.5-7b:8192 qwen2.5-7b:32768"}
  for run in $runs; do
    local s=${run%%:*} n=${run##*:}
    local draft=${TQ_DRAFT:-none} tag=tq
    [[ $draft == none ]] || tag="tq_$draft"
    step "${tag}_${s}_${n}" 150 $BG --shape "$s" --model "$DEMO" --synthetic "$n" --synthetic-jobs 2 \
      --max-tokens "${TQ_TOKENS:-64}" --draft "$draft" --no-prompt-cache --no-fuse --kv-cache turboquant --kv-bits 4 \
      --out "$R/${tag}_${s}_${n}.json"
  done
}

stage_tqbatch() {  # issue 8: TurboQuant rows in a batch: the step's attention on CUDA against the cache alone (stops
  # the call if it fails), then long-prompt throughput and memory, TurboQuant rows and fp16 rows against batch_generate
  # (TQB_SHAPES, TQB_CONTEXT prompt tokens, TQB_ROWS, TQB_JOBS distinct jobs)
  step tqb_test 150 python3 -m pytest -q -p no:cacheprovider tests/test_turboquant_batch.py -k reads_what || return 1
  for s in ${TQB_SHAPES:-qwen2.5-0.5b}; do
    for kv in turboquant fp16; do
      step "tqb_${s}_${kv}" 240 $BG --shape "$s" --model "$DEMO" --synthetic "${TQB_CONTEXT:-4096}" \
        --synthetic-jobs "${TQB_JOBS:-64}" --jobs-total "${TQB_JOBS:-64}" --max-tokens 128 --throughput "${TQB_ROWS:-8,32}" \
        --no-prompt-cache --kv-cache "$kv" --out "$R/tqbatch_${s}_${kv}.json"
    done
  done
}

stage_tqfree() {  # issue 8: jobs/freeform.jsonl on the 0.5B shape with TurboQuant rows (TQF_ROWS) and fp16 rows (8, 32)
  step tqf_turboquant 300 $BG jobs/freeform.jsonl --shape qwen2.5-0.5b --model "$DEMO" --throughput "${TQF_ROWS:-8,32,auto}" \
    --jobs-total 256 --max-tokens 128 --kv-cache turboquant --out "$R/tqfree_turboquant.json"
  step tqf_fp16 200 $BG jobs/freeform.jsonl --shape qwen2.5-0.5b --model "$DEMO" --throughput 8,32 \
    --jobs-total 256 --max-tokens 128 --out "$R/tqfree_fp16.json"
}

stage_bpld() {  # issue 8: prompt lookup in a batch against plain batched rows and batch_generate (BPLD_ROWS,
  # BPLD_RUNS: model:file pairs; BPLD_FLAGS e.g. --pld-always); the CPU exactness tests first, with the CUDA step kernel
  [[ ${BPLD_TEST:-1} == 0 ]] || step bpld_test 150 python3 -m pytest -q -p no:cacheprovider tests/test_batch_pld.py -x || return 1
  local runs=${BPLD_RUNS:-"demo:edits demo:freeform qwen2.5-0.5b:edits"}
  for run in $runs; do
    local m=${run%%:*} f=${run##*:} model=()
    [[ $m == demo ]] && model=(--model "$DEMO") || model=(--shape "$m" --model "$DEMO")
    step "bpld_${m}_${f}" 240 $BG "jobs/$f.jsonl" "${model[@]}" --throughput "${BPLD_ROWS:-8,32}" --jobs-total 256 \
      --max-tokens 128 --throughput-drafts pld,none --pld-in-batch ${BPLD_FLAGS:-} --out "$R/bpld_${m}_${f}.json"
  done
}

stage_proj() {  # issue 8: the few-row projection kernel (CUDA tests stop the call if they fail), against MLX's matmul
  step proj_test 240 python3 -m pytest -q -p no:cacheprovider tests/test_projection.py || return 1
  step proj_0.5b 150 python3 bench/projection_probe.py --shape qwen2.5-0.5b --rows 2,8,16,32 --out "$R/proj_0.5b.json"
  step proj_7b 200 python3 bench/projection_probe.py --shape qwen2.5-7b --rows 8,32 --reps 2 --out "$R/proj_7b.json"
}

stage_margin() {  # batched PLD's CUDA float32 divergence: MLX's TF32 matmuls on and off, then the exactness tests
  MLX_ENABLE_TF32=1 step margin_tf32 120 python3 bench/batch_pld_margin.py --out "$R/margin_tf32.json"
  MLX_ENABLE_TF32=0 step margin_fp32 120 python3 bench/batch_pld_margin.py --out "$R/margin_fp32.json"
  step bpld_test 240 python3 -m pytest -q -p no:cacheprovider tests/test_batch_pld.py -k "equals_plain or short_attention"
}

stage_tp05edits() {  # issue 8: the 0.5B shape on both job files
  step tp_0.5b_edits 240 $BG jobs/edits.jsonl --shape qwen2.5-0.5b --model "$DEMO" --throughput 8,32 \
    --jobs-total 256 --max-tokens 128 --out "$R/throughput_0.5b_edits.json"
  stage_tp05
}

stage_matrix() {  # issue 8: rows of the measurement matrix not run on the current code
  step tp_7b_edits 200 $BG jobs/edits.jsonl --shape qwen2.5-7b --model "$DEMO" --throughput 8,32 \
    --jobs-total 128 --max-tokens 64 --out "$R/throughput_7b_edits.json"
  step tp_0.5b_b1 150 $BG jobs/freeform.jsonl --shape qwen2.5-0.5b --model "$DEMO" --throughput 1 \
    --jobs-total 48 --max-tokens 128 --out "$R/throughput_0.5b_b1.json"
  step tp_0.5b_auto 120 $BG jobs/freeform.jsonl --shape qwen2.5-0.5b --model "$DEMO" --throughput auto \
    --jobs-total 256 --max-tokens 128 --out "$R/throughput_0.5b_auto.json"
  step tp_demo_freeform 120 $BG jobs/freeform.jsonl --model "$DEMO" --throughput 8,32,auto --jobs-total 256 \
    --max-tokens 128 --out "$R/throughput_demo_freeform.json"
}

ncu_bin() {  # Nsight Compute's command line: on the PATH, else where the CUDA image installs it
  command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1
}

ncu_each() {  # ncu_each PREFIX SPECS NCU_ARGS...: bench/kernel_profile.py under Nsight Compute once for each of
  # the ';'-separated SPECS (its arguments), logged as $R/PREFIX_<spec>.log; {} in NCU_ARGS stands for that name
  local prefix=$1 specs_text=$2 ncu spec name specs
  shift 2
  ncu=$(ncu_bin)
  step "${prefix}_version" 30 "$ncu" --version || return 1
  IFS=';' read -r -a specs <<<"$specs_text"
  for spec in "${specs[@]}"; do
    name=${prefix}_$(echo "$spec" | tr -c 'a-z0-9.\n' '_' | tr -s '_')
    step "$name" 200 "$ncu" "${@//\{\}/$name}" python3 bench/kernel_profile.py $spec
    if [[ -f $R/$name.csv ]]; then  # a CSV of kernel times: summed by family
      python3 bench/kernel_profile.py summary "$R/$name.csv" >>"$R/${prefix}_summary.txt" 2>&1
      tail -n 12 "$R/${prefix}_summary.txt"
    fi
  done
}

stage_ncu() {  # issues 7 / 8: GPU time of each kernel of one step (Nsight Compute; bench/kernel_profile.py)
  # NCU_SPECS: kernel_profile.py arguments, runs separated by ';'
  ncu_each ncu "${NCU_SPECS:-step --shape qwen2.5-7b --rows 8;step --shape qwen2.5-7b --rows 32;\
tq --shape 7b --context 32768;tq --shape 0.5b --context 32768;tqbatch --shape qwen2.5-0.5b --rows 32 --context 1024;\
step --shape qwen2.5-0.5b --rows 32}" --profile-from-start off --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --csv --page raw --print-units base --log-file "$R/{}.csv"
}

stage_attn() {  # issue 8: the CUDA tests of the batch attention kernels, their launch cache and TurboQuant rows'
  # step (stop the call if they fail)
  step attn_test 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_names.py tests/test_attention_kernels.py \
    tests/test_step_forward.py "tests/test_turboquant_batch.py::test_step_attention_reads_what_a_cache_alone_reads" \
    -x || return 1
}

# ATTN_BASELINE: another attention.py (see bench/attention_baseline.py);
# ATTN_VARIANTS: attention_probe.py --variant values, separated by spaces.
stage_attnprobe() {  # issue 8: the batch attention kernel's compiled steps and launches, shipped against others
  local v args=()
  for v in ${ATTN_VARIANTS:-}; do args+=(--variant "$v"); done
  [[ -n ${ATTN_BASELINE:-} ]] && args+=(--baseline "$ATTN_BASELINE")
  step attnprobe_7b 200 python3 bench/attention_probe.py --shape qwen2.5-7b --rows 8,32 --contexts 512,2048 \
    "${args[@]}" --out "$R/attnprobe_7b.json"
  step attnprobe_05b 120 python3 bench/attention_probe.py --shape qwen2.5-0.5b --rows 8,32 --contexts 512 \
    "${args[@]}" --out "$R/attnprobe_05b.json"
}

ab_run() {  # ab_run NAME SIDE BASELINE ARGS...: one bench CLI run, the shipped code or (SIDE baseline) the CLI
  # through bench/attention_baseline.py BASELINE (its arguments: a file, or --turboquant-batch and a file)
  local name=$1_$2 side=$2 baseline=$3 cli=($BG)
  shift 3
  [[ $side == baseline ]] && cli=(python3 bench/attention_baseline.py $baseline bench)
  step "$name" 150 "${cli[@]}" "$@" --out "$R/$name.json"
}

stage_attnab() {  # issue 8: whole runs, the shipped attention and ATTN_BASELINE in turn (ATTN_ORDER), one machine;
  # ATTN_SHAPES: which of the 7B (8 rows) and 0.5B (32 rows) runs
  local side i=0 shapes=" ${ATTN_SHAPES:-7b 05} "
  for side in ${ATTN_ORDER:-baseline shipped baseline shipped}; do
    i=$((i + 1))
    if [[ $shapes == *" 7b "* ]]; then
      ab_run "ab7b_$i" "$side" "$ATTN_BASELINE" jobs/freeform.jsonl --shape qwen2.5-7b --model "$DEMO" --throughput 8 \
        --jobs-total 64 --max-tokens 64
    fi
    if [[ $shapes == *" 05 "* ]]; then
      ab_run "ab05_$i" "$side" "$ATTN_BASELINE" jobs/freeform.jsonl --shape qwen2.5-0.5b --model "$DEMO" \
        --throughput 32 --jobs-total 256 --max-tokens 64
    fi
  done
  return 0
}

# TQ_BASELINE: another turboquant_batch.py (its step kernel: STEP_SOURCE, STEP_HEADER).
stage_tqab() {  # issue 8: TurboQuant rows' step kernel, shipped against TQ_BASELINE: probe, then whole runs in turn
  step tqab_probe 150 python3 bench/turboquant_batch_probe.py --shape qwen2.5-0.5b --rows 32 --context 1024 \
    --baseline "$TQ_BASELINE" --out "$R/tqab_probe.json"
  local side i=0
  for side in ${TQ_ORDER:-baseline shipped baseline shipped}; do
    i=$((i + 1))
    ab_run "tqab_$i" "$side" "--turboquant-batch $TQ_BASELINE" jobs/freeform.jsonl --shape qwen2.5-0.5b \
      --model "$DEMO" --throughput 32 --jobs-total 256 --max-tokens 128 --kv-cache turboquant
  done
}

stage_ncudetail() {  # issues 7 / 8: why the step attention kernels take their time (Nsight Compute sections:
  # throughput against peaks, warp stall reasons, occupancy), two launches each (NCUD_SPECS: as NCU_SPECS)
  ncu_each ncud "${NCUD_SPECS:-step --shape qwen2.5-7b --rows 8;tqbatch --shape qwen2.5-0.5b --rows 32 --context 1024;\
tq --shape 7b --context 32768}" --profile-from-start off --kernel-name "regex:attention|tq_" --launch-count 2 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section SchedulerStats --section LaunchStats
}

stage_tqblocks() {  # issue 7: the one-job step kernel's blocks a step (TQ_BLOCKS: STEP_BLOCKS values) at 8k / 32k
  step tqblocks 300 python3 bench/turboquant_attention.py --shapes 7b,0.5b --contexts 8192,32768 --paths step \
    --step-blocks "${TQ_BLOCKS:-1024,2048}" --out "$R/tqblocks.json"
}

stage_syncsteps() {  # issue 8: where a whole run's step time goes, TurboQuant rows against fp16 rows (0.5B shape,
  # 32 rows; each step evaluated as queued, timed by what came before it: bench/batch_profile.py --sync-steps)
  local kv
  for kv in turboquant fp16; do
    step "syncsteps_$kv" 150 python3 bench/batch_profile.py jobs/freeform.jsonl --shape qwen2.5-0.5b --batch 32 \
      --jobs-total 128 --max-tokens 128 --kv-cache "$kv" --sync-steps --top 60 --out "$R/syncsteps_$kv.json"
  done
}

stage_keepbuf() {  # issue 8: the same whole runs pipelined as shipped, with and without emptying MLX's buffer cache
  local kv keep
  for kv in turboquant fp16; do
    for keep in "" --keep-buffers; do
      step "keepbuf_$kv${keep:+_keep}" 120 python3 bench/batch_profile.py jobs/freeform.jsonl --shape qwen2.5-0.5b \
        --batch 32 --jobs-total 128 --max-tokens 128 --kv-cache "$kv" $keep --top 30 \
        --out "$R/keepbuf_$kv${keep:+_keep}.json"
    done
  done
}

stage_tqshared() {  # issue 8: TurboQuant rows entering in shared prompt passes, against batch_generate (0.5B
  # shape, 8 and 32 rows), then where a 128-job run's time goes (its passes' rows and seconds, steps by kind)
  step tqsh_throughput 300 $BG jobs/freeform.jsonl --shape qwen2.5-0.5b --model "$DEMO" --throughput 8,32 \
    --jobs-total 256 --max-tokens 128 --kv-cache turboquant --out "$R/tqshared_0.5b.json"
  step tqsh_profile 150 python3 bench/batch_profile.py jobs/freeform.jsonl --shape qwen2.5-0.5b --batch 32 \
    --jobs-total 128 --max-tokens 128 --kv-cache turboquant --sync-steps --top 40 --out "$R/tqshared_profile.json"
}

stage_tp7bwarm() {  # issue 8: the 7B rows of the matrix on a machine's first bench process (cold: MLX compiles the
  # kernels, keeping their PTX on disk) and again (warm), then edits warm
  local run
  for run in cold warm; do
    step "tp_7b_$run" 200 $BG jobs/freeform.jsonl --shape qwen2.5-7b --model "$DEMO" --throughput 8,32 \
      --jobs-total 128 --max-tokens 64 --out "$R/throughput_7b_$run.json"
  done
  step tp_7b_edits_warm 200 $BG jobs/edits.jsonl --shape qwen2.5-7b --model "$DEMO" --throughput 8,32 \
    --jobs-total 128 --max-tokens 64 --out "$R/throughput_7b_edits_warm.json"
}

stage_tp7bfull() {  # issue 8: the 7B shape's rows of the matrix at the issue's size (256 jobs of 128 tokens), both
  # files, 8 / 32 / auto rows (a short 8-row run first, so that MLX's kernel builds fall outside the timed runs)
  step tp_7b_warm 120 $BG jobs/freeform.jsonl --shape qwen2.5-7b --model "$DEMO" --throughput 8 --jobs-total 16 \
    --max-tokens 16 --out "$R/throughput_7b_warm.json"
  local f
  for f in freeform edits; do
    step "tp_7b_${f}_256" 270 $BG "jobs/$f.jsonl" --shape qwen2.5-7b --model "$DEMO" --throughput 8,32,auto \
      --jobs-total 256 --max-tokens 128 --out "$R/throughput_7b_${f}_256.json"
  done
}

stage_tprest() {  # issue 8: the demo model's and the 0.5B shape's rows not run since rows stopped shrinking on CUDA,
  # and one job at a time on the 7B shape
  step tp_demo_all 150 $BG jobs/freeform.jsonl --model "$DEMO" --throughput 1,8,32,auto --jobs-total 256 \
    --max-tokens 128 --out "$R/throughput_demo_freeform.json"
  step tp_demo_edits 150 $BG jobs/edits.jsonl --model "$DEMO" --throughput 1,8,32,auto --jobs-total 256 \
    --max-tokens 128 --out "$R/throughput_demo_edits.json"
  step tp_0.5b_auto 150 $BG jobs/freeform.jsonl --shape qwen2.5-0.5b --model "$DEMO" --throughput auto \
    --jobs-total 256 --max-tokens 128 --out "$R/throughput_0.5b_auto.json"
  step tp_7b_b1 150 $BG jobs/freeform.jsonl --shape qwen2.5-7b --model "$DEMO" --throughput 1 --jobs-total 16 \
    --max-tokens 128 --out "$R/throughput_7b_b1.json"
}

stage_passsplit() {  # issue 8: entering rows' prompt passes split by tail length (edits: tails of 59-500 tokens),
  # the 7B and 0.5B shapes (SPLIT_7B_ONLY: the 7B alone) at 8 and 32 rows, 256 jobs of 128 tokens (prompt_s
  # against the tp7bfull set's)
  step tp_7b_edits_split 300 $BG jobs/edits.jsonl --shape qwen2.5-7b --model "$DEMO" --throughput 8,32 \
    --jobs-total 256 --max-tokens 128 --out "$R/throughput_7b_edits_split.json"
  [[ ${SPLIT_7B_ONLY:-} ]] && return
  step tp_0.5b_edits_split 150 $BG jobs/edits.jsonl --shape qwen2.5-0.5b --model "$DEMO" --throughput 8,32 \
    --jobs-total 256 --max-tokens 128 --out "$R/throughput_0.5b_edits_split.json"
}

stage_tqflash() {  # issue 8: TurboQuant rows' prompt passes with cuDNN (FLASH_MIN_QUERIES 64, as shipped) and
  # without it below 1,024 queries, in turn, after a short run that builds the machine's kernels
  step tqflash_warm 120 python3 bench/batch_profile.py jobs/freeform.jsonl --shape qwen2.5-0.5b --batch 32 \
    --jobs-total 32 --max-tokens 16 --kv-cache turboquant --top 5
  local q run=0
  for q in 64 1024 64 1024; do
    run=$((run + 1))
    step "tqflash_${run}_$q" 90 python3 bench/batch_profile.py jobs/freeform.jsonl --shape qwen2.5-0.5b --batch 32 \
      --jobs-total 128 --max-tokens 128 --kv-cache turboquant --flash-min-queries "$q" --top 20 \
      --out "$R/tqflash_${run}_$q.json"
  done
}

stage_tqstepab() {  # issue 7: the one-job step kernel against TQ_BASELINE (another commit's turboquant_kernels.py):
  # its CUDA test and error against the reference, the probe (each version's step alone, as many calls as layers),
  # then Nsight Compute of one launch of each at the 7B shape and 32k positions (duration, IPC, occupancy, stalls)
  : "${TQ_BASELINE:?tqstepab needs TQ_BASELINE (an older turboquant_kernels.py)}"
  step tqsab_test 200 python3 -m pytest -q -p no:cacheprovider tests/test_turboquant_step.py -k step_kernel || return 1
  step tqsab_error 120 python3 bench/turboquant_step_error.py
  step tqsab_probe 240 python3 bench/turboquant_step_probe.py 7b,0.5b 8192,32768 "$TQ_BASELINE"
  local ncu k
  ncu=$(ncu_bin)
  for k in baseline shipped; do  # MLX names a kernel after its template: tq_step_baseline_128_.., tq_step_128_..
    local re=tq_step_baseline
    [[ $k == shipped ]] && re="tq_step_[0-9]"
    step "tqsab_ncu_$k" 200 "$ncu" --kernel-name "regex:$re" --launch-skip 40 --launch-count 1 --clock-control none \
      --section SpeedOfLight --section WarpStateStats --section Occupancy --section SchedulerStats \
      --section LaunchStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      python3 bench/turboquant_step_probe.py 7b 32768 "$TQ_BASELINE"
  done
}

stage_tqdecode() {  # issue 7: decode over TurboQuant against mlx-lm's fp16 cache, one loop and model, sides in turn
  # (bench/turboquant_decode.py; TQD_SHAPES, TQD_CONTEXTS, TQD_ROUNDS; TQ_BASELINE: a third side, that file's step)
  for s in ${TQD_SHAPES:-qwen2.5-7b qwen2.5-0.5b}; do
    step "tqd_${s}" 300 python3 bench/turboquant_decode.py "$s" "${TQD_CONTEXTS:-1024,8192,32768}" \
      --rounds "${TQD_ROUNDS:-5}" ${TQ_BASELINE:+--baseline "$TQ_BASELINE"} --out "$R/tqd_${s}.jsonl"
  done
}

for s in "$@"; do "stage_$s" || break; done  # a stage that fails its check ends the call
(cd "$OUT" && tar czf results.tgz results && rm -rf results)
