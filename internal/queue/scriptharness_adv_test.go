package queue_test

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
)

// Test-only copies of the twelve scripts the refusal audit reordered
// (branch refusal-audit, abf3cd2..37a2252): the bodies that ship (read
// from this package's sources with go/parser and checked against each
// compiled script's SHA1) and the bodies before the reorder
// (testdata/scripts_before_reorder/<var>.lua, from 489861f, main at the
// time: see TestAdvRegenScriptsBeforeReorder), each with every
// redis.call sent through a hook that
//
//   - answers TIME with a fixed Unix ms, so two copies run on identical
//     states end in identical states;
//   - counts the calls and fails the n-th (0: none), as a refused command
//     does: an error, the script ends, its writes so far stay;
//   - logs each call ("cmd arg1 arg2") to a list.
//
// The hook's parameters ride at the end of ARGV (now, fail-at) and KEYS
// (the log key), and the prologue pops them, so a script's #ARGV and
// #KEYS are what the store sends.

// advScriptVars names the reordered scripts by the variable that holds
// each, in the order the audit's commits took them.
var advScriptVars = []string{
	"retryScript", "buryScript", "handBackScript", "enqueueScript", "cancelScript", "requeueScript",
	"requeueTasksScript", "forwardScript", "streamBuryScript", "putTaskScript", "releaseScript", "takeScript",
}

const advHookPrologue = `
local __failat = tonumber(table.remove(ARGV)) or 0
local __now = tonumber(table.remove(ARGV)) or 0
local __log = table.remove(KEYS)
local __n = 0
local function __call(cmd, ...)
  __n = __n + 1
  local a, b = ...
  redis.call('RPUSH', __log, string.lower(cmd) .. ' ' .. tostring(a) .. ' ' .. tostring(b))
  if __failat > 0 and __n == __failat then error({err = 'ERR adversary: call ' .. __n .. ' (' .. cmd .. ') refused'}) end
  if __now > 0 and string.upper(cmd) == 'TIME' then
    return {string.format('%d', math.floor(__now / 1000)), string.format('%d', (__now % 1000) * 1000)}
  end
  return redis.call(cmd, ...)
end
`

// hookScript is a copy of src with the hook.
func hookScript(src string) string {
	return advHookPrologue + strings.ReplaceAll(src, "redis.call(", "__call(")
}

// luaScriptSources parses the non-test Go files of dir and returns, per
// package-level variable whose value is redis.NewScript(expr), the Lua
// text expr evaluates to (string constants and literals joined by +).
func luaScriptSources(dir string) (map[string]string, error) {
	fset := token.NewFileSet()
	names, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		return nil, err
	}
	consts := map[string]ast.Expr{}
	scripts := map[string]ast.Expr{}
	for _, name := range names {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			return nil, err
		}
		for _, d := range f.Decls {
			g, ok := d.(*ast.GenDecl)
			if !ok {
				continue
			}
			for _, sp := range g.Specs {
				vs, ok := sp.(*ast.ValueSpec)
				if !ok || len(vs.Values) != len(vs.Names) {
					continue
				}
				for i, n := range vs.Names {
					v := vs.Values[i]
					if g.Tok == token.CONST {
						consts[n.Name] = v
						continue
					}
					c, ok := v.(*ast.CallExpr)
					if !ok || len(c.Args) != 1 {
						continue
					}
					if sel, ok := c.Fun.(*ast.SelectorExpr); ok && sel.Sel.Name == "NewScript" {
						scripts[n.Name] = c.Args[0]
					}
				}
			}
		}
	}
	var eval func(e ast.Expr) (string, error)
	eval = func(e ast.Expr) (string, error) {
		switch e := e.(type) {
		case *ast.BasicLit:
			if e.Kind != token.STRING {
				return "", fmt.Errorf("%s: not a string", fset.Position(e.Pos()))
			}
			return strconv.Unquote(e.Value)
		case *ast.Ident:
			c, ok := consts[e.Name]
			if !ok {
				return "", fmt.Errorf("%s: no constant %s", fset.Position(e.Pos()), e.Name)
			}
			return eval(c)
		case *ast.ParenExpr:
			return eval(e.X)
		case *ast.BinaryExpr:
			if e.Op != token.ADD {
				return "", fmt.Errorf("%s: operator %s", fset.Position(e.Pos()), e.Op)
			}
			x, err := eval(e.X)
			if err != nil {
				return "", err
			}
			y, err := eval(e.Y)
			return x + y, err
		}
		return "", fmt.Errorf("%s: cannot evaluate %T", fset.Position(e.Pos()), e)
	}
	out := map[string]string{}
	for name, e := range scripts {
		s, err := eval(e)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		out[name] = s
	}
	return out, nil
}

// shippedScripts are the reordered scripts as this package compiles
// them, checked against their SHA1s.
func shippedScripts(t testing.TB) map[string]string {
	t.Helper()
	all, err := luaScriptSources(".")
	if err != nil {
		t.Fatal(err)
	}
	hashes := queue.AdvScriptHashes()
	out := map[string]string{}
	for _, v := range advScriptVars {
		src, ok := all[v]
		if !ok {
			t.Fatalf("no %s in the package's sources", v)
		}
		sum := sha1.Sum([]byte(src))
		if got := hex.EncodeToString(sum[:]); got != hashes[v] {
			t.Fatalf("%s read from the sources hashes to %s, the compiled one to %s", v, got, hashes[v])
		}
		out[v] = src
	}
	return out
}

const beforeReorderDir = "testdata/scripts_before_reorder"

// scriptsBeforeReorder are the reordered scripts as they were before the
// refusal audit.
func scriptsBeforeReorder(t testing.TB) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, v := range advScriptVars {
		b, err := os.ReadFile(filepath.Join(beforeReorderDir, v+".lua"))
		if err != nil {
			t.Fatal(err)
		}
		out[v] = string(b)
	}
	return out
}

// The snapshot of the scripts before the reorder is made from main's
// sources of the time:
//
//	git archive 489861f internal/queue | tar -x -C /tmp/before
//	ORDERDELAY_ADV_BEFORE_DIR=/tmp/before/internal/queue go test ./internal/queue/ -run TestAdvRegenScriptsBeforeReorder
func TestAdvRegenScriptsBeforeReorder(t *testing.T) {
	dir := os.Getenv("ORDERDELAY_ADV_BEFORE_DIR")
	if dir == "" {
		t.Skip("set ORDERDELAY_ADV_BEFORE_DIR to the package's sources before the reorder to rewrite " + beforeReorderDir)
	}
	all, err := luaScriptSources(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(beforeReorderDir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, v := range advScriptVars {
		src, ok := all[v]
		if !ok {
			t.Fatalf("no %s in %s", v, dir)
		}
		if err := os.WriteFile(filepath.Join(beforeReorderDir, v+".lua"), []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// Each snapshot is a script the reorder changed (else the differential
// tests compare a script with itself).
func TestAdvScriptsBeforeReorderDifferFromShipped(t *testing.T) {
	before, after := scriptsBeforeReorder(t), shippedScripts(t)
	for _, v := range advScriptVars {
		if before[v] == after[v] {
			t.Errorf("%s: the snapshot before the reorder is the shipped script", v)
		}
	}
}

// advRoles names every key of k by its role.
func advRoles(k queue.Keys) [][2]string {
	return [][2]string{{"queue", k.Queue}, {"inflight", k.Inflight}, {"deadlines", k.Deadlines}, {"lease", k.Lease},
		{"leases", k.Leases}, {"leasebatch", k.LeaseBatch}, {"dead", k.Dead}, {"deadinfo", k.DeadInfo},
		{"wake", k.Wake}, {"paused", k.Paused}, {"payload", k.Payload}, {"stream", k.Stream}, {"ready", k.Ready},
		{"processing", k.Processing}, {"unacked", k.Unacked}, {"taken", k.Taken}, {"deliveries", k.Deliveries},
		{"deliveryids", k.DeliveryIDs}, {"deliveryseq", k.DeliverySeq}, {"meta", k.Meta}}
}

// The keys, by role, that the store sends a reliable list's take, ack and
// forward (to the ready list).
var (
	advTakeRoles    = []string{"ready", "processing", "unacked", "taken", "deliveries", "deliveryids", "deliveryseq"}
	advAckRoles     = []string{"processing", "unacked", "taken", "deliveries", "deliveryids"}
	advForwardRoles = []string{"queue", "payload", "paused", "ready", "dead", "deadinfo", "unacked", "taken", "processing", "deliveries", "deliveryids"}
)

func advKey(k queue.Keys, role string) string {
	for _, r := range advRoles(k) {
		if r[0] == role {
			return r[1]
		}
	}
	panic("no key role " + role)
}

func advRoleOf(k queue.Keys, key string) string {
	for _, r := range advRoles(k) {
		if r[1] == key {
			return r[0]
		}
	}
	return key
}

// advKeyRef is a key argument of a state's command, named by role.
type advKeyRef string

// advCmds is a state as the commands that write it, keys by role.
type advCmds [][]any

func (c advCmds) write(t testing.TB, rdb *redis.Client, k queue.Keys) {
	t.Helper()
	ctx := context.Background()
	p := rdb.Pipeline()
	for _, cmd := range c {
		args := make([]any, len(cmd))
		for i, a := range cmd {
			if r, ok := a.(advKeyRef); ok {
				a = advKey(k, string(r))
			}
			args[i] = a
		}
		p.Do(ctx, args...)
	}
	if _, err := p.Exec(ctx); err != nil {
		t.Fatalf("writing the state: %v", err)
	}
}

// advRun is one hooked run: its reply, error and calls.
type advRun struct {
	Reply any
	Err   error
	Calls [][3]string // command, first and second argument (keys by role)
}

// evalHooked runs src (a hooked copy) with keys (by role) and args on k,
// Redis's clock now, failing its failAt-th call (0: none).
func evalHooked(t testing.TB, rdb *redis.Client, src string, k queue.Keys, roles []string, args []any, now int64, failAt int) advRun {
	t.Helper()
	ctx := context.Background()
	logKey := k.Queue + ":advcalls"
	rdb.Del(ctx, logKey)
	keys := make([]string, 0, len(roles)+1)
	for _, r := range roles {
		keys = append(keys, advKey(k, r))
	}
	keys = append(keys, logKey)
	a := append(append([]any{}, args...), now, failAt)
	var run advRun
	run.Reply, run.Err = rdb.Eval(ctx, src, keys, a...).Result()
	if run.Err == redis.Nil {
		run.Reply, run.Err = nil, nil
	}
	l, err := rdb.LRange(ctx, logKey, 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	rdb.Del(ctx, logKey)
	for _, c := range l {
		f := strings.SplitN(c, " ", 3)
		for len(f) < 3 {
			f = append(f, "")
		}
		f[1] = advRoleOf(k, f[1])
		if f[0] != "publish" {
			f[2] = advRoleOf(k, f[2]) // LMOVE's second key; else an argument
		}
		run.Calls = append(run.Calls, [3]string{f[0], f[1], f[2]})
	}
	return run
}

// keyDump is one key's content, in the order Redis returns it.
type keyDump struct {
	Type, Enc string
	Z         []redis.Z
	H         []string // field, value, ... (HSCAN order: a listpack's own)
	L         []string
	S         string
	X         []string // stream: entries, then groups and their pending entries
}

// dumpAll reads every key of k. Stream entry IDs not in known (those a
// run added with '*', which differ between two runs) read as "*".
func dumpAll(t testing.TB, rdb *redis.Client, k queue.Keys, known map[string]bool) map[string]keyDump {
	return readKeys(t, rdb, advRoles(k), known)
}

// readKeys reads the keys of roles ({role, key} pairs), by role. Stream
// entry IDs not in known read as "*".
func readKeys(t testing.TB, rdb *redis.Client, roles [][2]string, known map[string]bool) map[string]keyDump {
	t.Helper()
	ctx := context.Background()
	out := map[string]keyDump{}
	for _, kn := range roles {
		var d keyDump
		var err error
		if d.Type, err = rdb.Type(ctx, kn[1]).Result(); err != nil {
			t.Fatal(err)
		}
		if d.Type != "none" {
			d.Enc, _ = rdb.ObjectEncoding(ctx, kn[1]).Result()
		}
		switch d.Type {
		case "zset":
			d.Z, err = rdb.ZRangeWithScores(ctx, kn[1], 0, -1).Result()
		case "hash":
			// HSCAN returns a listpack whole, in its order, in one call.
			var cur uint64
			for {
				var part []string
				part, cur, err = rdb.HScan(ctx, kn[1], cur, "*", 100000).Result()
				d.H = append(d.H, part...)
				if err != nil || cur == 0 {
					break
				}
			}
		case "list":
			d.L, err = rdb.LRange(ctx, kn[1], 0, -1).Result()
		case "string":
			d.S, err = rdb.Get(ctx, kn[1]).Result()
		case "stream":
			d.X, err = dumpStream(ctx, rdb, kn[1], known)
		}
		if err != nil {
			t.Fatal(err)
		}
		out[kn[0]] = d
	}
	return out
}

func dumpStream(ctx context.Context, rdb *redis.Client, key string, known map[string]bool) ([]string, error) {
	var out []string
	id := func(s string) string {
		if known[s] {
			return s
		}
		return "*"
	}
	ents, err := rdb.XRange(ctx, key, "-", "+").Result()
	if err != nil {
		return nil, err
	}
	for _, e := range ents {
		// XRANGE's values come back as a map: read them as Redis keeps them.
		raw, err := rdb.Do(ctx, "XRANGE", key, e.ID, e.ID).Slice()
		if err != nil {
			return nil, err
		}
		out = append(out, fmt.Sprintf("entry %s %v", id(e.ID), raw[0].([]any)[1]))
	}
	groups, err := rdb.XInfoGroups(ctx, key).Result()
	if err != nil {
		return nil, err
	}
	for _, g := range groups {
		out = append(out, fmt.Sprintf("group %s consumers %d pending %d last %s", g.Name, g.Consumers, g.Pending, id(g.LastDeliveredID)))
		pend, err := rdb.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: key, Group: g.Name, Start: "-", End: "+", Count: 1000}).Result()
		if err != nil {
			return nil, err
		}
		for _, p := range pend {
			out = append(out, fmt.Sprintf("pending %s %s %d", id(p.ID), p.Consumer, p.RetryCount))
		}
	}
	return out, nil
}

// dumpDiff lists how two dumps differ: content, encoding, and for
// listpacks the order of fields.
func dumpDiff(a, b map[string]keyDump) []string { return keyDiff(advRoles(queue.Keys{}), a, b) }

// keyDiff is dumpDiff over the keys of roles (their role names).
func keyDiff(roles [][2]string, a, b map[string]keyDump) []string {
	var out []string
	for _, kn := range roles {
		x, y := a[kn[0]], b[kn[0]]
		if x.Type != y.Type {
			out = append(out, fmt.Sprintf("%s: type %s before, %s after", kn[0], x.Type, y.Type))
			continue
		}
		if x.Enc != y.Enc {
			out = append(out, fmt.Sprintf("%s: encoding %s before, %s after", kn[0], x.Enc, y.Enc))
		}
		if !reflect.DeepEqual(x.Z, y.Z) {
			out = append(out, fmt.Sprintf("%s: %v before, %v after", kn[0], x.Z, y.Z))
		}
		if x.S != y.S {
			out = append(out, fmt.Sprintf("%s: %q before, %q after", kn[0], x.S, y.S))
		}
		if !slices.Equal(x.L, y.L) {
			out = append(out, fmt.Sprintf("%s: %q before, %q after", kn[0], x.L, y.L))
		}
		if !slices.Equal(x.X, y.X) {
			out = append(out, fmt.Sprintf("%s: %q before, %q after", kn[0], x.X, y.X))
		}
		if !slices.Equal(x.H, y.H) {
			mx, my := pairsMap(x.H), pairsMap(y.H)
			if !reflect.DeepEqual(mx, my) {
				out = append(out, fmt.Sprintf("%s: %q before, %q after", kn[0], sortedPairs(mx), sortedPairs(my)))
			} else if x.Enc == y.Enc && x.Enc != "hashtable" {
				out = append(out, fmt.Sprintf("%s: same fields, listpack order %q before, %q after", kn[0], x.H, y.H))
			}
		}
	}
	return out
}

// publishes is a run's PUBLISH calls, "channel role message".
func (r advRun) publishes() []string {
	var out []string
	for _, c := range r.Calls {
		if c[0] == "publish" {
			out = append(out, c[1]+" "+c[2])
		}
	}
	return out
}

// counts is a run's calls by command.
func (r advRun) counts() map[string]int {
	out := map[string]int{}
	for _, c := range r.Calls {
		out[c[0]]++
	}
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
