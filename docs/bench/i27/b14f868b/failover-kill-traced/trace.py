# Reads the cells `loadgen failover` kept (LOADGEN_KEEP_DATA=1, with RUST_LOG=info,openraft=info)
# and prints, per run, the surviving replicas' election events from the killed leader's
# last log line on. Usage: trace.py [CELL_GLOB [LOADGEN_OUT_DIR]]. With the loadgen --out
# directory of the same series (run-N/failover-ours.json, from a loadgen that records
# "event at (Unix time, s)"), offsets are from the kill instead, and each run ends with
# when the new leader was elected and how long after that the writes came back.
import glob, json, re, os, sys
from datetime import datetime, timezone
def ts(l): return datetime.strptime(l[:26], "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=timezone.utc)
# The cells kept by LOADGEN_KEEP_DATA=1, oldest first (run 1 first).
runs = sorted(glob.glob(sys.argv[1] if len(sys.argv) > 1 else "/tmp/loadgen-ours-*"), key=os.path.getmtime)
reports = []
if len(sys.argv) > 2:
    for n in range(1, len(runs) + 1):
        f = glob.glob(f"{sys.argv[2]}/run-{n}/failover*-ours.json")
        reports.append(json.load(open(f[0])) if f else None)
for i, d in enumerate(runs):
    logs = {}
    for f in sorted(glob.glob(d+"/cell/replica-*.log")):
        rid = int(re.search(r"replica-(\d+)\.log", f).group(1))
        logs[rid] = open(f, errors="replace").read().splitlines()
    # leader killed (or frozen) = the one at the report's leader address, else the one
    # whose log ends earliest (no lines after a kill)
    last = {r: ts(ls[-1]) for r, ls in logs.items() if ls and ls[-1][:4]=="2026"}
    dead = min(last, key=last.get)
    rep = reports[i] if i < len(reports) else None
    if rep:
        for r in logs:
            conf = open(f"{d}/cell/replica-{r}.toml").read()
            if f'listen = "{rep["params"]["leader"]}"' in conf:
                dead = r
    kill = None
    if rep and "event at (Unix time, s)" in rep["params"]:
        kill = datetime.fromtimestamp(float(rep["params"]["event at (Unix time, s)"]), timezone.utc)
    origin = kill or last[dead]
    since = kill or last[dead]
    print(f"== {os.path.basename(d)}: replica {dead} killed or frozen (its last line {last[dead].time()}"
          + (f", the kill {kill.time()}; offsets from the kill)" if kill else "; offsets from it)"))
    events, elected = [], None
    for r, ls in logs.items():
        if r == dead: continue
        for l in ls:
            if l[:4] != "2026": continue
            t = ts(l)
            if t < since: continue
            m = re.search(r"Engine::handle_vote_req req=\{vote:T(\d+)-N(\d+)", l)
            if m: events.append((t, r, f"vote req from {m.group(2)} term {m.group(1)}")); continue
            m = re.search(r"vote is updated before ([\d.]+\w+), leader lease\(1s\) will expire after ([\d.]+\w+)", l)
            if m: events.append((t, r, f"  lease: last update {m.group(1)} ago, expires in {m.group(2)}")); continue
            m = re.search(r"handle vote request result .* result=(\w+)", l)
            if m: events.append((t, r, f"  -> {m.group(1)}")); continue
            m = re.search(r"vote is changing from (\S+) to (\S+)", l)
            if m:
                events.append((t, r, f"vote {m.group(1)} -> {m.group(2)}"))
                if m.group(2) == f"T{m.group(2)[1:].split('-')[0]}-N{r}:committed" and elected is None:
                    elected = (t, r)
                continue
            if "standing again" in l or "standing at once" in l:
                events.append((t, r, "  " + l[l.find("INFO")+5:][:110])); continue
            if "RejectVoteRequest" in l or "reject" in l.lower() and "vote" in l.lower():
                events.append((t, r, "  reject: " + l[60:200]))
    for t, r, e in sorted(events)[:40]:
        print(f"  +{(t-origin).total_seconds():6.3f}s r{r}: {e}")
    if kill and elected:
        fig = rep["figures"]
        first = fig.get("writes back after the event (s)", fig.get("first write after the event (s)"))
        at = (elected[0] - kill).total_seconds()
        line = f"  elected: r{elected[1]} at +{at:.3f}s"
        if first is not None:
            line += f"; writes back at +{first:.3f}s, {1000*(first-at):.0f} ms after the election"
        print(line + f"; writes unavailable {fig['writes unavailable (s)']:.3f}s")
