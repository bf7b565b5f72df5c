#!/bin/bash
# cpu-sample.sh OUT: every 2 s, appends "epoch cpu_secs procs": the CPU seconds (user +
# system) of every process named etcd, summed, and how many there are. Stop it with kill.
out=$1
while true; do
  t=0; n=0
  for p in $(pgrep -x etcd); do
    s=$(cat /proc/$p/stat 2>/dev/null) || continue
    s=${s##*) }
    set -- $s
    t=$((t + ${12} + ${13})); n=$((n+1))
  done
  echo "$(date +%s.%N) $(echo "scale=2; $t/100" | bc) $n" >> $out
  sleep 2
done
