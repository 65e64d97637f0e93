-- The outbox table. `{{table}}` and `{{index:...}}` are replaced by the
-- outbox's validated, quoted identifiers before this runs. Times are
-- microseconds since the Unix epoch on SQLite's clock.
CREATE TABLE IF NOT EXISTS {{table}} (
    -- Enqueue order: the relay publishes in this order.
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
    -- The stable id, sent as the `event-id` header.
    event_id        TEXT    NOT NULL,
    topic           TEXT    NOT NULL,
    key             BLOB,
    payload         BLOB    NOT NULL,
    -- Each header as name length, name, value length, value.
    headers         BLOB    NOT NULL,
    enqueued_at     INTEGER NOT NULL,
    -- Set when the broker acknowledged it (rows are deleted instead under
    -- the delete-on-publish retention).
    sent_at         INTEGER,
    attempts        INTEGER NOT NULL DEFAULT 0,
    last_error      TEXT,
    -- After a failed attempt: not before this time (its back-off).
    next_attempt_at INTEGER,
    -- The relay's lease: which batch holds the row, and until when.
    lease_id        INTEGER,
    leased_until    INTEGER
);

-- The relay's queue, and the per-key order check: pending rows in order.
CREATE INDEX IF NOT EXISTS {{index:key_idx}} ON {{table}} (topic, key, seq) WHERE sent_at IS NULL;
CREATE INDEX IF NOT EXISTS {{index:pending_idx}} ON {{table}} (seq) WHERE sent_at IS NULL;
-- Purging sent rows after their retention.
CREATE INDEX IF NOT EXISTS {{index:sent_idx}} ON {{table}} (sent_at) WHERE sent_at IS NOT NULL;
