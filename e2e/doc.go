// Package e2e holds the end-to-end tests: the real orderdelay binary,
// built once per test run, driven as a user drives it — its HTTP API, its
// admin API, its CLI, signals — against real Redis and PostgreSQL servers,
// each test with its own database and queue keys (internal/testenv), and
// destructive faults only against private servers or proxies the test owns.
//
// The package has no code of its own; everything is in its test files:
//
//	harness_test.go   the binary, a world (servers, database, queue keys), a
//	                  running daemon (its env, URL and AdminURL), the one
//	                  HTTP helper, metrics scraping, waiting
//	orders_test.go    the orders table: creating and enqueueing orders, the
//	                  audit (closed twice? closed early? paid and closed?),
//	                  and the checkout producer loop
//	*_test.go         the tests, one file per area (integration, faults,
//	                  redis_stall — Redis hanging rather than gone —, ops,
//	                  security, tasks, scale, shards, failover, campaign)
//
// Run them with
//
//	go test -race -count=1 ./e2e/                       # all (about two minutes)
//	go test -race -count=1 -run TestIntegration ./e2e/  # one area
//
// -short skips only the fault campaign (TestCampaignHistoryUnderFaults);
// CI (scripts/test.sh) runs without it.
//
// Every test has its own database, queue keys and private servers, and all
// but one run in parallel: four at a time unless -parallel says otherwise
// (most of their time is spent waiting on deadlines, leases and
// failovers). See defaultParallel in harness_test.go.
package e2e
