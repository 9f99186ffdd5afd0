package validate

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"sort"
	"strings"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/promqltest"
	"github.com/prometheus/prometheus/rules"
	"sigs.k8s.io/yaml"
)

const (
	prometheusRuleFile = "deploy/components/prometheus-operator/prometheusrule.yaml"
	plainAlertsFile    = "deploy/prometheus/alerts.yml"
	runbookFile        = "docs/operations.md"
)

// requiredAlerts are the conditions the issue asks to page on; each needs a
// rule, a runbook section and a behaviour test below.
var requiredAlerts = []string{
	"OrderdelayOverdueOrders",           // overdue orders above a threshold for N minutes
	"OrderdelayOldestOverdueTooOld",     // oldest overdue age too high
	"OrderdelayDeadLettersGrowing",      // dead letters growing
	"OrderdelayCloseErrors",             // close errors rate
	"OrderdelayPostgresDown",            // PostgreSQL down
	"OrderdelayNoReadyReplica",          // no ready replica
	"OrderdelayScannerStalled",          // last scan too old
	"OrderdelayReclaimsClimbing",        // leases expiring: database too slow
	"OrderdelayReconcilerClosingOrders", // the fast path lost orders
	"OrderdelayPausedTooLong",           // closing paused by an operator and not resumed
	"OrderdelayConfigWarning",           // a start-up check found a risky setup
	"OrderdelayTaskDeadLetters",         // a task queue dead-lettered tasks
	"OrderdelayTaskOverdue",             // a task queue's oldest overdue task too old
}

// prometheusRule decodes the PrometheusRule strictly from its source file.
func prometheusRule(t testing.TB) *monitoringv1.PrometheusRule {
	t.Helper()
	b, err := os.ReadFile(repoPath(prometheusRuleFile))
	if err != nil {
		t.Fatal(err)
	}
	obj, _, err := strictDecoder.Decode(b, nil, nil)
	if err != nil {
		t.Fatalf("%s: %v", prometheusRuleFile, err)
	}
	pr, ok := obj.(*monitoringv1.PrometheusRule)
	if !ok {
		t.Fatalf("%s holds a %T", prometheusRuleFile, obj)
	}
	return pr
}

// allPrometheusRules: the source file plus what each overlay renders (an
// overlay could patch an expression).
func allPrometheusRules(t *testing.T) map[string]*monitoringv1.PrometheusRule {
	out := map[string]*monitoringv1.PrometheusRule{prometheusRuleFile: prometheusRule(t)}
	for _, r := range built(t) {
		for _, o := range r.Objs {
			if pr, ok := o.(*monitoringv1.PrometheusRule); ok {
				out[r.Dir+"/"+pr.Name] = pr
			}
		}
	}
	return out
}

// TestAlertRules: every expression parses and uses only exported metrics,
// labels and label values; every alert has a severity, a summary, a
// description and a runbook_url whose anchor exists in docs/operations.md;
// the required alerts all exist.
func TestAlertRules(t *testing.T) {
	c := newExprChecker(t)
	anchors := markdownAnchors(t, repoPath(runbookFile))
	for where, pr := range allPrometheusRules(t) {
		t.Run(where, func(t *testing.T) {
			seen := map[string]bool{}
			for _, g := range pr.Spec.Groups {
				for _, r := range g.Rules {
					name := r.Alert + r.Record
					for _, err := range c.check(r.Expr.String()) {
						t.Errorf("%s: %v\n    expr: %s", name, err, r.Expr.String())
					}
					if r.Alert == "" {
						continue
					}
					if seen[r.Alert] {
						t.Errorf("alert %s defined twice", r.Alert)
					}
					seen[r.Alert] = true
					if s := r.Labels["severity"]; s != "warning" && s != "critical" {
						t.Errorf("%s: severity %q, want warning or critical", r.Alert, s)
					}
					for _, a := range []string{"summary", "description", "runbook_url"} {
						if r.Annotations[a] == "" {
							t.Errorf("%s: no %s annotation", r.Alert, a)
						}
					}
					url := r.Annotations["runbook_url"]
					_, anchor, ok := strings.Cut(url, "#")
					if !ok || !strings.Contains(url, runbookFile) || !anchors[anchor] {
						t.Errorf("%s: runbook_url %q does not point at a section of %s (add a heading \"%s\")", r.Alert, url, runbookFile, r.Alert)
					}
				}
			}
			for _, a := range requiredAlerts {
				if !seen[a] {
					t.Errorf("required alert %s is missing", a)
				}
			}
		})
	}
}

// plainAlerts renders the PrometheusRule's groups as a Prometheus rules file.
func plainAlerts(t testing.TB) []byte {
	pr := prometheusRule(t)
	body, err := yaml.Marshal(struct {
		Groups []monitoringv1.RuleGroup `json:"groups"`
	}{pr.Spec.Groups})
	if err != nil {
		t.Fatal(err)
	}
	head := "# Generated from " + prometheusRuleFile + " -- do not edit.\n" +
		"# For a Prometheus without the Operator (docker-compose.yml loads it).\n" +
		"# Regenerate: cd deploy/validate && go test -run TestAlertsFileInSync -update\n"
	return append([]byte(head), body...)
}

// TestAlertsFileInSync: deploy/prometheus/alerts.yml is exactly the
// PrometheusRule's groups, so the local stack alerts like production.
func TestAlertsFileInSync(t *testing.T) {
	want := plainAlerts(t)
	path := repoPath(plainAlertsFile)
	if *update {
		if err := os.WriteFile(path, want, 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("wrote %s", plainAlertsFile)
		return
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s differs from %s; regenerate with: go test -run TestAlertsFileInSync -update", plainAlertsFile, prometheusRuleFile)
	}
}

// TestAlertsFileLoadsInPrometheus validates the rules file as Prometheus
// does at load time (rulefmt, strict): unknown fields, bad durations,
// unparsable expressions and broken annotation templates fail.
func TestAlertsFileLoadsInPrometheus(t *testing.T) {
	groups, errs := rulefmt.ParseFile(repoPath(plainAlertsFile), false, model.LegacyValidation, promqlParser, slog.New(slog.DiscardHandler))
	for _, err := range errs {
		t.Error(err)
	}
	if groups == nil || len(groups.Groups) == 0 {
		t.Fatal("no rule groups loaded")
	}
}

// alertCase is a promtool-style unit test: input series (promqltest "load"
// notation, one sample a minute from t=0), an evaluation time, and the
// labels of the alerts expected to be firing then.
type alertCase struct {
	name   string
	alert  string
	series string
	at     time.Duration
	want   []map[string]string // labels besides alertname and the rule's own
}

var alertCases = []alertCase{
	{
		name:  "overdue orders above 1000 for 10 minutes fire once per deployment",
		alert: "OrderdelayOverdueOrders",
		series: `
orderdelay_overdue_orders{namespace="shop",job="orderdelay",pod="a"} 0+200x30
orderdelay_overdue_orders{namespace="shop",job="orderdelay",pod="b"} 0+200x30`,
		at:   17 * time.Minute, // above 1000 from 6m, so firing from 16m
		want: []map[string]string{{"namespace": "shop", "job": "orderdelay"}},
	},
	{
		name:  "overdue orders above 1000 for less than 10 minutes stay pending",
		alert: "OrderdelayOverdueOrders",
		series: `
orderdelay_overdue_orders{namespace="shop",job="orderdelay",pod="a"} 0+200x30`,
		at: 15 * time.Minute,
	},
	{
		name:  "two replicas reporting the same 600 overdue orders do not add up",
		alert: "OrderdelayOverdueOrders",
		series: `
orderdelay_overdue_orders{namespace="shop",job="orderdelay",pod="a"} 600x30
orderdelay_overdue_orders{namespace="shop",job="orderdelay",pod="b"} 600x30`,
		at: 30 * time.Minute,
	},
	{
		name:  "a short spike of overdue orders does not fire",
		alert: "OrderdelayOverdueOrders",
		series: `
orderdelay_overdue_orders{namespace="shop",job="orderdelay",pod="a"} 0 0 5000 5000 5000 0x25`,
		at: 20 * time.Minute,
	},
	{
		name:   "oldest overdue order older than 10 minutes for 5 minutes",
		alert:  "OrderdelayOldestOverdueTooOld",
		series: `orderdelay_oldest_overdue_seconds{namespace="shop",job="orderdelay",pod="a"} 0+60x30`,
		at:     17 * time.Minute,
		want:   []map[string]string{{"namespace": "shop", "job": "orderdelay"}},
	},
	{
		name:   "new dead letters fire with their reason",
		alert:  "OrderdelayDeadLettersGrowing",
		series: `orderdelay_dead_lettered_total{namespace="shop",job="orderdelay",pod="a",reason="malformed"} 0x5 3x10`,
		at:     8 * time.Minute,
		want:   []map[string]string{{"namespace": "shop", "job": "orderdelay", "reason": "malformed"}},
	},
	{
		name:   "a dead-letter count that stopped growing resolves",
		alert:  "OrderdelayDeadLettersGrowing",
		series: `orderdelay_dead_lettered_total{namespace="shop",job="orderdelay",pod="a",reason="malformed"} 0x5 3x30`,
		at:     30 * time.Minute,
	},
	{
		name:   "close errors every few seconds for 10 minutes",
		alert:  "OrderdelayCloseErrors",
		series: `orderdelay_errors_total{namespace="shop",job="orderdelay",pod="a",stage="close"} 0+10x30`,
		at:     15 * time.Minute,
		want:   []map[string]string{{"namespace": "shop", "job": "orderdelay"}},
	},
	{
		name:   "claim errors are not close errors",
		alert:  "OrderdelayCloseErrors",
		series: `orderdelay_errors_total{namespace="shop",job="orderdelay",pod="a",stage="claim"} 0+10x30`,
		at:     15 * time.Minute,
	},
	{
		name:  "one replica cut off from PostgreSQL",
		alert: "OrderdelayPostgresDown",
		series: `
orderdelay_dependency_up{namespace="shop",job="orderdelay",pod="a",dependency="postgres"} 1x3 0x10
orderdelay_dependency_up{namespace="shop",job="orderdelay",pod="b",dependency="postgres"} 1x13
orderdelay_dependency_up{namespace="shop",job="orderdelay",pod="a",dependency="redis"} 1x13`,
		at:   8 * time.Minute,
		want: []map[string]string{{"namespace": "shop", "job": "orderdelay"}},
	},
	{
		name:   "Redis down",
		alert:  "OrderdelayRedisDown",
		series: `orderdelay_dependency_up{namespace="shop",job="orderdelay",pod="a",dependency="redis"} 1x3 0x10`,
		at:     8 * time.Minute,
		want:   []map[string]string{{"namespace": "shop", "job": "orderdelay"}},
	},
	{
		name:  "no available replica per kube-state-metrics: one alert, not two",
		alert: "OrderdelayNoReadyReplica",
		series: `
kube_deployment_status_replicas_available{namespace="shop",deployment="orderdelay"} 2x3 0x10
up{namespace="shop",job="orderdelay",pod="a"} 1x3 0x10`,
		at:   10 * time.Minute,
		want: []map[string]string{{"namespace": "shop"}},
	},
	{
		name:   "no kube-state-metrics and nothing scraped",
		alert:  "OrderdelayNoReadyReplica",
		series: `up{job="prometheus"} 1x13`,
		at:     10 * time.Minute,
		// absent() of a comparison carries no labels.
		want: []map[string]string{{}},
	},
	{
		name:  "replicas available and scraped",
		alert: "OrderdelayNoReadyReplica",
		series: `
kube_deployment_status_replicas_available{namespace="shop",deployment="orderdelay"} 2x13
up{namespace="shop",job="orderdelay",pod="a"} 1x13`,
		at: 10 * time.Minute,
	},
	{
		name:   "scanner stopped completing scans at 5m",
		alert:  "OrderdelayScannerStalled",
		series: `orderdelay_last_scan_timestamp_seconds{namespace="shop",job="orderdelay",pod="a"} 0+60x5 300x15`,
		at:     12 * time.Minute,
		want:   []map[string]string{{"namespace": "shop", "job": "orderdelay"}},
	},
	{
		name:   "scanner completing scans",
		alert:  "OrderdelayScannerStalled",
		series: `orderdelay_last_scan_timestamp_seconds{namespace="shop",job="orderdelay",pod="a"} 0+60x20`,
		at:     15 * time.Minute,
	},
	{
		name:  "5% of claims are re-claims for 15 minutes",
		alert: "OrderdelayReclaimsClimbing",
		series: `
orderdelay_claimed_total{namespace="shop",job="orderdelay",pod="a"} 0+100x40
orderdelay_reclaimed_total{namespace="shop",job="orderdelay",pod="a"} 0+5x40`,
		at:   20 * time.Minute,
		want: []map[string]string{{"namespace": "shop", "job": "orderdelay"}},
	},
	{
		name:  "0.5% re-claims are noise",
		alert: "OrderdelayReclaimsClimbing",
		series: `
orderdelay_claimed_total{namespace="shop",job="orderdelay",pod="a"} 0+1000x40
orderdelay_reclaimed_total{namespace="shop",job="orderdelay",pod="a"} 0+5x40`,
		at: 30 * time.Minute,
	},
	{
		name:   "the reconciler closed orders",
		alert:  "OrderdelayReconcilerClosingOrders",
		series: `orderdelay_orders_reconciled_total{namespace="shop",job="orderdelay",pod="a"} 0x10 1 2 3`,
		at:     13 * time.Minute,
		want:   []map[string]string{{"namespace": "shop", "job": "orderdelay"}},
	},
	{
		name:   "the reconciler found nothing to close",
		alert:  "OrderdelayReconcilerClosingOrders",
		series: `orderdelay_orders_reconciled_total{namespace="shop",job="orderdelay",pod="a"} 0x40`,
		at:     40 * time.Minute,
	},
	{
		name:  "paused for 35 minutes, seen by both replicas: one alert",
		alert: "OrderdelayPausedTooLong",
		series: `
orderdelay_paused{namespace="shop",job="orderdelay",pod="a"} 0x5 1x40
orderdelay_paused{namespace="shop",job="orderdelay",pod="b"} 0x6 1x39`,
		at:   40 * time.Minute, // paused from 6m, so firing from 36m
		want: []map[string]string{{"namespace": "shop", "job": "orderdelay"}},
	},
	{
		name:  "a 20-minute pause that was resumed does not fire",
		alert: "OrderdelayPausedTooLong",
		series: `
orderdelay_paused{namespace="shop",job="orderdelay",pod="a"} 0x5 1x20 0x30`,
		at: 50 * time.Minute,
	},
	{
		name:  "a pause seen by one replica only still fires",
		alert: "OrderdelayPausedTooLong",
		series: `
orderdelay_paused{namespace="shop",job="orderdelay",pod="a"} 1x45
orderdelay_paused{namespace="shop",job="orderdelay",pod="b"} 0x45`,
		at:   40 * time.Minute,
		want: []map[string]string{{"namespace": "shop", "job": "orderdelay"}},
	},
	{
		name:  "start-up warnings fire once per check, not per replica",
		alert: "OrderdelayConfigWarning",
		series: `
orderdelay_config_warning{namespace="shop",job="orderdelay",pod="a",check="redis_eviction"} 1x20
orderdelay_config_warning{namespace="shop",job="orderdelay",pod="b",check="redis_eviction"} 1x20
orderdelay_config_warning{namespace="shop",job="orderdelay",pod="a",check="pending_index"} 1x20
orderdelay_config_warning{namespace="shop",job="orderdelay",pod="a",check="redis_persistence"} 0x20
orderdelay_config_warning{namespace="shop",job="orderdelay",pod="a",check="redis_version"} 0x20
orderdelay_config_warning{namespace="shop",job="orderdelay",pod="a",check="schema_version"} 0x20`,
		at: 15 * time.Minute,
		want: []map[string]string{
			{"namespace": "shop", "job": "orderdelay", "check": "pending_index"},
			{"namespace": "shop", "job": "orderdelay", "check": "redis_eviction"},
		},
	},
	{
		name:  "a warning cleared by a fix and a restart resolves",
		alert: "OrderdelayConfigWarning",
		series: `
orderdelay_config_warning{namespace="shop",job="orderdelay",pod="a",check="redis_persistence"} 1x20 _x2
orderdelay_config_warning{namespace="shop",job="orderdelay",pod="c",check="redis_persistence"} _x22 0x10`,
		at: 30 * time.Minute,
	},
	{
		name:  "a warning younger than 10 minutes stays pending",
		alert: "OrderdelayConfigWarning",
		series: `
orderdelay_config_warning{namespace="shop",job="orderdelay",pod="a",check="schema_version"} 0x5 1x10`,
		at: 12 * time.Minute,
	},
	{
		name:  "task dead letters fire per queue and reason",
		alert: "OrderdelayTaskDeadLetters",
		series: `
orderdelay_task_dead_lettered_total{namespace="shop",job="orderdelay",pod="a",queue="callrecord",reason="failed"} 0x5 2x10
orderdelay_task_dead_lettered_total{namespace="shop",job="orderdelay",pod="b",queue="callrecord",reason="failed"} 0x5 1x10
orderdelay_task_dead_lettered_total{namespace="shop",job="orderdelay",pod="a",queue="jobs",reason="failed"} 0x15`,
		at:   8 * time.Minute,
		want: []map[string]string{{"namespace": "shop", "job": "orderdelay", "queue": "callrecord", "reason": "failed"}},
	},
	{
		name:   "task dead letters that stopped growing resolve",
		alert:  "OrderdelayTaskDeadLetters",
		series: `orderdelay_task_dead_lettered_total{namespace="shop",job="orderdelay",pod="a",queue="callrecord",reason="failed"} 0x5 3x30`,
		at:     30 * time.Minute,
	},
	{
		name:  "a task 15 minutes overdue for 10 minutes fires for its queue, once for two replicas",
		alert: "OrderdelayTaskOverdue",
		series: `
orderdelay_task_queue_oldest_overdue_seconds{namespace="shop",job="orderdelay",pod="a",queue="jobs"} 0+60x40
orderdelay_task_queue_oldest_overdue_seconds{namespace="shop",job="orderdelay",pod="b",queue="jobs"} 0+60x40
orderdelay_task_queue_oldest_overdue_seconds{namespace="shop",job="orderdelay",pod="a",queue="events"} 0x40`,
		at:   27 * time.Minute, // above 900 s from 16m, so firing from 26m
		want: []map[string]string{{"namespace": "shop", "job": "orderdelay", "queue": "jobs"}},
	},
	{
		name:   "a task overdue for a while, then done, stays quiet",
		alert:  "OrderdelayTaskOverdue",
		series: `orderdelay_task_queue_oldest_overdue_seconds{namespace="shop",job="orderdelay",pod="a",queue="jobs"} 0+60x20 0x20`,
		at:     30 * time.Minute, // above 900 s only from 16m to 20m
	},
}

// TestAlertRuleBehaviour evaluates each alert, as Prometheus's rule manager
// does (the rules package on the PromQL engine, one evaluation a minute), on
// the series above and compares the firing alerts. Every alert needs at
// least one case that fires it.
func TestAlertRuleBehaviour(t *testing.T) {
	byName := map[string]monitoringv1.Rule{}
	for _, g := range prometheusRule(t).Spec.Groups {
		for _, r := range g.Rules {
			if r.Alert != "" {
				byName[r.Alert] = r
			}
		}
	}
	fired := map[string]bool{}
	for _, tc := range alertCases {
		t.Run(tc.name, func(t *testing.T) {
			rule, ok := byName[tc.alert]
			if !ok {
				t.Fatalf("no alert %s", tc.alert)
			}
			got := evalAlert(t, rule, tc.series, tc.at)
			var want []string
			for _, w := range tc.want {
				l := labels.NewBuilder(labels.FromMap(w))
				l.Set(labels.AlertName, tc.alert)
				for k, v := range rule.Labels {
					l.Set(k, v)
				}
				want = append(want, l.Labels().String())
			}
			sort.Strings(want)
			if strings.Join(got, "\n") != strings.Join(want, "\n") {
				t.Errorf("at %v firing:\n  %s\nwant:\n  %s", tc.at, strings.Join(got, "\n  "), strings.Join(want, "\n  "))
			}
			if len(tc.want) > 0 && len(got) > 0 {
				fired[tc.alert] = true
			}
		})
	}
	for name := range byName {
		if !fired[name] {
			t.Errorf("alert %s has no case above that fires it", name)
		}
	}
}

// evalAlert loads the series, evaluates the rule every minute from 0 to at,
// and returns the label sets of the alerts firing at `at`.
func evalAlert(t *testing.T, r monitoringv1.Rule, series string, at time.Duration) []string {
	t.Helper()
	storage := promqltest.LoadedStorage(t, "load 1m\n"+indent(series))
	engine := promqltest.NewTestEngine(t, false, 0, 1_000_000)
	expr, err := promqlParser.ParseExpr(r.Expr.String())
	if err != nil {
		t.Fatal(err)
	}
	var hold, keep time.Duration
	if r.For != nil {
		d, err := model.ParseDuration(string(*r.For))
		if err != nil {
			t.Fatal(err)
		}
		hold = time.Duration(d)
	}
	if r.KeepFiringFor != nil {
		d, err := model.ParseDuration(string(*r.KeepFiringFor))
		if err != nil {
			t.Fatal(err)
		}
		keep = time.Duration(d)
	}
	rule := rules.NewAlertingRule(r.Alert, expr, hold, keep,
		labels.FromMap(r.Labels), labels.FromMap(r.Annotations), labels.EmptyLabels(),
		"", true, slog.New(slog.DiscardHandler))
	query := rules.EngineQueryFunc(engine, storage)
	start := time.Unix(0, 0).UTC()
	for ts := time.Duration(0); ts <= at; ts += time.Minute {
		if _, err := rule.Eval(context.Background(), 0, start.Add(ts), query, nil, 0); err != nil {
			t.Fatalf("eval at %v: %v", ts, err)
		}
	}
	var got []string
	for _, a := range rule.ActiveAlerts() {
		if a.State != rules.StateFiring {
			continue
		}
		got = append(got, a.Labels.String())
		a.Annotations.Range(func(l labels.Label) {
			if strings.Contains(l.Value, "error expanding") || strings.Contains(l.Value, "<no value>") {
				t.Errorf("annotation %s does not render: %s", l.Name, l.Value)
			}
		})
	}
	sort.Strings(got)
	return got
}

func indent(s string) string {
	var b strings.Builder
	for _, line := range strings.Split(strings.TrimSpace(s), "\n") {
		fmt.Fprintf(&b, "  %s\n", strings.TrimSpace(line))
	}
	return b.String()
}
