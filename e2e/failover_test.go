package e2e

// A real PostgreSQL failover (issue 11, "What to build" item 4): a private
// primary and a streaming standby, the daemon behind a front proxy standing
// in for a Kubernetes Service. See docs/reliability.md.

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"

	"github.com/orderdelay/orderdelay/internal/testenv"
)

// logProblems returns the daemon's warn and error log lines, grouped by
// message and error, most frequent first.
func logProblems(out string) []string {
	counts := map[string]int{}
	for line := range strings.SplitSeq(out, "\n") {
		var rec struct {
			Level, Msg, Error, Reason string
		}
		if json.Unmarshal([]byte(line), &rec) != nil || (rec.Level != "warn" && rec.Level != "error") {
			continue
		}
		key := rec.Level + ": " + rec.Msg
		if rec.Reason != "" {
			key += " (reason " + rec.Reason + ")"
		}
		if rec.Error != "" {
			key += ": " + rec.Error
		}
		counts[key]++
	}
	keys := make([]string, 0, len(counts))
	for k := range counts {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return counts[keys[i]] > counts[keys[j]] })
	lines := make([]string, len(keys))
	for i, k := range keys {
		lines[i] = fmt.Sprintf("%5d × %s", counts[k], k)
	}
	return lines
}

// TestFailoverPostgresPromoteStandby fails the database over under load:
// two replicas close orders falling due over 8 s on a primary whose standby
// is cut off, so closes the primary acknowledges (and the daemon removes
// from the queue) never reach the standby. Then the primary dies, the
// standby is promoted and the front proxy repointed. No order may be
// dead-lettered by the failover; every due unpaid order ends closed on the
// new primary, none early, no paid one; and the lost closes, pending again
// and nowhere in Redis, are the reconciler's to close.
//
// Two orders of events: the Service follows the new primary once it is
// promoted, or it is repointed first, so the daemons meet the standby while
// it is still read-only (SQLSTATE 25006) until the promotion.
func TestFailoverPostgresPromoteStandby(t *testing.T) {
	// Private servers of its own, one pair per subtest: both orders of
	// events run at once, in parallel with the other end-to-end tests.
	t.Parallel()
	together(t,
		subtest{"promote_then_repoint", func(t *testing.T) { testFailover(t, false) }},
		subtest{"repoint_then_promote", func(t *testing.T) { testFailover(t, true) }})
}

func testFailover(t *testing.T, readOnlyFirst bool) {
	pair := testenv.PrivatePostgresPair(t)
	rdb, keys := testenv.Redis(t)
	primary, err := sqlx.Open("postgres", pair.URL(pair.PrimaryAddr))
	if err != nil {
		t.Fatal(err)
	}
	defer primary.Close()
	w := &world{t: t, rdb: rdb, redisURL: testenv.RedisURL(), keys: keys, db: primary, dbURL: pair.URL(pair.Front.Addr())}
	settings := []string{"ORDERDELAY_BATCH_SIZE=50", "ORDERDELAY_LEASE=2s", "ORDERDELAY_STATEMENT_TIMEOUT=1s",
		"ORDERDELAY_DRAIN_TIMEOUT=1s", "ORDERDELAY_RECONCILE_INTERVAL=1s", "ORDERDELAY_RECONCILE_GRACE=3s",
		"ORDERDELAY_BACKOFF_MAX=2s"}
	ds := []*daemon{w.start(settings...), w.start(settings...)}

	const n = 1500
	const span = 8 * time.Second
	began := time.Now()
	start := began.Add(time.Second)
	serials := w.spread("fo", n, start, span)
	var paid []string
	for i := 0; i < n; i += 10 {
		paid = append(paid, serials[i])
	}
	w.pay(paid)
	unpaid := n - len(paid)

	// The standby keeps up until a fifth is closed, then is cut off: what
	// the primary closes from now on exists only there.
	waitFor(t, "a fifth of the orders closed", 30*time.Second, func() bool { return w.closed() >= unpaid/5 })
	pair.CutReplication()
	atCut := w.closed()
	waitFor(t, "closes on the cut-off primary", 30*time.Second, func() bool { return w.closed() >= atCut+100 })
	stopped := time.Now()
	pair.StopPrimary()
	var inherited map[string]bool
	var readOnlyErrors float64
	if readOnlyFirst {
		// What the standby has of the old primary's closes, read while the
		// daemons cannot write to it.
		inherited = closedSerials(t, pair.URL(pair.StandbyAddr))
		pair.Repoint()
		before := sum(`orderdelay_errors_total{stage="close"}`, ds...)
		waitFor(t, "closes refused by the read-only standby", 30*time.Second, func() bool {
			return sum(`orderdelay_errors_total{stage="close"}`, ds...) >= before+4
		})
		readOnlyErrors = sum(`orderdelay_errors_total{stage="close"}`, ds...) - before
	}
	// Until the daemons can write to the new primary, which orders can
	// the fast path still close? A lost close that is not among them can
	// only be the reconciler's.
	var queued map[string]bool
	if readOnlyFirst {
		queued = w.inRedis()
	}
	if err := pair.Promote(30 * time.Second); err != nil {
		t.Fatalf("promote the standby: %v", err)
	}
	promoted := time.Now()
	if !readOnlyFirst {
		// Read the new primary before the daemons can reach it.
		inherited = closedSerials(t, pair.URL(pair.StandbyAddr))
		queued = w.inRedis()
		pair.Repoint()
	}
	newPrimary, err := sqlx.Open("postgres", pair.URL(pair.StandbyAddr))
	if err != nil {
		t.Fatal(err)
	}
	defer newPrimary.Close()
	w.db = newPrimary

	// What the old primary had acknowledged, read after its crash
	// recovery: its closes the standby never got are lost.
	old := closedSerials(t, pair.RestartOldPrimary(t))
	var lost, lostUnqueued []string
	for s := range old {
		if inherited[s] {
			continue
		}
		lost = append(lost, s)
		if !queued[s] {
			lostUnqueued = append(lostUnqueued, s)
		}
	}
	for s := range inherited {
		if !old[s] {
			t.Errorf("order %s is closed on the promoted standby but not on the old primary", s)
		}
	}
	if len(lost) == 0 {
		t.Fatalf("the old primary closed %d orders, the standby had all of them: the failover lost no close and this test proved nothing",
			len(old))
	}

	waitFor(t, "every unpaid order closed on the new primary", 60*time.Second, func() bool {
		return w.count("SELECT count(*) FROM orders WHERE status = 'pending'") == 0
	})
	allClosed := time.Since(promoted)
	waitFor(t, "the queue empty", 30*time.Second, func() bool { return w.queueLen() == 0 })

	w.checkInvariants()
	if got := w.closed(); got != unpaid {
		t.Errorf("%d orders closed on the new primary, want the %d unpaid", got, unpaid)
	}
	if n := w.count("SELECT count(*) FROM orders WHERE serial_no = ANY($1) AND status <> 'closed'", pq.Array(lost)); n != 0 {
		t.Errorf("%d of the %d closes lost by the failover are not closed again", n, len(lost))
	}
	ctx := context.Background()
	dead, err := rdb.ZCard(ctx, keys.Dead).Result()
	if err != nil {
		t.Fatal(err)
	}
	if dead != 0 {
		info, _ := rdb.HGetAll(ctx, keys.DeadInfo).Result()
		reasons := map[string]int{}
		for _, v := range info {
			f := strings.SplitN(v, "|", 4)
			reasons[f[0]+": "+f[len(f)-1]]++
		}
		t.Errorf("%d orders dead-lettered by the failover, want 0; reasons: %v", dead, reasons)
	}
	reconciled := sum("orderdelay_orders_reconciled_total", ds...)
	if reconciled == 0 {
		t.Errorf("orderdelay_orders_reconciled_total is 0: the %d closes lost by the failover were not found by the reconciler", len(lost))
	}
	if int(reconciled) < len(lostUnqueued) {
		t.Errorf("the reconciler closed %v orders, want at least the %d lost closes that had left the queue", reconciled, len(lostUnqueued))
	}

	t.Logf("%d orders (%d paid) due over %s; standby cut off with %d closed, primary stopped %s later with %d closed",
		n, len(paid), span, atCut, stopped.Sub(began).Round(time.Millisecond), len(old))
	t.Logf("orders at risk (closed on the old primary, never replicated): %d, of which %d had left the queue; promoted %s after the stop",
		len(lost), len(lostUnqueued), promoted.Sub(stopped).Round(time.Millisecond))
	if readOnlyFirst {
		t.Logf("the daemons met the read-only standby: %v close errors before the promotion", readOnlyErrors)
	}
	t.Logf("after promotion: all %d unpaid orders closed in %s; fast path closed %v, reconciler %v; dead letters %d; close errors %v, re-claims %v, settled skips %v",
		unpaid, allClosed.Round(time.Millisecond), sum("orderdelay_orders_closed_total", ds...), reconciled, dead,
		sum(`orderdelay_errors_total{stage="close"}`, ds...), sum("orderdelay_reclaimed_total", ds...),
		sum(`orderdelay_orders_skipped_total{reason="settled"}`, ds...))
	for i, d := range ds {
		if p := logProblems(d.Output()); len(p) > 0 {
			t.Logf("replica %d warnings and errors:\n%s", i, strings.Join(p[:min(len(p), 15)], "\n"))
		}
	}
	for _, d := range ds {
		d.stopCleanly()
	}
}
