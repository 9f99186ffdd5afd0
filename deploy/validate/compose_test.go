package validate

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"path"
	"path/filepath"
	"strings"
	"testing"
	"time"

	yaml "go.yaml.in/yaml/v3"
)

const composeFile = "docker-compose.yml"

// Only the parts of the Compose spec this stack uses; the decoder rejects
// anything else (a misspelt key is an error, not a silently ignored line).
type composeProject struct {
	Name       string                    `yaml:"name"`
	Services   map[string]composeService `yaml:"services"`
	Volumes    map[string]any            `yaml:"volumes"`
	Networks   map[string]any            `yaml:"networks"`
	Extensions map[string]any            `yaml:",inline"` // x-* keys (anchors)
}

type composeService struct {
	Image       string         `yaml:"image"`
	Build       *composeBuild  `yaml:"build"`
	Command     []string       `yaml:"command"`
	Entrypoint  []string       `yaml:"entrypoint"`
	Environment map[string]any `yaml:"environment"`
	EnvFile     []string       `yaml:"env_file"`
	Ports       []string       `yaml:"ports"`
	Volumes     []string       `yaml:"volumes"`
	DependsOn   dependsOn      `yaml:"depends_on"`
	Healthcheck map[string]any `yaml:"healthcheck"`
	Restart     string         `yaml:"restart"`
	ReadOnly    bool           `yaml:"read_only"`
	User        string         `yaml:"user"`
	// How long `docker compose stop` waits after SIGTERM before SIGKILL
	// (Compose's default is 10s).
	StopGracePeriod string `yaml:"stop_grace_period"`
}

type composeBuild struct {
	Context    string            `yaml:"context"`
	Dockerfile string            `yaml:"dockerfile"`
	Args       map[string]string `yaml:"args"`
}

// dependsOn accepts the list and the map forms, as Compose does.
type dependsOn map[string]struct {
	Condition string `yaml:"condition"`
}

func (d *dependsOn) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind == yaml.SequenceNode {
		var names []string
		if err := n.Decode(&names); err != nil {
			return err
		}
		*d = dependsOn{}
		for _, s := range names {
			(*d)[s] = struct {
				Condition string `yaml:"condition"`
			}{}
		}
		return nil
	}
	var m map[string]struct {
		Condition string `yaml:"condition"`
	}
	if err := n.Decode(&m); err != nil {
		return err
	}
	*d = m
	return nil
}

func loadCompose(t *testing.T) *composeProject {
	t.Helper()
	b, err := os.ReadFile(repoPath(composeFile))
	if err != nil {
		t.Fatal(err)
	}
	var p composeProject
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&p); err != nil {
		t.Fatalf("%s: %v", composeFile, err)
	}
	for k := range p.Extensions {
		if !strings.HasPrefix(k, "x-") {
			t.Errorf("%s: unknown top-level key %q", composeFile, k)
		}
	}
	return &p
}

// hostPath resolves a path from the compose file's directory.
func hostPath(p string) string {
	if filepath.IsAbs(p) {
		return p
	}
	return repoPath(p)
}

// bindMounts returns container path -> host path of a service's binds;
// named volumes must be declared.
func bindMounts(t *testing.T, p *composeProject, name string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, v := range p.Services[name].Volumes {
		parts := strings.Split(v, ":")
		if len(parts) < 2 || len(parts) > 3 {
			t.Errorf("service %s: volume %q is not src:dst[:mode]", name, v)
			continue
		}
		src, dst := parts[0], parts[1]
		if strings.HasPrefix(src, ".") || strings.HasPrefix(src, "/") {
			if _, err := os.Stat(hostPath(src)); err != nil {
				t.Errorf("service %s mounts %s, which does not exist", name, src)
			}
			out[dst] = hostPath(src)
			continue
		}
		if _, ok := p.Volumes[src]; !ok {
			t.Errorf("service %s uses volume %q, not declared under volumes:", name, src)
		}
	}
	return out
}

// inContainer maps a container path to the host path behind it, through
// the service's bind mounts ("" if none covers it).
func inContainer(mounts map[string]string, p string) string {
	best := ""
	for dst := range mounts {
		if (p == dst || strings.HasPrefix(p, dst+"/")) && len(dst) > len(best) {
			best = dst
		}
	}
	if best == "" {
		return ""
	}
	return filepath.Join(mounts[best], strings.TrimPrefix(p, best))
}

// TestComposeStack: docker-compose.yml parses (strictly, for the keys it
// uses), every file or directory it references exists, the services depend
// on services that exist, the daemon's variables are real settings, and the
// Prometheus and Grafana configs it mounts point at files that are mounted.
func TestComposeStack(t *testing.T) {
	p := loadCompose(t)
	known := settings(t)
	mounts := map[string]map[string]string{}
	for _, need := range []string{"redis", "postgres", "migrate", "orderdelay", "prometheus", "grafana"} {
		if _, ok := p.Services[need]; !ok {
			t.Errorf("no service %q", need)
		}
	}
	for name, s := range p.Services {
		if s.Image == "" && s.Build == nil {
			t.Errorf("service %s has neither image nor build", name)
		}
		if b := s.Build; b != nil {
			ctx := hostPath(b.Context)
			if st, err := os.Stat(ctx); err != nil || !st.IsDir() {
				t.Errorf("service %s: build context %s is not a directory", name, b.Context)
			}
			df := b.Dockerfile
			if df == "" {
				df = "Dockerfile"
			}
			if _, err := os.Stat(filepath.Join(ctx, df)); err != nil {
				t.Errorf("service %s: %v", name, err)
			}
		}
		for _, f := range s.EnvFile {
			if _, err := os.Stat(hostPath(f)); err != nil {
				t.Errorf("service %s: env_file: %v", name, err)
			}
		}
		for dep, d := range s.DependsOn {
			if _, ok := p.Services[dep]; !ok {
				t.Errorf("service %s depends on unknown service %s", name, dep)
			}
			switch d.Condition {
			case "", "service_started", "service_healthy", "service_completed_successfully":
			default:
				t.Errorf("service %s: depends_on %s condition %q", name, dep, d.Condition)
			}
			if d.Condition == "service_healthy" && p.Services[dep].Healthcheck == nil {
				t.Errorf("service %s waits for %s to be healthy, but %s has no healthcheck", name, dep, dep)
			}
		}
		for k := range s.Environment {
			if strings.HasPrefix(k, "ORDERDELAY_") && !known[k] {
				t.Errorf("service %s sets %s, which the daemon does not read", name, k)
			}
		}
		mounts[name] = bindMounts(t, p, name)
	}
	if m := p.Services["migrate"]; len(m.Command) == 0 || m.Command[0] != "migrate" {
		t.Errorf("service migrate runs %v, want [migrate]", m.Command)
	}
	if o := p.Services["orderdelay"]; len(o.Command) > 0 && o.Command[0] != "run" {
		t.Errorf("service orderdelay runs %v, want [run]", o.Command)
	}
	if p.Services["orderdelay"].DependsOn["migrate"].Condition != "service_completed_successfully" {
		t.Error("orderdelay must start after migrate completed successfully")
	}
	checkComposeStop(t, p.Services["orderdelay"])
	checkComposePrometheus(t, p, mounts["prometheus"])
	checkComposeGrafana(t, p, mounts["grafana"])
}

// checkComposeStop: `docker compose stop` or `down` must leave the daemon
// its whole stop (the drain, then the hand-back, with Redis hanging) before
// it sends SIGKILL, as terminationGracePeriodSeconds does on Kubernetes.
// Compose's default of 10s is below the default drain alone.
func checkComposeStop(t *testing.T, s composeService) {
	t.Helper()
	drain := durationSetting(t, envOf(s), "ORDERDELAY_DRAIN_TIMEOUT")
	want := stopBound(drain)
	if s.StopGracePeriod == "" {
		t.Errorf("service orderdelay has no stop_grace_period: Compose kills it after 10s, before its stop's longest %v (drain %v)", want, drain)
		return
	}
	got, err := time.ParseDuration(s.StopGracePeriod)
	if err != nil {
		t.Fatalf("service orderdelay: stop_grace_period %q: %v", s.StopGracePeriod, err)
	}
	if got < want {
		t.Errorf("service orderdelay: stop_grace_period %v < the stop's longest %v (drain %v; Redis hanging): Compose kills it mid-stop", got, want, drain)
	}
}

// envOf is a service's environment as the manifests' checks read it.
func envOf(s composeService) map[string]envVar {
	env := map[string]envVar{}
	for k, v := range s.Environment {
		if v == nil { // "KEY:" with no value: Compose passes it from the shell
			continue
		}
		env[k] = envVar{Value: fmt.Sprint(v), Source: "literal"}
	}
	return env
}

func checkComposePrometheus(t *testing.T, p *composeProject, mounts map[string]string) {
	cfgPath := "/etc/prometheus/prometheus.yml"
	for _, a := range p.Services["prometheus"].Command {
		if v, ok := strings.CutPrefix(a, "--config.file="); ok {
			cfgPath = v
		}
	}
	host := inContainer(mounts, cfgPath)
	if host == "" {
		t.Fatalf("prometheus reads %s, which no bind mount provides", cfgPath)
	}
	b, err := os.ReadFile(host)
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		Global        map[string]any `yaml:"global"`
		RuleFiles     []string       `yaml:"rule_files"`
		ScrapeConfigs []struct {
			JobName       string `yaml:"job_name"`
			MetricsPath   string `yaml:"metrics_path"`
			StaticConfigs []struct {
				Targets []string `yaml:"targets"`
			} `yaml:"static_configs"`
		} `yaml:"scrape_configs"`
	}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&cfg); err != nil {
		t.Fatalf("%s: %v", host, err)
	}
	// Rule files: each glob matches a mounted file, and the alerts are among them.
	alertsLoaded := false
	for _, glob := range cfg.RuleFiles {
		hostGlob := inContainer(mounts, path.Dir(glob))
		matched := false
		for dst, src := range mounts {
			if ok, _ := path.Match(glob, dst); ok {
				matched = true
				abs1, _ := filepath.Abs(src)
				abs2, _ := filepath.Abs(repoPath(plainAlertsFile))
				alertsLoaded = alertsLoaded || abs1 == abs2
			}
		}
		if hostGlob != "" {
			if m, _ := filepath.Glob(filepath.Join(hostGlob, path.Base(glob))); len(m) > 0 {
				matched = true
			}
		}
		if !matched {
			t.Errorf("prometheus rule_files %q matches no mounted file", glob)
		}
	}
	if !alertsLoaded {
		t.Errorf("prometheus does not load %s: the local stack would not alert like production", plainAlertsFile)
	}
	found := false
	for _, sc := range cfg.ScrapeConfigs {
		if sc.JobName != "orderdelay" {
			continue
		}
		found = true
		if sc.MetricsPath != "" && sc.MetricsPath != metricsPath {
			t.Errorf("scrape job orderdelay: metrics_path %s, the daemon serves %s", sc.MetricsPath, metricsPath)
		}
		for _, st := range sc.StaticConfigs {
			for _, tg := range st.Targets {
				h, port, err := net.SplitHostPort(tg)
				if err != nil {
					t.Errorf("scrape target %q: %v", tg, err)
					continue
				}
				if _, ok := p.Services[h]; !ok {
					t.Errorf("scrape target %q: no service %s", tg, h)
				}
				addr, _ := p.Services[h].Environment["ORDERDELAY_HTTP_ADDR"].(string)
				if addr == "" {
					addr = settingDefault(t, "ORDERDELAY_HTTP_ADDR")
				}
				if _, want, _ := net.SplitHostPort(addr); want != port {
					t.Errorf("scrape target %q: %s listens on %s", tg, h, addr)
				}
			}
		}
	}
	if !found {
		t.Error(`prometheus.yml has no job_name "orderdelay": the alerts and the dashboard select job="orderdelay"`)
	}
}

func checkComposeGrafana(t *testing.T, p *composeProject, mounts map[string]string) {
	prov := inContainer(mounts, "/etc/grafana/provisioning")
	if prov == "" {
		t.Fatal("grafana: /etc/grafana/provisioning is not mounted")
	}
	// Dashboard providers must point at a mounted directory holding the dashboard.
	dir := filepath.Join(prov, "dashboards")
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	dashboardMounted := false
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		var f struct {
			APIVersion int `yaml:"apiVersion"`
			Providers  []struct {
				Name    string `yaml:"name"`
				Options struct {
					Path string `yaml:"path"`
				} `yaml:"options"`
			} `yaml:"providers"`
		}
		if err := yaml.Unmarshal(b, &f); err != nil {
			t.Fatalf("%s: %v", e.Name(), err)
		}
		for _, pr := range f.Providers {
			host := inContainer(mounts, pr.Options.Path)
			if host == "" {
				t.Errorf("dashboard provider %s reads %s, which is not mounted", pr.Name, pr.Options.Path)
				continue
			}
			if same(filepath.Join(host, filepath.Base(dashboardFile)), repoPath(dashboardFile)) {
				dashboardMounted = true
			}
		}
	}
	if !dashboardMounted {
		t.Errorf("no Grafana dashboard provider serves %s", dashboardFile)
	}
	if home, ok := p.Services["grafana"].Environment["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"].(string); ok {
		if h := inContainer(mounts, home); h == "" || !fileExists(h) {
			t.Errorf("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH %s is not a mounted file", home)
		}
	}
	// Datasources: parse, and one is Prometheus at the prometheus service.
	dsDir := filepath.Join(prov, "datasources")
	entries, err = os.ReadDir(dsDir)
	if err != nil {
		t.Fatal(err)
	}
	promDS := false
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(dsDir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		var f struct {
			Datasources []struct {
				Type string `yaml:"type"`
				URL  string `yaml:"url"`
			} `yaml:"datasources"`
		}
		if err := yaml.Unmarshal(b, &f); err != nil {
			t.Fatalf("%s: %v", e.Name(), err)
		}
		for _, ds := range f.Datasources {
			promDS = promDS || (ds.Type == "prometheus" && strings.Contains(ds.URL, "//prometheus:"))
		}
	}
	if !promDS {
		t.Error("no Grafana datasource of type prometheus pointing at the prometheus service")
	}
}

func same(a, b string) bool {
	sa, err1 := os.Stat(a)
	sb, err2 := os.Stat(b)
	return err1 == nil && err2 == nil && os.SameFile(sa, sb)
}

func fileExists(p string) bool {
	st, err := os.Stat(p)
	return err == nil && !st.IsDir()
}
