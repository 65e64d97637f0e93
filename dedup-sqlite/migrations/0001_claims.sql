-- The dedup table. `{{table}}` and `{{expires_index}}` are replaced by the
-- store's validated, quoted identifiers before this runs. Times are
-- microseconds since the Unix epoch on SQLite's clock.
CREATE TABLE IF NOT EXISTS {{table}} (
    scope      TEXT    NOT NULL,
    key        TEXT    NOT NULL,
    claimed_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    -- How many times this row was claimed: 1 = created fresh, more = an
    -- expired claim taken over. SQLite's upsert cannot say which it did.
    claims     INTEGER NOT NULL DEFAULT 1,
    PRIMARY KEY (scope, key)
);

CREATE INDEX IF NOT EXISTS {{expires_index}} ON {{table}} (expires_at);
