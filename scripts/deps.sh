#!/usr/bin/env bash
# System packages the build needs. librdkafka is compiled from source by the
# rdkafka crate with its own configure script and make: a C (and C++) compiler
# and make are all it takes. No curl, OpenSSL or zlib headers: TLS is an opt-in
# feature (`dedup-kafka/ssl`), and zlib comes from libz-sys's bundled source
# when its headers are missing. PostgreSQL and Kafka are installed by
# scripts/postgres.sh and scripts/kafka.sh.
set -euo pipefail
packages=(gcc g++ make)
missing=()
for p in "${packages[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "deps: installing ${missing[*]}" >&2
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
