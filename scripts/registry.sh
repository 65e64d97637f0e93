#!/usr/bin/env bash
# A real schema registry for the tests: Apicurio Registry, whose
# Confluent-compatible API (/apis/ccompat/v6) serves what Confluent Schema
# Registry, Karapace and Redpanda's registry serve. Built once from Maven
# Central with Maven (scripts/registry/pom.xml says how and why this
# version), it listens on 127.0.0.1:8087 behind nginx on
# https://localhost:8086, secured as a managed registry is: TLS only, with
# the server certificate scripts/tls.sh makes, and HTTP basic auth for the
# user `dedup` (password `registry-secret`); the user `stranger` (password
# `stranger-secret`) signs in but may not use the API (403). While the
# registry itself is down, nginx answers 502, as a load balancer in front of
# one does.
#   scripts/registry.sh start    # build if needed, start, wait until it answers; no-op if running
#   scripts/registry.sh stop     # both
#   scripts/registry.sh kill     # SIGKILL the registry (nginx stays: 502), for tests
#   scripts/registry.sh status   # exit 0 if running
#   scripts/registry.sh url      # the API's base URL
#   scripts/registry.sh env      # DEDUP_REGISTRY_* lines: URL, user, password, CA
# Schemas are kept in PostgreSQL (scripts/postgres.sh), as Apicurio keeps
# them in production, in a database of the registry's own: they survive a
# restart, as a real registry's do. A test that stops its registry runs one
# of its own: DEDUP_REGISTRY_HOME=.registry/other DEDUP_REGISTRY_PORT=8186
# (the registry itself on port+1), with a database of its own, made anew
# when its home is new; the build stays shared.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
HOME_DIR="${DEDUP_REGISTRY_HOME:-$ROOT/.registry/main}"
BUILD="$ROOT/.registry/build"
PIDFILE="$HOME_DIR/registry.pid"
LOG="$HOME_DIR/registry.log"
PORT="${DEDUP_REGISTRY_PORT:-8086}"
INNER_PORT="$((PORT + 1))"
USER_NAME=dedup
USER_PASSWORD=registry-secret
STRANGER_PASSWORD=stranger-secret

tls_dir() { bash "$ROOT/scripts/tls.sh" dir; }

url() { echo "https://localhost:$PORT/apis/ccompat/v6"; }

answers() {
    curl -s -o /dev/null -w '%{http_code}' --max-time 5 --cacert "$(tls_dir)/ca.pem" \
        -u "$USER_NAME:$USER_PASSWORD" "$(url)/subjects" 2>/dev/null | grep -q '^200$'
}

running() { answers; }

ensure_tools() {
    if ! command -v java >/dev/null || ! command -v mvn >/dev/null; then
        echo "registry: installing Java 17 and Maven" >&2
        local sudo=""
        [ "$(id -u)" = 0 ] || sudo="sudo"
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq openjdk-17-jre-headless maven >/dev/null
    fi
}

build() {
    # Built again whenever the build's files change.
    local wanted
    wanted="$(cd "$ROOT/scripts/registry" && find . -type f | sort | xargs sha256sum | sha256sum | cut -c1-16)"
    [ "$(cat "$BUILD/.complete" 2>/dev/null)" = "$wanted" ] && return
    echo "registry: building Apicurio Registry from Maven Central (once)" >&2
    rm -rf "$BUILD"
    mvn -q -B -s "$ROOT/scripts/registry/settings.xml" -f "$ROOT/scripts/registry/pom.xml" \
        -Dregistry.build="$BUILD" package
    echo "$wanted" >"$BUILD/.complete"
}

# The registry's database, named after its home, made anew with a new home
# (a test's own registry starts empty).
DATABASE="registry_$(basename "$HOME_DIR" | tr -c 'a-zA-Z0-9_\n' '_')"
database() {
    bash "$ROOT/scripts/postgres.sh" start >/dev/null
    local admin
    admin="$(bash "$ROOT/scripts/postgres.sh" url)"
    # postgres://user:password@host:port/db
    local rest="${admin#postgres://}"
    PG_USER="${rest%%:*}"
    rest="${rest#*:}"
    PG_PASSWORD="${rest%%@*}"
    rest="${rest#*@}"
    PG_HOST="${rest%%:*}"
    rest="${rest#*:}"
    PG_PORT="${rest%%/*}"
    if [ ! -f "$HOME_DIR/.database" ]; then
        PGOPTIONS=--client-min-messages=warning psql "$admin" -q -v ON_ERROR_STOP=1 \
            -c "DROP DATABASE IF EXISTS $DATABASE" \
            -c "CREATE DATABASE $DATABASE" >/dev/null
        touch "$HOME_DIR/.database"
    fi
}

inner_answers() {
    curl -s -o /dev/null -w '%{http_code}' --max-time 5 \
        "http://127.0.0.1:$INNER_PORT/apis/ccompat/v6/subjects" 2>/dev/null | grep -q '^200$'
}

start_registry() {
    if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null && inner_answers; then
        return
    fi
    stop_registry
    database
    : >"$LOG"
    # A modest heap: a test registry on a shared 2-core machine. Its first
    # connection may take over the pool's default 5 s to come while test
    # suites beside it load PostgreSQL, and then it exited at start.
    setsid nohup java -Xms64m -Xmx256m -XX:+UseSerialGC \
        -Dquarkus.http.host=127.0.0.1 -Dquarkus.http.port="$INNER_PORT" \
        -Dquarkus.datasource.jdbc.url="jdbc:postgresql://$PG_HOST:$PG_PORT/$DATABASE" \
        -Dquarkus.datasource.username="$PG_USER" -Dquarkus.datasource.password="$PG_PASSWORD" \
        -Dquarkus.datasource.jdbc.acquisition-timeout=60S \
        -jar "$BUILD/registry-for-tests-1-runner.jar" >>"$LOG" 2>&1 </dev/null &
    echo $! >"$PIDFILE"
    for _ in $(seq 1 120); do
        if ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
            echo "registry: it exited; last lines of $LOG:" >&2
            tail -n 30 "$LOG" >&2
            exit 1
        fi
        inner_answers && return
        sleep 0.5
    done
    echo "registry: not ready after 60 s; see $LOG" >&2
    exit 1
}

# nginx: TLS and basic auth in front (its own prefix under the home).
start_proxy() {
    local tls
    tls="$(tls_dir)"
    mkdir -p "$HOME_DIR/nginx/logs"
    printf 'dedup:%s\nstranger:%s\n' "$(openssl passwd -apr1 "$USER_PASSWORD")" \
        "$(openssl passwd -apr1 "$STRANGER_PASSWORD")" >"$HOME_DIR/nginx/users"
    cat >"$HOME_DIR/nginx/nginx.conf.new" <<CONF
# certificates: $(cat "$tls/server.pem" "$tls/ca.pem" | sha256sum | cut -c1-16)
worker_processes 1;
pid $HOME_DIR/nginx/nginx.pid;
error_log $HOME_DIR/nginx/logs/error.log warn;
events { worker_connections 256; }
http {
    access_log $HOME_DIR/nginx/logs/access.log;
    client_body_temp_path $HOME_DIR/nginx/body;
    proxy_temp_path $HOME_DIR/nginx/proxy;
    fastcgi_temp_path $HOME_DIR/nginx/fastcgi;
    uwsgi_temp_path $HOME_DIR/nginx/uwsgi;
    scgi_temp_path $HOME_DIR/nginx/scgi;
    server {
        listen 127.0.0.1:$PORT ssl;
        server_name localhost;
        ssl_certificate $tls/server.pem;
        ssl_certificate_key $tls/server.key;
        auth_basic "schema registry";
        auth_basic_user_file $HOME_DIR/nginx/users;
        location /apis/ {
            if (\$remote_user = stranger) { return 403; }
            proxy_pass http://127.0.0.1:$INNER_PORT;
            proxy_connect_timeout 2s;
        }
    }
}
CONF
    if [ -f "$HOME_DIR/nginx/nginx.pid" ] && kill -0 "$(cat "$HOME_DIR/nginx/nginx.pid")" 2>/dev/null; then
        if cmp -s "$HOME_DIR/nginx/nginx.conf.new" "$HOME_DIR/nginx/nginx.conf"; then
            rm -f "$HOME_DIR/nginx/nginx.conf.new"
            return
        fi
        stop_proxy
    fi
    mv "$HOME_DIR/nginx/nginx.conf.new" "$HOME_DIR/nginx/nginx.conf"
    nginx -p "$HOME_DIR/nginx" -c "$HOME_DIR/nginx/nginx.conf"
}

start() {
    ensure_tools
    command -v nginx >/dev/null || PATH="$PATH:/usr/sbin"
    command -v nginx >/dev/null || bash "$ROOT/scripts/deps.sh"
    bash "$ROOT/scripts/tls.sh" make >/dev/null
    build
    mkdir -p "$HOME_DIR"
    start_registry
    start_proxy
    for _ in $(seq 1 20); do
        if answers; then
            echo "registry: Apicurio Registry ready at $(url)" >&2
            return
        fi
        sleep 0.5
    done
    echo "registry: nginx does not answer on $PORT; see $HOME_DIR/nginx/logs/error.log" >&2
    exit 1
}

stop_registry() {
    if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
        kill "$(cat "$PIDFILE")"
        for _ in $(seq 1 60); do
            kill -0 "$(cat "$PIDFILE")" 2>/dev/null || break
            sleep 0.5
        done
        kill -9 "$(cat "$PIDFILE")" 2>/dev/null || true
    fi
    rm -f "$PIDFILE"
}

stop_proxy() {
    local pidfile="$HOME_DIR/nginx/nginx.pid" pid
    pid="$(cat "$pidfile" 2>/dev/null || true)"
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 1 20); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.25
        done
    fi
    rm -f "$pidfile"
}

stop() {
    stop_proxy
    stop_registry
}

kill_hard() {
    if [ -f "$PIDFILE" ]; then
        kill -9 "$(cat "$PIDFILE")" 2>/dev/null || true
        for _ in $(seq 1 60); do
            kill -0 "$(cat "$PIDFILE")" 2>/dev/null || break
            sleep 0.5
        done
    fi
    rm -f "$PIDFILE"
}

env_lines() {
    echo "DEDUP_REGISTRY_URL=$(url)"
    echo "DEDUP_REGISTRY_USERNAME=$USER_NAME"
    echo "DEDUP_REGISTRY_PASSWORD=$USER_PASSWORD"
    echo "DEDUP_REGISTRY_CA=$(tls_dir)/ca.pem"
}

case "${1:-start}" in
    start) start ;;
    stop) stop ;;
    kill) kill_hard ;;
    status) running ;;
    url) url ;;
    env) env_lines ;;
    *) echo "usage: $0 start|stop|kill|status|url|env" >&2; exit 2 ;;
esac
