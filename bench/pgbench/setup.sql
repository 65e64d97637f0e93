-- Tables for the claim-statement comparison (the other .sql files here).
-- psql "$DATABASE_URL" -f bench/pgbench/setup.sql, then for each script:
-- pgbench -n -T 20 -c 1 -f bench/pgbench/<script>.sql "$DATABASE_URL"
-- Each transaction writes 200 fresh random keys, like one batch of the
-- runtime; keys.sql alone measures making the keys (subtract it).
DROP TABLE IF EXISTS pgb_claims, pgb_claims_uuid, pgb_effects;
CREATE TABLE pgb_claims (scope text NOT NULL, key text NOT NULL, claimed_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL, PRIMARY KEY (scope, key));
CREATE INDEX ON pgb_claims (expires_at);
CREATE TABLE pgb_claims_uuid (id uuid PRIMARY KEY, scope text NOT NULL, key text NOT NULL,
    claimed_at timestamptz NOT NULL, expires_at timestamptz NOT NULL);
CREATE INDEX ON pgb_claims_uuid (expires_at);
CREATE TABLE pgb_effects (seq bigserial PRIMARY KEY, event_id text NOT NULL, account_id text NOT NULL,
    amount_cents bigint NOT NULL);
