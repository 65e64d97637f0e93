-- The same upsert with a 16-byte digest of scope and key as primary key.
INSERT INTO pgb_claims_uuid AS c (id, scope, key, claimed_at, expires_at)
SELECT md5(u.scope || chr(31) || u.key)::uuid, u.scope, u.key, now(), now() + 14400 * interval '1 second'
FROM unnest(array_fill('bench'::text, ARRAY[200]), ARRAY(SELECT 'evt-' || gen_random_uuid() FROM generate_series(1, 200))) AS u(scope, key)
ON CONFLICT (id) DO UPDATE SET claimed_at = EXCLUDED.claimed_at, expires_at = EXCLUDED.expires_at
WHERE c.expires_at <= now()
RETURNING c.key, (c.xmax = 0) AS fresh;
