package lifecycle

import (
	"context"
	"math/rand/v2"
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

// Jitter spreads d uniformly over d ± d/n (n 0: d itself), so the loops of
// several replicas do not run in step.
func Jitter(d time.Duration, n int64) time.Duration {
	if n <= 0 || d <= 0 {
		return d
	}
	k := time.Duration(n)
	return d - d/k + rand.N(2*d/k+1)
}
