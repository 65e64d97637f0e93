-- Lease mode: a claim in progress (`in_progress`, `expires_at` the lease's
-- end) held under a fencing token. Tokens come from a one-row counter, so
-- they grow with every lease and are never reused, not even after the
-- purge deletes the claim that held one.
ALTER TABLE {{table}} ADD COLUMN token INTEGER;
ALTER TABLE {{table}} ADD COLUMN in_progress INTEGER NOT NULL DEFAULT 0;
CREATE TABLE IF NOT EXISTS {{object:tokens}} (last INTEGER NOT NULL);
INSERT INTO {{object:tokens}} (last) SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM {{object:tokens}});
