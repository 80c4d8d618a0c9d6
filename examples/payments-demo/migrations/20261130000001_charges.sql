-- The demo's business table. record_id is the idempotency record id under a unique
-- constraint: even if the process dies between inserting the charge and storing the outcome,
-- the retry that takes the key over finds this row instead of charging again.
CREATE TABLE IF NOT EXISTS charges (
    id         text        PRIMARY KEY,
    record_id  bytea       NOT NULL UNIQUE,
    amount     bigint      NOT NULL CHECK (amount BETWEEN 1 AND 100000000),
    currency   text        NOT NULL CHECK (currency ~ '^[a-z]{3}$'),
    customer   text        NOT NULL,
    status     text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX IF NOT EXISTS charges_customer ON charges (customer, created_at);
