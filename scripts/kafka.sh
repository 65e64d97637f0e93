#!/usr/bin/env bash
# A real single-node Apache Kafka (KRaft, broker + controller) on
# 127.0.0.1:9092 for the tests, fetched from Maven Central with Maven.
#   scripts/kafka.sh start    # fetch if needed, format once, start, wait until it answers; no-op if running
#   scripts/kafka.sh stop
#   scripts/kafka.sh kill     # SIGKILL (a crashed broker), for tests
#   scripts/kafka.sh status   # exit 0 if running
# Everything lives under .kafka/: jars, data, server.log. A second broker (the
# outbox outage test stops and restarts one of its own) takes another home and
# port: DEDUP_KAFKA_HOME=.kafka/other DEDUP_KAFKA_PORT=9192 (controller: port+1);
# the jars stay shared.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
HOME_DIR="${DEDUP_KAFKA_HOME:-$ROOT/.kafka}"
VERSION="$(sed -n 's|.*<kafka.version>\(.*\)</kafka.version>.*|\1|p' "$ROOT/scripts/kafka/pom.xml")"
LIBS="$ROOT/.kafka/libs-$VERSION"
DATA="$HOME_DIR/data"
CONF="$HOME_DIR/server.properties"
LOG="$HOME_DIR/server.log"
PIDFILE="$HOME_DIR/kafka.pid"
HOST=127.0.0.1
PORT="${DEDUP_KAFKA_PORT:-9092}"
CONTROLLER_PORT="$((PORT + 1))"

port_open() { (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null; }

running() {
    [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null && port_open "$PORT"
}

ensure_tools() {
    if ! command -v java >/dev/null || ! command -v mvn >/dev/null; then
        echo "kafka: installing Java 17 and Maven" >&2
        local sudo=""
        [ "$(id -u)" = 0 ] || sudo="sudo"
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq openjdk-17-jre-headless maven >/dev/null
    fi
}

fetch() {
    [ -f "$LIBS/.complete" ] && return
    echo "kafka: fetching org.apache.kafka:kafka_2.13:$VERSION and its dependencies" >&2
    rm -rf "$LIBS"
    mvn -q -B -f "$ROOT/scripts/kafka/pom.xml" dependency:copy-dependencies \
        -DincludeScope=runtime -DoutputDirectory="$LIBS"
    touch "$LIBS/.complete"
}

# A modest heap: this is a test broker on a shared 2-core machine.
JAVA=(java -Xms256m -Xmx512m -XX:+UseG1GC -Djava.awt.headless=true
    -Dkafka.logs.file="$LOG" -Dlog4j2.configurationFile="$ROOT/scripts/kafka/log4j2.properties"
    -cp "$LIBS/*")

configure() {
    mkdir -p "$DATA"
    cat >"$CONF" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$HOST:$CONTROLLER_PORT
listeners=PLAINTEXT://$HOST:$PORT,CONTROLLER://$HOST:$CONTROLLER_PORT
advertised.listeners=PLAINTEXT://$HOST:$PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$DATA
num.partitions=1
auto.create.topics.enable=true
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
# A consumer-protocol (KIP-848) member that dies is dropped after 15 s, not
# 45 s: the scaling tests SIGKILL one (classic members set their own
# session.timeout.ms).
group.consumer.min.session.timeout.ms=6000
group.consumer.session.timeout.ms=15000
log.retention.hours=24
PROPS
    if [ ! -f "$DATA/meta.properties" ]; then
        local cluster_id
        cluster_id="$("${JAVA[@]}" kafka.tools.StorageTool random-uuid)"
        "${JAVA[@]}" kafka.tools.StorageTool format -t "$cluster_id" -c "$CONF" >/dev/null
    fi
}

start() {
    if running; then
        echo "kafka: already running on $HOST:$PORT" >&2
        return
    fi
    ensure_tools
    fetch
    configure
    : >"$LOG"
    setsid nohup "${JAVA[@]}" kafka.Kafka "$CONF" >>"$HOME_DIR/stdout.log" 2>&1 </dev/null &
    echo $! >"$PIDFILE"
    for _ in $(seq 1 120); do
        if ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
            echo "kafka: the broker exited; last lines of $LOG:" >&2
            tail -n 30 "$LOG" "$HOME_DIR/stdout.log" >&2
            exit 1
        fi
        if port_open "$PORT" && grep -q "Kafka Server started" "$LOG"; then
            echo "kafka: $VERSION ready on $HOST:$PORT" >&2
            return
        fi
        sleep 0.5
    done
    echo "kafka: not ready after 60 s; see $LOG" >&2
    exit 1
}

stop() {
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

# SIGKILL, as a crashed broker: for the tests that survive one.
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

case "${1:-start}" in
    start) start ;;
    stop) stop ;;
    kill) kill_hard ;;
    status) running ;;
    *) echo "usage: $0 start|stop|kill|status" >&2; exit 2 ;;
esac
