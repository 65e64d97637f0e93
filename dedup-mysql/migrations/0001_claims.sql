-- The dedup table on MySQL 8 or MariaDB 10.6+. `{{table}}`,
-- `{{expires_index}}` and `{{object:...}}` are replaced by the store's
-- validated, backtick-quoted identifiers before this runs. Times are
-- microseconds since the Unix epoch on the server's clock.
--
-- `scope` and `id` are byte strings: compared and ordered byte for byte,
-- with no trailing-space padding (under the PAD SPACE collations, which
-- utf8mb4_bin is, 'x' and 'x ' would be one key). Each is at most 255 bytes
-- (longer parts are digested by dedup-core), so the primary key fits
-- InnoDB's 3072-byte limit.
CREATE TABLE IF NOT EXISTS {{table}} (
    scope       VARBINARY(255) NOT NULL,
    id          VARBINARY(255) NOT NULL,
    claimed_at  BIGINT         NOT NULL,
    expires_at  BIGINT         NOT NULL,
    -- How many times this row was claimed: 1 = created fresh, more = an
    -- expired claim taken over.
    claims      BIGINT         NOT NULL DEFAULT 1,
    -- A random tag of the statement that last claimed the row: a claimer
    -- reads back which rows its statement took (MySQL has no RETURNING,
    -- and its affected-rows count is one number for a whole batch).
    tag         BIGINT         NOT NULL,
    -- A 16-byte fingerprint of the event's content, or NULL.
    fingerprint VARBINARY(16),
    -- Lease mode: a claim in progress held under a fencing token.
    token       BIGINT,
    in_progress TINYINT        NOT NULL DEFAULT 0,
    PRIMARY KEY (scope, id),
    INDEX {{expires_index}} (expires_at)
) ENGINE = InnoDB;

-- Lease tokens come from a one-row counter, so they grow with every lease
-- and are never reused, not even after the purge deletes the claim that
-- held one.
-- (A primary key, for servers that require one: sql_require_primary_key,
-- Galera.)
CREATE TABLE IF NOT EXISTS {{object:tokens}} (
    id   TINYINT NOT NULL DEFAULT 1 PRIMARY KEY,
    last BIGINT  NOT NULL
) ENGINE = InnoDB;
INSERT INTO {{object:tokens}} (last)
    SELECT 0 FROM DUAL WHERE NOT EXISTS (SELECT 1 FROM {{object:tokens}});
