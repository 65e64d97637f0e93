-- The outbox table. `{{table}}`, `{{index:...}}`, `{{object:...}}` and
-- `{{name}}` are replaced by the outbox's validated, quoted identifiers
-- before this runs.
CREATE TABLE IF NOT EXISTS {{table}} (
    -- Enqueue order: the relay publishes in this order.
    seq           bigserial   PRIMARY KEY,
    -- The stable id, sent as the `event-id` header.
    event_id      text        NOT NULL,
    topic         text        NOT NULL,
    key           bytea,
    payload       bytea       NOT NULL,
    header_names  text[]      NOT NULL,
    header_values bytea[]     NOT NULL,
    enqueued_at   timestamptz NOT NULL DEFAULT now(),
    -- Set when the broker acknowledged it (rows are deleted instead under
    -- the delete-on-publish retention).
    sent_at       timestamptz,
    attempts      integer     NOT NULL DEFAULT 0,
    last_error    text,
    -- After a failed attempt: not before this time (its back-off).
    next_attempt_at timestamptz
);

-- The relay's queue: pending rows in order.
CREATE INDEX IF NOT EXISTS {{index:pending_idx}} ON {{table}} (seq) WHERE sent_at IS NULL;
-- The per-key order check: earlier pending rows of the same topic and key.
CREATE INDEX IF NOT EXISTS {{index:key_idx}} ON {{table}} (topic, key, seq) WHERE sent_at IS NULL;
-- Events backing off after a failure, which hold back their key.
CREATE INDEX IF NOT EXISTS {{index:retry_idx}} ON {{table}} (topic, key, seq)
    WHERE sent_at IS NULL AND next_attempt_at IS NOT NULL;
-- Purging sent rows after their retention.
CREATE INDEX IF NOT EXISTS {{index:sent_idx}} ON {{table}} (sent_at) WHERE sent_at IS NOT NULL;

-- Wake relays (LISTEN "{{name}}") when a transaction that enqueued commits:
-- PostgreSQL delivers notifications at commit, once per transaction.
CREATE OR REPLACE FUNCTION {{object:notify}}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('{{name}}', '');
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER {{index:notify}} AFTER INSERT ON {{table}}
    FOR EACH STATEMENT EXECUTE FUNCTION {{object:notify}}();
