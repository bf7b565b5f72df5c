#!/bin/bash
# One pinned max-writes run of ours at scale 0.4 (levels 1, 4, 16, 64 writers, 4 s each),
# summarised on one line: writes a second per level, one writer's p50, and the replicas'
# CPU (all three, from loadgen's process table) divided by the writes of the whole run.
# Usage (from the repository's root, after a release build): mw.sh LABEL [SCALE]
set -euo pipefail
scale=${2:-0.4}
out=${OUT:-/tmp}/mw-$1-$RANDOM
target/release/loadgen --out "$out" --server-cpus 0 --loadgen-cpus 1 --runs 1 \
    --system ours --scale "$scale" max-writes > "$out.log" 2>&1
python3 - "$out.log" "$1" <<'PY'
import re, sys
t = open(sys.argv[1]).read()
lv = {int(m.group(1)): float(m.group(2))
      for m in re.finditer(r'writes per s at +(\d+) writers +([\d.]+)', t)}
p50 = re.search(r'p50 ms at +1 writers +([\d.]+)', t).group(1)
secs = float(re.search(r'seconds per level +([\d.]+)', t).group(1))
cpu = sum(float(x) for x in re.findall(r'process replica-\d +cpu +([\d.]+) s', t))
writes = sum(lv.values()) * secs
print(sys.argv[2], 'levels', {k: round(v) for k, v in lv.items()}, 'p50@1', p50,
      'replica cpu us/write %.0f' % (cpu / writes * 1e6))
PY
