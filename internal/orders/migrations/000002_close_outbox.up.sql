-- Close events: when ORDERDELAY_CLOSE_EVENTS is on, every close writes a row
-- here in the same transaction, and a relay moves the rows to the Redis
-- Stream {<queue key>}:events, so a crash between the commit and the XADD
-- cannot lose an event.
CREATE TABLE IF NOT EXISTS orderdelay_close_outbox (
    id        bigserial   PRIMARY KEY,
    serial_no text        NOT NULL,
    reason    text        NOT NULL,
    closed_at timestamptz NOT NULL DEFAULT now()
);
