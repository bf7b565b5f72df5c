#!/usr/bin/env bash
# Runs etcd-profile (main.go: loadgen's `profile` load driven by etcd's own Go client) on
# a fresh 3-member etcd cluster, pinned as loadgen pins (members on CPU 0, the driver on
# CPU 1), then stops the cluster:
#   ops/bench/etcd-go/run.sh [-fault kill|freeze] [-secs 60] [-sessions 10000] [-out F.json]
#   ops/bench/etcd-go/run.sh -scenario failover -fault kill|freeze [-out F.json]
# Needs Debian's packages: apt-get install -y etcd-server etcd-client golang-go
# golang-etcd-server-dev (clientv3 3.4.23, the server's version, built in GOPATH mode
# from /usr/share/gocode, so nothing is fetched). ETCD_GO_KEEP=1 keeps the data dir.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
for c in go etcd taskset; do
  command -v "$c" >/dev/null || { echo "run.sh: $c not installed (see the header)" >&2; exit 2; }
done
[ -d /usr/share/gocode/src/go.etcd.io/etcd/clientv3 ] ||
  { echo "run.sh: clientv3 missing: apt-get install -y golang-etcd-server-dev" >&2; exit 2; }
work=$(mktemp -d)
mkdir -p "$work/gopath/src"
ln -s "$here" "$work/gopath/src/etcdprofile"
GO111MODULE=off GOPATH="$work/gopath:/usr/share/gocode" GOFLAGS= go build -o "$work/etcd-profile" etcdprofile
case "${1:-}" in
-h | -help | --help)
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  "$work/etcd-profile" -h 2>&1 | sed 1d
  rm -rf "$work"
  exit 0
  ;;
esac

# Six free loopback ports from an even base (client, peer per member).
free() { ! ss -Hltn "sport = :$1" | grep -q .; }
base=""
for _ in $(seq 1 50); do
  b=$(( (20000 + RANDOM % 20000) & ~1 ))
  ok=1
  for p in $(seq "$b" $((b + 5))); do free "$p" || ok=0; done
  if [ $ok = 1 ]; then base=$b; break; fi
done
[ -n "$base" ] || { echo "run.sh: no free ports found" >&2; exit 1; }

dir="$work/cluster"
stop() {
  "$here/../peers.sh" stop "$dir" >/dev/null 2>&1 || true
  if [ "${ETCD_GO_KEEP:-}" = 1 ]; then echo "kept: $work" >&2; else rm -rf "$work"; fi
}
trap stop EXIT
eps=$(taskset -c 0 "$here/../peers.sh" etcd "$dir" 3 "$base")
# Healthy within 30 s.
for _ in $(seq 1 60); do
  ETCDCTL_API=3 etcdctl --endpoints "$eps" endpoint health >/dev/null 2>&1 && break
  sleep 0.5
done
ETCDCTL_API=3 etcdctl --endpoints "$eps" endpoint health >&2
taskset -c 1 "$work/etcd-profile" -endpoints "$eps" -pids "$dir/pids" "$@"
