package main

import (
	"math"
	"runtime/debug"
	"testing"
)

// gcSettings returns the collector's settings in force without changing them.
func gcSettings() (int, int64) {
	pct := debug.SetGCPercent(100)
	debug.SetGCPercent(pct)
	return pct, debug.SetMemoryLimit(-1) // a negative limit reads it
}

// The daemon's collector defaults apply only where the environment says
// nothing: GOGC and GOMEMLIMIT, which the runtime read at start, win.
func TestGCDefaultsYieldToTheEnvironment(t *testing.T) {
	pct0, lim0 := gcSettings()
	t.Cleanup(func() { debug.SetGCPercent(pct0); debug.SetMemoryLimit(lim0) })
	for _, c := range []struct {
		name    string
		env     map[string]string
		wantPct int
		wantLim int64
	}{
		{"neither set: the daemon's defaults", nil, defaultGCPercent, defaultMemoryLimit},
		{"GOGC set: it stands, the limit is the daemon's", map[string]string{"GOGC": "100"}, 77, defaultMemoryLimit},
		{"GOMEMLIMIT set: it stands, GOGC is the daemon's", map[string]string{"GOMEMLIMIT": "1GiB"}, defaultGCPercent, 1 << 30},
		{"both set", map[string]string{"GOGC": "off", "GOMEMLIMIT": "1GiB"}, 77, 1 << 30},
	} {
		// What the runtime read from the environment at start: a value
		// gcDefaults must leave as it finds it.
		debug.SetGCPercent(77)
		debug.SetMemoryLimit(1 << 30)
		if _, ok := c.env["GOMEMLIMIT"]; !ok {
			debug.SetMemoryLimit(math.MaxInt64)
		}
		gcDefaults(func(k string) (string, bool) { v, ok := c.env[k]; return v, ok })
		pct, lim := gcSettings()
		if pct != c.wantPct || lim != c.wantLim {
			t.Errorf("%s: GOGC %d, memory limit %d; want %d, %d", c.name, pct, lim, c.wantPct, c.wantLim)
		}
	}
}
