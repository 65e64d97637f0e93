#!/usr/bin/env bash
# Builds the book (docs/, mdBook) into target/book and checks its links.
# mdBook comes from crates.io, built once into ~/.cargo/bin (about two
# minutes on 2 cores; no default features: no file watcher, no web server,
# no search index, none of which a check needs).
set -euo pipefail
cd "$(dirname "$0")/.."
MDBOOK_VERSION=0.5.4
if ! mdbook --version 2>/dev/null | grep -q "v$MDBOOK_VERSION"; then
    echo "book: installing mdbook $MDBOOK_VERSION" >&2
    cargo install --quiet --locked --no-default-features --version "$MDBOOK_VERSION" mdbook
fi
mdbook build docs
python3 scripts/doclinks.py
