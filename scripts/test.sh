#!/usr/bin/env bash
# The one command that runs every check and test. It installs and starts what
# the tests need (PostgreSQL), then runs the gate: fmt, clippy, tests, docs.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/postgres.sh start
DATABASE_URL="$(bash scripts/postgres.sh url)"
export DATABASE_URL

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked
