#!/usr/bin/env bash
# Two ranks (batchgen launch, ring backend on localhost) against one process, on a CPU machine,
# in turn, ROUNDS times: the first 24 jobs of jobs/edits.jsonl on the demo model in float32.
#   bash bench/ranks_cpu.sh            # results (outputs, summaries, load averages) in $OUT (/tmp/ranks_cpu)
# Prints a table row per run: wall, load, completion tok/s, decode tok/s per job, ids, texts equal
# to the first one-process run, each rank's share and tok/s, the machine's load average at the start.
set -u
OUT=${OUT:-/tmp/ranks_cpu}
ROUNDS=${ROUNDS:-3}
mkdir -p "$OUT"
head -n 25 jobs/edits.jsonl >"$OUT/jobs.jsonl"
for round in $(seq "$ROUNDS"); do
  for side in one two; do
    rm -f "$OUT/$side-$round.jsonl"
    uptime >"$OUT/$side-$round.load"
    args=(run "$OUT/jobs.jsonl" -o "$OUT/$side-$round.jsonl" --dtype float32 --summary "$OUT/$side-$round.json" -q)
    if [[ $side == one ]]; then
      python -m batchgen "${args[@]}"
    else
      python -m batchgen launch -n 2 --backend ring -- python -m batchgen "${args[@]}" </dev/null
    fi
  done
done
python - "$OUT" "$ROUNDS" <<'EOF'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
read = lambda p: [json.loads(l) for l in open(p)]
ref = {l["id"]: l.get("text") for l in read(f"{out}/one-1.jsonl")}
for r in range(1, rounds + 1):
    for side in ("one", "two"):
        s, lines = json.load(open(f"{out}/{side}-{r}.json")), read(f"{out}/{side}-{r}.jsonl")
        same = sum(ref[l["id"]] == l.get("text") for l in lines)
        ranks = ", ".join(f"{x['share']} jobs {x['throughput_tps']} tok/s" for x in s.get("ranks", []))
        load = open(f"{out}/{side}-{r}.load").read().split("load average:")[1].split(",")[0].strip()
        print(f"| {r} | {side} | {s['wall_s']:.1f} | {s['load_s']:.2f} | {s['throughput_tps']} | {s['decode_tps']} "
              f"| {len({l['id'] for l in lines})}/{len(lines)} | {same}/{len(lines)} | {ranks} | {load} |")
EOF
