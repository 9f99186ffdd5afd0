-- The reference orders table. Shops with their own table point
-- ORDERDELAY_CLOSE_SQL / _LOOKUP_SQL / _OVERDUE_SQL at it instead.
CREATE TABLE IF NOT EXISTS orders (
    serial_no    text        PRIMARY KEY,
    status       text        NOT NULL DEFAULT 'pending'
                             CHECK (status IN ('pending', 'paid', 'closed')),
    expires_at   timestamptz NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    paid_at      timestamptz,
    closed_at    timestamptz,
    close_reason text,
    closed_by    text
);

-- The reconciler looks for pending orders past their deadline; only pending
-- rows are indexed, so the index stays small however many orders are settled.
CREATE INDEX IF NOT EXISTS orders_pending_expires_at
    ON orders (expires_at) WHERE status = 'pending';
