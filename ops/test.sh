#!/usr/bin/env bash
# The project's test command (needs protoc for loadgen's etcd client and promtool for the
# alerting rules: apt-get install -y protobuf-compiler prometheus; moto's S3 server and
# Azurite for the backup test: python3 -m pip install 'moto[server]'; npm install -g
# azurite@3.35.0): formatting, lints,
# docs, the monitoring files and every test (unit, property, openraft's storage suite,
# and the cell tests that start real replica processes on loopback). Figures measured by the cell tests are printed as lines starting "FIGURE".
set -euo pipefail
cd "$(dirname "$0")/.."
# Property tests draw from a fixed seed here so a run replays exactly; plain `cargo test`
# draws a fresh one each time (how to explore: docs/testing.md).
export PROPTEST_RNG_SEED="${PROPTEST_RNG_SEED:-20261201}"
# Each step's end, in seconds since the start, on stderr: where a slow run spent its time
# (docs/testing.md, "How long the test command takes").
step() { echo "ops/test.sh: $1 done at ${SECONDS} s" >&2; }
cargo fmt --all -- --check
# The alerting rules and the dashboard, with the real promtool (apt-get install -y
# prometheus): rules parse, their unit tests pass, every dashboard query parses.
./ops/monitoring/check.sh
# A client compiles neither the replica's consensus and storage nor the dev CA's rcgen:
# `wire` keeps them behind its `raft` and `dev-ca` features (docs/architecture.md).
if cargo tree -p client-sdk -e normal --prefix none | grep -E '^(openraft|fjall|rcgen) '; then
  echo "client-sdk must not depend on openraft, fjall or rcgen (see above)" >&2
  exit 1
fi
# Cargo.toml builds code that runs only inside the compiler (proc macros, build
# dependencies) unoptimised, by name: none of those may be compiled into what the tests
# run, where it would run unoptimised.
host_only=$(sed -n '/^\[profile.dev.package\]/,/^\[/p' Cargo.toml |
  grep -E '^"?[A-Za-z0-9_-]+"? = \{ opt-level = 0 \}' | cut -d' ' -f1 | tr -d '"')
runtime=$(cargo tree --workspace -e normal,dev,no-proc-macro --prefix none --format '{p}' |
  awk '{print $1}' | sort -u)
for p in $host_only; do
  if grep -qx "$p" <<<"$runtime"; then
    echo "Cargo.toml builds $p unoptimised (opt-level 0), but the tests run it: remove its line" >&2
    exit 1
  fi
done
# Every cargo invocation below selects the whole workspace, so cargo unifies features
# alike and builds each dependency once: selecting `-p loadgen` alone (as this script did
# until 2026-12-03) built tokio and everything above it a second time with other features.
# Every test target but loadgen's two run binaries; examples are built, as plain `cargo
# test` does.
targets=$(cargo metadata --no-deps --format-version 1 | jq -r '
  .packages[] | .name as $p | .targets[]
  | select(.kind == ["test"])
  | select(($p == "loadgen" and (.name == "scenarios" or .name == "peers")) | not)
  | .name' | sort -u)
# shellcheck disable=SC2086 # one argument per target, names have no spaces
cargo test --workspace --lib --bins --examples $(printf -- '--test=%s ' $targets) --no-run
step "the build of the tests"
# The test binaries mostly wait (leases, fault schedules, elections): one after another
# they took 1 000 s of CI's time at a sixth of its two cores. So they run in two lanes
# side by side, and a third lane runs what does not depend on the CPU it gets, at the
# lowest priority (`nice -n 19`: the lanes' processes get a core whenever they want one):
# the simulation tier (turmoil's simulated clock), clippy (in a target directory of its
# own, so it never holds the build's lock), the rustdoc check and the doc tests. Lane B
# holds the binaries named here, lane A every other one (so a new test file lands in A),
# balanced by their run times (docs/testing.md, "How long the test command takes").
lane_b="netns directory lockctl rotation sdk_recipe_outcomes bounds cell_lease_churn backup cell_basic cell_membership"
niced="sim sim_pause"
a=()
b=()
n=()
for t in $targets; do
  if grep -qw -- "$t" <<<"$niced"; then
    n+=("--test=$t")
  elif grep -qw -- "$t" <<<"$lane_b"; then
    b+=("--test=$t")
  else
    a+=("--test=$t")
  fi
done
logs=$(mktemp -d)
# --no-fail-fast: a failing binary does not stop the ones after it, so one run reports
# every failure (CI shows only a part of the output).
# The proxy's KeepAlive soak runs 30 s here (2.5 leases; 60 s by default by hand).
PROXY_SOAK_SECS="${PROXY_SOAK_SECS:-30}" \
  cargo test --no-fail-fast --workspace --lib --bins --examples "${a[@]}" -- --nocapture \
  >"$logs/a.log" 2>&1 &
pid_a=$!
cargo test --no-fail-fast --workspace "${b[@]}" -- --nocapture >"$logs/b.log" 2>&1 &
pid_b=$!
(
  rc=0
  nice -n 19 cargo test --no-fail-fast --workspace "${n[@]}" -- --nocapture || rc=1
  CARGO_TARGET_DIR=target/clippy nice -n 19 \
    cargo clippy --workspace --all-targets -- -D warnings || rc=1
  CARGO_TARGET_DIR=target/clippy RUSTDOCFLAGS="-D warnings" nice -n 19 \
    cargo doc --no-deps -p wire -p client-sdk --features wire/server -q || rc=1
  nice -n 19 cargo test --workspace --doc || rc=1
  exit "$rc"
) >"$logs/n.log" 2>&1 &
pid_n=$!
a_rc=0
b_rc=0
n_rc=0
wait "$pid_a" || a_rc=$?
wait "$pid_b" || b_rc=$?
wait "$pid_n" || n_rc=$?
cat "$logs/a.log" "$logs/b.log" "$logs/n.log"
rm -rf "$logs"
step "the test binaries, clippy, rustdoc and the doc tests"
if [ "$a_rc" != 0 ] || [ "$b_rc" != 0 ] || [ "$n_rc" != 0 ]; then
  echo "failed: lane A (${a[*]} and the unit tests) exit $a_rc, lane B (${b[*]}) exit $b_rc," \
    "lane N (${n[*]}, clippy, rustdoc, doc tests) exit $n_rc; the logs are above, A, B, N" >&2
  exit 1
fi
# loadgen's runs against our cell (tests/scenarios.rs) and against etcd and ZooKeeper
# (tests/peers.rs) side by side: each run starts its own cluster on ports it finds free,
# most of their time is spent waiting out leases, and they check behaviour with wide
# margins, not speed. Together they take about as long as the longer of the two
# (docs/testing.md, "How long the test command takes").
cargo test --workspace --test scenarios --test peers --no-run
step "the build of loadgen's runs"
logs=$(mktemp -d)
cargo test --workspace --test scenarios -- --nocapture >"$logs/scenarios.log" 2>&1 &
ours=$!
# The peers' runs one at a time (not an etcd lane beside a ZooKeeper lane): on
# 2026-12-05 a ZooKeeper `state` run beside an etcd run and the scenarios lost 255
# sessions at the server, a member having waited 18 s for a CPU on the 2 cores.
cargo test --workspace --test peers -- --test-threads=1 --nocapture >"$logs/peers.log" 2>&1 &
peers=$!
ours_rc=0
peers_rc=0
wait "$ours" || ours_rc=$?
wait "$peers" || peers_rc=$?
cat "$logs/scenarios.log" "$logs/peers.log"
rm -rf "$logs"
step "loadgen's runs"
if [ "$ours_rc" != 0 ] || [ "$peers_rc" != 0 ]; then
  echo "loadgen's runs failed: tests/scenarios.rs exit $ours_rc, tests/peers.rs exit $peers_rc" >&2
  exit 1
fi
