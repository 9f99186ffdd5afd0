package validate

import (
	"net"
	"strconv"
	"testing"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// prometheusPods are the labels of the Prometheus Operator's Prometheus
// pods, which the NetworkPolicy lets scrape /metrics.
var prometheusPods = map[string]string{"app.kubernetes.io/name": "prometheus"}

// loopback mirrors the daemon's rule (internal/config.Loopback): a
// loopback IP or "localhost"; a wildcard or any other name is not.
func loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

func setting(env map[string]envVar, name, def string) string {
	if v, ok := env[name]; ok && v.Source != "secret" {
		return v.Value
	}
	return def
}

func addrPort(t *testing.T, addr string) int32 {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("listen address %q: %v", addr, err)
	}
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatalf("listen address %q: port: %v", addr, err)
	}
	return int32(n)
}

// TestExposure holds every kustomization to protected mode and the admin
// API apart (issue 14): a daemon listening beyond loopback gets a required
// API token (or it refuses to start); the admin API listens on loopback in
// the pod, with no container or Service port; a NetworkPolicy lets
// producers from labelled namespaces and Prometheus reach the http port
// only, and nothing reach the admin port.
func TestExposure(t *testing.T) {
	for _, r := range built(t) {
		t.Run(r.Dir, func(t *testing.T) {
			deps := r.Deployments()
			if len(deps) != 1 {
				t.Fatalf("want 1 Deployment, got %d", len(deps))
			}
			pods := deps[0].Spec.Template.Labels
			c := findContainer(&deps[0].Spec.Template.Spec, daemonContainer)
			env := containerEnv(t, r, c)
			httpAddr := setting(env, "ORDERDELAY_HTTP_ADDR", settingDefault(t, "ORDERDELAY_HTTP_ADDR"))
			adminAddr := setting(env, "ORDERDELAY_ADMIN_ADDR", settingDefault(t, "ORDERDELAY_ADMIN_ADDR"))
			auth := setting(env, "ORDERDELAY_API_AUTH", settingDefault(t, "ORDERDELAY_API_AUTH"))

			// Protected mode.
			if auth != "token" {
				t.Errorf("ORDERDELAY_API_AUTH=%q: the manifests never switch producer auth off", auth)
			}
			if !loopback(httpAddr) {
				tok, ok := env["ORDERDELAY_API_TOKEN"]
				switch {
				case !ok || tok.Source != "secret":
					t.Errorf("ORDERDELAY_HTTP_ADDR=%q is not loopback and ORDERDELAY_API_TOKEN does not come from a Secret: the daemon refuses to start (protected mode)", httpAddr)
				case tok.Ref.SecretKeyRef.Optional != nil && *tok.Ref.SecretKeyRef.Optional:
					t.Errorf("ORDERDELAY_HTTP_ADDR=%q is not loopback and the api-token key is optional: a missing key starts pods that refuse to run", httpAddr)
				}
			}

			// The admin API apart.
			if !loopback(adminAddr) {
				t.Errorf("ORDERDELAY_ADMIN_ADDR=%q: the admin API listens on loopback in the pod (reached with kubectl port-forward)", adminAddr)
			}
			adminPort, httpPort := addrPort(t, adminAddr), addrPort(t, httpAddr)
			if adminPort == httpPort {
				t.Fatalf("ORDERDELAY_ADMIN_ADDR %q and ORDERDELAY_HTTP_ADDR %q share a port", adminAddr, httpAddr)
			}
			for _, p := range c.Ports {
				if p.ContainerPort == adminPort {
					t.Errorf("container port %s (%d) is the admin port", p.Name, p.ContainerPort)
				}
			}
			for _, o := range r.Objs {
				if s, ok := o.(*corev1.Service); ok {
					for _, p := range s.Spec.Ports {
						if n, ok := namedPort(c, p.TargetPort); !ok || n == adminPort {
							t.Errorf("Service %s port %s reaches %s, not the http port", s.Name, p.Name, p.TargetPort.String())
						}
					}
				}
			}

			// The NetworkPolicy.
			var policies []*networkingv1.NetworkPolicy
			for _, o := range r.Objs {
				if np, ok := o.(*networkingv1.NetworkPolicy); ok && selects(&np.Spec.PodSelector, pods) {
					policies = append(policies, np)
				}
			}
			if len(policies) != 1 {
				t.Fatalf("%d NetworkPolicies select the daemon's pods, want 1", len(policies))
			}
			checkPolicy(t, policies[0], c, httpPort, adminPort)
		})
	}
}

// checkPolicy: ingress is restricted, each rule admits labelled namespaces
// to the http port and nothing else, and Prometheus is among them.
func checkPolicy(t *testing.T, np *networkingv1.NetworkPolicy, c *corev1.Container, httpPort, adminPort int32) {
	t.Helper()
	ingress := false
	for _, pt := range np.Spec.PolicyTypes {
		ingress = ingress || pt == networkingv1.PolicyTypeIngress
	}
	if !ingress {
		t.Errorf("NetworkPolicy %s: policyTypes %v lacks Ingress: it restricts nothing coming in", np.Name, np.Spec.PolicyTypes)
	}
	producers, prometheus := false, false
	for i, rule := range np.Spec.Ingress {
		if len(rule.From) == 0 {
			t.Errorf("NetworkPolicy %s: ingress rule %d has no from: it admits every source", np.Name, i)
		}
		if len(rule.Ports) == 0 {
			t.Errorf("NetworkPolicy %s: ingress rule %d has no ports: it opens the admin port too", np.Name, i)
		}
		for _, p := range rule.Ports {
			port := intstr.FromInt32(0)
			if p.Port != nil {
				port = *p.Port
			}
			n, ok := namedPort(c, port)
			switch {
			case p.Port == nil || p.EndPort != nil:
				t.Errorf("NetworkPolicy %s: ingress rule %d admits a port range or every port", np.Name, i)
			case port.Type == intstr.Int && port.IntVal == adminPort, ok && n == adminPort:
				t.Errorf("NetworkPolicy %s: ingress rule %d admits the admin port %d", np.Name, i, adminPort)
			case !ok || n != httpPort:
				t.Errorf("NetworkPolicy %s: ingress rule %d admits port %s, not the http port %d", np.Name, i, port.String(), httpPort)
			}
		}
		for _, peer := range rule.From {
			if peer.IPBlock != nil {
				t.Errorf("NetworkPolicy %s: ingress rule %d admits an IP block; admit labelled namespaces", np.Name, i)
				continue
			}
			if !labelled(peer.NamespaceSelector) {
				t.Errorf("NetworkPolicy %s: ingress rule %d has a peer without a namespace selector by label: it admits every namespace (or only its own)", np.Name, i)
				continue
			}
			if peer.PodSelector == nil {
				producers = true
			} else if selects(peer.PodSelector, prometheusPods) {
				prometheus = true
			}
		}
	}
	if !producers {
		t.Errorf("NetworkPolicy %s: no rule admits producers' namespaces", np.Name)
	}
	if !prometheus {
		t.Errorf("NetworkPolicy %s: no rule admits Prometheus pods (%v) to scrape /metrics", np.Name, prometheusPods)
	}
}

// labelled: a selector that matches namespaces by at least one label.
func labelled(sel *metav1.LabelSelector) bool {
	return sel != nil && (len(sel.MatchLabels) > 0 || len(sel.MatchExpressions) > 0)
}
