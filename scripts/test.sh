#!/usr/bin/env bash
# The one command that runs every check and test. It installs and starts what
# the tests need (build packages, PostgreSQL, MariaDB, a real Apache Kafka on
# 127.0.0.1:9092, a real schema registry on https://localhost:8086), then
# runs the gate: fmt, clippy, tests, docs, the book,
# packaging, and the quickstart as a smoke test.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each phase's time, printed at the end (also when one fails, naming it).
began=$SECONDS
phases=()
current=""
phase() {
    current="$1"
    shift
    local start=$SECONDS
    "$@"
    phases+=("$(printf '%-44s %5d s' "$current" $((SECONDS - start)))")
    current=""
}
temporary=()
report() {
    local code=$?
    # Services still starting when a phase failed finish first, so none
    # is left half-started for the next run.
    [ -z "${services_pid:-}" ] || wait "$services_pid" 2>/dev/null || true
    rm -f "${temporary[@]}"
    echo
    echo "test: phases"
    for p in "${phases[@]}"; do echo "  $p"; done
    [ -z "$current" ] || echo "  $current: FAILED"
    printf '  %-44s %5d s\n' "total" $((SECONDS - began))
    return "$code"
}
trap report EXIT

# The build and the broker's logs take gigabytes; say what the disk had.
echo "test: $(df -Ph . | awk 'NR == 2 { print $4 }') free on the disk"
phase "packages (apt)" bash scripts/deps.sh

# The services start beside the lint and the build: fetching Kafka and the
# registry from Maven Central, and their JVMs' start, wait on the network
# and the disk more than on the two cores the compiler wants.
services_log="$(mktemp)"
temporary+=("$services_log")
services() {
    bash scripts/postgres.sh start
    bash scripts/mariadb.sh start
    bash scripts/kafka.sh start
    bash scripts/registry.sh start
}
services_began=$SECONDS
services >"$services_log" 2>&1 &
services_pid=$!

lint() {
    cargo fmt --all -- --check
    cargo clippy --workspace --all-targets --locked -- -D warnings
    # The workspace's shape: file sizes, and dedup-kafka's layers (no
    # import cycle; the runtimes never import each other). See
    # ARCHITECTURE.md.
    python3 scripts/architecture.py
    # The alert rules, checked and unit-tested on synthetic series
    # (promtool, installed by deps.sh).
    (cd dashboards && promtool check rules alerts.yml && promtool test rules alerts.test.yml)
    # The Kubernetes manifests, decoded strictly into the API's own Go
    # types and cross-checked (probes, ports, references, budgets). Go
    # comes with the machine; k8s.io/api from the Go module proxy.
    command -v go >/dev/null || PATH="$PATH:/usr/local/go/bin"
    (cd deploy/kubernetes/check && go run . ..)
}
phase "fmt, clippy, shape, alert rules, manifests" lint

# Everything the tests run, built once with the features of the whole
# workspace: the test binaries, and the examples and the CLI with its crash
# points, which the end-to-end tests start as processes (crashes,
# restarts).
phase "build" python3 scripts/tests.py --no-run

wait_services() {
    local code=0
    wait "$services_pid" || code=$?
    cat "$services_log"
    [ "$code" = 0 ] || return "$code"
    echo "test: services started in $((SECONDS - services_began)) s, beside the lint and the build"
}
phase "services (what outlasted the build)" wait_services
DATABASE_URL="$(bash scripts/postgres.sh url)"
MYSQL_URL="$(bash scripts/mariadb.sh url)"
KAFKA_BROKERS="127.0.0.1:9092"
export DATABASE_URL MYSQL_URL KAFKA_BROKERS
# DEDUP_REGISTRY_URL, _USERNAME, _PASSWORD and _CA.
set -a
eval "$(bash scripts/registry.sh env)"
set +a

# The test binaries side by side (scripts/tests.py), four at a time: each
# test makes its own topics, groups, databases and ports, and most of their
# time is spent waiting on brokers, rebalances and restarts (the machine's
# two cores were 28% busy running them two at a time, 61-65% four at a
# time). On a fresh machine (no times kept from a run before) the slowest
# start first; after that, by the times of the last run.
log="$(mktemp)"
temporary+=("$log")
run_tests() {
    python3 scripts/tests.py --lanes 4 \
        --first kafka,scaling,transactional,outbox,registry,cli | tee "$log"
}
phase "tests" run_tests

phase "docs (rustdoc, warnings denied)" env RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked

# The book (docs/, mdBook; installed once) with its links checked.
phase "book" bash scripts/book.sh

# The published crates packaged and built from their packages alone, so a
# missing file or a feature another crate happened to turn on cannot
# silently break a release (--allow-dirty: also mid-work, on a dirty tree).
package() {
    # cargo verifies each crate against the others' packages through a
    # local registry, and reuses a package it extracted before under the
    # same version however its sources changed since (a crate that gained
    # an API fails to verify against its stale self): drop those
    # extractions first.
    local cargo_home="${CARGO_HOME:-$HOME/.cargo}"
    for registry in "$cargo_home"/registry/src/-* "$cargo_home"/registry/cache/-*; do
        if [ -d "$registry" ]; then rm -rf "$registry"/dedup-*; fi
    done
    # And what was built from them: a package's files keep the fixed time
    # the archive gives them, older than any build, so cargo takes a build
    # of an earlier package of the same version as fresh (a crate that
    # gained an API fails to verify against it). Dropping its fingerprint
    # rebuilds it.
    local target_dir="${CARGO_TARGET_DIR:-target}"
    for dep_info in "$target_dir"/debug/deps/dedup_*.d; do
        if [ -e "$dep_info" ] && grep -q "/registry/src/-" "$dep_info"; then
            local hash="${dep_info##*-}"
            rm -rf "$target_dir"/debug/.fingerprint/dedup-*-"${hash%.d}"
        fi
    done
    cargo package --workspace --locked --allow-dirty \
        --exclude dedup-examples --exclude dedup-tests --exclude dedup-bench
}
phase "package" package

# The quickstart as a smoke test, as a newcomer runs it (no services: an
# in-process Kafka and SQLite), then against the real Kafka and PostgreSQL.
# It exits non-zero if any balance or count is off.
quickstart() {
    env -u DATABASE_URL -u KAFKA_BROKERS cargo run --quiet --locked --example quickstart
    cargo run --quiet --locked --example quickstart
}
phase "quickstart, both ways" quickstart

# The closing line: every test of every binary.
grep "^all tests:" "$log"
