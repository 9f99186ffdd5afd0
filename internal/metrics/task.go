package metrics

import "github.com/prometheus/client_golang/prometheus"

// Task queues (named queues from the queues file) have metric families of
// their own, labelled by queue name (bounded: names come from the file), so
// the order queue's metric names stay exactly as they are.

// TaskFamilies are the task-queue metric families, registered once.
type TaskFamilies struct {
	enqueued, claimed, reclaimed, done, forwarded *prometheus.CounterVec
	deadLettered, errors                          *prometheus.CounterVec
	lateness                                      *prometheus.HistogramVec
	inflight, lastScan, paused, readyFull         *prometheus.GaugeVec
	shared                                        *Metrics
}

// TaskDeadReasons label orderdelay_task_dead_lettered_total.
var TaskDeadReasons = []string{"malformed", "score_out_of_range", "failed"}

// NewTaskFamilies registers the task families on reg. shared supplies the
// series that are not per queue (dependency_up, config warnings).
func NewTaskFamilies(reg prometheus.Registerer, shared *Metrics) *TaskFamilies {
	c := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, append([]string{"queue"}, labels...))
	}
	g := func(name, help string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help}, []string{"queue"})
	}
	f := &TaskFamilies{
		enqueued:     c("orderdelay_task_enqueued_total", "Tasks added through this daemon's API or CLI, by queue."),
		claimed:      c("orderdelay_task_claimed_total", "Tasks claimed because they became due, by queue."),
		reclaimed:    c("orderdelay_task_reclaimed_total", "Claims of tasks whose earlier lease expired, by queue."),
		done:         c("orderdelay_task_done_total", "Tasks whose action succeeded, by queue."),
		forwarded:    c("orderdelay_task_forwarded_total", "Due tasks moved into the queue's stream or list, by queue."),
		deadLettered: c("orderdelay_task_dead_lettered_total", "Tasks moved to the dead-letter set, by queue and reason.", "reason"),
		errors:       c("orderdelay_task_errors_total", "Errors, by queue and stage.", "stage"),
		lateness: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "orderdelay_task_lateness_seconds",
			Help:    "Time from a task's due time to its action's success (or its forwarding), by queue.",
			Buckets: []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 1800, 3600, 7200},
		}, []string{"queue"}),
		inflight: g("orderdelay_task_inflight", "Tasks this replica holds under a lease, by queue."),
		lastScan: g("orderdelay_task_last_scan_timestamp_seconds", "When this replica last scanned the queue, by queue."),
		paused:   g("orderdelay_task_paused", "1 while the queue is paused, by queue."),
		readyFull: g("orderdelay_task_ready_full",
			"1 while a list queue's ready list holds action.max_len items and due tasks wait in the queue, by queue."),
		shared: shared,
	}
	reg.MustRegister(f.enqueued, f.claimed, f.reclaimed, f.done, f.forwarded, f.deadLettered, f.errors,
		f.lateness, f.inflight, f.lastScan, f.paused, f.readyFull)
	return f
}

// For returns the metrics of one task queue in the shape the consumer and
// producer use, every series created at zero.
func (f *TaskFamilies) For(queue string) *Metrics {
	l := prometheus.Labels{"queue": queue}
	m := &Metrics{
		Enqueued:     f.enqueued.WithLabelValues(queue),
		Claimed:      f.claimed.WithLabelValues(queue),
		Reclaimed:    f.reclaimed.WithLabelValues(queue),
		Closed:       f.done.WithLabelValues(queue),
		Forwarded:    f.forwarded.WithLabelValues(queue),
		Reconciled:   prometheus.NewCounter(prometheus.CounterOpts{Name: "unused"}),
		InDoubt:      prometheus.NewCounter(prometheus.CounterOpts{Name: "unused"}),
		Skipped:      prometheus.NewCounterVec(prometheus.CounterOpts{Name: "unused"}, []string{"reason"}),
		DeadLettered: f.deadLettered.MustCurryWith(l),
		Errors:       f.errors.MustCurryWith(l),
		Lateness:     f.lateness.WithLabelValues(queue),
		Inflight:     f.inflight.WithLabelValues(queue),
		LastScan:     f.lastScan.WithLabelValues(queue),
		DependencyUp: f.shared.DependencyUp,
		Paused:       f.paused.WithLabelValues(queue),
		ReadyFull:    f.readyFull.WithLabelValues(queue),
		// Order-only tools.
		CloseRateLimited: prometheus.NewCounter(prometheus.CounterOpts{Name: "unused"}),
		DryRunWouldClose: prometheus.NewCounter(prometheus.CounterOpts{Name: "unused"}),
		ConfigWarning:    f.shared.ConfigWarning,
	}
	for _, r := range TaskDeadReasons {
		m.DeadLettered.WithLabelValues(r)
	}
	for _, s := range []string{StageClaim, StageClose, StageRemove, StageAPI} {
		m.Errors.WithLabelValues(s)
	}
	return m
}
