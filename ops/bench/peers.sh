#!/usr/bin/env bash
# Starts and stops the peer systems loadgen compares against, on loopback, with fsync on:
#   ops/bench/peers.sh etcd DIR N BASE_PORT   # N etcd 3.4 members (client ports BASE, BASE+2, ...)
#   ops/bench/peers.sh zk   DIR N BASE_PORT   # N ZooKeeper 3.8 servers (client ports BASE, BASE+1, ...)
#   ops/bench/peers.sh stop DIR               # SIGTERM every member started in DIR
# Needs Debian's packages: apt-get install -y etcd-server etcd-client zookeeper
# Each member's pid goes to DIR/pids ("name pid client-address" per line), its log to
# DIR/<name>.log. Prints the client endpoints, comma-separated, once all are started.
set -euo pipefail

cmd=${1:?usage: peers.sh etcd|zk|stop DIR [N BASE_PORT]}
dir=${2:?DIR}
mkdir -p "$dir"

case "$cmd" in
etcd)
  n=${3:-3}; base=${4:-2379}
  command -v etcd >/dev/null || { echo "etcd not installed: apt-get install -y etcd-server" >&2; exit 2; }
  cluster=""
  for i in $(seq 1 "$n"); do
    peer=$((base + 2 * (i - 1) + 1))
    cluster+="m$i=http://127.0.0.1:$peer,"
  done
  cluster=${cluster%,}
  endpoints=""
  for i in $(seq 1 "$n"); do
    client=$((base + 2 * (i - 1))); peer=$((client + 1))
    # etcd fsyncs its WAL on every commit by default (no --unsafe-no-fsync).
    ETCD_UNSUPPORTED_ARCH= nohup etcd --name "m$i" --data-dir "$dir/m$i" \
      --listen-client-urls "http://127.0.0.1:$client" --advertise-client-urls "http://127.0.0.1:$client" \
      --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
      --initial-cluster "$cluster" --initial-cluster-state new --initial-cluster-token "bench-$base" \
      --log-level warn >"$dir/m$i.log" 2>&1 &
    echo "m$i $! 127.0.0.1:$client" >>"$dir/pids"
    endpoints+="127.0.0.1:$client,"
  done
  echo "${endpoints%,}"
  ;;
zk)
  n=${3:-3}; base=${4:-2181}
  [ -f /usr/share/java/zookeeper.jar ] || { echo "ZooKeeper not installed: apt-get install -y zookeeper" >&2; exit 2; }
  endpoints=""
  for i in $(seq 1 "$n"); do
    mkdir -p "$dir/z$i/data"
    echo "$i" >"$dir/z$i/data/myid"
    client=$((base + i - 1))
    {
      echo "tickTime=2000"
      echo "initLimit=10"
      echo "syncLimit=5"
      echo "dataDir=$dir/z$i/data"
      echo "clientPort=$client"
      echo "clientPortAddress=127.0.0.1"
      echo "forceSync=yes"
      echo "admin.enableServer=false"
      echo "4lw.commands.whitelist=srvr,mntr,stat"
      echo "maxClientCnxns=0"
      for j in $(seq 1 "$n"); do
        echo "server.$j=127.0.0.1:$((base + 100 + 2 * (j - 1))):$((base + 101 + 2 * (j - 1)))"
      done
    } >"$dir/z$i/zoo.cfg"
    nohup java -Xmx1g -cp "/etc/zookeeper/conf:/usr/share/java/zookeeper.jar" \
      -Dzookeeper.log.dir="$dir/z$i" -Dzookeeper.root.logger=WARN,CONSOLE \
      org.apache.zookeeper.server.quorum.QuorumPeerMain "$dir/z$i/zoo.cfg" >"$dir/z$i.log" 2>&1 &
    echo "z$i $! 127.0.0.1:$client" >>"$dir/pids"
    endpoints+="127.0.0.1:$client,"
  done
  echo "${endpoints%,}"
  ;;
stop)
  [ -f "$dir/pids" ] || exit 0
  while read -r _ pid _; do kill "$pid" 2>/dev/null || true; done <"$dir/pids"
  for _ in $(seq 1 100); do
    alive=0
    while read -r _ pid _; do kill -0 "$pid" 2>/dev/null && alive=1; done <"$dir/pids"
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  while read -r _ pid _; do kill -9 "$pid" 2>/dev/null || true; done <"$dir/pids"
  rm -f "$dir/pids"
  ;;
*)
  echo "unknown command $cmd" >&2; exit 2
  ;;
esac
