package testenv

import (
	"flag"
	"strconv"
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

// SetDefaultParallel makes n the number of a package's parallel tests that
// run at once (go test's -parallel, whose default is GOMAXPROCS) unless the
// command line set -parallel. Call it from TestMain, before m.Run, in a
// package whose tests mostly wait — on PostgreSQL, on statement timeouts,
// on leases — so that more of them fit than there are cores.
func SetDefaultParallel(n int) {
	if !flag.Parsed() {
		flag.Parse()
	}
	given := false
	flag.Visit(func(f *flag.Flag) { given = given || f.Name == "test.parallel" })
	if !given {
		flag.Set("test.parallel", strconv.Itoa(n)) //nolint:errcheck // registered by the testing package
	}
}
