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
# The main broker also listens securely, with the certificates scripts/tls.sh
# makes (server certificate for 127.0.0.1 and localhost, signed by the tests'
# CA): SASL_SSL on 9096 (PLAIN and SCRAM-SHA-256/512 for the user `dedup`,
# password `dedup-secret`; OAUTHBEARER with unsigned JWTs, sessions
# re-authenticated every 10 s so that a token's expiry matters) and SSL with
# a required client certificate on 9097. A broker of a test's own has only
# PLAINTEXT unless given DEDUP_KAFKA_SASL_SSL_PORT and DEDUP_KAFKA_SSL_PORT.
#   scripts/kafka.sh secure-env   # KAFKA_CFG_* lines for the SASL_SSL listener
#   scripts/kafka.sh acl ARGS     # kafka-acls.sh ARGS (the broker has ACLs on)
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
if [ -z "${DEDUP_KAFKA_PORT:-}" ]; then
    SASL_SSL_PORT="${DEDUP_KAFKA_SASL_SSL_PORT:-9096}"
    SSL_PORT="${DEDUP_KAFKA_SSL_PORT:-9097}"
else
    SASL_SSL_PORT="${DEDUP_KAFKA_SASL_SSL_PORT:-}"
    SSL_PORT="${DEDUP_KAFKA_SSL_PORT:-}"
fi
SASL_USER=dedup
SASL_PASSWORD=dedup-secret

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
    # The jars for this pom: another pom (a tool added) fetches again.
    local wanted
    wanted="$(sha256sum "$ROOT/scripts/kafka/pom.xml" | cut -c1-16)"
    [ "$(cat "$LIBS/.complete" 2>/dev/null)" = "$wanted" ] && return
    echo "kafka: fetching org.apache.kafka:kafka_2.13:$VERSION and its dependencies" >&2
    rm -rf "$LIBS"
    mvn -q -B -f "$ROOT/scripts/kafka/pom.xml" dependency:copy-dependencies \
        -DincludeScope=runtime -DoutputDirectory="$LIBS"
    echo "$wanted" >"$LIBS/.complete"
}

# A modest heap: this is a test broker on a shared 2-core machine.
JAVA=(java -Xms256m -Xmx512m -XX:+UseG1GC -Djava.awt.headless=true
    -Dkafka.logs.file="$LOG" -Dlog4j2.configurationFile="$ROOT/scripts/kafka/log4j2.properties"
    -cp "$LIBS/*")
# The admin tools: their own log file.
TOOL=(java -Xmx256m -Djava.awt.headless=true -Dkafka.logs.file="$HOME_DIR/tools.log"
    -Dlog4j2.configurationFile="$ROOT/scripts/kafka/log4j2.properties" -cp "$LIBS/*")

configure() {
    mkdir -p "$DATA"
    local listeners="PLAINTEXT://$HOST:$PORT,CONTROLLER://$HOST:$CONTROLLER_PORT"
    local advertised="PLAINTEXT://$HOST:$PORT"
    local protocols="PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
    if [ -n "$SASL_SSL_PORT" ]; then
        listeners+=",SASL_SSL://$HOST:$SASL_SSL_PORT,SSL://$HOST:$SSL_PORT"
        advertised+=",SASL_SSL://$HOST:$SASL_SSL_PORT,SSL://$HOST:$SSL_PORT"
        protocols+=",SASL_SSL:SASL_SSL,SSL:SSL"
    fi
    cat >"$CONF.new" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$HOST:$CONTROLLER_PORT
listeners=$listeners
advertised.listeners=$advertised
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=$protocols
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
# ACLs as a managed cluster has them, for the tests of a principal missing
# one: a resource without ACLs stays open to all (the tests' own topics and
# groups), one with ACLs only to the principals they name. The PLAINTEXT and
# controller listeners' ANONYMOUS (the broker itself, the admin tools) may
# do anything.
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:ANONYMOUS
allow.everyone.if.no.acl.found=true
PROPS
    if [ -n "$SASL_SSL_PORT" ]; then
        local tls
        tls="$(bash "$ROOT/scripts/tls.sh" make)"
        # Kafka reads PEM: the key (PKCS#8, unencrypted) and its certificate
        # in one file. DEDUP_KAFKA_SERVER_CERT=expired presents the expired
        # one (a test's own broker, for the clients' refusal of it).
        local cert="${DEDUP_KAFKA_SERVER_CERT:-server}"
        cat "$tls/$cert.key" "$tls/$cert.pem" >"$HOME_DIR/server-keystore.pem"
        chmod 600 "$HOME_DIR/server-keystore.pem"
        # The certificates' fingerprint: new certificates (tls.sh makes them
        # again near their expiry) change the settings, so the broker
        # restarts with them.
        cat >>"$CONF.new" <<PROPS
# certificates: $(cat "$tls/$cert.pem" "$tls/ca.pem" | sha256sum | cut -c1-16)
ssl.keystore.type=PEM
ssl.keystore.location=$HOME_DIR/server-keystore.pem
ssl.truststore.type=PEM
ssl.truststore.location=$tls/ca.pem
listener.name.ssl.ssl.client.auth=required
sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256,SCRAM-SHA-512,OAUTHBEARER
listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required user_$SASL_USER="$SASL_PASSWORD";
listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.oauthbearer.sasl.jaas.config=org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required;
listener.name.sasl_ssl.oauthbearer.sasl.server.callback.handler.class=org.apache.kafka.common.security.oauthbearer.internals.unsecured.OAuthBearerUnsecuredValidatorCallbackHandler
listener.name.sasl_ssl.oauthbearer.connections.max.reauth.ms=10000
PROPS
    fi
    if [ ! -f "$DATA/meta.properties" ]; then
        local cluster_id
        cluster_id="$("${JAVA[@]}" kafka.tools.StorageTool random-uuid)"
        "${JAVA[@]}" kafka.tools.StorageTool format -t "$cluster_id" -c "$CONF.new" >/dev/null
    fi
}

# The SCRAM credentials of the SASL_SSL listener's user (stored in the
# cluster's metadata; setting them again is harmless).
scram_users() {
    [ -n "$SASL_SSL_PORT" ] || return 0
    local mechanism
    for mechanism in SCRAM-SHA-256 SCRAM-SHA-512; do
        "${TOOL[@]}" kafka.admin.ConfigCommand --bootstrap-server "$HOST:$PORT" --alter \
            --add-config "$mechanism=[password=$SASL_PASSWORD]" \
            --entity-type users --entity-name "$SASL_USER" >/dev/null
    done
}

secure_env() {
    [ -n "$SASL_SSL_PORT" ] || { echo "kafka: this broker has no SASL_SSL listener" >&2; exit 2; }
    local tls
    tls="$(bash "$ROOT/scripts/tls.sh" dir)"
    echo "KAFKA_CFG_SECURITY_PROTOCOL=SASL_SSL"
    echo "KAFKA_CFG_SASL_MECHANISMS=SCRAM-SHA-512"
    echo "KAFKA_CFG_SASL_USERNAME=$SASL_USER"
    echo "KAFKA_CFG_SASL_PASSWORD=$SASL_PASSWORD"
    echo "KAFKA_CFG_SSL_CA_LOCATION=$tls/ca.pem"
    echo "KAFKA_BROKERS=$HOST:$SASL_SSL_PORT"
}

start() {
    ensure_tools
    fetch
    configure
    if running; then
        if cmp -s "$CONF.new" "$CONF"; then
            rm -f "$CONF.new"
            # A user an earlier start failed to make; a failure here is
            # said, not fatal (the running broker serves the rest).
            scram_users || echo "kafka: could not set the SCRAM user's credentials" >&2
            echo "kafka: already running on $HOST:$PORT" >&2
            return
        fi
        # Started by an earlier version of this script: its settings change.
        echo "kafka: restarting with new settings" >&2
        stop
    fi
    mv "$CONF.new" "$CONF"
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
            scram_users
            echo "kafka: $VERSION ready on $HOST:$PORT${SASL_SSL_PORT:+ (SASL_SSL on $SASL_SSL_PORT, SSL with client certificates on $SSL_PORT)}" >&2
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

# ACLs, through the PLAINTEXT listener: scripts/kafka.sh acl --add
# --allow-principal User:dedup --operation Read --topic orders (the
# arguments of Kafka's kafka-acls.sh).
acl() {
    "${TOOL[@]}" org.apache.kafka.tools.AclCommand --bootstrap-server "$HOST:$PORT" "$@"
}

case "${1:-start}" in
    start) start ;;
    stop) stop ;;
    kill) kill_hard ;;
    status) running ;;
    secure-env) secure_env ;;
    acl) shift; acl "$@" ;;
    *) echo "usage: $0 start|stop|kill|status|secure-env|acl ARGS" >&2; exit 2 ;;
esac
