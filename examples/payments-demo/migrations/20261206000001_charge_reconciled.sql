-- How many times the layer's reconcile hook found the charge of a record id left in flight
-- (an attempt that charged and did not store its outcome). The fault campaign checks it: a
-- charge found so with no fault to explain it is an outcome the layer lost, which the hook
-- rebuilt byte for byte and would otherwise hide.
ALTER TABLE charges ADD COLUMN IF NOT EXISTS reconciled integer NOT NULL DEFAULT 0;
