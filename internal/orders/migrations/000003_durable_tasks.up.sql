-- Durable task queues (queues file: durable: true): PostgreSQL is the source
-- of truth; Redis holds only the tasks due within the queue's window.
CREATE TABLE IF NOT EXISTS orderdelay_tasks (
    queue      text        NOT NULL,
    id         text        NOT NULL,
    due_at     timestamptz NOT NULL,
    payload    jsonb       NOT NULL DEFAULT 'null',
    state      text        NOT NULL DEFAULT 'SCHEDULED'
                           CHECK (state IN ('SCHEDULED', 'EXECUTED', 'CANCELLED', 'FAILED')),
    attempts   integer     NOT NULL DEFAULT 0,
    version    bigint      NOT NULL DEFAULT 1,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue, id)
);

-- The loader reads scheduled tasks by due time, per queue.
CREATE INDEX IF NOT EXISTS orderdelay_tasks_scheduled
    ON orderdelay_tasks (queue, due_at) WHERE state = 'SCHEDULED';

-- Every state change of a durable task, for audits.
CREATE TABLE IF NOT EXISTS orderdelay_task_log (
    id      bigserial   PRIMARY KEY,
    queue   text        NOT NULL,
    task_id text        NOT NULL,
    state   text        NOT NULL,
    version bigint      NOT NULL,
    detail  text,
    at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS orderdelay_task_log_task ON orderdelay_task_log (queue, task_id);
