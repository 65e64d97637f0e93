-- The outbox table on MySQL 8 or MariaDB 10.6+. `{{table}}` and
-- `{{index:...}}` are replaced by the outbox's validated, backtick-quoted
-- identifiers before this runs. Times are microseconds since the Unix
-- epoch on the server's clock.
CREATE TABLE IF NOT EXISTS {{table}} (
    -- Enqueue order: the relay publishes in this order.
    seq             BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    -- The stable id, sent as the `event-id` header.
    event_id        TEXT         CHARACTER SET utf8mb4 NOT NULL,
    topic           VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    msg_key         MEDIUMBLOB,
    -- The topic and key as 32 bytes, for the per-key order check (a key
    -- may be longer than an index can hold); NULL without a key.
    key_hash        BINARY(32) AS (UNHEX(SHA2(CONCAT(topic, X'00', msg_key), 256))) STORED,
    payload         LONGBLOB     NOT NULL,
    -- Each header as name length, name, value length, value.
    headers         MEDIUMBLOB   NOT NULL,
    enqueued_at     BIGINT       NOT NULL,
    -- Set when the broker acknowledged it (rows are deleted instead under
    -- the delete-on-publish retention).
    sent_at         BIGINT,
    attempts        INT          NOT NULL DEFAULT 0,
    last_error      TEXT         CHARACTER SET utf8mb4,
    -- After a failed attempt: not before this time (its back-off).
    next_attempt_at BIGINT,
    -- The relay's lease: which batch holds the row, and until when.
    lease_id        BIGINT,
    leased_until    BIGINT,
    -- The relay's queue (sent_at IS NULL, in order) and the purge's
    -- (sent_at past the retention).
    INDEX {{index:state_idx}} (sent_at, seq),
    -- Earlier pending rows of the same topic and key (MySQL has no partial
    -- index: with `sent_at` in it, a key's kept sent rows are never read).
    INDEX {{index:key_idx}} (key_hash, sent_at, seq)
) ENGINE = InnoDB;
