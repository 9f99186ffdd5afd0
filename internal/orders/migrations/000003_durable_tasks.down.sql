DROP TABLE IF EXISTS orderdelay_task_log;
DROP TABLE IF EXISTS orderdelay_tasks;
