package main

import "runtime/debug"

// The daemon's garbage collector, where GOGC and GOMEMLIMIT do not set it.
//
// The daemon keeps little (a few MB: the batches in flight and the
// clients' buffers) and makes its garbage per order closed, about 750
// bytes (BENCHMARKS.md). Go's default, GOGC=100, collects each time the
// heap doubles from that small base: about 190 collections per million
// orders, which cost more CPU than anything else the daemon does besides
// its network calls (issue 13). GOGC=400 collects a quarter as often for
// about 12 MB more memory (a 1,000,000-order drain peaks at 35 MB instead
// of 23). The soft memory limit bounds what that costs if the daemon ever
// keeps more than usual: near 256 MiB the collector works harder rather
// than let the heap grow to five times what it keeps. The deployment sets
// GOMEMLIMIT to the container's limit, which takes precedence.
const (
	defaultGCPercent   = 400
	defaultMemoryLimit = 256 << 20
)

// gcDefaults applies the daemon's collector settings that the
// environment leaves unset (the runtime has read GOGC and GOMEMLIMIT
// already).
func gcDefaults(getenv func(string) (string, bool)) {
	if v, ok := getenv("GOGC"); !ok || v == "" {
		debug.SetGCPercent(defaultGCPercent)
	}
	if v, ok := getenv("GOMEMLIMIT"); !ok || v == "" {
		debug.SetMemoryLimit(defaultMemoryLimit)
	}
}
