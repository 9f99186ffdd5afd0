DROP TABLE IF EXISTS orderdelay_close_outbox;
