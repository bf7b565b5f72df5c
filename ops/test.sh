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
cargo test --workspace -- --nocapture
