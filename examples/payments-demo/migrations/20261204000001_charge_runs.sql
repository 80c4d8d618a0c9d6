-- How many times the charge handler ran for the charge's record id: 1, unless a request
-- reached it again for a key already charged (a record past its retention, or a second
-- execution the idempotency layer should have stopped). The fault campaign checks it: a
-- second run shows here even when its answer never reached a client.
ALTER TABLE charges ADD COLUMN IF NOT EXISTS runs integer NOT NULL DEFAULT 1;
