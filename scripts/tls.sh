#!/usr/bin/env bash
# Makes the certificates the secured tests use, once: a CA of the tests' own,
# a server certificate it signed for 127.0.0.1 and localhost (PostgreSQL,
# MariaDB and the broker's SASL_SSL listener present it), a client
# certificate (mutual TLS), a certificate that has expired (for a server or
# a client), and a second CA that signed none of them (a client trusting it
# must refuse our servers). Made again when missing or within 30 days of expiry. Idempotent.
#   scripts/tls.sh make   # prints the folder
#   scripts/tls.sh dir
set -euo pipefail

DIR="${DEDUP_TLS_DIR:-/var/tmp/dedup-tls}"

fresh() {
    [ -f "$1" ] && openssl x509 -checkend $((30 * 86400)) -noout -in "$1" >/dev/null 2>&1
}

key() {
    # EC P-256 in PKCS#8: what OpenSSL, PostgreSQL, MariaDB and Java all read.
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null
}

ca() { # name subject
    key "$DIR/$1.key"
    openssl req -x509 -new -key "$DIR/$1.key" -sha256 -days 3650 -subj "$2" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" -out "$DIR/$1.pem" 2>/dev/null
}

signed() { # name subject extensions [days]
    local ext
    ext="$(mktemp)"
    printf '%s\n' "$3" >"$ext"
    key "$DIR/$1.key"
    openssl req -new -key "$DIR/$1.key" -subj "$2" -out "$DIR/$1.csr" 2>/dev/null
    openssl x509 -req -in "$DIR/$1.csr" -CA "$DIR/ca.pem" -CAkey "$DIR/ca.key" \
        -CAcreateserial -sha256 -days "${4:-825}" -extfile "$ext" -out "$DIR/$1.pem" 2>/dev/null
    rm -f "$DIR/$1.csr" "$ext"
}

# A certificate whose validity ended long ago, signed by our CA: `openssl
# ca` is the one OpenSSL 3.0 command that takes explicit dates.
expired() {
    local work
    work="$(mktemp -d)"
    : >"$work/index.txt"
    echo 1000 >"$work/serial"
    cat >"$work/ca.cnf" <<EOF
[ca]
default_ca = test
[test]
dir = $work
database = $work/index.txt
serial = $work/serial
new_certs_dir = $work
default_md = sha256
policy = any
copy_extensions = none
x509_extensions = server
[any]
commonName = supplied
[server]
basicConstraints = CA:FALSE
keyUsage = digitalSignature
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = DNS:localhost,IP:127.0.0.1
EOF
    key "$DIR/expired.key"
    openssl req -new -key "$DIR/expired.key" -subj "/CN=localhost" -out "$work/expired.csr" 2>/dev/null
    openssl ca -batch -config "$work/ca.cnf" -cert "$DIR/ca.pem" -keyfile "$DIR/ca.key" \
        -startdate 20200101000000Z -enddate 20200102000000Z \
        -notext -in "$work/expired.csr" -out "$DIR/expired.pem" 2>/dev/null
    rm -rf "$work"
}

make_all() {
    command -v openssl >/dev/null || { echo "tls: openssl is missing (scripts/deps.sh installs it)" >&2; exit 1; }
    mkdir -p "$DIR"
    chmod 755 "$DIR"
    if fresh "$DIR/ca.pem" && fresh "$DIR/server.pem" && fresh "$DIR/client.pem" \
        && openssl x509 -noout -ext extendedKeyUsage -in "$DIR/expired.pem" 2>/dev/null | grep -q "Client" \
        && fresh "$DIR/other-ca.pem"; then
        echo "$DIR"
        return
    fi
    ca ca "/CN=dedup test CA"
    ca other-ca "/CN=another CA"
    signed server "/CN=localhost" "basicConstraints=CA:FALSE
keyUsage=digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=DNS:localhost,IP:127.0.0.1"
    signed client "/CN=dedup-client" "basicConstraints=CA:FALSE
keyUsage=digitalSignature
extendedKeyUsage=clientAuth"
    expired
    # Certificates are public; the servers copy the keys they need into
    # their own folders with their own owners.
    chmod 644 "$DIR"/*.pem
    chmod 640 "$DIR"/*.key
    rm -f "$DIR"/*.srl
    echo "tls: certificates made in $DIR" >&2
    echo "$DIR"
}

case "${1:-make}" in
    make) make_all ;;
    dir) echo "$DIR" ;;
    *) echo "usage: $0 make|dir" >&2; exit 2 ;;
esac
