SELECT count(*) FROM (SELECT 'evt-' || gen_random_uuid() FROM generate_series(1, 200)) s;
