-- A lease is one row per batch, not a write to every leased event: the
-- relay's batch costs one small INSERT instead of an UPDATE of each of its
-- rows (a new row version and an entry in three indexes per event, which
-- then had to be vacuumed). Relays take leases one at a time (a
-- transaction-scoped advisory lock), publish with no transaction open, and
-- delete their lease when they mark the batch; a lease past `until` (its
-- relay died) is ignored and removed by the next relay that leases.
CREATE TABLE IF NOT EXISTS {{object:leases}} (
    id    uuid        PRIMARY KEY,
    until timestamptz NOT NULL,
    seqs  int8[]      NOT NULL
);

-- The per-event lease of 0002 is gone. Dropping its columns makes a relay
-- of an older version fail (and retry) instead of publishing beside the
-- new ones without seeing their leases.
ALTER TABLE {{table}} DROP COLUMN IF EXISTS lease_id;
ALTER TABLE {{table}} DROP COLUMN IF EXISTS leased_until;
