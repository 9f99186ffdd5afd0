package worker

import "github.com/prometheus/client_golang/prometheus"

// metrics are a Worker's Prometheus collectors, labelled by queue (the
// names a program registers, so the label is bounded).
type metrics struct {
	processed, failed, retried, dead, lost, handedBack *prometheus.CounterVec
	inFlight                                           *prometheus.GaugeVec
	duration                                           *prometheus.HistogramVec
}

func newMetrics() *metrics {
	c := func(name, help string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, []string{"queue"})
	}
	return &metrics{
		processed: c("orderdelay_worker_processed_total", "Tasks whose handler returned nil, by queue."),
		failed:    c("orderdelay_worker_failed_total", "Handler runs that returned an error or panicked, by queue."),
		retried:   c("orderdelay_worker_retried_total", "Failed tasks scheduled for another attempt, by queue."),
		dead:      c("orderdelay_worker_dead_lettered_total", "Failed tasks dead-lettered (out of attempts, or SkipRetry), by queue."),
		lost: c("orderdelay_worker_leases_lost_total",
			"Tasks whose lease this worker lost while holding them (another claim or a producer took them), by queue."),
		handedBack: c("orderdelay_worker_handed_back_total", "Tasks handed back at shutdown (claimed but unstarted, or cut short by the timeout), by queue."),
		inFlight: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "orderdelay_worker_in_flight",
			Help: "Handlers running now, by queue."}, []string{"queue"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "orderdelay_worker_handler_duration_seconds",
			Help:    "Time handlers ran, by queue.",
			Buckets: prometheus.ExponentialBuckets(0.005, 4, 10)}, []string{"queue"}),
	}
}

func (m *metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.processed, m.failed, m.retried, m.dead, m.lost, m.handedBack, m.inFlight, m.duration}
}

// init creates queue's series at zero, so they exist from the first scrape.
func (m *metrics) init(queue string) {
	for _, v := range []*prometheus.CounterVec{m.processed, m.failed, m.retried, m.dead, m.lost, m.handedBack} {
		v.WithLabelValues(queue)
	}
	m.inFlight.WithLabelValues(queue)
	m.duration.WithLabelValues(queue)
}
