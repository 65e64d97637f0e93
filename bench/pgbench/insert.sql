-- A plain INSERT into the v1 claims table: no conflict handling at all.
INSERT INTO pgb_claims_v1
SELECT 'bench', k, now(), now() + 14400 * interval '1 second'
FROM unnest(ARRAY(SELECT 'evt-' || gen_random_uuid() FROM generate_series(1, 200))) AS k;
