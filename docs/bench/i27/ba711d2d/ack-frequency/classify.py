import sys,collections
cp=set(map(int,sys.argv[1].split(',')))
c=collections.defaultdict(lambda: collections.Counter())
t0=None
for l in sys.stdin:
    f=l.split()
    t=float(f[0])
    if t0 is None: t0=t
    s=int(f[2].rsplit(".",1)[1]); d=int(f[4].rstrip(":").rsplit(".",1)[1])
    n=int(f[-1])
    if d in cp and s in cp: k="peer"
    elif d in cp: k="c->s"
    elif s in cp: k="s->c"
    else: k="other"
    c[int(t-t0)][k]+=1
    if n<=41: c[int(t-t0)][k+"<=41B"]+=1
for sec in sorted(c): print(sec, dict(sorted(c[sec].items())))
