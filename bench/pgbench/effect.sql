-- The benchmark's effect write: 200 rows, one multi-row statement.
INSERT INTO pgb_effects (event_id, account_id, amount_cents)
SELECT * FROM unnest(ARRAY(SELECT 'evt-' || gen_random_uuid() FROM generate_series(1, 200)),
    array_fill('acct-0001'::text, ARRAY[200]), array_fill(100::int8, ARRAY[200]));
