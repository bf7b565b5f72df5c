#!/bin/bash
# A new client process after a leader kill -9 (issue 27, item 6): a fresh `lockctl dev`
# cell of three (servers on CPU 0), the leader killed, then `lockctl set` run again and
# again as new processes (on CPU 1), each with the endpoint list that still names the dead
# replica, until one succeeds. Prints, per trial, the seconds from the kill to the end of
# the first invocation that succeeded, and how many failed before it.
# Usage (from the repository's root, after a release build): run.sh TRIALS [OUTDIR]
set -uo pipefail
trials=${1:-10}
out=${2:-/tmp/new-client-after-kill}
mkdir -p "$out"
bin=target/release/lockctl
for t in $(seq 1 "$trials"); do
    dir=$(mktemp -d)
    base=$((25000 + t * 10))
    taskset -c 0 $bin dev --no-demo --replicas 3 --base-port $base --proxies 0 \
        --data "$dir" > "$out/dev-$t.log" 2>&1 &
    dev=$!
    for _ in $(seq 1 100); do grep -q ' leads after ' "$out/dev-$t.log" && break; sleep 0.1; done
    leader=$(sed -n 's/^replica \([0-9]*\) leads after.*/\1/p' "$out/dev-$t.log")
    export LOCKCTL_ENDPOINTS=127.0.0.1:$base,127.0.0.1:$((base + 1)),127.0.0.1:$((base + 2))
    export LOCKCTL_CA=$dir/tls/ca.pem
    taskset -c 1 $bin create /t v0 > /dev/null 2>&1
    sleep 1
    pid=$(pgrep -f "lockctl replica --config $dir/replica-$leader.toml")
    t0=$(date +%s.%N)
    kill -9 "$pid"
    failed=0
    for k in $(seq 1 200); do
        if taskset -c 1 $bin set /t "v$k" > "$out/set-$t-$k.log" 2>&1; then
            t1=$(date +%s.%N)
            echo "trial $t: leader $leader killed; first new-process write after $(echo "$t1 - $t0" | bc) s, $failed failed before it"
            break
        fi
        failed=$((failed + 1))
    done
    kill "$dev" 2>/dev/null; sleep 1; pkill -9 -f "lockctl replica --config $dir/" 2>/dev/null
    wait "$dev" 2>/dev/null
    rm -rf "$dir"
done
