-- Orders move pending -> processing -> shipped -> completed, guarded by a version column
-- (optimistic locking; HTTP If-Match carries the version).
CREATE TABLE IF NOT EXISTS orders (
    id        text   PRIMARY KEY,
    record_id bytea  NOT NULL UNIQUE,
    customer  text   NOT NULL,
    amount    bigint NOT NULL CHECK (amount BETWEEN 1 AND 100000000),
    status    text   NOT NULL,
    version   bigint NOT NULL
);
