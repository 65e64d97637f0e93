#!/usr/bin/env bash
# Makes a local PostgreSQL ready for the tests: installs it if missing, starts
# the cluster, creates the `dedup` role (CREATEDB, for #[sqlx::test]'s
# per-test databases) and database. Idempotent.
#   scripts/postgres.sh start   # then: export DATABASE_URL=$(scripts/postgres.sh url)
#   scripts/postgres.sh url
#   scripts/postgres.sh stop
#   scripts/postgres.sh kill   # the server gone at once, as in a crash
#   scripts/postgres.sh drop   # stop and delete the cluster
#   scripts/postgres.sh tls-url [role]   # a verify-full URL (dedup_tls by default)
# A test that stops PostgreSQL runs a cluster of its own, so the tests beside
# it never notice: DEDUP_PG_CLUSTER=<name> PGPORT=<port> scripts/postgres.sh start
# TLS is on, with the certificates scripts/tls.sh makes: the role dedup_tls
# may connect only over TLS, dedup_mtls only over TLS with a client
# certificate our CA signed (both may create databases, as dedup may).
set -euo pipefail

PGPORT="${PGPORT:-5432}"
CLUSTER="${DEDUP_PG_CLUSTER:-main}"
URL="postgres://dedup:dedup@127.0.0.1:${PGPORT}/dedup"
HERE="$(cd "$(dirname "$0")" && pwd)"

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

ready() {
    for _ in $(seq 1 60); do
        pg_isready -q -h 127.0.0.1 -p "$PGPORT" && break
        sleep 0.5
    done
    pg_isready -q -h 127.0.0.1 -p "$PGPORT" || { echo "postgres: not ready on port $PGPORT" >&2; exit 1; }
}

start() {
    if [ -z "$(server_version)" ] || ! command -v pg_ctlcluster >/dev/null; then
        echo "postgres: installing the server" >&2
        apt_install postgresql
    fi
    local version
    version="$(server_version)"
    # Room for four test binaries at once (scripts/tests.py), each with
    # two tests' pools, stores and child processes: Debian's 100 is not.
    if ! pg_lsclusters -h | awk '{print $1" "$2}' | grep -qx "$version $CLUSTER"; then
        pg_createcluster "$version" "$CLUSTER" --port "$PGPORT" -o max_connections=300 >/dev/null
    fi
    if ! pg_lsclusters -h | awk -v v="$version" -v c="$CLUSTER" '$1==v && $2==c {print $4}' | grep -q online; then
        pg_ctlcluster "$version" "$CLUSTER" start
    fi
    ready
    if [ "$(as_postgres psql -tA -p "$PGPORT" -d postgres -c 'SHOW max_connections')" -lt 300 ]; then
        as_postgres psql -q -p "$PGPORT" -d postgres -c "ALTER SYSTEM SET max_connections = 300"
        pg_ctlcluster "$version" "$CLUSTER" restart
        ready
    fi
    as_postgres psql -q -v ON_ERROR_STOP=1 -p "$PGPORT" -d postgres <<'SQL'
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'dedup') THEN
        CREATE ROLE dedup LOGIN CREATEDB PASSWORD 'dedup';
    END IF;
    -- A service's role, with no right of its own: the least-privilege
    -- tests grant it dedup's tables in their databases.
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'dedup_app') THEN
        CREATE ROLE dedup_app LOGIN PASSWORD 'dedup';
    END IF;
END $$;
SQL
    if ! as_postgres psql -tA -p "$PGPORT" -d postgres -c "SELECT 1 FROM pg_database WHERE datname = 'dedup'" | grep -q 1; then
        as_postgres createdb -p "$PGPORT" -O dedup dedup
    fi
    secure "$version"
    # The databases earlier runs' TLS tests made (each makes its own).
    local stale
    for stale in $(as_postgres psql -tA -p "$PGPORT" -d postgres \
        -c "SELECT datname FROM pg_database WHERE datname LIKE 'dedup\_tls\_%'"); do
        as_postgres dropdb -p "$PGPORT" --if-exists "$stale" || true
    done
    echo "postgres: ready at ${URL%%:dedup@*}:***@${URL#*dedup@} (TLS: ${URL%%:dedup@*}_tls:***@localhost:${PGPORT})" >&2
}

# TLS with our CA's server certificate, and the TLS-only roles; reloaded, not
# restarted (PostgreSQL rereads its certificates and pg_hba.conf on reload).
secure() {
    local version="$1" tls conf
    tls="$(bash "$HERE/tls.sh" make)"
    conf="/etc/postgresql/$version/$CLUSTER"
    install -o postgres -g postgres -m 600 "$tls/server.key" "$conf/dedup-server.key"
    install -o postgres -g postgres -m 644 "$tls/server.pem" "$conf/dedup-server.pem"
    install -o postgres -g postgres -m 644 "$tls/ca.pem" "$conf/dedup-ca.pem"
    # Our block first (pg_hba.conf's first matching line wins), rewritten on
    # every start so that a change to it reaches a cluster made earlier.
    local hba
    hba="$(mktemp)"
    {
        echo "# dedup: TLS-only roles (scripts/postgres.sh)"
        for net in 127.0.0.1/32 ::1/128; do
            echo "hostssl all dedup_mtls $net scram-sha-256 clientcert=verify-ca"
            echo "hostssl all dedup_tls $net scram-sha-256"
            echo "hostnossl all dedup_tls,dedup_mtls $net reject"
        done
        echo "# dedup: end"
        sed '/^# dedup: TLS-only roles/,/^# dedup: end/d' "$conf/pg_hba.conf"
    } >"$hba"
    install -o postgres -g postgres -m 640 "$hba" "$conf/pg_hba.conf"
    rm -f "$hba"
    as_postgres psql -q -v ON_ERROR_STOP=1 -p "$PGPORT" -d postgres <<SQL
ALTER SYSTEM SET ssl = on;
ALTER SYSTEM SET ssl_cert_file = '$conf/dedup-server.pem';
ALTER SYSTEM SET ssl_key_file = '$conf/dedup-server.key';
ALTER SYSTEM SET ssl_ca_file = '$conf/dedup-ca.pem';
\\o /dev/null
SELECT pg_reload_conf();
\\o
DO \$\$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'dedup_tls') THEN
        CREATE ROLE dedup_tls LOGIN CREATEDB PASSWORD 'dedup';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'dedup_mtls') THEN
        CREATE ROLE dedup_mtls LOGIN CREATEDB PASSWORD 'dedup';
    END IF;
END \$\$;
SQL
}

tls_url() {
    local role="${1:-dedup_tls}" tls
    tls="$(bash "$HERE/tls.sh" dir)"
    echo "postgres://${role}:dedup@localhost:${PGPORT}/postgres?sslmode=verify-full&sslrootcert=${tls}/ca.pem"
}

case "${1:-start}" in
    start) start ;;
    url) echo "$URL" ;;
    tls-url) tls_url "${2:-}" ;;
    stop) pg_ctlcluster "$(server_version)" "$CLUSTER" stop --mode fast ;;
    kill) pg_ctlcluster "$(server_version)" "$CLUSTER" stop --mode immediate ;;
    drop)
        if pg_lsclusters -h | awk '{print $1" "$2}' | grep -qx "$(server_version) $CLUSTER"; then
            pg_dropcluster --stop "$(server_version)" "$CLUSTER"
        fi
        ;;
    *) echo "usage: $0 start|url|tls-url [role]|stop|kill|drop" >&2; exit 2 ;;
esac
