#!/usr/bin/env bash
# System packages the build needs: librdkafka is compiled from source by the
# rdkafka crate (cmake-build), which needs cmake, curl and OpenSSL headers.
set -euo pipefail
packages=(cmake pkg-config libcurl4-openssl-dev libssl-dev zlib1g-dev)
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
