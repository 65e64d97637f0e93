#!/usr/bin/env bash
# Makes a local PostgreSQL ready for the tests: installs it if missing, starts
# the cluster, creates the `dedup` role (CREATEDB, for #[sqlx::test]'s
# per-test databases) and database. Idempotent.
#   scripts/postgres.sh start   # then: export DATABASE_URL=$(scripts/postgres.sh url)
#   scripts/postgres.sh url
#   scripts/postgres.sh stop
#   scripts/postgres.sh kill   # the server gone at once, as in a crash
#   scripts/postgres.sh drop   # stop and delete the cluster
# A test that stops PostgreSQL runs a cluster of its own, so the tests beside
# it never notice: DEDUP_PG_CLUSTER=<name> PGPORT=<port> scripts/postgres.sh start
set -euo pipefail

PGPORT="${PGPORT:-5432}"
CLUSTER="${DEDUP_PG_CLUSTER:-main}"
URL="postgres://dedup:dedup@127.0.0.1:${PGPORT}/dedup"

as_postgres() {
    if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else sudo -u postgres "$@"; fi
}

apt_install() {
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}

server_version() {
    ls /usr/lib/postgresql 2>/dev/null | sort -n | tail -n 1
}

start() {
    if [ -z "$(server_version)" ] || ! command -v pg_ctlcluster >/dev/null; then
        echo "postgres: installing the server" >&2
        apt_install postgresql
    fi
    local version
    version="$(server_version)"
    if ! pg_lsclusters -h | awk '{print $1" "$2}' | grep -qx "$version $CLUSTER"; then
        pg_createcluster "$version" "$CLUSTER" --port "$PGPORT" >/dev/null
    fi
    if ! pg_lsclusters -h | awk -v v="$version" -v c="$CLUSTER" '$1==v && $2==c {print $4}' | grep -q online; then
        pg_ctlcluster "$version" "$CLUSTER" start
    fi
    for _ in $(seq 1 60); do
        pg_isready -q -h 127.0.0.1 -p "$PGPORT" && break
        sleep 0.5
    done
    pg_isready -q -h 127.0.0.1 -p "$PGPORT" || { echo "postgres: not ready on port $PGPORT" >&2; exit 1; }
    as_postgres psql -q -v ON_ERROR_STOP=1 -p "$PGPORT" -d postgres <<'SQL'
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'dedup') THEN
        CREATE ROLE dedup LOGIN CREATEDB PASSWORD 'dedup';
    END IF;
END $$;
SQL
    if ! as_postgres psql -tA -p "$PGPORT" -d postgres -c "SELECT 1 FROM pg_database WHERE datname = 'dedup'" | grep -q 1; then
        as_postgres createdb -p "$PGPORT" -O dedup dedup
    fi
    echo "postgres: ready at ${URL%%:dedup@*}:***@${URL#*dedup@}" >&2
}

case "${1:-start}" in
    start) start ;;
    url) echo "$URL" ;;
    stop) pg_ctlcluster "$(server_version)" "$CLUSTER" stop --mode fast ;;
    kill) pg_ctlcluster "$(server_version)" "$CLUSTER" stop --mode immediate ;;
    drop)
        if pg_lsclusters -h | awk '{print $1" "$2}' | grep -qx "$(server_version) $CLUSTER"; then
            pg_dropcluster --stop "$(server_version)" "$CLUSTER"
        fi
        ;;
    *) echo "usage: $0 start|url|stop|kill|drop" >&2; exit 2 ;;
esac
