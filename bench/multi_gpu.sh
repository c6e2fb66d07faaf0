#!/usr/bin/env bash
# Data and tensor parallel on several H200s (MLX's CUDA backend, NCCL through mlx.launch).
# Run from the repo root on a machine with 2 GPUs, MLX unpacked in /tmp/site (as bench/h200.sh):
#   bash bench/multi_gpu.sh STAGE [STAGE ...]
# Stages:
#   env     versions, the GPUs, a two-rank all_gather through mlx.launch
#   shapes  random-weight model directories of the 0.5B and 7B shapes (/tmp/shapes), and the jobs:
#           2,048 jobs of jobs/freeform.jsonl and jobs/edits.jsonl, cycled (max_tokens 128)
#   dp05    data parallel, 0.5B shape, --batch-size auto: 1 GPU, then 2 GPUs (wall, tok/s, ids)
#   dp7b    the same on the 7B shape
#   tp7b    tensor parallel over 2 GPUs on the 7B shape against 1 GPU: one job, and 32 rows
#           (decode tok/s, memory per GPU)
#   kill    2 GPUs, 0.5B shape: rank 1 killed (SIGKILL) mid-run, the run again: nothing lost or twice
# NVLink multicast stays off: NCCL_NVLS_ENABLE=0, exported and passed through the launcher's --env.
# A device call runs 10 minutes at most: e.g. `env dp05`, then `dp7b`, then `tp7b kill`; each
# stage first makes the shapes and jobs it needs where a fresh machine lacks them.
# Each figure lands in $OUT/results/*.json with its log; results.tgz at the end.
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
R=$OUT/results
S=${SHAPES_DIR:-/tmp/shapes}
mkdir -p "$R" "$S"
DEADLINE=$((SECONDS + ${BUDGET_S:-570}))
LAUNCH=(python3 -m batchgen launch -n 2 --backend nccl --env NCCL_NVLS_ENABLE=0 --)
RUN=(python3 -m batchgen run)

. "$(dirname "$0")/step.sh"  # step NAME SECONDS CMD...

compare() {  # compare NAME ONE_OUT ONE_SUMMARY TWO_OUT TWO_SUMMARY: scaling and ids, as JSON
  [[ -f $3 && -f $5 ]] || { echo "=== $1: a side has no summary"; return 1; }
  python3 - "$@" >"$R/$1.json" <<'EOF'
import json, sys
name, one_out, one_sum, two_out, two_sum = sys.argv[1:]
def ids(p):
    return [json.loads(l).get("id") or json.loads(l).get("custom_id") for l in open(p)]
a, b = json.load(open(one_sum)), json.load(open(two_sum))
ia, ib = ids(one_out), ids(two_out)
row = {
    "name": name,
    "one": {k: a[k] for k in ("wall_s", "load_s", "throughput_tps", "decode_tps", "peak_memory_gb", "batch")},
    "two": {k: b[k] for k in ("wall_s", "load_s", "throughput_tps", "decode_tps", "peak_memory_gb", "batch",
                              "parallel", "ranks")},
    "tokens": [a["tokens"]["completion"], b["tokens"]["completion"]],
    "scaling_throughput": round(b["throughput_tps"] / a["throughput_tps"], 3),
    "scaling_after_load": round((a["wall_s"] - a["load_s"]) / (b["wall_s"] - b["load_s"]), 3),
    "ids_identical": sorted(ia) == sorted(ib), "ids_once": len(set(ib)) == len(ib), "jobs": [len(ia), len(ib)],
}
print(json.dumps(row, indent=2))
EOF
  tail -n 4 "$R/$1.json"
}

stage_env() {
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >"$R/nvidia-smi.txt" 2>&1
  step env 60 python3 -c "import mlx.core as mx, mlx_lm; print(mx.__version__, mlx_lm.__version__, mx.default_device(), mx.device_info())"
  cat >/tmp/allgather.py <<'EOF'
import mlx.core as mx
g = mx.distributed.init()
x = mx.distributed.all_gather(mx.array([g.rank()], dtype=mx.uint8))
print("rank", g.rank(), "of", g.size(), "gathered", x.tolist())
EOF
  step allgather 120 "${LAUNCH[@]}" python3 /tmp/allgather.py
}

stage_shapes() {  # stage_shapes [SHAPE ...] (default: both)
  local shape shapes=("$@")
  ((${#shapes[@]})) || shapes=(qwen2.5-0.5b qwen2.5-7b)
  for shape in "${shapes[@]}"; do
    [[ -f $S/$shape/model.safetensors ]] || step "shape_$shape" 300 python3 bench/shape_model.py "$shape" "$S/$shape"
  done
  python3 - "$S/jobs2048.jsonl" <<'EOF'
import itertools, json, sys
def jobs(path):
    lines = [json.loads(l) for l in open(path) if l.strip()]
    header = "batchgen" in lines[0]
    system = lines[0]["batchgen"].get("system") if header else None
    for j in lines[1 if header else 0:]:
        msgs = j["messages"] if any(m["role"] == "system" for m in j["messages"]) or system is None else \
            [{"role": "system", "content": system}] + j["messages"]
        yield msgs
source = itertools.cycle(list(jobs("jobs/freeform.jsonl")) + list(jobs("jobs/edits.jsonl")))
with open(sys.argv[1], "w") as f:
    for i, msgs in zip(range(2048), source):
        f.write(json.dumps({"id": f"c{i:04d}", "messages": msgs, "max_tokens": 128}) + "\n")
EOF
  head -c 200 "$S/jobs2048.jsonl"; echo
}

data_parallel() {  # data_parallel NAME SHAPE
  local name=$1 model=$S/$2
  stage_shapes "$2" >/dev/null
  rm -f "$R/${name}_one.jsonl" "$R/${name}_two.jsonl" "$R/${name}"_*.summary.json
  CUDA_VISIBLE_DEVICES=0 step "${name}_one" 540 "${RUN[@]}" "$S/jobs2048.jsonl" --model "$model" --batch-size auto \
    -o "$R/${name}_one.jsonl" --summary "$R/${name}_one.summary.json" || return 1
  step "${name}_two" 540 "${LAUNCH[@]}" "${RUN[@]}" "$S/jobs2048.jsonl" --model "$model" --batch-size auto \
    -o "$R/${name}_two.jsonl" --summary "$R/${name}_two.summary.json" || return 1
  compare "$name" "$R/${name}_one.jsonl" "$R/${name}_one.summary.json" "$R/${name}_two.jsonl" "$R/${name}_two.summary.json"
}

stage_dp05() { data_parallel dp05 qwen2.5-0.5b; }
stage_dp7b() { data_parallel dp7b qwen2.5-7b; }

stage_tp7b() {  # one job (256 tokens, batch 1) and 32 rows (--batch-size 32), 1 GPU then tensor parallel over 2
  local model=$S/qwen2.5-7b n
  stage_shapes qwen2.5-7b >/dev/null
  for n in 1 32; do
    head -n "$n" "$S/jobs2048.jsonl" | sed 's/"max_tokens": 128/"max_tokens": 256/' >"$S/tp_$n.jsonl"
    rm -f "$R/tp7b_${n}_one.jsonl" "$R/tp7b_${n}_two.jsonl" "$R/tp7b_${n}"_*.summary.json
    CUDA_VISIBLE_DEVICES=0 step "tp7b_${n}_one" 300 "${RUN[@]}" "$S/tp_$n.jsonl" --model "$model" --batch-size "$n" \
      -o "$R/tp7b_${n}_one.jsonl" --summary "$R/tp7b_${n}_one.summary.json"
    step "tp7b_${n}_two" 300 "${LAUNCH[@]}" "${RUN[@]}" "$S/tp_$n.jsonl" --model "$model" --batch-size "$n" \
      --tensor-parallel all -o "$R/tp7b_${n}_two.jsonl" --summary "$R/tp7b_${n}_two.summary.json"
    compare "tp7b_$n" "$R/tp7b_${n}_one.jsonl" "$R/tp7b_${n}_one.summary.json" "$R/tp7b_${n}_two.jsonl" \
      "$R/tp7b_${n}_two.summary.json"
  done
}

stage_kill() {  # rank 1 killed once 200 lines are written; then the same command again
  local out=$R/kill.jsonl pid
  stage_shapes qwen2.5-0.5b >/dev/null
  rm -f "$out" "$R"/.kill.jsonl.*
  "${LAUNCH[@]}" "${RUN[@]}" "$S/jobs2048.jsonl" --model "$S/qwen2.5-0.5b" --batch-size auto -o "$out" \
    >"$R/kill_first.log" 2>&1 &
  local launcher=$!
  until (($(cat "$out" "$R"/.kill.jsonl.part-* 2>/dev/null | wc -l) >= 200)) || ! kill -0 $launcher 2>/dev/null; do
    sleep 0.2
  done
  pid=$(grep -l "MLX_RANK=1" /proc/[0-9]*/environ 2>/dev/null | while read -r f; do
    p=${f#/proc/}; p=${p%/environ}
    tr '\0' ' ' </proc/$p/cmdline | grep -q "batchgen run .*kill.jsonl" && echo "$p"; done | head -n 1)
  echo "killing rank 1 (pid ${pid:-none}) at $(cat "$out" "$R"/.kill.jsonl.part-* 2>/dev/null | wc -l) lines"
  [[ -n $pid ]] && kill -9 "$pid"
  wait $launcher
  echo "first launch rc=$? ($(wc -l <"$out") lines in the output)" | tee -a "$R/kill_first.log"
  step kill_again 540 "${LAUNCH[@]}" "${RUN[@]}" "$S/jobs2048.jsonl" --model "$S/qwen2.5-0.5b" --batch-size auto \
    -o "$out" --summary "$R/kill_again.summary.json"
  python3 - "$out" "$S/jobs2048.jsonl" >"$R/kill.json" <<'EOF'
import json, sys
got = [json.loads(l)["id"] for l in open(sys.argv[1])]
want = [json.loads(l)["id"] for l in open(sys.argv[2])]
print(json.dumps({"lines": len(got), "ids_once": len(set(got)) == len(got), "all_ids": sorted(got) == sorted(want)}))
EOF
  cat "$R/kill.json"
}

for s in "$@"; do "stage_$s" || break; done  # a stage that fails ends the call
(cd "$OUT" && tar czf results.tgz results && rm -rf results)
