package validate

import (
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
)

const dashboardFile = "deploy/grafana/orderdelay.json"

type dashboard struct {
	Title      string `json:"title"`
	UID        string `json:"uid"`
	Templating struct {
		List []struct {
			Name       string          `json:"name"`
			Type       string          `json:"type"`
			Query      json.RawMessage `json:"query"`
			Datasource *datasourceRef  `json:"datasource"`
		} `json:"list"`
	} `json:"templating"`
	Panels []panel `json:"panels"`
}

type datasourceRef struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

type panel struct {
	ID         int            `json:"id"`
	Type       string         `json:"type"`
	Title      string         `json:"title"`
	Datasource *datasourceRef `json:"datasource"`
	GridPos    struct{ H, W, X, Y int }
	Targets    []struct {
		RefID      string         `json:"refId"`
		Expr       string         `json:"expr"`
		Datasource *datasourceRef `json:"datasource"`
	} `json:"targets"`
	Panels []panel `json:"panels"` // collapsed rows
}

func loadDashboard(t testing.TB) *dashboard {
	t.Helper()
	b, err := os.ReadFile(repoPath(dashboardFile))
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	return &d
}

func (d *dashboard) allPanels() []panel {
	var out []panel
	for _, p := range d.Panels {
		out = append(out, p)
		out = append(out, p.Panels...)
	}
	return out
}

// substituteGrafanaVars replaces Grafana's variables so the Prometheus
// parser sees what Grafana sends: built-in intervals become durations,
// template variables (used inside label matchers) the marker __var_NAME__.
var grafanaVar = regexp.MustCompile(`\$\{([A-Za-z0-9_]+)(?::[^}]*)?\}|\$([A-Za-z0-9_]+)|\[\[([A-Za-z0-9_]+)\]\]`)

func substituteGrafanaVars(expr string) string {
	durations := map[string]string{
		"__rate_interval": "1m", "__interval": "1m", "__range": "1h", "__auto": "1m",
		"__interval_ms": "60000", "__range_s": "3600", "__range_ms": "3600000",
	}
	return grafanaVar.ReplaceAllStringFunc(expr, func(m string) string {
		sub := grafanaVar.FindStringSubmatch(m)
		name := sub[1] + sub[2] + sub[3]
		if d, ok := durations[name]; ok {
			return d
		}
		return "__var_" + name + "__"
	})
}

// TestDashboard: the dashboard is valid JSON with a datasource template
// variable that every panel uses; every query parses after Grafana's
// variables are substituted, uses only exported metrics and label values,
// never sums a gauge read from Redis, and filters on the namespace and job
// variables; the headline panels exist.
func TestDashboard(t *testing.T) {
	d := loadDashboard(t)
	c := newExprChecker(t)
	if d.UID == "" || d.Title == "" {
		t.Error("dashboard needs a uid and a title (provisioning and links use the uid)")
	}
	vars := map[string]string{}
	for _, v := range d.Templating.List {
		vars[v.Name] = v.Type
		if v.Type != "query" {
			continue
		}
		var q struct{ Query string }
		if err := json.Unmarshal(v.Query, &q); err != nil {
			_ = json.Unmarshal(v.Query, &q.Query) // older dashboards: a plain string
		}
		m := regexp.MustCompile(`^label_values\((.*),\s*(\w+)\)$`).FindStringSubmatch(q.Query)
		if m == nil {
			t.Errorf("variable %s: query %q is not label_values(selector, label)", v.Name, q.Query)
			continue
		}
		for _, err := range c.check(substituteGrafanaVars(m[1])) {
			t.Errorf("variable %s: %v", v.Name, err)
		}
		if v.Datasource == nil || v.Datasource.UID != "${datasource}" {
			t.Errorf("variable %s does not query the ${datasource} variable", v.Name)
		}
	}
	if vars["datasource"] != "datasource" {
		t.Error("no template variable \"datasource\" of type datasource: the dashboard would be tied to one Prometheus")
	}
	for _, need := range []string{"namespace", "job", "queue"} {
		if vars[need] != "query" {
			t.Errorf("no query variable %q", need)
		}
	}

	ids := map[int]string{}
	titles := map[string]bool{}
	queries := 0
	for _, p := range d.allPanels() {
		where := fmt.Sprintf("panel %d %q", p.ID, p.Title)
		if prev, dup := ids[p.ID]; dup {
			t.Errorf("%s: id %d already used by %q", where, p.ID, prev)
		}
		ids[p.ID] = p.Title
		titles[p.Title] = true
		if p.GridPos.W <= 0 || p.GridPos.X+p.GridPos.W > 24 {
			t.Errorf("%s: gridPos %+v is outside the 24-column grid", where, p.GridPos)
		}
		if p.Type == "row" {
			continue
		}
		if p.Datasource == nil || p.Datasource.UID != "${datasource}" {
			t.Errorf("%s: datasource %+v, want uid ${datasource}", where, p.Datasource)
		}
		if len(p.Targets) == 0 {
			t.Errorf("%s: no queries", where)
		}
		for _, tg := range p.Targets {
			if tg.Datasource != nil && tg.Datasource.UID != "${datasource}" {
				t.Errorf("%s/%s: query datasource %+v, want uid ${datasource}", where, tg.RefID, tg.Datasource)
			}
			if strings.TrimSpace(tg.Expr) == "" {
				t.Errorf("%s/%s: empty query", where, tg.RefID)
				continue
			}
			queries++
			expr := substituteGrafanaVars(tg.Expr)
			for _, err := range c.check(expr) {
				t.Errorf("%s/%s: %v\n    expr: %s", where, tg.RefID, err, tg.Expr)
			}
			if err := filtersOnVariables(expr, "namespace", "job"); err != nil {
				t.Errorf("%s/%s: %v, or the panel mixes deployments\n    expr: %s", where, tg.RefID, err, tg.Expr)
			}
			if strings.Contains(expr, "orderdelay_task_") {
				if err := filtersOnVariables(expr, "queue"); err != nil {
					t.Errorf("%s/%s: %v, or the $queue picker does nothing\n    expr: %s", where, tg.RefID, err, tg.Expr)
				}
			}
		}
	}
	for _, need := range []string{
		"Overdue orders", "Oldest overdue order", "Arrivals vs closes", "Close lateness p50 / p99",
		"Close lateness distribution", "Queue depth", "Dead letters", "Skipped by reason",
		"Errors by stage", "Worker utilisation per pod",
		"Task queues", "Task queue depth", "Overdue tasks", "Oldest overdue task", "Task dead letters",
		"Task throughput", "Task lateness p99",
	} {
		if !titles[need] {
			t.Errorf("no panel %q", need)
		}
	}
	t.Logf("%d panels, %d queries", len(ids), queries)
}

// filtersOnVariables checks that every selector of expr has NAME=~"$NAME"
// for each given variable.
func filtersOnVariables(expr string, vars ...string) error {
	ast, err := promqlParser.ParseExpr(expr)
	if err != nil {
		return err
	}
	var missing error
	parser.Inspect(ast, func(node parser.Node, _ []parser.Node) error {
		vs, ok := node.(*parser.VectorSelector)
		if !ok || missing != nil {
			return nil
		}
		for _, v := range vars {
			found := false
			for _, m := range vs.LabelMatchers {
				found = found || (m.Name == v && m.Type == labels.MatchRegexp && m.Value == "__var_"+v+"__")
			}
			if !found {
				missing = fmt.Errorf("selector %s lacks %s=~\"$%s\"", selectorName(vs), v, v)
				return nil
			}
		}
		return nil
	})
	return missing
}
