//go:build race

package testenv

// raceEnabled: this test binary is race-instrumented (go test -race), and
// so is the daemon BuildDaemon builds for it.
const raceEnabled = true
