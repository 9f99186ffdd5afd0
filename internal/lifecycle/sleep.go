package lifecycle

import (
	"context"
	"time"
)

// Sleep waits d or until ctx ends, whichever is first, and reports whether
// it waited d (false: ctx ended). It is the pause of an actor's loop
// between passes or retries: stopping the run cuts it short.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
