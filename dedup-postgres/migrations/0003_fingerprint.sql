-- v3: a claim keeps a 16-byte fingerprint of its event's content
-- (`#[idempotent(fingerprint)]`), so a duplicate whose content differs is
-- told apart from a redelivery. NULL for claims taken without one (all
-- claims before this version): they match any event.
--
-- A nullable column without a default is added to the catalog only: no row
-- is rewritten, however many the table holds, and the lock is held for
-- moments (README: upgrading).
ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS fingerprint bytea;
