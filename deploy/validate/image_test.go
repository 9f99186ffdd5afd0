package validate

import (
	"bytes"
	"context"
	"debug/elf"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
)

type instruction struct {
	Cmd  string // upper case: FROM, RUN, ...
	Args string
	Line int
}

// parseDockerfile returns the instructions, continuation lines joined and
// comments dropped. Enough for this Dockerfile; no heredocs.
func parseDockerfile(t testing.TB) []instruction {
	t.Helper()
	b, err := os.ReadFile(repoPath("Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	var out []instruction
	var cur strings.Builder
	start := 0
	for i, line := range strings.Split(string(b), "\n") {
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, "#") || (trimmed == "" && cur.Len() == 0) {
			continue
		}
		if cur.Len() == 0 {
			start = i + 1
		}
		if s, ok := strings.CutSuffix(trimmed, "\\"); ok {
			cur.WriteString(s + " ")
			continue
		}
		cur.WriteString(trimmed)
		cmd, args, _ := strings.Cut(strings.TrimSpace(cur.String()), " ")
		out = append(out, instruction{Cmd: strings.ToUpper(cmd), Args: strings.TrimSpace(args), Line: start})
		cur.Reset()
	}
	return out
}

// finalStage returns the instructions of the last stage.
func finalStage(ins []instruction) []instruction {
	last := 0
	for i, in := range ins {
		if in.Cmd == "FROM" {
			last = i
		}
	}
	return ins[last:]
}

// dockerfileUID is the numeric UID of the runtime image's USER line.
func dockerfileUID(t testing.TB) int64 {
	t.Helper()
	for _, in := range finalStage(parseDockerfile(t)) {
		if in.Cmd != "USER" {
			continue
		}
		m := regexp.MustCompile(`^(\d+)(:(\d+))?$`).FindStringSubmatch(in.Args)
		if m == nil {
			t.Fatalf("Dockerfile:%d: USER %s is not numeric: the kubelet cannot verify runAsNonRoot for a named user and refuses the pod", in.Line, in.Args)
		}
		uid, _ := strconv.ParseInt(m[1], 10, 64)
		if uid == 0 {
			t.Fatalf("Dockerfile:%d: USER 0 is root", in.Line)
		}
		return uid
	}
	t.Fatal("Dockerfile: the runtime stage has no USER line (it would run as root)")
	return 0
}

// TestDockerfile checks the recipe's promises: static distroless nonroot
// runtime, numeric user, exec-form entrypoint, stamped static build.
func TestDockerfile(t *testing.T) {
	ins := parseDockerfile(t)
	final := finalStage(ins)
	from := final[0].Args
	if !strings.HasPrefix(from, "gcr.io/distroless/static") || !strings.Contains(from, ":nonroot") {
		t.Errorf("runtime stage FROM %s: want gcr.io/distroless/static*:nonroot (no shell, no libc)", from)
	}
	dockerfileUID(t)
	want := map[string][]string{"ENTRYPOINT": {"/orderdelay"}, "CMD": {"run"}}
	for _, in := range final {
		if w, ok := want[in.Cmd]; ok {
			var got []string
			if err := json.Unmarshal([]byte(in.Args), &got); err != nil {
				t.Errorf("Dockerfile:%d: %s %s is not exec (JSON) form: a shell form needs /bin/sh, which distroless lacks", in.Line, in.Cmd, in.Args)
			} else if strings.Join(got, " ") != strings.Join(w, " ") {
				t.Errorf("Dockerfile:%d: %s %v, want %v", in.Line, in.Cmd, got, w)
			}
			delete(want, in.Cmd)
		}
		if in.Cmd == "EXPOSE" && in.Args != "8080" {
			t.Errorf("Dockerfile:%d: EXPOSE %s; the daemon listens on 8080 by default", in.Line, in.Args)
		}
	}
	for k := range want {
		t.Errorf("runtime stage has no %s", k)
	}
	cmd := goBuildCommand(t, map[string]string{})
	line := strings.Join(cmd.env, " ") + " " + strings.Join(cmd.args, " ")
	for _, s := range []string{"CGO_ENABLED=0", "-trimpath", "-X main.version=", "-X main.revision=", "./cmd/orderdelay"} {
		if !strings.Contains(line, s) {
			t.Errorf("the image's go build lacks %q: %s", s, line)
		}
	}
}

type goBuild struct {
	env  []string // NAME=value assignments before `go`
	args []string // after `go build`
}

// goBuildCommand extracts the image's `go build` command from the Dockerfile,
// with build args expanded from vars (falling back to the ARG defaults).
func goBuildCommand(t testing.TB, vars map[string]string) goBuild {
	t.Helper()
	ins := parseDockerfile(t)
	defaults := map[string]string{}
	for _, in := range ins {
		if in.Cmd == "ARG" {
			for _, a := range strings.Fields(in.Args) {
				k, v, _ := strings.Cut(a, "=")
				defaults[k] = v
			}
		}
	}
	expand := func(s string) string {
		return os.Expand(s, func(k string) string {
			if v, ok := vars[k]; ok {
				return v
			}
			return defaults[k]
		})
	}
	for _, in := range ins {
		if in.Cmd != "RUN" || !strings.Contains(in.Args, "go build") {
			continue
		}
		words, err := shellWords(in.Args)
		if err != nil {
			t.Fatalf("Dockerfile:%d: %v", in.Line, err)
		}
		var b goBuild
		i := 0
		for ; i < len(words) && strings.HasPrefix(words[i], "--mount"); i++ {
		}
		for ; i < len(words) && words[i] != "go"; i++ {
			if !strings.Contains(words[i], "=") {
				t.Fatalf("Dockerfile:%d: cannot follow %q before `go build` (keep the RUN to env assignments and one go build)", in.Line, words[i])
			}
			b.env = append(b.env, expand(words[i]))
		}
		if i+1 >= len(words) || words[i+1] != "build" {
			t.Fatalf("Dockerfile:%d: no `go build` in %q", in.Line, in.Args)
		}
		for _, w := range words[i+2:] {
			if w == "&&" || w == ";" {
				t.Fatalf("Dockerfile:%d: keep `go build` the last command of its RUN", in.Line)
			}
			b.args = append(b.args, expand(w))
		}
		return b
	}
	t.Fatal("Dockerfile: no RUN with go build")
	return goBuild{}
}

// shellWords splits like sh for the simple cases a Dockerfile RUN uses:
// blanks separate words, quotes group, variables are left for expansion.
func shellWords(s string) ([]string, error) {
	var words []string
	var cur strings.Builder
	inWord := false
	var quote rune
	for _, r := range s {
		switch {
		case quote != 0:
			if r == quote {
				quote = 0
			} else {
				cur.WriteRune(r)
			}
		case r == '"' || r == '\'':
			quote, inWord = r, true
		case r == ' ' || r == '\t':
			if inWord {
				words = append(words, cur.String())
				cur.Reset()
				inWord = false
			}
		default:
			cur.WriteRune(r)
			inWord = true
		}
	}
	if quote != 0 {
		return nil, errUnterminatedQuote
	}
	if inWord {
		words = append(words, cur.String())
	}
	return words, nil
}

var errUnterminatedQuote = &os.PathError{Op: "parse", Path: "Dockerfile", Err: os.ErrInvalid}

var (
	daemonOnce sync.Once
	daemonBin  string
	daemonErr  error
	daemonDir  string
)

const (
	stampVersion  = "0.0.0-validate"
	stampRevision = "0123456789abcdef0123456789abcdef01234567"
)

func TestMain(m *testing.M) {
	flag.Parse()
	code := m.Run()
	if daemonDir != "" {
		os.RemoveAll(daemonDir)
	}
	os.Exit(code)
}

// daemonBinary builds ./cmd/orderdelay once per test run, with the
// Dockerfile's own go build command (no Docker engine needed). It skips
// while the package does not exist and fails on build errors once it does.
func daemonBinary(t *testing.T) string {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: skipping the daemon build")
	}
	if m, _ := filepath.Glob(repoPath("cmd", "orderdelay", "*.go")); len(m) == 0 {
		t.Skip("../../cmd/orderdelay does not exist yet: nothing to build (this test fails on build errors once it does)")
	}
	daemonOnce.Do(func() {
		daemonDir, daemonErr = os.MkdirTemp("", "orderdelay-validate-")
		if daemonErr != nil {
			return
		}
		b := goBuildCommand(t, map[string]string{
			"VERSION": stampVersion, "REVISION": stampRevision,
			"TARGETOS": runtime.GOOS, "TARGETARCH": runtime.GOARCH,
		})
		out := filepath.Join(daemonDir, "orderdelay")
		args := []string{"build"}
		for i := 0; i < len(b.args); i++ {
			if b.args[i] == "-o" && i+1 < len(b.args) {
				args = append(args, "-o", out)
				i++
				continue
			}
			args = append(args, b.args[i])
		}
		ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, "go", args...)
		cmd.Dir = repoRoot
		cmd.Env = append(os.Environ(), b.env...)
		t.Logf("%s go %s", strings.Join(b.env, " "), strings.Join(args, " "))
		if msg, err := cmd.CombinedOutput(); err != nil {
			daemonErr = fmt.Errorf("go build (the Dockerfile's command) failed: %v\n%s", err, msg)
			return
		}
		daemonBin = out
	})
	if daemonErr != nil {
		t.Fatal(daemonErr)
	}
	return daemonBin
}

// TestBinaryBuiltLikeTheImage checks the binary the Dockerfile builds is
// static -- it must run on distroless/static, which has no libc or dynamic
// loader -- and reports the stamped version and revision.
func TestBinaryBuiltLikeTheImage(t *testing.T) {
	out := daemonBinary(t)
	const version, revision = stampVersion, stampRevision
	f, err := elf.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Error("the binary has a PT_INTERP header (dynamically linked): it cannot start on distroless/static")
		}
	}
	if libs, _ := f.ImportedLibraries(); len(libs) > 0 {
		t.Errorf("the binary needs shared libraries %v", libs)
	}

	vctx, vcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer vcancel()
	v := exec.CommandContext(vctx, out, "version")
	v.Env = []string{"PATH=/nonexistent"} // as in distroless: nothing else
	var buf bytes.Buffer
	v.Stdout, v.Stderr = &buf, &buf
	if err := v.Run(); err != nil {
		t.Fatalf("orderdelay version: %v\n%s", err, buf.String())
	}
	got := buf.String()
	t.Logf("orderdelay version: %s", strings.TrimSpace(got))
	if !strings.Contains(got, version) {
		t.Errorf("`orderdelay version` does not show the stamped version %q (main.version): %q", version, got)
	}
	if !strings.Contains(got, revision[:7]) {
		t.Errorf("`orderdelay version` does not show the stamped revision %q (main.revision): %q", revision, got)
	}
}

// TestDockerignoreKeepsBuildInputs lists every file `go build
// ./cmd/orderdelay` reads from the repository (Go files and embedded files
// of the main module's packages, go.mod, go.sum) and checks .dockerignore
// does not exclude any of them.
func TestDockerignoreKeepsBuildInputs(t *testing.T) {
	patterns := dockerignore(t)
	if m, _ := filepath.Glob(repoPath("cmd", "orderdelay", "*.go")); len(m) == 0 {
		t.Skip("../../cmd/orderdelay does not exist yet")
	}
	cmd := exec.Command("go", "list", "-deps", "-f",
		`{{if .Module}}{{if .Module.Main}}{{$d := .Dir}}{{range .GoFiles}}{{$d}}/{{.}}
{{end}}{{range .EmbedFiles}}{{$d}}/{{.}}
{{end}}{{end}}{{end}}`, "./cmd/orderdelay")
	cmd.Dir = repoRoot
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	root, _ := filepath.Abs(repoRoot)
	files := []string{"go.mod", "go.sum"}
	for _, f := range strings.Fields(string(out)) {
		rel, err := filepath.Rel(root, f)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, filepath.ToSlash(rel))
	}
	for _, f := range files {
		if p := ignoredBy(patterns, f); p != "" {
			t.Errorf(".dockerignore pattern %q excludes %s, which the build needs", p, f)
		}
	}
	t.Logf("%d build inputs, none ignored", len(files))
}

type ignorePattern struct {
	pat    string
	negate bool
}

func dockerignore(t testing.TB) []ignorePattern {
	t.Helper()
	b, err := os.ReadFile(repoPath(".dockerignore"))
	if err != nil {
		t.Fatal(err)
	}
	var out []ignorePattern
	for _, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		p := ignorePattern{pat: line}
		if s, ok := strings.CutPrefix(line, "!"); ok {
			p = ignorePattern{pat: s, negate: true}
		}
		if strings.Contains(p.pat, "**") {
			t.Fatalf(".dockerignore %q: this check does not implement **; spell the pattern out", line)
		}
		p.pat = strings.TrimPrefix(filepath.Clean(p.pat), "/")
		out = append(out, p)
	}
	return out
}

// ignoredBy reports the pattern that leaves path excluded ("" if kept).
// Docker semantics: a pattern matches the path or any of its parent
// directories; the last matching pattern wins.
func ignoredBy(patterns []ignorePattern, path string) string {
	excludedBy := ""
	for _, p := range patterns {
		matched := false
		for prefix := path; prefix != "." && prefix != "/"; prefix = filepath.Dir(prefix) {
			if ok, _ := filepath.Match(p.pat, prefix); ok {
				matched = true
				break
			}
		}
		if !matched {
			continue
		}
		if p.negate {
			excludedBy = ""
		} else {
			excludedBy = p.pat
		}
	}
	return excludedBy
}

// TestDaemonAcceptsRenderedSettings runs the real binary with each rendered
// container's settings (ConfigMap and literal env; the secrets replaced by
// unreachable loopback URLs) and fails if it refuses them as invalid
// configuration (exit status 2), e.g. a drain timeout above the lease or a
// malformed duration. `inspect` is used because it validates every setting
// and then only reads: against 127.0.0.1:1 it fails fast with status 1.
func TestDaemonAcceptsRenderedSettings(t *testing.T) {
	bin := daemonBinary(t)
	placeholders := map[string]string{
		"ORDERDELAY_REDIS_URL":    "redis://127.0.0.1:1/0",
		"ORDERDELAY_DATABASE_URL": "postgres://127.0.0.1:1/orderdelay?sslmode=disable",
		"ORDERDELAY_API_TOKEN":    "validate-token-0123456789",
		"ORDERDELAY_ADMIN_TOKEN":  "validate-admin-token-0123456789",
	}
	seen := map[string]bool{}
	for _, r := range built(t) {
		var pods []*corev1.PodSpec
		for _, d := range r.Deployments() {
			pods = append(pods, &d.Spec.Template.Spec)
		}
		for _, j := range r.Jobs() {
			pods = append(pods, &j.Spec.Template.Spec)
		}
		for _, spec := range pods {
			for i := range spec.Containers {
				c := &spec.Containers[i]
				var env []string
				for name, v := range containerEnv(t, r, c) {
					switch {
					case v.Source == "secret" && optionalSecrets[name] && r.Secret(v.Ref.SecretKeyRef.Name) != nil:
						// A generated (dev) Secret: check its real tokens
						// (long enough, admin token not a producer token).
						env = append(env, name+"="+string(r.Secret(v.Ref.SecretKeyRef.Name).Data[v.Ref.SecretKeyRef.Key]))
					case placeholders[name] != "":
						env = append(env, name+"="+placeholders[name])
					case strings.HasPrefix(name, "ORDERDELAY_") && (v.Source == "configmap" || v.Source == "literal"):
						env = append(env, name+"="+v.Value)
					}
				}
				sort.Strings(env)
				key := strings.Join(env, "\n")
				if seen[key] {
					continue
				}
				seen[key] = true
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				cmd := exec.CommandContext(ctx, bin, "inspect")
				cmd.Env = env
				msg, err := cmd.CombinedOutput()
				cancel()
				var exit *exec.ExitError
				if errors.As(err, &exit) && exit.ExitCode() == 2 {
					t.Errorf("%s: container %s: the daemon refuses these settings:\n%s", r.Dir, c.Name, msg)
				}
			}
		}
	}
	if len(seen) == 0 {
		t.Fatal("no container settings checked")
	}
	t.Logf("%d distinct settings sets accepted", len(seen))
}
