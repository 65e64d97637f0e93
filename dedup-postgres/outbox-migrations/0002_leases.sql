-- Leases instead of row locks held by an open transaction: a relay takes a
-- batch with one short UPDATE, publishes with no transaction open, and
-- marks it in another short one. A relay that dies leaves leases that
-- expire (on the database clock), and another relay takes the events over.
ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS lease_id uuid;
ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS leased_until timestamptz;
