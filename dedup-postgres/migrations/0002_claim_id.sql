-- v2: a claim is found by a 16-byte digest of its scope and key, not by
-- the two texts. A unique index of two texts of ~60 bytes together cost
-- more than the rest of a claim (benchmark: the claim statement 35-40%
-- cheaper); its entries are now 16 bytes, compared with memcmp.
--
-- Upgrades a filled v1 table in place, in one transaction that holds the
-- table locked while every row is rewritten (README: upgrading). The
-- application computes the same digest (`dedup_postgres::claim_id`); this
-- function is the SQL spelling of it, for the upgrade and for operators:
--   SELECT * FROM dedup_claims WHERE id = dedup_claims_claim_id('scope', 'key');
-- The scope's length in UTF-8 bytes leads, so that no two (scope, key)
-- pairs are digested from the same bytes: ('ab', 'c') is '2:abc',
-- ('a', 'bc') is '1:abc'. The bytes are the texts in UTF-8: in a database
-- of another encoding, a text the conversion does not map back one to one
-- digests apart from the application's (README: upgrading).
CREATE OR REPLACE FUNCTION {{object:claim_id}}(scope text, key text) RETURNS uuid
LANGUAGE sql STABLE STRICT PARALLEL SAFE AS $$
    SELECT encode(substring(sha256(convert_to(
        octet_length(convert_to(scope, 'UTF8'))::text || ':' || scope || key, 'UTF8'))
        FROM 1 FOR 16), 'hex')::uuid
$$;

-- The old keys go first, so that rewriting every row does not maintain
-- them; the new ones are built once, from the rewritten rows.
ALTER TABLE {{table}} ADD COLUMN id uuid;
-- The v1 primary key on (scope, key), whatever it was named.
DO $$
DECLARE
    pkey name;
BEGIN
    SELECT conname INTO pkey FROM pg_constraint
    WHERE conrelid = '{{table}}'::regclass AND contype = 'p';
    IF pkey IS NOT NULL THEN
        EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I', '{{table}}'::regclass, pkey);
    END IF;
END $$;
-- Qualified like the table (an index lives in its table's schema).
DROP INDEX IF EXISTS {{object:expires_at_idx}};
UPDATE {{table}} SET id = {{object:claim_id}}(scope, key);
ALTER TABLE {{table}} ALTER COLUMN id SET NOT NULL;
ALTER TABLE {{table}} ADD PRIMARY KEY (id);
-- Purge finds expired claims through this index (as in v1).
CREATE INDEX {{expires_index}} ON {{table}} (expires_at);

-- The runtime reads its dead-letter records in key order, per partition
-- (`live_ids_from`); only those scopes are kept in that order. The store
-- repeats this predicate in its query, so the planner can use the index.
CREATE INDEX {{index:ordered_idx}} ON {{table}} (scope, key)
    WHERE scope LIKE 'dedup.dead-letter/%';
