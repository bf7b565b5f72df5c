import glob, re, os, sys
from datetime import datetime
def ts(l): return datetime.strptime(l[:26], "%Y-%m-%dT%H:%M:%S.%f")
# The cells kept by LOADGEN_KEEP_DATA=1, oldest first (run 1 first).
runs = sorted(glob.glob(sys.argv[1] if len(sys.argv) > 1 else "/tmp/loadgen-ours-*"), key=os.path.getmtime)
for d in runs:
    logs = {}
    for f in sorted(glob.glob(d+"/cell/replica-*.log")):
        rid = int(re.search(r"replica-(\d+)\.log", f).group(1))
        logs[rid] = open(f, errors="replace").read().splitlines()
    # leader killed = the one whose log ends earliest (no lines after the kill)
    last = {r: ts(ls[-1]) for r, ls in logs.items() if ls and ls[-1][:4]=="2026"}
    dead = min(last, key=last.get)
    print(f"== {os.path.basename(d)}: killed replica {dead} (its last line {last[dead].time()})")
    events = []
    for r, ls in logs.items():
        if r == dead: continue
        for l in ls:
            if l[:4] != "2026": continue
            t = ts(l)
            if t < last[dead]: continue
            m = re.search(r"Engine::handle_vote_req req=\{vote:T(\d+)-N(\d+)", l)
            if m: events.append((t, r, f"vote req from {m.group(2)} term {m.group(1)}")); continue
            m = re.search(r"vote is updated before ([\d.]+\w+), leader lease\(1s\) will expire after ([\d.]+\w+)", l)
            if m: events.append((t, r, f"  lease: last update {m.group(1)} ago, expires in {m.group(2)}")); continue
            m = re.search(r"handle vote request result .* result=(\w+)", l)
            if m: events.append((t, r, f"  -> {m.group(1)}")); continue
            m = re.search(r"vote is changing from (\S+) to (\S+)", l)
            if m: events.append((t, r, f"vote {m.group(1)} -> {m.group(2)}")); continue
            if "RejectVoteRequest" in l or "reject" in l.lower() and "vote" in l.lower():
                events.append((t, r, "  reject: " + l[60:200]))
    for t, r, e in sorted(events)[:40]:
        print(f"  +{(t-last[dead]).total_seconds():6.3f}s r{r}: {e}")
