package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

// `orderdelay task -h` lists every verb with its arguments (it said
// "task -h needs a queue name and a task id"), and an unknown verb is bad
// usage named before anything connects.
func TestTaskHelpListsEveryVerb(t *testing.T) {
	noEnv := func(string) (string, bool) { return "", false }
	for _, h := range []string{"-h", "--help", "help"} {
		var out, errOut bytes.Buffer
		if code := run(context.Background(), []string{"task", h}, &out, &errOut, noEnv); code != 0 {
			t.Errorf("task %s: exit %d, want 0; stderr %q", h, code, errOut.String())
		}
		for _, verb := range []string{"put", "get", "delete", "list", "dead", "requeue", "purge", "stats", "pause", "resume"} {
			if !strings.Contains(out.String(), "orderdelay task "+verb+" ") && !strings.Contains(out.String(), "task "+verb+" QUEUE") {
				t.Errorf("task %s does not show %q:\n%s", h, verb, out.String())
			}
		}
	}
	var out, errOut bytes.Buffer
	// The Redis URL points nowhere: an unknown verb must be refused before any connection.
	env := func(k string) (string, bool) {
		if k == "ORDERDELAY_REDIS_URL" {
			return "redis://127.0.0.1:1/0", true
		}
		return "", false
	}
	if code := run(context.Background(), []string{"task", "frobnicate", "q", "id"}, &out, &errOut, env); code != 2 ||
		!strings.Contains(errOut.String(), `unknown verb "frobnicate"`) {
		t.Errorf("task frobnicate: exit %d, stderr %q; want 2 naming the verb", code, errOut.String())
	}
}
