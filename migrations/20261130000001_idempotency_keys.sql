-- The key table of the idempotency framework: one row per (scope, key), keyed by the record id
-- SHA-256(scope, 0x00, key). The primary key is the unique constraint that decides every race.
--
-- A row is live while expires_at > now(): for an in-flight row expires_at is the lease expiry,
-- for a completed row the end of its retention. A row past expires_at behaves as absent and is
-- taken over by the next begin, or deleted by the purge.
CREATE TABLE IF NOT EXISTS idempotency_keys (
    record_id    bytea       PRIMARY KEY CHECK (octet_length(record_id) = 32),
    fingerprint  bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    -- 0 = in flight, 1 = completed
    state        smallint    NOT NULL CHECK (state IN (0, 1)),
    lease_token  uuid        NOT NULL,
    -- The outcome, set on completion: its status (for queries) and the versioned encoding of
    -- status, headers and body that replays decode.
    status       smallint,
    response     bytea,
    created_at   timestamptz NOT NULL DEFAULT now(),
    completed_at timestamptz,
    expires_at   timestamptz NOT NULL,
    CHECK (state = 0 OR (status IS NOT NULL AND response IS NOT NULL AND completed_at IS NOT NULL))
);

-- The purge scans by expiry.
CREATE INDEX IF NOT EXISTS idempotency_keys_expires_at ON idempotency_keys (expires_at);
