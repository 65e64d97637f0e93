#!/usr/bin/env bash
# Makes a local MariaDB server ready for the tests: installs Debian's
# mariadb-server if missing, and runs an instance of our own (its own data
# directory, port and socket; the package's system service is never used),
# with a `dedup` user that may create databases (each test makes its own).
# Idempotent.
#   scripts/mariadb.sh start   # then: export MYSQL_URL=$(scripts/mariadb.sh url)
#   scripts/mariadb.sh url
#   scripts/mariadb.sh stop
#   scripts/mariadb.sh kill    # the server gone at once, as in a crash
#   scripts/mariadb.sh drop    # stop and delete the instance's data
#   scripts/mariadb.sh tls-url [user]   # a VERIFY_IDENTITY URL (dedup_tls by default)
# A test that stops the server runs an instance of its own, so the tests
# beside it never notice: MYSQL_PORT=<port> scripts/mariadb.sh start
# TLS is on, with the certificates scripts/tls.sh makes: the user dedup_tls
# must connect over TLS, dedup_mtls over TLS with a client certificate our
# CA signed.
# The default port is 3307, not 3306: the package's own service (started by
# its install where the machine lets it) may hold 3306.
set -euo pipefail

PORT="${MYSQL_PORT:-3307}"
BASE="${DEDUP_MARIADB_DIR:-/var/tmp/dedup-mariadb}/$PORT"
DATA="$BASE/data"
SOCKET="$BASE/mariadb.sock"
PIDFILE="$BASE/mariadb.pid"
URL="mysql://dedup:dedup@127.0.0.1:${PORT}/dedup"
HERE="$(cd "$(dirname "$0")" && pwd)"

sudo_() {
    if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

# Our server runs: its pid file names a live mariadbd (not a process that
# reused the pid of one that died).
running() {
    [ -f "$PIDFILE" ] || return 1
    local pid
    pid="$(cat "$PIDFILE")"
    [ -n "$pid" ] && [ "$(ps -p "$pid" -o comm= 2>/dev/null)" = mariadbd ]
}

client() {
    sudo_ mariadb --no-defaults --protocol=socket -S "$SOCKET" -uroot "$@"
}

start() {
    if ! command -v mariadbd >/dev/null && [ ! -x /usr/sbin/mariadbd ]; then
        echo "mariadb: installing the server" >&2
        local sudo=""
        [ "$(id -u)" = 0 ] || sudo="sudo"
        $sudo apt-get update -qq
        # Without its recommends (a mail agent, extra tools): the server and
        # its client are all the tests use. The package's own service is
        # not wanted: where no policy says otherwise, one that refuses
        # service starts is in place for the install (and removed after).
        local policy=/usr/sbin/policy-rc.d added=""
        if [ ! -e "$policy" ]; then
            printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
            $sudo chmod +x "$policy"
            added=1
        fi
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
            mariadb-server >/dev/null || { [ -z "$added" ] || $sudo rm -f "$policy"; exit 1; }
        [ -z "$added" ] || $sudo rm -f "$policy"
    fi
    local daemon tls
    daemon="$(command -v mariadbd || echo /usr/sbin/mariadbd)"
    tls="$(bash "$HERE/tls.sh" make)"
    if [ ! -d "$DATA/mysql" ]; then
        sudo_ mkdir -p "$BASE"
        sudo_ chown mysql:mysql "$BASE"
        sudo_ mariadb-install-db --no-defaults --user=mysql --datadir="$DATA" \
            --auth-root-authentication-method=socket --skip-test-db >/dev/null
    fi
    # The server's own copies of our CA's certificate and key.
    sudo_ mkdir -p "$BASE"
    sudo_ install -o mysql -g mysql -m 600 "$tls/server.key" "$BASE/server.key"
    sudo_ install -o mysql -g mysql -m 644 "$tls/server.pem" "$BASE/server.pem"
    sudo_ install -o mysql -g mysql -m 644 "$tls/ca.pem" "$BASE/ca.pem"
    # An instance an earlier version of this script started without TLS;
    # one that has TLS rereads the certificates (made anew when they near
    # their expiry).
    if running; then
        if [ "$(client -N -e "SELECT @@have_ssl" 2>/dev/null)" != YES ]; then
            stop
        else
            client -e "FLUSH SSL"
        fi
    fi
    if ! running; then
        # Durable as a production server is (flush the log at every commit);
        # no binary log, no name resolution. Detached, so it outlives this
        # script (and the session's shell) like PostgreSQL's cluster does.
        sudo_ setsid "$daemon" --no-defaults --user=mysql --datadir="$DATA" \
            --port="$PORT" --bind-address=127.0.0.1 --socket="$SOCKET" --pid-file="$PIDFILE" \
            --skip-name-resolve --skip-log-bin --max-connections=500 \
            --innodb-buffer-pool-size=128M --log-error="$BASE/error.log" \
            --ssl-ca="$BASE/ca.pem" --ssl-cert="$BASE/server.pem" --ssl-key="$BASE/server.key" \
            </dev/null >/dev/null 2>&1 &
    fi
    for _ in $(seq 1 120); do
        client -e "SELECT 1" >/dev/null 2>&1 && break
        sleep 0.5
    done
    client -e "SELECT 1" >/dev/null 2>&1 ||
        { echo "mariadb: not ready on port $PORT (log: $BASE/error.log)" >&2; exit 1; }
    client <<'SQL'
CREATE USER IF NOT EXISTS 'dedup'@'127.0.0.1' IDENTIFIED BY 'dedup';
CREATE USER IF NOT EXISTS 'dedup'@'localhost' IDENTIFIED BY 'dedup';
GRANT ALL PRIVILEGES ON *.* TO 'dedup'@'127.0.0.1' WITH GRANT OPTION;
GRANT ALL PRIVILEGES ON *.* TO 'dedup'@'localhost' WITH GRANT OPTION;
-- A service's user, with no right of its own: the least-privilege tests
-- grant it dedup's tables in their databases.
CREATE USER IF NOT EXISTS 'dedup_app'@'127.0.0.1' IDENTIFIED BY 'dedup';
CREATE USER IF NOT EXISTS 'dedup_app'@'localhost' IDENTIFIED BY 'dedup';
CREATE DATABASE IF NOT EXISTS dedup;
CREATE USER IF NOT EXISTS 'dedup_tls'@'127.0.0.1' IDENTIFIED BY 'dedup' REQUIRE SSL;
CREATE USER IF NOT EXISTS 'dedup_mtls'@'127.0.0.1' IDENTIFIED BY 'dedup' REQUIRE X509;
GRANT ALL PRIVILEGES ON *.* TO 'dedup_tls'@'127.0.0.1';
GRANT ALL PRIVILEGES ON *.* TO 'dedup_mtls'@'127.0.0.1';
SQL
    # The databases of an earlier run's tests (each test makes its own).
    local stale
    stale="$(client -N -e "SELECT schema_name FROM information_schema.schemata WHERE schema_name LIKE 'dedup\\_test\\_%'")"
    for db in $stale; do client -e "DROP DATABASE \`$db\`"; done
    echo "mariadb: ready at mysql://dedup:***@127.0.0.1:${PORT}/dedup" >&2
}

stop() {
    if running; then
        sudo_ kill -TERM "$(cat "$PIDFILE")"
        for _ in $(seq 1 120); do running || return 0; sleep 0.5; done
        echo "mariadb: still running after 60 s" >&2
        exit 1
    fi
}

case "${1:-start}" in
    start) start ;;
    url) echo "$URL" ;;
    tls-url)
        echo "mysql://${2:-dedup_tls}:dedup@localhost:${PORT}/dedup?ssl-mode=VERIFY_IDENTITY&ssl-ca=$(bash "$HERE/tls.sh" dir)/ca.pem"
        ;;
    stop) stop ;;
    kill) if running; then sudo_ kill -KILL "$(cat "$PIDFILE")"; fi ;;
    drop) stop; sudo_ rm -rf "$BASE" ;;
    *) echo "usage: $0 start|url|tls-url [user]|stop|kill|drop" >&2; exit 2 ;;
esac
