-- v4: lease mode (`#[idempotent(lease = "30s")]`), for effects outside the
-- database. A lease is a claim in progress (`in_progress`, `expires_at` the
-- lease's end) held under a fencing token. Tokens come from a sequence, so
-- they grow with every lease the table gives and are never reused, not even
-- after the purge deletes the claim that held one.
--
-- Both columns are added to the catalog only (a constant default is not
-- written into the rows): no row is rewritten (README: upgrading).
CREATE SEQUENCE IF NOT EXISTS {{object:tokens}} AS bigint;
ALTER TABLE {{table}}
    ADD COLUMN IF NOT EXISTS token bigint,
    ADD COLUMN IF NOT EXISTS in_progress boolean NOT NULL DEFAULT false;
