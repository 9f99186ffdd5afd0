package testenv

import (
	"testing"

	"go.uber.org/goleak"
)

// VerifyNoLeaks runs a package's tests (call it from TestMain) and fails
// the run if a goroutine outlives them, but for the pool reapers go-redis
// and lib/pq end asynchronously after their clients close.
func VerifyNoLeaks(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).reaper"),
		goleak.IgnoreTopFunction("database/sql.(*DB).connectionOpener"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
	)
}
