#!/usr/bin/env bash
# The project's test command (needs protoc for loadgen's etcd client: apt-get install -y
# protobuf-compiler): formatting, lints, docs and every test (unit, property,
# openraft's storage suite, and the cell tests that start real replica processes on
# loopback). Figures measured by the cell tests are printed as lines starting "FIGURE".
set -euo pipefail
cd "$(dirname "$0")/.."
# Property tests draw from a fixed seed here so a run replays exactly; plain `cargo test`
# draws a fresh one each time (how to explore: docs/testing.md).
export PROPTEST_RNG_SEED="${PROPTEST_RNG_SEED:-20261201}"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps -p wire -p client-sdk -q
# A client compiles neither the replica's consensus and storage nor the dev CA's rcgen:
# `wire` keeps them behind its `raft` and `dev-ca` features (docs/architecture.md).
if cargo tree -p client-sdk -e normal --prefix none | grep -E '^(openraft|fjall|rcgen) '; then
  echo "client-sdk must not depend on openraft, fjall or rcgen (see above)" >&2
  exit 1
fi
cargo test --workspace -- --nocapture
