#!/usr/bin/env bash
# The one command that runs every check and test. It installs and starts what
# the tests need (build packages, PostgreSQL, MariaDB, a real Apache Kafka on
# 127.0.0.1:9092, a real schema registry on https://localhost:8086), then
# runs the gate: fmt, clippy, tests, docs, the book,
# packaging, and the quickstart as a smoke test.
set -euo pipefail
cd "$(dirname "$0")/.."

# The build and the broker's logs take gigabytes; say what the disk had.
echo "test: $(df -Ph . | awk 'NR == 2 { print $4 }') free on the disk"
bash scripts/deps.sh
bash scripts/postgres.sh start
bash scripts/mariadb.sh start
bash scripts/kafka.sh start
bash scripts/registry.sh start
DATABASE_URL="$(bash scripts/postgres.sh url)"
MYSQL_URL="$(bash scripts/mariadb.sh url)"
KAFKA_BROKERS="127.0.0.1:9092"
export DATABASE_URL MYSQL_URL KAFKA_BROKERS
# DEDUP_REGISTRY_URL, _USERNAME, _PASSWORD and _CA.
set -a
eval "$(bash scripts/registry.sh env)"
set +a

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings

# The workspace's shape: file sizes, and dedup-kafka's layers (no import
# cycle; the runtimes never import each other). See ARCHITECTURE.md.
python3 scripts/architecture.py

# The alert rules, checked and unit-tested on synthetic series (promtool,
# installed by deps.sh).
(cd dashboards && promtool check rules alerts.yml && promtool test rules alerts.test.yml)

# The Kubernetes manifests, decoded strictly into the API's own Go types and
# cross-checked (probes, ports, references, budgets). Go comes with the
# machine; k8s.io/api from the Go module proxy.
command -v go >/dev/null || PATH="$PATH:/usr/local/go/bin"
(cd deploy/kubernetes/check && go run . ..)

# The end-to-end tests run the examples as processes (crashes, restarts);
# built here, the build they start themselves is a no-op instead of competing
# with the timing-sensitive tests beside it for the two cores.
cargo build --locked -p dedup-examples --examples
cargo build --locked -p dedup-cli --features failpoints

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
cargo test --workspace --locked 2>&1 | tee "$log"

RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked

# The book (docs/, mdBook; installed once) with its links checked, and the
# published crates packaged and built from their packages alone, so a
# missing file or a feature another crate happened to turn on cannot
# silently break a release (--allow-dirty: also mid-work, on a dirty tree).
bash scripts/book.sh
# cargo verifies each crate against the others' packages through a local
# registry, and reuses a package it extracted before under the same version
# however its sources changed since (a crate that gained an API fails to
# verify against its stale self): drop those extractions first.
cargo_home="${CARGO_HOME:-$HOME/.cargo}"
for registry in "$cargo_home"/registry/src/-* "$cargo_home"/registry/cache/-*; do
    if [ -d "$registry" ]; then rm -rf "$registry"/dedup-*; fi
done
# And what was built from them: a package's files keep the fixed time the
# archive gives them, older than any build, so cargo takes a build of an
# earlier package of the same version as fresh (a crate that gained an API
# fails to verify against it). Dropping its fingerprint rebuilds it.
target_dir="${CARGO_TARGET_DIR:-target}"
for dep_info in "$target_dir"/debug/deps/dedup_*.d; do
    if [ -e "$dep_info" ] && grep -q "/registry/src/-" "$dep_info"; then
        hash="${dep_info##*-}"
        rm -rf "$target_dir"/debug/.fingerprint/dedup-*-"${hash%.d}"
    fi
done
cargo package --workspace --locked --allow-dirty \
    --exclude dedup-examples --exclude dedup-tests --exclude dedup-bench

# The quickstart as a smoke test, as a newcomer runs it (no services: an
# in-process Kafka and SQLite), then against the real Kafka and PostgreSQL.
# It exits non-zero if any balance or count is off.
env -u DATABASE_URL -u KAFKA_BROKERS cargo run --quiet --locked --example quickstart
cargo run --quiet --locked --example quickstart

# One closing line for the whole run, summed over every test binary.
awk '/^test result:/ { p += $4; f += $6 } END { printf "all tests: %d passed, %d failed\n", p, f }' "$log"
