-- The claim_many statement of schema v1: the primary key was (scope, key).
INSERT INTO pgb_claims_v1 AS c (scope, key, claimed_at, expires_at)
SELECT u.scope, u.key, now(), now() + 14400 * interval '1 second'
FROM unnest(array_fill('bench'::text, ARRAY[200]), ARRAY(SELECT 'evt-' || gen_random_uuid() FROM generate_series(1, 200))) AS u(scope, key)
ORDER BY u.scope, u.key
ON CONFLICT (scope, key) DO UPDATE SET claimed_at = EXCLUDED.claimed_at, expires_at = EXCLUDED.expires_at
WHERE c.expires_at <= now()
RETURNING c.scope, c.key, (c.xmax = 0) AS fresh, (extract(epoch FROM expires_at) * 1000000)::int8 AS expires_us;
