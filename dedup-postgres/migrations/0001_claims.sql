-- The dedup table. `{{table}}` and `{{expires_index}}` are replaced by the
-- store's validated, quoted identifiers before this runs.
CREATE TABLE IF NOT EXISTS {{table}} (
    scope      text        NOT NULL,
    key        text        NOT NULL,
    claimed_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (scope, key)
);

-- Purge finds expired claims through this index.
CREATE INDEX IF NOT EXISTS {{expires_index}} ON {{table}} (expires_at);
