#!/usr/bin/env bash
# Starts and stops the peer systems loadgen compares against, on loopback, with fsync on:
#   ops/bench/peers.sh etcd DIR N BASE_PORT   # N etcd 3.4 members (client ports BASE, BASE+2, ...)
#   ops/bench/peers.sh zk   DIR N BASE_PORT   # N ZooKeeper 3.8 servers (client ports BASE, BASE+1, ...)
#   ops/bench/peers.sh restart DIR NAME       # start member NAME again exactly as before
#                                             # (after it was killed); its data dir is kept
#   ops/bench/peers.sh etcd-learner DIR NAME CLIENT_PORT PEER_PORT INITIAL_CLUSTER
#                                             # start a new etcd member NAME joining the
#                                             # cluster of DIR (--initial-cluster-state
#                                             # existing); add it first (MemberAdd, e.g. as a
#                                             # learner); INITIAL_CLUSTER lists every member
#                                             # with it, "m1=http://127.0.0.1:PORT,...";
#                                             # prints its client endpoint
#   ops/bench/peers.sh stop DIR               # SIGTERM every member started in DIR
# ZooKeeper logs at WARN; PEERS_ZK_LOG=INFO (or DEBUG) for more (session expiries, syncs).
# Its JVM gets -Xmx${PEERS_ZK_HEAP:-2g}: zkEnv.sh's default is 1g, but with the largest
# benchmark state (100 000 nodes of 1 KB, 50 000 sessions: a 110 MB snapshot) the JVMs
# at 1g reached 0.75-1.0 GB of RSS and took 2-9 s per snapshot, so the heap is sized
# with room over the data, and -Xms is the same (the heap is not grown during a run, as
# ZooKeeper's administrator's guide advises). The collector is G1, named: started on one
# CPU (loadgen's --server-cpus), the JVM would pick the Serial collector, whose young
# collections paused the members 0.19-2.6 s under `profile` (2026-12-03); on the
# multi-core machines ZooKeeper runs on in production the JVM picks G1 itself. Each
# garbage collection (with its pause) goes to DIR/zN/gc.log, and loadgen's ZooKeeper
# reports sum them; PEERS_ZK_JAVA_OPTS adds flags.
# loadgen starts this script (and so every member) on its --server-cpus, so etcd's
# GOMAXPROCS and the JVM's GC and JIT threads are sized for the CPUs they run on.
# Needs Debian's packages: apt-get install -y etcd-server etcd-client zookeeper
# Each member's pid goes to DIR/pids ("name pid client-address" per line; `restart` updates
# it), its log to DIR/<name>.log (appended to on restart), its full start command line
# (shell-quoted) to DIR/<name>.cmd. Prints the client endpoints, comma-separated, once all
# are started.
set -euo pipefail

cmd=${1:?usage: peers.sh etcd|zk|restart|etcd-learner|stop DIR [...]}
dir=${2:?DIR}
mkdir -p "$dir"
# ZooKeeper's sessions are connections: 50 000 of them need more open files than the
# usual default (raising the hard limit needs root; otherwise the soft one goes up to it).
ulimit -n 200000 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

# running PID: the process is alive and not a zombie (killed members are reparented to a
# pid 1 that may never reap them).
running() {
  kill -0 "$1" 2>/dev/null && ! grep -q '^State:.*zombie' "/proc/$1/status" 2>/dev/null
}

# launch NAME ADDR CMD...: saves CMD to DIR/NAME.cmd, runs it in the background (log
# DIR/NAME.log) and notes "NAME PID ADDR" in DIR/pids.
launch() {
  local name=$1 addr=$2
  shift 2
  printf '%q ' "$@" >"$dir/$name.cmd"
  nohup "$@" >>"$dir/$name.log" 2>&1 &
  echo "$name $! $addr" >>"$dir/pids"
}

# etcd_member NAME CLIENT_PORT PEER_PORT INITIAL_CLUSTER STATE TOKEN: one etcd member.
etcd_member() {
  local name=$1 client=$2 peer=$3 initial=$4 state=$5 token=$6
  # etcd fsyncs its WAL on every commit by default (no --unsafe-no-fsync).
  launch "$name" "127.0.0.1:$client" env ETCD_UNSUPPORTED_ARCH= etcd --name "$name" \
    --data-dir "$dir/$name" \
    --listen-client-urls "http://127.0.0.1:$client" --advertise-client-urls "http://127.0.0.1:$client" \
    --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
    --initial-cluster "$initial" --initial-cluster-state "$state" --initial-cluster-token "$token" \
    --log-level warn
}

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
    etcd_member "m$i" "$client" "$peer" "$cluster" new "bench-$base"
    endpoints+="127.0.0.1:$client,"
  done
  echo "${endpoints%,}"
  ;;
etcd-learner)
  name=${3:?NAME}; client=${4:?CLIENT_PORT}; peer=${5:?PEER_PORT}; initial=${6:?INITIAL_CLUSTER}
  command -v etcd >/dev/null || { echo "etcd not installed: apt-get install -y etcd-server" >&2; exit 2; }
  if grep -q "^$name " "$dir/pids" 2>/dev/null; then
    echo "member $name already started in $dir" >&2; exit 2
  fi
  # The token only matters for a new cluster; an existing one's members are asked instead.
  etcd_member "$name" "$client" "$peer" "$initial" existing "bench-join"
  echo "127.0.0.1:$client"
  ;;
zk)
  # Debian's zookeeper.jar logs through slf4j, whose log4j binding is a separate jar:
  # without it every message goes to a no-op logger (as zkServer.sh's classpath has it).
  zk_cp=/etc/zookeeper/conf:/usr/share/java/zookeeper.jar
  for jar in /usr/share/java/slf4j-log4j12.jar /usr/share/java/log4j-1.2.jar; do
    [ -f "$jar" ] && zk_cp+=":$jar"
  done
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
      echo "4lw.commands.whitelist=srvr,mntr,stat,dump"
      echo "maxClientCnxns=0"
      # The accept queue of the client port: Java's default is 50, which 200 session opens
      # in flight overflowed (hundreds of dropped SYNs a second, each retried by the
      # kernel after 1 s, then 3 s: setups at 150 sessions a second instead of 1 000).
      # etcd's Go listener gets the kernel's somaxconn (4 096 here); so does this.
      echo "clientPortListenBacklog=4096"
      for j in $(seq 1 "$n"); do
        echo "server.$j=127.0.0.1:$((base + 100 + 2 * (j - 1))):$((base + 101 + 2 * (j - 1)))"
      done
    } >"$dir/z$i/zoo.cfg"
    launch "z$i" "127.0.0.1:$client" java -Xms"${PEERS_ZK_HEAP:-2g}" -Xmx"${PEERS_ZK_HEAP:-2g}" -XX:+UseG1GC -Xlog:gc:file="$dir/z$i/gc.log" ${PEERS_ZK_JAVA_OPTS:-} -cp "$zk_cp" \
      -Dzookeeper.log.dir="$dir/z$i" -Dzookeeper.root.logger="${PEERS_ZK_LOG:-WARN}",CONSOLE \
      org.apache.zookeeper.server.quorum.QuorumPeerMain "$dir/z$i/zoo.cfg"
    endpoints+="127.0.0.1:$client,"
  done
  echo "${endpoints%,}"
  ;;
restart)
  name=${3:?NAME}
  [ -f "$dir/$name.cmd" ] || { echo "$dir/$name.cmd not found: $name was not started here" >&2; exit 2; }
  line=$(grep "^$name " "$dir/pids" || true)
  [ -n "$line" ] || { echo "$name is not in $dir/pids" >&2; exit 2; }
  read -r _ old addr <<<"$line"
  if running "$old"; then
    echo "$name (pid $old) is still running" >&2; exit 2
  fi
  eval "set -- $(cat "$dir/$name.cmd")"
  nohup "$@" >>"$dir/$name.log" 2>&1 &
  sed -i "s|^$name [0-9]* .*\$|$name $! $addr|" "$dir/pids"
  ;;
stop)
  [ -f "$dir/pids" ] || exit 0
  while read -r _ pid _; do kill "$pid" 2>/dev/null || true; done <"$dir/pids"
  for _ in $(seq 1 100); do
    alive=0
    while read -r _ pid _; do running "$pid" && alive=1; done <"$dir/pids"
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
