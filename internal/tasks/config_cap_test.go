package tasks

import (
	"strings"
	"testing"
)

// max_pending: left out, the default; written, a whole number from 1 to
// MaxPendingLimit, anything else refused naming the setting.
func TestMaxPendingConfig(t *testing.T) {
	t.Parallel()
	file := func(v string) string {
		s := "queues:\n  - name: jobs\n    action: {type: poll}\n"
		if v != "" {
			s += "    max_pending: " + v + "\n"
		}
		return s
	}
	f, err := Parse([]byte(file("")))
	if err != nil || f.Queues[0].MaxPending != DefaultMaxPending {
		t.Fatalf("max_pending left out: %v, %v; want %d", f.Queues[0].MaxPending, err, DefaultMaxPending)
	}
	f, err = Parse([]byte(file("10")))
	if err != nil || f.Queues[0].MaxPending != 10 {
		t.Fatalf("max_pending: 10: %v, %v", f.Queues[0].MaxPending, err)
	}
	for _, bad := range []string{"0", "-1", "lots", "1.5", "1e6", "2000000000", `""`, "[1]", "{a: 1}", "true"} {
		_, err := Parse([]byte(file(bad)))
		if err == nil || !strings.Contains(err.Error(), "max_pending") {
			t.Errorf("max_pending: %s: %v; want an error naming max_pending", bad, err)
		}
	}
}
