package main

import (
	"bytes"
	"strings"
	"testing"
)

// TestBooleanFlagFollowedByAValue: a boolean flag takes no separate value,
// so in "inspect --json false" the "false" was taken for a serial, and the
// command went looking for order "false" (exit 1 after dialling Redis);
// "run --dry-run false" said only that run takes no arguments. A "true" or
// "false" right after a boolean flag is now a usage error (exit 2) that
// says how to write it, before anything is dialled. And "inspect --dead
// SERIAL" ignored --dead; it is a usage error too.
func TestBooleanFlagFollowedByAValue(t *testing.T) {
	for _, c := range []struct {
		args []string
		says string
	}{
		{[]string{"inspect", "--json", "false"}, "--json=false"},
		{[]string{"inspect", "-json", "TRUE"}, "--json=TRUE"},
		{[]string{"run", "--dry-run", "false"}, "--dry-run=false"},
		{[]string{"enqueue", "ORD-1", "--after", "1h", "--reschedule", "true"}, "--reschedule=true"},
		{[]string{"task", "list", "q", "--payload", "false"}, "--payload=false"},
		{[]string{"inspect", "--dead", "ORD-1"}, "--dead"},
	} {
		var stdout, stderr bytes.Buffer
		code := run(t.Context(), c.args, &stdout, &stderr, envOf(unreachable))
		if code != 2 || !strings.Contains(stderr.String(), c.says) {
			t.Errorf("%q: exit %d, stderr:\n%s\nwant exit 2 saying %q", c.args, code, stderr.String(), c.says)
		}
	}
}
