package validate

import (
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8slabels "k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/validation"
)

// The daemon's HTTP contract (DESIGN.md, HTTP).
const (
	livenessPath     = "/healthz"
	readinessPath    = "/readyz"
	metricsPath      = "/metrics"
	daemonContainer  = "orderdelay"
	migrateSubcmd    = "migrate"
	runSubcmd        = "run"
	migrationJobBase = "orderdelay-migrate"
)

// containerEnv resolves a container's environment as the kubelet would:
// envFrom ConfigMaps first, then env entries (which win). Values from a
// Secret or a resource field are returned as "" with source set.
type envVar struct {
	Value  string
	Source string // "configmap", "literal", "secret", "resource"
	Ref    *corev1.EnvVarSource
}

func containerEnv(t *testing.T, r *rendered, c *corev1.Container) map[string]envVar {
	t.Helper()
	env := map[string]envVar{}
	for _, from := range c.EnvFrom {
		switch {
		case from.ConfigMapRef != nil:
			cm := r.ConfigMap(from.ConfigMapRef.Name)
			if cm == nil {
				t.Errorf("%s: container %s: envFrom ConfigMap %q is not in the build", r.Dir, c.Name, from.ConfigMapRef.Name)
				continue
			}
			for k, v := range cm.Data {
				env[from.Prefix+k] = envVar{Value: v, Source: "configmap"}
			}
		case from.SecretRef != nil:
			t.Errorf("%s: container %s: envFrom a whole Secret hides which settings are secret; name each key with secretKeyRef", r.Dir, c.Name)
		}
	}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			env[e.Name] = envVar{Value: e.Value, Source: "literal"}
		case e.ValueFrom.SecretKeyRef != nil:
			env[e.Name] = envVar{Source: "secret", Ref: e.ValueFrom}
		case e.ValueFrom.ResourceFieldRef != nil:
			env[e.Name] = envVar{Source: "resource", Ref: e.ValueFrom}
		default:
			env[e.Name] = envVar{Source: "other", Ref: e.ValueFrom}
		}
	}
	return env
}

// checkEnvNames: every ORDERDELAY_* variable is one the daemon reads,
// secrets come from Secrets, and keys referenced in a generated Secret
// exist.
func checkEnvNames(t *testing.T, r *rendered, c *corev1.Container, env map[string]envVar) {
	t.Helper()
	known := settings(t)
	for name, v := range env {
		switch {
		case strings.HasPrefix(name, "ORDERDELAY_"):
			if !known[name] {
				t.Errorf("%s: container %s sets %s, which the daemon does not read (testdata/settings.txt)", r.Dir, c.Name, name)
			}
		case name == "GOMEMLIMIT" || name == "GOMAXPROCS" || name == "GOGC" || name == "TZ":
		default:
			t.Errorf("%s: container %s sets %s: neither a daemon setting nor a known runtime variable", r.Dir, c.Name, name)
		}
		if secretSettings[name] && v.Source != "secret" {
			t.Errorf("%s: container %s takes %s from a %s; it is a secret and must come from a secretKeyRef", r.Dir, c.Name, name, v.Source)
		}
		if v.Source == "secret" {
			ref := v.Ref.SecretKeyRef
			if s := r.Secret(ref.Name); s != nil {
				_, inData := s.Data[ref.Key]
				_, inString := s.StringData[ref.Key]
				if !inData && !inString {
					t.Errorf("%s: %s refers to key %q of Secret %s, which has no such key", r.Dir, name, ref.Key, ref.Name)
				}
			}
		}
	}
}

// checkFlags: any --flag in args is a real flag (settings lower-cased,
// without the prefix, underscores to dashes) or one of the subcommand's own.
func checkFlags(t *testing.T, r *rendered, c *corev1.Container, extra ...string) {
	t.Helper()
	flags := map[string]bool{}
	for s := range settings(t) {
		flags["--"+strings.ReplaceAll(strings.ToLower(strings.TrimPrefix(s, "ORDERDELAY_")), "_", "-")] = true
	}
	for _, f := range extra {
		flags[f] = true
	}
	for _, a := range append(append([]string{}, c.Command...), c.Args...) {
		if !strings.HasPrefix(a, "-") {
			continue
		}
		name, _, _ := strings.Cut(a, "=")
		name = "--" + strings.TrimLeft(name, "-")
		if !flags[name] {
			t.Errorf("%s: container %s passes %s, which the daemon does not accept", r.Dir, c.Name, a)
		}
	}
}

// durationSetting is the duration a container sets for name, or the
// daemon's default.
func durationSetting(t *testing.T, env map[string]envVar, name string) time.Duration {
	t.Helper()
	def, err := time.ParseDuration(settingDefault(t, name))
	if err != nil {
		t.Fatalf("default of %s: %v", name, err)
	}
	v, ok := env[name]
	if !ok || v.Value == "" {
		return def
	}
	d, err := time.ParseDuration(v.Value)
	if err != nil {
		t.Errorf("%s=%q: %v", name, v.Value, err)
		return def
	}
	return d
}

func checkPodSecurity(t *testing.T, where string, spec *corev1.PodSpec, wantUID int64) {
	t.Helper()
	psc := spec.SecurityContext
	if psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot {
		t.Errorf("%s: pod securityContext.runAsNonRoot must be true", where)
	}
	if psc == nil || psc.RunAsUser == nil || *psc.RunAsUser != wantUID {
		t.Errorf("%s: pod securityContext.runAsUser must be %d (the image's USER)", where, wantUID)
	}
	if psc == nil || psc.SeccompProfile == nil || psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("%s: pod seccompProfile must be RuntimeDefault", where)
	}
	if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
		t.Errorf("%s: the daemon never calls the Kubernetes API: automountServiceAccountToken must be false", where)
	}
	for _, c := range spec.Containers {
		sc := c.SecurityContext
		if sc == nil {
			t.Errorf("%s: container %s has no securityContext", where, c.Name)
			continue
		}
		if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
			t.Errorf("%s: container %s: allowPrivilegeEscalation must be false", where, c.Name)
		}
		if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
			t.Errorf("%s: container %s: readOnlyRootFilesystem must be true", where, c.Name)
		}
		if sc.Capabilities == nil || len(sc.Capabilities.Drop) != 1 || sc.Capabilities.Drop[0] != "ALL" || len(sc.Capabilities.Add) != 0 {
			t.Errorf("%s: container %s: capabilities must drop ALL and add none", where, c.Name)
		}
		if c.Resources.Limits.Memory().IsZero() {
			t.Errorf("%s: container %s has no memory limit", where, c.Name)
		}
		if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() {
			t.Errorf("%s: container %s needs cpu and memory requests", where, c.Name)
		}
	}
}

func findContainer(spec *corev1.PodSpec, name string) *corev1.Container {
	for i := range spec.Containers {
		if spec.Containers[i].Name == name {
			return &spec.Containers[i]
		}
	}
	return nil
}

// namedPort resolves a probe or Service port (name or number) against the
// container's ports.
func namedPort(c *corev1.Container, p intstr.IntOrString) (int32, bool) {
	for _, cp := range c.Ports {
		if (p.Type == intstr.String && cp.Name == p.StrVal) || (p.Type == intstr.Int && cp.ContainerPort == p.IntVal) {
			return cp.ContainerPort, true
		}
	}
	return 0, false
}

// TestDeploymentMatchesDaemon checks the Deployment against the daemon's
// real contract: probe paths and port, environment variable and flag names,
// secrets from a Secret, GOMEMLIMIT in bytes, a grace period that covers
// the drain, and the hardening the image relies on.
func TestDeploymentMatchesDaemon(t *testing.T) {
	uid := dockerfileUID(t)
	for _, r := range built(t) {
		t.Run(r.Dir, func(t *testing.T) {
			deps := r.Deployments()
			if len(deps) != 1 {
				t.Fatalf("want 1 Deployment, got %d", len(deps))
			}
			d := deps[0]
			spec := &d.Spec.Template.Spec
			c := findContainer(spec, daemonContainer)
			if c == nil {
				t.Fatalf("Deployment %s has no container %q", d.Name, daemonContainer)
			}
			if len(c.Command) != 0 {
				t.Errorf("container command %v overrides the image's ENTRYPOINT; use args", c.Command)
			}
			if len(c.Args) == 0 || c.Args[0] != runSubcmd {
				t.Errorf("container args %v: want %q first", c.Args, runSubcmd)
			}
			checkFlags(t, r, c, "--migrate")

			env := containerEnv(t, r, c)
			checkEnvNames(t, r, c, env)
			for name := range secretSettings {
				if optionalSecrets[name] {
					continue // optional: empty means no auth, or no admin API
				}
				if _, ok := env[name]; !ok {
					t.Errorf("%s is not set: the daemon would use its localhost default", name)
				}
			}

			// Probes and the port the daemon listens on.
			addr := settingDefault(t, "ORDERDELAY_HTTP_ADDR")
			if v, ok := env["ORDERDELAY_HTTP_ADDR"]; ok && v.Value != "" {
				addr = v.Value
			}
			_, portStr, err := net.SplitHostPort(addr)
			if err != nil {
				t.Fatalf("ORDERDELAY_HTTP_ADDR=%q: %v", addr, err)
			}
			listen, _ := strconv.Atoi(portStr)
			for _, p := range []struct {
				what  string
				probe *corev1.Probe
				path  string
			}{
				{"livenessProbe", c.LivenessProbe, livenessPath},
				{"readinessProbe", c.ReadinessProbe, readinessPath},
			} {
				if p.probe == nil || p.probe.HTTPGet == nil {
					t.Errorf("%s: want an httpGet probe on %s", p.what, p.path)
					continue
				}
				if p.probe.HTTPGet.Path != p.path {
					t.Errorf("%s path %q: the daemon serves it on %q", p.what, p.probe.HTTPGet.Path, p.path)
				}
				port, ok := namedPort(c, p.probe.HTTPGet.Port)
				if !ok {
					t.Errorf("%s port %s is not a container port", p.what, p.probe.HTTPGet.Port.String())
				} else if int(port) != listen {
					t.Errorf("%s goes to port %d, but the daemon listens on %d (ORDERDELAY_HTTP_ADDR=%q)", p.what, port, listen, addr)
				}
			}
			if c.StartupProbe != nil && c.StartupProbe.HTTPGet != nil && c.StartupProbe.HTTPGet.Path != livenessPath {
				t.Errorf("startupProbe path %q: want %q", c.StartupProbe.HTTPGet.Path, livenessPath)
			}

			// GOMEMLIMIT: the memory limit, in bytes.
			gml, ok := env["GOMEMLIMIT"]
			switch {
			case !ok:
				t.Error("GOMEMLIMIT is not set: the Go heap does not know the container limit")
			case gml.Source == "resource":
				ref := gml.Ref.ResourceFieldRef
				if ref.Resource != "limits.memory" {
					t.Errorf("GOMEMLIMIT from %s: want limits.memory", ref.Resource)
				}
				if !ref.Divisor.IsZero() && ref.Divisor.Cmp(resource.MustParse("1")) != 0 {
					t.Errorf("GOMEMLIMIT divisor %s: the kubelet then passes a bare number that Go reads as bytes; use divisor 1", ref.Divisor.String())
				}
			case gml.Source == "literal":
				if !strings.HasSuffix(gml.Value, "B") {
					t.Errorf("GOMEMLIMIT=%q: give a unit (MiB, GiB) or Go reads bytes", gml.Value)
				}
			}

			// Shutdown: preStop, then the whole stop, inside the grace
			// period; the drain inside the lease.
			drain := durationSetting(t, env, "ORDERDELAY_DRAIN_TIMEOUT")
			lease := durationSetting(t, env, "ORDERDELAY_LEASE")
			if drain >= lease {
				t.Errorf("ORDERDELAY_DRAIN_TIMEOUT %v must be below ORDERDELAY_LEASE %v", drain, lease)
			}
			var preStop time.Duration
			if c.Lifecycle != nil && c.Lifecycle.PreStop != nil && c.Lifecycle.PreStop.Sleep != nil {
				preStop = time.Duration(c.Lifecycle.PreStop.Sleep.Seconds) * time.Second
			} else {
				t.Error("no preStop sleep: endpoints may still send traffic to a draining pod (and the image has no shell for an exec sleep)")
			}
			if c.Lifecycle != nil && c.Lifecycle.PreStop != nil && c.Lifecycle.PreStop.Exec != nil {
				t.Error("preStop exec: the distroless image has no shell or sleep binary")
			}
			grace := 30 * time.Second
			if spec.TerminationGracePeriodSeconds != nil {
				grace = time.Duration(*spec.TerminationGracePeriodSeconds) * time.Second
			}
			if stop := stopBound(drain); grace < preStop+stop {
				t.Errorf("terminationGracePeriodSeconds %v < preStop %v + the stop's longest %v (drain %v; Redis hanging): "+
					"the kubelet kills pods mid-stop", grace, preStop, stop, drain)
			}

			checkPodSecurity(t, r.Dir+" Deployment", spec, uid)

			if d.Spec.Replicas == nil || *d.Spec.Replicas < 2 {
				t.Error("want 2+ replicas")
			}
			if len(spec.TopologySpreadConstraints) == 0 {
				t.Error("no topologySpreadConstraints")
			}
			keys := map[string]bool{}
			for _, tsc := range spec.TopologySpreadConstraints {
				keys[tsc.TopologyKey] = true
				if tsc.WhenUnsatisfiable != corev1.ScheduleAnyway {
					t.Errorf("topology spread on %s is %s: a single-zone or single-node cluster could not schedule; use ScheduleAnyway", tsc.TopologyKey, tsc.WhenUnsatisfiable)
				}
				if !selects(tsc.LabelSelector, d.Spec.Template.Labels) {
					t.Errorf("topology spread on %s does not select the Deployment's own pods", tsc.TopologyKey)
				}
			}
			for _, k := range []string{"kubernetes.io/hostname", "topology.kubernetes.io/zone"} {
				if !keys[k] {
					t.Errorf("no topology spread over %s", k)
				}
			}
		})
	}
}

// TestMigrationJob: the Job runs `migrate` with the Deployment's image and,
// in the overlays, is named after the release (a Job's template is
// immutable, so re-using a name makes `kubectl apply` fail on upgrade).
func TestMigrationJob(t *testing.T) {
	uid := dockerfileUID(t)
	for _, r := range built(t) {
		t.Run(r.Dir, func(t *testing.T) {
			jobs := r.Jobs()
			if len(jobs) != 1 {
				t.Fatalf("want 1 migration Job, got %d", len(jobs))
			}
			j := jobs[0]
			spec := &j.Spec.Template.Spec
			if len(spec.Containers) != 1 {
				t.Fatalf("Job %s: want 1 container", j.Name)
			}
			c := &spec.Containers[0]
			if len(c.Args) == 0 || c.Args[0] != migrateSubcmd {
				t.Errorf("Job %s args %v: want %q", j.Name, c.Args, migrateSubcmd)
			}
			checkFlags(t, r, c)
			env := containerEnv(t, r, c)
			checkEnvNames(t, r, c, env)
			if env["ORDERDELAY_DATABASE_URL"].Source != "secret" {
				t.Error("the migration needs ORDERDELAY_DATABASE_URL from the Secret")
			}
			if spec.RestartPolicy != corev1.RestartPolicyNever && spec.RestartPolicy != corev1.RestartPolicyOnFailure {
				t.Errorf("restartPolicy %q", spec.RestartPolicy)
			}
			if j.Spec.BackoffLimit == nil || j.Spec.ActiveDeadlineSeconds == nil {
				t.Error("set backoffLimit and activeDeadlineSeconds: a migration must not retry forever")
			}
			checkPodSecurity(t, r.Dir+" Job", spec, uid)

			deps := r.Deployments()
			if len(deps) != 1 {
				return
			}
			image := findContainer(&deps[0].Spec.Template.Spec, daemonContainer).Image
			if c.Image != image {
				t.Errorf("Job image %q != Deployment image %q: migrate with the release you deploy", c.Image, image)
			}
			if !r.isOverlay() {
				return
			}
			tag := imageTag(image)
			if tag == "" {
				t.Fatalf("Deployment image %q has no tag: the Job name is derived from it", image)
			}
			if want := migrationJobBase + "-" + tag; j.Name != want {
				t.Errorf("Job name %q: want %q, named after the release so each upgrade creates a new Job", j.Name, want)
			}
			for _, msg := range validation.IsDNS1123Subdomain(j.Name) {
				t.Errorf("Job name %q: %s", j.Name, msg)
			}
			// The Job controller copies the name into a pod label.
			for _, msg := range validation.IsValidLabelValue(j.Name) {
				t.Errorf("Job name %q as the job-name label: %s", j.Name, msg)
			}
		})
	}
}

// imageTag returns the tag of an image reference ("" if none).
func imageTag(image string) string {
	name, _, _ := strings.Cut(image, "@")
	slash := strings.LastIndex(name, "/")
	colon := strings.LastIndex(name, ":")
	if colon <= slash {
		return ""
	}
	return name[colon+1:]
}

func selects(sel *metav1.LabelSelector, podLabels map[string]string) bool {
	if sel == nil {
		return false
	}
	s, err := metav1.LabelSelectorAsSelector(sel)
	if err != nil || s.Empty() {
		return false
	}
	return s.Matches(k8slabels.Set(podLabels))
}

// TestWiring: Service, PDB and ServiceMonitor select the daemon's pods (and
// not the migration pods), through ports that exist.
func TestWiring(t *testing.T) {
	for _, r := range built(t) {
		t.Run(r.Dir, func(t *testing.T) {
			deps := r.Deployments()
			if len(deps) != 1 {
				t.Fatalf("want 1 Deployment")
			}
			d := deps[0]
			pods := d.Spec.Template.Labels
			if !selects(d.Spec.Selector, pods) {
				t.Error("the Deployment's selector does not match its own template")
			}
			c := findContainer(&d.Spec.Template.Spec, daemonContainer)
			var jobPods map[string]string
			if jobs := r.Jobs(); len(jobs) == 1 {
				jobPods = jobs[0].Spec.Template.Labels
			}
			var services []*corev1.Service
			for _, o := range r.Objs {
				switch o := o.(type) {
				case *corev1.Service:
					services = append(services, o)
					sel := &metav1.LabelSelector{MatchLabels: o.Spec.Selector}
					if !selects(sel, pods) {
						t.Errorf("Service %s selects %v, not the daemon's pods %v", o.Name, o.Spec.Selector, pods)
					}
					if jobPods != nil && selects(sel, jobPods) {
						t.Errorf("Service %s also selects the migration Job's pods", o.Name)
					}
					for _, p := range o.Spec.Ports {
						if _, ok := namedPort(c, p.TargetPort); !ok {
							t.Errorf("Service %s port %s targets %s, which the container does not expose", o.Name, p.Name, p.TargetPort.String())
						}
					}
				case *policyv1.PodDisruptionBudget:
					if !selects(o.Spec.Selector, pods) {
						t.Errorf("PodDisruptionBudget %s does not select the daemon's pods", o.Name)
					}
					if jobPods != nil && selects(o.Spec.Selector, jobPods) {
						t.Errorf("PodDisruptionBudget %s also selects the migration pods", o.Name)
					}
				case *appsv1.Deployment, *monitoringv1.ServiceMonitor:
				}
			}
			for _, o := range r.Objs {
				sm, ok := o.(*monitoringv1.ServiceMonitor)
				if !ok {
					continue
				}
				found := false
				for _, s := range services {
					if !selects(&sm.Spec.Selector, s.Labels) {
						continue
					}
					found = true
					for _, ep := range sm.Spec.Endpoints {
						portOK := false
						for _, p := range s.Spec.Ports {
							portOK = portOK || (ep.Port != "" && p.Name == ep.Port)
						}
						if !portOK {
							t.Errorf("ServiceMonitor %s scrapes port %q, which Service %s does not name", sm.Name, ep.Port, s.Name)
						}
						if ep.Path != "" && ep.Path != metricsPath {
							t.Errorf("ServiceMonitor %s scrapes %s; the daemon serves %s", sm.Name, ep.Path, metricsPath)
						}
					}
				}
				if !found {
					t.Errorf("ServiceMonitor %s selects no Service", sm.Name)
				}
			}
		})
	}
}

// TestSettingsConfigMap: the ConfigMap carries only daemon settings, and no
// secret.
func TestSettingsConfigMap(t *testing.T) {
	known := settings(t)
	for _, r := range built(t) {
		for _, o := range r.Objs {
			cm, ok := o.(*corev1.ConfigMap)
			if !ok {
				continue
			}
			for k := range cm.Data {
				if !known[k] {
					t.Errorf("%s: ConfigMap %s key %s is not a daemon setting (testdata/settings.txt)", r.Dir, cm.Name, k)
				}
				if secretSettings[k] {
					t.Errorf("%s: ConfigMap %s holds the secret %s", r.Dir, cm.Name, k)
				}
			}
		}
		if strings.HasSuffix(r.Dir, "/prod") {
			for _, o := range r.Objs {
				if s, ok := o.(*corev1.Secret); ok {
					t.Errorf("%s: Secret %s is generated from a committed file; production secrets are created out of band", r.Dir, s.Name)
				}
			}
		}
	}
}

// What a stop may wait for at the longest, with the daemon's own timeouts:
// with Redis hanging (connections open, no answers) every Redis call waits
// for go-redis's read timeout, which a context's deadline does not cut
// (the clients leave ContextTimeoutEnabled off). README: How it works.
const (
	redisReadTimeout = 5 * time.Second     // go-redis's default; read_timeout in ORDERDELAY_REDIS_URL changes it
	handBackDeadline = 5 * time.Second     // consumer.BookkeepingTimeout
	httpShutdown     = 5 * time.Second     // cmd/orderdelay httpShutdownTimeout
	poolsClose       = 2 * 2 * time.Second // cmd/orderdelay poolCloseWait, for each of two pools
)

// stopBound is the longest stop after SIGTERM, an upper bound: the scan
// loop's Redis call in flight (the drain's timer runs from SIGTERM
// meanwhile, so this overlaps the next two), the drain, the batch's Redis call in flight when the drain timeout passes,
// the hand-back (its deadline, or the read in flight past it), the HTTP
// shutdown and the database pools. The start-up Redis check, the one other
// Redis call in the stop, runs only while no consumer has started. A batch
// that committed just before Redis hung may add a read timeout per
// bookkeeping call it still makes; a kill at the end of the grace period
// then loses nothing (the leases bring back what those calls could not
// record).
func stopBound(drain time.Duration) time.Duration {
	return redisReadTimeout + drain + redisReadTimeout + max(handBackDeadline, redisReadTimeout) + httpShutdown + poolsClose
}
