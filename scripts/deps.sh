#!/usr/bin/env bash
# System packages the build needs. librdkafka is compiled from source by the
# rdkafka crate with its own configure script and make: a C (and C++) compiler
# and make are all it takes, with no curl or zlib headers (zlib comes from
# libz-sys's bundled source when its headers are missing). TLS to the
# brokers (and SASL SCRAM) is the system OpenSSL, found by pkg-config; TLS to
# the databases is rustls, compiled from crates. The openssl command makes the
# secured tests' certificates (scripts/tls.sh). PostgreSQL and Kafka are installed by
# scripts/postgres.sh and scripts/kafka.sh. The tests' tools: promtool (from
# Debian's prometheus package, without its recommended exporters; its server
# is never started) unit-tests the alert rules; Chromium and its WebDriver
# (chromium-driver), with one font for legible screenshots, run the console's
# browser tests; nginx (light) puts TLS and basic auth in front of the test
# schema registry (scripts/registry.sh).
set -euo pipefail
packages=(gcc g++ make pkg-config libssl-dev openssl)
tools=(prometheus chromium chromium-driver fonts-dejavu-core nginx-light)
missing=()
for p in "${packages[@]}" "${tools[@]}"; do
    # Installed, not merely known (a removed package keeps its config files).
    [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] ||
        missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "deps: installing ${missing[*]}" >&2
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    build=() no_recommends=()
    for p in "${missing[@]}"; do
        case " ${tools[*]} " in
            *" $p "*) no_recommends+=("$p") ;;
            *) build+=("$p") ;;
        esac
    done
    if [ ${#build[@]} -gt 0 ]; then
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${build[@]}" >/dev/null
    fi
    if [ ${#no_recommends[@]} -gt 0 ]; then
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
            "${no_recommends[@]}" >/dev/null
    fi
fi
