package validate

import (
	"strings"
	"testing"
)

// TestExprCheckerRefusesWhatTheDaemonDoesNotExport: the checker the
// dashboard and alert tests rely on fails a query that names a metric the
// daemon does not export, a label it does not set, or sums a gauge read
// from Redis — so a panel or an alert on a misspelt or removed metric
// cannot pass.
func TestExprCheckerRefusesWhatTheDaemonDoesNotExport(t *testing.T) {
	c := newExprChecker(t)
	for _, tc := range []struct {
		expr, want string // want: part of the error, "" for none
	}{
		{`max by (queue) (orderdelay_task_queue_depth{queue=~"jobs"})`, ""},
		{`histogram_quantile(0.99, sum by (queue, le) (rate(orderdelay_task_lateness_seconds_bucket[5m])))`, ""},
		{`sum by (queue, reason) (increase(orderdelay_task_dead_lettered_total{reason="failed"}[15m]))`, ""},
		{`max(orderdelay_task_queue_depht)`, "not exported"},
		{`max(orderdelay_task_queue_overdue_tasks)`, "not exported"},
		{`rate(orderdelay_task_lateness_seconds[5m])`, "is a histogram"},
		{`sum(orderdelay_task_queue_depth)`, "aggregate it with max()"},
		{`sum(orderdelay_task_dead_lettered_total{reason="timeout"})`, "only sets"},
		{`max(orderdelay_queue_depth{queue="jobs"})`, `no label "queue"`},
	} {
		errs := c.check(tc.expr)
		var got []string
		for _, err := range errs {
			got = append(got, err.Error())
		}
		all := strings.Join(got, "; ")
		switch {
		case tc.want == "" && len(errs) > 0:
			t.Errorf("%s: %s, want no error", tc.expr, all)
		case tc.want != "" && !strings.Contains(all, tc.want):
			t.Errorf("%s: errors %q, want one containing %q", tc.expr, all, tc.want)
		}
	}
}

// TestTaskFamiliesHaveKnownLabels: every family a queues file adds
// (testdata/task_metrics.txt) is labelled by queue in metricLabels, so
// the checker knows its labels.
func TestTaskFamiliesHaveKnownLabels(t *testing.T) {
	for f := range readList(t, repoPath("testdata", "task_metrics.txt")) {
		if _, ok := metricLabels[f]["queue"]; !ok {
			t.Errorf("%s: no queue label in metricLabels (common_test.go)", f)
		}
	}
}
