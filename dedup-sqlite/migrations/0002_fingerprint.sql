-- A claim keeps a 16-byte fingerprint of its event's content
-- (`#[idempotent(fingerprint)]`); NULL for claims taken without one, which
-- match any event. Adding a nullable column rewrites no row.
ALTER TABLE {{table}} ADD COLUMN fingerprint BLOB;
