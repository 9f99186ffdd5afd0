package consumer

import (
	"time"

	"go.uber.org/zap"
)

// readyFullRetry is how long the scanner of a list queue waits before it
// looks again at a ready list that was full (Forward.MaxLen) while tasks
// were due: consumers must drain it first, and looking sooner would spin.
const readyFullRetry = time.Second

// readyFull notes whether the ready list was full while tasks were due,
// in orderdelay_task_ready_full{queue} and the log. The first full pass logs a warning (the tasks wait, due, in the queue:
// consumers are behind) and the first pass after it an info line; while
// full, the scanner's next look is readyFullRetry away rather than at the
// overdue head, which would have it loop without pause.
func (c *Consumer) readyFull(res *claimResult, full bool) {
	if full {
		if !c.listFull {
			c.log.Warn("ready list full: due tasks wait in the queue until consumers drain it",
				zap.Int64("max_len", c.cfg.Forward.MaxLen))
		}
		c.listFull = true
		c.m.ReadyFull.Set(1)
		res.nextQueue = res.now + readyFullRetry.Milliseconds()
		return
	}
	if c.listFull {
		// Room again, or nothing due any more (another replica moved it).
		c.log.Info("ready list drained below max_len: due tasks move again", zap.Int("forwarded", res.forwarded))
		c.listFull = false
		c.m.ReadyFull.Set(0)
	}
}
