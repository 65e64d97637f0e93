-- Tables for the claim-statement comparison (the other .sql files here).
-- psql "$DATABASE_URL" -f bench/pgbench/setup.sql, then for each script:
-- pgbench -n -T 20 -c 1 -f bench/pgbench/<script>.sql "$DATABASE_URL"
-- Each transaction writes 200 fresh random keys, like one batch of the
-- runtime; keys.sql alone measures making the keys (subtract it).
-- (keys.sql and claim.sql both make 200 UUIDs: subtract keys.sql twice
-- from claim.sql, once from the others.)
DROP TABLE IF EXISTS pgb_claims, pgb_claims_v1, pgb_effects;
-- The claims table as migrations 0001 + 0002 leave it.
CREATE TABLE pgb_claims (scope text NOT NULL, key text NOT NULL, claimed_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL, id uuid PRIMARY KEY);
CREATE INDEX ON pgb_claims (expires_at);
CREATE INDEX ON pgb_claims (scope, key) WHERE scope LIKE 'dedup.dead-letter/%';
-- Schema v1, for comparison.
CREATE TABLE pgb_claims_v1 (scope text NOT NULL, key text NOT NULL, claimed_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL, PRIMARY KEY (scope, key));
CREATE INDEX ON pgb_claims_v1 (expires_at);
CREATE TABLE pgb_effects (seq bigserial PRIMARY KEY, event_id text NOT NULL, account_id text NOT NULL,
    amount_cents bigint NOT NULL);
