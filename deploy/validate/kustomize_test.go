package validate

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

// scheme knows exactly the kinds deploy/ may contain. A kind outside it
// fails the strict decode: add it here, with its typed package, on purpose.
var scheme = func() *runtime.Scheme {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{
		corev1.AddToScheme, appsv1.AddToScheme, batchv1.AddToScheme,
		policyv1.AddToScheme, networkingv1.AddToScheme, monitoringv1.AddToScheme,
	} {
		if err := add(s); err != nil {
			panic(err)
		}
	}
	return s
}()

// strictDecoder rejects unknown and duplicate fields, as `kubectl apply
// --validate=strict` and the API server's strict field validation do.
var strictDecoder = serializer.NewCodecFactory(scheme, serializer.EnableStrict).UniversalDeserializer()

// rendered is one kustomization, built and decoded into typed objects.
type rendered struct {
	Dir  string // relative to the repository root, e.g. deploy/overlays/prod
	Objs []runtime.Object
	Err  error
}

func (r *rendered) Deployments() (out []*appsv1.Deployment) {
	for _, o := range r.Objs {
		if d, ok := o.(*appsv1.Deployment); ok {
			out = append(out, d)
		}
	}
	return out
}

func (r *rendered) Jobs() (out []*batchv1.Job) {
	for _, o := range r.Objs {
		if j, ok := o.(*batchv1.Job); ok {
			out = append(out, j)
		}
	}
	return out
}

func (r *rendered) ConfigMap(name string) *corev1.ConfigMap {
	for _, o := range r.Objs {
		if c, ok := o.(*corev1.ConfigMap); ok && c.Name == name {
			return c
		}
	}
	return nil
}

func (r *rendered) Secret(name string) *corev1.Secret {
	for _, o := range r.Objs {
		if s, ok := o.(*corev1.Secret); ok && s.Name == name {
			return s
		}
	}
	return nil
}

func (r *rendered) isOverlay() bool { return strings.HasPrefix(r.Dir, "deploy/overlays/") }

// kustomizationDirs lists every buildable kustomization under deploy/
// (components are built as part of the overlays that include them).
func kustomizationDirs(t testing.TB) []string {
	t.Helper()
	var dirs []string
	root := repoPath("deploy")
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && d.Name() == "validate" {
			return filepath.SkipDir
		}
		switch d.Name() {
		case "kustomization.yaml", "kustomization.yml", "Kustomization":
		default:
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		var head struct{ Kind string }
		if err := yaml.Unmarshal(b, &head); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		if head.Kind == "Component" {
			return nil
		}
		dirs = append(dirs, filepath.Dir(path))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(dirs)
	if len(dirs) < 3 {
		t.Fatalf("found %d kustomizations under deploy/ (%v), want base, dev and prod", len(dirs), dirs)
	}
	return dirs
}

var (
	renderOnce sync.Once
	renderAll  []*rendered
)

// renderedAll builds every kustomization once per test binary.
func renderedAll(t testing.TB) []*rendered {
	t.Helper()
	renderOnce.Do(func() {
		for _, dir := range kustomizationDirs(t) {
			renderAll = append(renderAll, render(dir))
		}
	})
	return renderAll
}

func render(dir string) *rendered {
	rel, _ := filepath.Rel(repoRoot, dir)
	r := &rendered{Dir: filepath.ToSlash(rel)}
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	resMap, err := k.Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		r.Err = fmt.Errorf("kustomize build %s: %w", r.Dir, err)
		return r
	}
	var errs []string
	for _, res := range resMap.Resources() {
		y, err := res.AsYAML()
		if err != nil {
			errs = append(errs, fmt.Sprintf("%s: %v", res.CurId(), err))
			continue
		}
		obj, _, err := strictDecoder.Decode(y, nil, nil)
		if err != nil {
			errs = append(errs, fmt.Sprintf("%s: %v", res.CurId(), err))
			continue
		}
		r.Objs = append(r.Objs, obj)
	}
	if len(errs) > 0 {
		r.Err = fmt.Errorf("%s: strict decode:\n  %s", r.Dir, strings.Join(errs, "\n  "))
	}
	return r
}

// TestKustomizationsBuildAndDecodeStrictly builds every kustomization with
// the kustomize Go API (what `kubectl apply -k` runs) and decodes each
// object into its typed Go struct, refusing unknown or duplicate fields:
// a misspelt or misplaced field that kubectl would silently drop (or the
// API server reject at deploy time) fails here.
func TestKustomizationsBuildAndDecodeStrictly(t *testing.T) {
	for _, r := range renderedAll(t) {
		t.Run(r.Dir, func(t *testing.T) {
			if r.Err != nil {
				t.Fatal(r.Err)
			}
			kinds := map[string]int{}
			for _, o := range r.Objs {
				kinds[fmt.Sprintf("%T", o)]++
			}
			t.Logf("%d objects: %v", len(r.Objs), kinds)
			want := []string{"*v1.Deployment", "*v1.Service", "*v1.PodDisruptionBudget", "*v1.Job", "*v1.ConfigMap", "*v1.ServiceAccount", "*v1.NetworkPolicy"}
			if r.isOverlay() {
				want = append(want, "*v1.ServiceMonitor", "*v1.PrometheusRule")
			}
			for _, k := range want {
				if kinds[k] == 0 {
					t.Errorf("no %s in %s", k, r.Dir)
				}
			}
		})
	}
}

// built returns the kustomizations that built; the build test reports the
// others, so the tests that inspect objects skip them instead of failing
// twice.
func built(t *testing.T) []*rendered {
	var out []*rendered
	for _, r := range renderedAll(t) {
		if r.Err == nil {
			out = append(out, r)
		}
	}
	if len(out) == 0 {
		t.Fatal("no kustomization built")
	}
	return out
}
