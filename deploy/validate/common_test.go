package validate

import (
	"bufio"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
)

var update = flag.Bool("update", false, "rewrite generated files (deploy/prometheus/alerts.yml) instead of failing")

// repoRoot is the daemon's repository, seen from this module's directory
// (go test runs in the package directory).
const repoRoot = "../.."

func repoPath(elem ...string) string {
	return filepath.Join(append([]string{repoRoot}, elem...)...)
}

// settingDefault is the daemon's default for a setting, from
// testdata/defaults.txt (generated from internal/config and kept equal to
// it by TestDefaultsGolden there): this module never writes one again.
func settingDefault(t testing.TB, name string) string {
	t.Helper()
	for line := range readList(t, repoPath("testdata", "defaults.txt")) {
		if v, ok := strings.CutPrefix(line, name+"="); ok {
			return v
		}
	}
	t.Fatalf("testdata/defaults.txt has no %s", name)
	return ""
}

// readList reads a checked-in list: one entry per line, blank lines and
// '#' comments ignored.
func readList(t testing.TB, path string) map[string]bool {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	defer f.Close()
	out := map[string]bool{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		out[line] = true
	}
	if err := sc.Err(); err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	if len(out) == 0 {
		t.Fatalf("%s is empty", path)
	}
	return out
}

// settings are the daemon's environment variables (ORDERDELAY_*), kept in
// sync with its flags by the daemon's own tests.
func settings(t testing.TB) map[string]bool {
	return readList(t, repoPath("testdata", "settings.txt"))
}

// metricFamilies are the families a running daemon exports: the order
// queue's (testdata/metrics.txt) and those a queues file adds
// (testdata/task_metrics.txt). The end-to-end tests (e2e/) scrape /metrics after real
// work (TestIntegration…, TestTaskQueueMetricsThroughTheDaemon) and fail when
// these golden files no longer match.
func metricFamilies(t testing.TB) map[string]bool {
	out := readList(t, repoPath("testdata", "metrics.txt"))
	for f := range readList(t, repoPath("testdata", "task_metrics.txt")) {
		out[f] = true
	}
	return out
}

// secretSettings must come from a Secret, never from a ConfigMap or a
// committed file of the production overlay.
var secretSettings = map[string]bool{
	"ORDERDELAY_REDIS_URL":    true,
	"ORDERDELAY_DATABASE_URL": true,
	"ORDERDELAY_API_TOKEN":    true,
	"ORDERDELAY_ADMIN_TOKEN":  true,
}

// optionalSecrets may be absent: an empty admin token means no admin API.
// The API token is not optional: the pods listen on their IP, where the
// daemon refuses to start without one (protected mode; TestExposure).
var optionalSecrets = map[string]bool{
	"ORDERDELAY_ADMIN_TOKEN": true,
}

// Names the daemon cannot export but the alerts and the dashboard may use.
// Exact names, then prefixes of families from other exporters or of the
// client library's standard collectors (go_*, process_*, and go_sql_* from
// the database/sql pool collector).
var (
	allowedMetricNames    = map[string]bool{"up": true}
	allowedMetricPrefixes = []string{"kube_", "go_", "process_"}
)

// histogramFamilies are classic histograms: they exist only as
// _bucket/_sum/_count series.
var histogramFamilies = map[string]bool{
	"orderdelay_close_lateness_seconds": true,
	"orderdelay_task_lateness_seconds":  true,
}

// redisGauges are read from the shared Redis (or, for the start-up checks,
// from the shared Redis and database) and identical on every replica:
// summing them over replicas multiplies the truth by the replica count.
var redisGauges = map[string]bool{
	"orderdelay_queue_depth":            true,
	"orderdelay_overdue_orders":         true,
	"orderdelay_oldest_overdue_seconds": true,
	"orderdelay_dead_letter_depth":      true,
	"orderdelay_paused":                 true,
	"orderdelay_config_warning":         true,
	// Task queues (internal/consumer.TaskStatsCollector).
	"orderdelay_task_queue_depth":                  true,
	"orderdelay_task_queue_overdue":                true,
	"orderdelay_task_queue_oldest_overdue_seconds": true,
	"orderdelay_task_queue_leased":                 true,
	"orderdelay_task_queue_dead_letters":           true,
}

// metricLabels are the labels each daemon family carries and, where the
// contract fixes them, their values (DESIGN.md, Metrics).
var metricLabels = map[string]map[string][]string{
	"orderdelay_orders_skipped_total":   {"reason": {"settled", "not_found"}},
	"orderdelay_dead_lettered_total":    {"reason": {"malformed", "score_out_of_range", "not_found", "close_failed"}},
	"orderdelay_errors_total":           {"stage": {"claim", "close", "lookup", "remove", "reconcile", "api"}},
	"orderdelay_dependency_up":          {"dependency": {"redis", "postgres"}},
	"orderdelay_build_info":             {"version": nil, "revision": nil, "goversion": nil},
	"orderdelay_close_lateness_seconds": {"le": nil},
	"orderdelay_config_warning":         {"check": {"redis_eviction", "redis_persistence", "redis_version", "schema_version", "pending_index", "redis_permissions"}},
}

// Every task family carries `queue` (names from the queues file, so any
// value); some one more label.
func init() {
	extra := map[string]map[string][]string{
		"orderdelay_task_dead_lettered_total": {"reason": {"malformed", "score_out_of_range", "failed"}},
		"orderdelay_task_errors_total":        {"stage": {"claim", "close", "remove", "api"}},
		"orderdelay_task_lateness_seconds":    {"le": nil},
	}
	for _, f := range []string{
		"orderdelay_task_enqueued_total", "orderdelay_task_claimed_total", "orderdelay_task_reclaimed_total",
		"orderdelay_task_done_total", "orderdelay_task_forwarded_total", "orderdelay_task_dead_lettered_total",
		"orderdelay_task_errors_total", "orderdelay_task_lateness_seconds", "orderdelay_task_inflight",
		"orderdelay_task_last_scan_timestamp_seconds", "orderdelay_task_paused", "orderdelay_task_ready_full",
		"orderdelay_task_queue_depth", "orderdelay_task_queue_overdue", "orderdelay_task_queue_oldest_overdue_seconds",
		"orderdelay_task_queue_leased", "orderdelay_task_queue_dead_letters",
	} {
		l := map[string][]string{"queue": nil}
		for k, v := range extra[f] {
			l[k] = v
		}
		metricLabels[f] = l
	}
}

// targetLabels are attached by Prometheus (static configs, the
// ServiceMonitor's relabelling), not by the daemon.
var targetLabels = map[string]bool{
	"job": true, "instance": true, "namespace": true, "pod": true,
	"service": true, "container": true, "endpoint": true,
}

// promqlParser parses like a default Prometheus server: no experimental
// functions, so a dashboard that needs a feature flag fails here.
var promqlParser = parser.NewParser(parser.Options{})

// exprChecker checks PromQL expressions against the daemon's exports.
type exprChecker struct {
	families map[string]bool
}

func newExprChecker(t testing.TB) *exprChecker {
	return &exprChecker{families: metricFamilies(t)}
}

// family maps a series name to the family that exports it, or reports why
// the name is not exported.
func (c *exprChecker) family(name string) (string, error) {
	if allowedMetricNames[name] {
		return name, nil
	}
	for _, p := range allowedMetricPrefixes {
		if strings.HasPrefix(name, p) {
			return name, nil
		}
	}
	if histogramFamilies[name] {
		return "", fmt.Errorf("%s is a histogram: use %s_bucket, _sum or _count", name, name)
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		base, ok := strings.CutSuffix(name, suffix)
		if ok && histogramFamilies[base] {
			if !c.families[base] {
				return "", fmt.Errorf("histogram %s is not in testdata/metrics.txt nor testdata/task_metrics.txt", base)
			}
			return base, nil
		}
	}
	if !c.families[name] {
		return "", fmt.Errorf("metric %s is not exported by the daemon (testdata/metrics.txt, testdata/task_metrics.txt) nor allow-listed", name)
	}
	return name, nil
}

// check parses expr and returns every problem found: syntax, metric names
// not exported, labels or label values the daemon never sets, and sum()
// over gauges read from Redis.
func (c *exprChecker) check(expr string) []error {
	ast, err := promqlParser.ParseExpr(expr)
	if err != nil {
		return []error{fmt.Errorf("parse: %w", err)}
	}
	var errs []error
	parser.Inspect(ast, func(node parser.Node, _ []parser.Node) error {
		switch n := node.(type) {
		case *parser.VectorSelector:
			errs = append(errs, c.checkSelector(n)...)
		case *parser.AggregateExpr:
			if n.Op != parser.SUM {
				break
			}
			parser.Inspect(n.Expr, func(inner parser.Node, _ []parser.Node) error {
				if vs, ok := inner.(*parser.VectorSelector); ok && redisGauges[selectorName(vs)] {
					errs = append(errs, fmt.Errorf("sum() over %s: it is read from the shared Redis or database and the same on every replica; aggregate it with max()", selectorName(vs)))
				}
				return nil
			})
		}
		return nil
	})
	return errs
}

func selectorName(vs *parser.VectorSelector) string {
	if vs.Name != "" {
		return vs.Name
	}
	for _, m := range vs.LabelMatchers {
		if m.Name == labels.MetricName && m.Type == labels.MatchEqual {
			return m.Value
		}
	}
	return ""
}

func (c *exprChecker) checkSelector(vs *parser.VectorSelector) []error {
	name := selectorName(vs)
	if name == "" {
		return []error{fmt.Errorf("selector %s has no fixed metric name, so it cannot be checked against the daemon's exports", vs)}
	}
	fam, err := c.family(name)
	if err != nil {
		return []error{err}
	}
	if strings.HasPrefix(fam, "go_sql_") {
		return checkDBName(vs)
	}
	if !strings.HasPrefix(fam, "orderdelay_") {
		return nil
	}
	var errs []error
	known := metricLabels[fam]
	for _, m := range vs.LabelMatchers {
		if m.Name == labels.MetricName || targetLabels[m.Name] {
			continue
		}
		values, ok := known[m.Name]
		if !ok {
			errs = append(errs, fmt.Errorf("%s has no label %q", fam, m.Name))
			continue
		}
		if values == nil {
			continue
		}
		switch m.Type {
		case labels.MatchEqual:
			if !contains(values, m.Value) {
				errs = append(errs, fmt.Errorf("%s{%s=%q}: the daemon only sets %s", fam, m.Name, m.Value, strings.Join(values, ", ")))
			}
		case labels.MatchRegexp:
			any := false
			for _, v := range values {
				any = any || m.Matches(v)
			}
			if !any {
				errs = append(errs, fmt.Errorf("%s{%s=~%q} matches none of %s", fam, m.Name, m.Value, strings.Join(values, ", ")))
			}
		}
	}
	return errs
}

// dbNames are the db_name labels of the daemon's two database/sql pools
// (cmd/orderdelay: the order path's own and the shared one).
var dbNames = []string{"orderdelay", "orderdelay_shared"}

// checkDBName: a go_sql_* selector that picks a pool names one the daemon
// has.
func checkDBName(vs *parser.VectorSelector) []error {
	var errs []error
	for _, m := range vs.LabelMatchers {
		if m.Name != "db_name" {
			continue
		}
		any := false
		for _, v := range dbNames {
			any = any || m.Matches(v)
		}
		if !any {
			errs = append(errs, fmt.Errorf("%s{db_name%s%q} matches none of the daemon's pools %s", selectorName(vs), m.Type, m.Value, strings.Join(dbNames, ", ")))
		}
	}
	return errs
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// markdownAnchors returns the GitHub anchors of a Markdown file's headings.
func markdownAnchors(t testing.TB, path string) map[string]bool {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	drop := regexp.MustCompile(`[^\p{L}\p{N}\- _]`)
	out := map[string]bool{}
	inFence := false
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			inFence = !inFence
			continue
		}
		if inFence || !strings.HasPrefix(line, "#") {
			continue
		}
		h := strings.TrimSpace(strings.TrimLeft(line, "#"))
		h = strings.ToLower(drop.ReplaceAllString(h, ""))
		out[strings.ReplaceAll(h, " ", "-")] = true
	}
	return out
}
