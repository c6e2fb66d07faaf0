# Shared by the device scripts (bench/h200.sh, bench/multi_gpu.sh); needs R (the results
# folder) and DEADLINE (in $SECONDS) set by the script that sources it.
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
