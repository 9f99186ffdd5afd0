package e2e

import (
	"net/http"
	"os"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestTaskQueueMetricsThroughTheDaemon runs the daemon with two task
// queues, makes one task late, one dead and one waiting, and checks what a
// scrape shows: the per-queue gauges, the lateness of a polled task, every
// task series labelled with a queue of the file, and the task families
// equal to testdata/task_metrics.txt (what deploy/validate checks the
// dashboard and the alerts against; ORDERDELAY_UPDATE_GOLDEN=1 rewrites it).
func TestTaskQueueMetricsThroughTheDaemon(t *testing.T) {
	t.Parallel()
	tw := newTaskWorld(t, `
queues:
  - name: jobs
    key: PREFIX:jobs
    lease: 1s
    action: {type: poll}
    retry: {max_attempts: 1}
  - name: events
    key: PREFIX:events
    action: {type: stream}
`)
	d := tw.start()
	put := func(q, id, body string) {
		t.Helper()
		if code := d.call(http.MethodPut, "/v1/queues/"+q+"/tasks/"+id, "", body, nil); code != http.StatusCreated {
			t.Fatalf("PUT %s/%s: %d", q, id, code)
		}
	}
	past := time.Now().Add(-time.Minute).UTC().Format(time.RFC3339Nano)
	put("jobs", "late-1", `{"at":"`+past+`","payload":{}}`)
	put("events", "later-1", `{"after":"1h","payload":{}}`)

	// A poll leases late-1; its ack observes the lateness (a minute).
	var p struct {
		Token string `json:"token"`
		Tasks []struct {
			ID string `json:"id"`
		} `json:"tasks"`
	}
	waitFor(t, "poll returns late-1", 20*time.Second, func() bool {
		d.call(http.MethodPost, "/v1/queues/jobs/poll?max=10", "", "", &p)
		return len(p.Tasks) == 1
	})
	if m := d.metrics(); m[`orderdelay_task_queue_leased{queue="jobs"}`] != 1 || m[`orderdelay_task_queue_overdue{queue="jobs"}`] != 1 {
		t.Errorf("while leased: leased %v, overdue %v; want 1 and 1 (leased tasks are overdue until done)",
			m[`orderdelay_task_queue_leased{queue="jobs"}`], m[`orderdelay_task_queue_overdue{queue="jobs"}`])
	}
	if code := d.call(http.MethodPost, "/v1/queues/jobs/ack", "", `{"token":"`+p.Token+`","ids":["late-1"]}`, nil); code != http.StatusOK {
		t.Fatalf("ack: %d", code)
	}
	// dead-1 is polled and never acked: with max_attempts 1 the next poll
	// after its 1 s lease dead-letters it.
	put("jobs", "dead-1", `{"at":"`+past+`","payload":{}}`)
	waitFor(t, "dead-1 dead-lettered", 30*time.Second, func() bool {
		d.call(http.MethodPost, "/v1/queues/jobs/poll?max=10", "", "", nil)
		return d.metrics()[`orderdelay_task_queue_dead_letters{queue="jobs"}`] == 1
	})

	m := d.metrics()
	for series, want := range map[string]float64{
		`orderdelay_task_queue_depth{queue="jobs"}`:                  0,
		`orderdelay_task_queue_overdue{queue="jobs"}`:                0,
		`orderdelay_task_queue_oldest_overdue_seconds{queue="jobs"}`: 0,
		`orderdelay_task_queue_leased{queue="jobs"}`:                 0,
		`orderdelay_task_queue_depth{queue="events"}`:                1,
		`orderdelay_task_queue_overdue{queue="events"}`:              0,
		`orderdelay_task_queue_dead_letters{queue="events"}`:         0,
		`orderdelay_task_done_total{queue="jobs"}`:                   1,
		`orderdelay_task_lateness_seconds_count{queue="jobs"}`:       1,
	} {
		if got, ok := m[series]; !ok || got != want {
			t.Errorf("%s = %v (exported: %v), want %v", series, got, ok, want)
		}
	}
	if s := m[`orderdelay_task_lateness_seconds_sum{queue="jobs"}`]; s < 59 {
		t.Errorf("lateness of late-1 %vs, want its minute", s)
	}
	for series := range m {
		if !strings.HasPrefix(series, "orderdelay_task_") || !strings.Contains(series, "{") {
			continue
		}
		if !strings.Contains(series, `queue="jobs"`) && !strings.Contains(series, `queue="events"`) {
			t.Errorf("series %s is not labelled with a queue of the file", series)
		}
	}

	// The task families: everything exported beyond the order queue's.
	order, err := os.ReadFile(repoFile("testdata", "metrics.txt"))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, f := range d.families() {
		if !slices.Contains(strings.Fields(string(order)), f) {
			got = append(got, f)
		}
	}
	checkGolden(t, repoFile("testdata", "task_metrics.txt"), got)
	if code := d.stop(); code != 0 {
		t.Fatalf("exit status %d after SIGTERM, want 0", code)
	}
}
