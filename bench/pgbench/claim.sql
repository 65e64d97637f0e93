-- The store's claim_many statement, as PgStore sends it (schema v2): the
-- key is a 16-byte digest of scope and key, which PgStore computes and
-- binds; here random UUIDs stand in for it.
INSERT INTO pgb_claims AS c (id, scope, key, claimed_at, expires_at)
SELECT u.id, u.scope, u.key, now(), now() + 14400 * interval '1 second'
FROM unnest(ARRAY(SELECT gen_random_uuid() FROM generate_series(1, 200)),
    array_fill('bench'::text, ARRAY[200]),
    ARRAY(SELECT 'evt-' || gen_random_uuid() FROM generate_series(1, 200))) AS u(id, scope, key)
ORDER BY u.id
ON CONFLICT (id) DO UPDATE SET claimed_at = EXCLUDED.claimed_at, expires_at = EXCLUDED.expires_at
WHERE c.expires_at <= now()
RETURNING c.id, (c.xmax = 0) AS fresh, (extract(epoch FROM expires_at) * 1000000)::int8 AS expires_us;
