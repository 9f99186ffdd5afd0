package preflight

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// daemonSources are the daemon's production Go files: the module's
// packages the daemon links, without tests, test helpers and the
// separate programs (bench, the worker library, examples).
func daemonSources(t *testing.T) map[string]string {
	t.Helper()
	root := filepath.Join("..", "..")
	out := map[string]string{}
	for _, dir := range []string{"client", "cmd", "internal"} {
		err := filepath.WalkDir(filepath.Join(root, dir), func(path string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() && (d.Name() == "testenv" || d.Name() == "testdata") {
				return filepath.SkipDir
			}
			if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return nil
			}
			b, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			rel, _ := filepath.Rel(root, path)
			out[filepath.ToSlash(rel)] = string(b)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return out
}

func command(name string) *Command {
	for i := range commands {
		if commands[i].Name == name {
			return &commands[i]
		}
	}
	return nil
}

// containers are the commands whose first argument is a subcommand, which
// ACL rules can name on their own (-object|encoding).
var containers = []string{"ACL", "CLIENT", "CLUSTER", "COMMAND", "CONFIG", "DEBUG", "FUNCTION", "LATENCY", "MEMORY",
	"MODULE", "OBJECT", "PUBSUB", "SCRIPT", "SLOWLOG", "XGROUP", "XINFO"}

// TestCommandsCoverTheScripts: every command a Lua script of the daemon
// calls is in commands, and one it calls with redis.call (whose refusal
// fails the script, keeping its earlier writes) is not optional.
func TestCommandsCoverTheScripts(t *testing.T) {
	call := regexp.MustCompile(`redis\.(p?call)\(\s*(?:['"]([A-Za-z]+)['"]|([^'"\s,)]+))(?:\s*,\s*['"]([A-Za-z]+)['"])?`)
	// bulk(cmd, key, args) of package queue's helpers calls redis.call(cmd, ...).
	bulk := regexp.MustCompile(`\bbulk\(\s*['"]([A-Za-z]+)['"]`)
	found := map[string]bool{}
	check := func(file, name, sub, how string) {
		name = strings.ToUpper(name)
		if slices.Contains(containers, name) {
			name += " " + strings.ToUpper(sub)
		}
		found[name] = true
		c := command(name)
		switch {
		case c == nil:
			t.Errorf("%s: a script calls %s, which preflight's commands lack: add it (with what ACL DRYRUN is asked) and to README's Redis permissions", file, name)
		case how == "call" && c.Optional != "":
			t.Errorf("%s: a script calls %s with redis.call, so a refusal fails the script: it cannot be optional (ask it with pcall, before any write, or make it required)", file, name)
		}
	}
	for file, src := range daemonSources(t) {
		for _, m := range call.FindAllStringSubmatch(src, -1) {
			switch {
			case m[2] != "":
				check(file, m[2], m[4], m[1])
			case m[3] == "cmd" && strings.Contains(src, "local function bulk(cmd"):
				// bulk's calls are found below.
			default:
				t.Errorf("%s: a script calls redis.%s(%s, ...): a command named by a variable; teach this test where its names come from", file, m[1], m[3])
			}
		}
		for _, m := range bulk.FindAllStringSubmatch(src, -1) {
			check(file, m[1], "", "call")
		}
	}
	// The scan saw the scripts: the claim's commands among them.
	for _, want := range []string{"ZADD", "HDEL", "ZREMRANGEBYRANK", "OBJECT ENCODING", "PUBLISH", "TIME"} {
		if !found[want] {
			t.Errorf("no script calls %s: did the scan miss package queue's scripts?", want)
		}
	}
	if c := command("OBJECT ENCODING"); c == nil || c.Optional == "" {
		t.Error("OBJECT ENCODING is asked with pcall before the claim's first write: it should be optional")
	}
}

// TestCommandsCoverTheDirectCalls: every go-redis command method the
// daemon calls sends a command in commands.
func TestCommandsCoverTheDirectCalls(t *testing.T) {
	// What each go-redis method the daemon calls sends ("": nothing of its
	// own). A method not here fails the test: add it, and its command to
	// commands.
	sends := map[string]string{
		"ConfigGet": "CONFIG GET", "Del": "DEL", "EvalSha": "EVALSHA", "Eval": "EVAL", "Exists": "EXISTS",
		"Get": "GET", "HDel": "HDEL", "HGet": "HGET", "HMGet": "HMGET", "HSet": "HSET", "Info": "INFO",
		"Ping": "PING", "Pipelined": "", "Publish": "PUBLISH", "ScriptLoad": "SCRIPT LOAD",
		"SetNX":     "SETNX", // with no expiry, as the pause sets it
		"Subscribe": "SUBSCRIBE", "Unsubscribe": "UNSUBSCRIBE", "Time": "TIME",
		"XAdd": "XADD", "XInfoGroups": "XINFO GROUPS", "XPendingExt": "XPENDING",
		"ZAdd": "ZADD", "ZCard": "ZCARD", "ZRange": "ZRANGE", "ZRangeArgsWithScores": "ZRANGE",
		"ZRangeWithScores": "ZRANGE", "ZScore": "ZSCORE",
	}
	methods := map[string]bool{"Subscribe": true} // UniversalClient's, not Cmdable's
	// Cmdable's, and a subscription's (PubSub: Subscribe, Unsubscribe, Ping, ...).
	for _, ct := range []reflect.Type{reflect.TypeFor[redis.Cmdable](), reflect.TypeFor[*redis.PubSub]()} {
		for i := range ct.NumMethod() {
			methods[ct.Method(i).Name] = true
		}
	}
	// Methods of other types that share a name with one of go-redis's.
	for _, other := range []string{
		"Shutdown", // http.Server's
	} {
		delete(methods, other)
	}
	// Raw commands: Process and Do, only where this test knows what they send.
	raw := map[string]string{
		"internal/queue/once.go":            "EVALSHA", // runOnce
		"internal/queue/claimreply.go":      "EVALSHA", // runClaim
		"internal/preflight/permissions.go": "",        // ACL WHOAMI, ACL DRYRUN: the check's own
	}
	call := regexp.MustCompile(`\.([A-Z]\w*)\(\s*(?:ctx|context\.\w+\(\)|r\.Context\(\)|\w*[cC]tx)\s*[,)]`)
	seen := 0
	for file, src := range daemonSources(t) {
		for _, m := range call.FindAllStringSubmatch(src, -1) {
			name := m[1]
			if name == "Process" || name == "Do" {
				if _, ok := raw[file]; !ok {
					t.Errorf("%s: %s sends a raw command: tell this test which (raw) and add it to commands", file, name)
				}
				continue
			}
			if !methods[name] {
				continue
			}
			seen++
			cmd, ok := sends[name]
			switch {
			case !ok:
				t.Errorf("%s: calls go-redis %s: tell this test what it sends (sends) and add that to commands", file, name)
			case cmd != "" && command(cmd) == nil:
				t.Errorf("%s: go-redis %s sends %s, which commands lack", file, name, cmd)
			}
		}
	}
	if seen < 20 {
		t.Errorf("found %d go-redis calls: did the scan miss the sources?", seen)
	}
	for _, cmd := range raw {
		if cmd != "" && command(cmd) == nil {
			t.Errorf("commands lack %s", cmd)
		}
	}
	for _, name := range []string{"EVALSHA", "EVAL", "SCRIPT LOAD"} { // Script.Run and Load
		if command(name) == nil {
			t.Errorf("commands lack %s", name)
		}
	}
}

// TestTargetsCoverTheKeys: every key of queue.Keys is asked about, as one
// kind; the wake channel as a channel and, since scripts get it in KEYS, a
// key of EVALSHA and EVAL.
func TestTargetsCoverTheKeys(t *testing.T) {
	k := queue.NewKeys("q")
	ts := targets(k)
	v := reflect.ValueOf(k)
	for i := range v.NumField() {
		key := v.Field(i).String()
		var kinds []Target
		for on, keys := range ts {
			if on != AnyKey && slices.Contains(keys, key) {
				kinds = append(kinds, on)
			}
		}
		if len(kinds) != 1 {
			t.Errorf("Keys.%s (%s) is in %d kinds of targets, want 1", v.Type().Field(i).Name, key, len(kinds))
		}
		if !slices.Contains(ts[AnyKey], key) {
			t.Errorf("Keys.%s (%s) is not a key of EVALSHA's dry run", v.Type().Field(i).Name, key)
		}
	}
}

// aclServer is a private redis-server (with extra server arguments) that
// has user "od" with password "pw" and rules; it returns a client logged
// in as od and the server's address.
func aclServer(t *testing.T, serverArgs []string, rules ...string) (*redis.Client, string) {
	t.Helper()
	admin, addr := testenv.PrivateRedisWith(t, nil, serverArgs...)
	ctx := context.Background()
	if err := admin.Do(ctx, append([]any{"acl", "setuser", "od", "on", ">pw"}, toArgs(rules)...)...).Err(); err != nil {
		t.Fatalf("ACL SETUSER od %v: %v", rules, err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: addr, Username: "od", Password: "pw"})
	t.Cleanup(func() { rdb.Close() })
	return rdb, addr
}

// permissions runs Permissions on the order queue key and two shards,
// and returns its error, its warnings and the redis_permissions gauge.
func permissions(t *testing.T, rdb redis.UniversalClient) (error, *observer.ObservedLogs, float64) {
	t.Helper()
	m := metrics.New(prometheus.NewRegistry(), "test", "test")
	core, logs := observer.New(zap.InfoLevel)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	keys := append([]queue.Keys{queue.NewKeys(queue.DefaultKey)}, queue.ShardKeys(queue.DefaultKey, 2)...)
	err := Permissions(ctx, rdb, Queues{Orders: keys}, m, zap.New(core))
	return err, logs, warning(m, metrics.CheckRedisPermissions)
}

func warnings(logs *observer.ObservedLogs) []observer.LoggedEntry {
	return logs.FilterLevelExact(zap.WarnLevel).All()
}

// TestPermissionsPassTheFullUser: the default user may run everything;
// every dry run is answered OK (their arguments fit each command).
func TestPermissionsPassTheFullUser(t *testing.T) {
	rdb, _ := testenv.PrivateRedis(t)
	err, logs, gauge := permissions(t, rdb)
	if err != nil || len(warnings(logs)) != 0 || gauge != 0 {
		t.Fatalf("Permissions: %v, warnings %v, gauge %v; want nil, none, 0", err, warnings(logs), gauge)
	}
	if logs.FilterMessageSnippet("redis permissions checked").Len() != 1 {
		t.Errorf("log: %v", logs.All())
	}
}

// TestPermissionsWarnWithoutObject: OBJECT is asked with pcall, so a user
// without it only warns (and raises the gauge); the daemon starts.
func TestPermissionsWarnWithoutObject(t *testing.T) {
	rdb, _ := aclServer(t, nil, "~*", "&*", "+@all", "-object")
	err, logs, gauge := permissions(t, rdb)
	if err != nil {
		t.Fatalf("Permissions: %v, want nil (OBJECT is optional)", err)
	}
	ws := warnings(logs)
	if len(ws) != 1 || !strings.Contains(ws[0].Message, "OBJECT ENCODING") || !strings.Contains(ws[0].Message, "listpack") || gauge != 1 {
		t.Fatalf("warnings %v, gauge %v; want one naming OBJECT ENCODING and what it costs, gauge 1", ws, gauge)
	}
}

// TestPermissionsRefuseAMissingCommand: a user without a command a script
// calls is an error that names the command and the user.
func TestPermissionsRefuseAMissingCommand(t *testing.T) {
	for _, cmd := range []string{"hdel", "zremrangebyrank"} {
		t.Run(cmd, func(t *testing.T) {
			rdb, _ := aclServer(t, nil, "~*", "&*", "+@all", "-"+cmd)
			err, _, _ := permissions(t, rdb)
			var pe *PermissionError
			if !errors.As(err, &pe) {
				t.Fatalf("Permissions: %v, want a *PermissionError", err)
			}
			msg := err.Error()
			for _, want := range []string{strings.ToUpper(cmd), `user "od"`, "{" + queue.DefaultKey + "}:"} {
				if !strings.Contains(msg, want) {
					t.Errorf("error %q does not name %s", msg, want)
				}
			}
			for _, r := range pe.Refusals {
				if r.Command != strings.ToUpper(cmd) {
					t.Errorf("refusal %+v: only %s is refused", r, cmd)
				}
			}
		})
	}
}

// TestPermissionsRefuseKeysOutsideThePattern: a key pattern that covers
// the queue key but not its companions ({Q}:*), or not the shards, is an
// error naming the key.
func TestPermissionsRefuseKeysOutsideThePattern(t *testing.T) {
	q := queue.DefaultKey
	t.Run("companions", func(t *testing.T) {
		rdb, _ := aclServer(t, nil, "~"+q, "~"+q+"#*", "~{"+q+"#*", "&*", "+@all")
		err, _, _ := permissions(t, rdb)
		var pe *PermissionError
		if !errors.As(err, &pe) || !strings.Contains(err.Error(), "{"+q+"}:inflight") || !strings.Contains(err.Error(), "key patterns") {
			t.Fatalf("Permissions: %v, want a *PermissionError naming {%s}:inflight, outside the key patterns", err, q)
		}
		for _, r := range pe.Refusals {
			if r.Denied != DeniedKey || !strings.HasPrefix(r.Target, "{"+q+"}:") {
				t.Errorf("refusal %+v: want only the companions' keys refused", r)
			}
		}
		if len(pe.Refusals) < 19 {
			t.Errorf("%d refusals, want every companion of the queue key refused", len(pe.Refusals))
		}
	})
	t.Run("shards", func(t *testing.T) {
		rdb, _ := aclServer(t, nil, "~"+q, "~{"+q+"}:*", "&*", "+@all")
		err, _, _ := permissions(t, rdb)
		shard := queue.ShardKey(q, 0)
		if pe := (*PermissionError)(nil); !errors.As(err, &pe) || !strings.Contains(err.Error(), shard) {
			t.Fatalf("Permissions: %v, want a *PermissionError naming shard key %s", err, shard)
		}
	})
	t.Run("channel", func(t *testing.T) {
		// Redis 7's default for a new user: no channels (acl-pubsub-default
		// resetchannels). The scripts PUBLISH on the wake channel.
		rdb, _ := aclServer(t, nil, "~*", "resetchannels", "+@all")
		err, _, _ := permissions(t, rdb)
		if pe := (*PermissionError)(nil); !errors.As(err, &pe) || !strings.Contains(err.Error(), "PUBLISH") ||
			!strings.Contains(err.Error(), "channels {"+q+"}:wake") {
			t.Fatalf("Permissions: %v, want a *PermissionError naming PUBLISH on channel {%s}:wake", err, q)
		}
	})
}

// TestPermissionsRefuseARenamedCommand: ACL DRYRUN does not know a command
// renamed away (rename-command); one the daemon needs is an error that
// says so, an optional one a warning.
func TestPermissionsRefuseARenamedCommand(t *testing.T) {
	rdb, _ := testenv.PrivateRedisWith(t, nil, "--rename-command", "HDEL", "hdel_renamed", "--rename-command", "OBJECT", "")
	err, _, _ := permissions(t, rdb)
	var pe *PermissionError
	if !errors.As(err, &pe) || !strings.Contains(err.Error(), "HDEL") || !strings.Contains(err.Error(), "rename-command") {
		t.Fatalf("Permissions: %v, want a *PermissionError naming HDEL and rename-command", err)
	}
	for _, r := range pe.Refusals {
		if r.Command != "HDEL" {
			t.Errorf("refusal %+v: only HDEL is needed and renamed", r)
		}
	}

	rdb, _ = testenv.PrivateRedisWith(t, nil, "--rename-command", "OBJECT", "")
	err, logs, gauge := permissions(t, rdb)
	if ws := warnings(logs); err != nil || len(ws) != 1 || !strings.Contains(ws[0].Message, "OBJECT ENCODING") || gauge != 1 {
		t.Fatalf("OBJECT renamed: %v, warnings %v, gauge %v; want nil, one warning naming OBJECT ENCODING, 1", err, ws, gauge)
	}
}

// TestPermissionsSkipWithoutDryRun: a user who may not run ACL DRYRUN (or
// a Redis before 7.0) cannot be checked: one warning, and the daemon
// starts.
func TestPermissionsSkipWithoutDryRun(t *testing.T) {
	for name, rules := range map[string][]string{
		"dryrun": {"~*", "&*", "+@all", "-acl|dryrun"},
		"whoami": {"~*", "&*", "+@all", "-acl|whoami"},
	} {
		t.Run(name, func(t *testing.T) {
			rdb, _ := aclServer(t, nil, rules...)
			err, logs, gauge := permissions(t, rdb)
			ws := warnings(logs)
			if err != nil || len(ws) != 1 || !strings.Contains(ws[0].Message, "not checked") || gauge != 0 {
				t.Fatalf("Permissions: %v, warnings %v, gauge %v; want nil, one saying the check was skipped, 0", err, ws, gauge)
			}
			if why := ws[0].ContextMap()["why"]; !strings.Contains(why.(string), "NOPERM") {
				t.Errorf("why %q: want the server's refusal", why)
			}
		})
	}
}

// replyHook answers the commands whose name (first two words, lower
// case) is in replies with the value or error given, without sending them.
type replyHook map[string]any

func (replyHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h replyHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.answer(cmd) {
			return cmd.Err()
		}
		return next(ctx, cmd)
	}
}

func (h replyHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		var rest []redis.Cmder
		for _, c := range cmds {
			if !h.answer(c) {
				rest = append(rest, c)
			}
		}
		if len(rest) == 0 {
			return nil
		}
		return next(ctx, rest)
	}
}

func (h replyHook) answer(cmd redis.Cmder) bool {
	args := cmd.Args()
	if len(args) < 2 {
		return false
	}
	a, _ := args[0].(string)
	b, _ := args[1].(string)
	v, ok := h[strings.ToLower(a+" "+b)]
	if !ok {
		return false
	}
	c, ok := cmd.(*redis.Cmd)
	if !ok {
		return false
	}
	if err, isErr := v.(error); isErr {
		c.SetErr(err)
	} else {
		c.SetVal(v)
	}
	return true
}

// proto is a reply error as the server sends it.
type proto string

func (e proto) Error() string { return string(e) }
func (proto) RedisError()     {}

// TestPermissionsOddReplies: answers the check does not expect — Redis
// 6.2's "unknown subcommand", a number where OK or a refusal belongs, no
// user name — skip the check with a warning that quotes them; none
// panics, none stops the daemon.
func TestPermissionsOddReplies(t *testing.T) {
	for name, replies := range map[string]replyHook{
		"redis 6.2":     {"acl dryrun": proto("ERR Unknown subcommand or wrong number of arguments for 'DRYRUN'. Try ACL HELP.")},
		"number":        {"acl dryrun": int64(7)},
		"nil":           {"acl dryrun": nil},
		"array":         {"acl dryrun": []any{"OK"}},
		"whoami number": {"acl whoami": int64(1)},
		"whoami empty":  {"acl whoami": ""},
		"unknown user":  {"acl dryrun": proto("ERR User 'od' not found")},
	} {
		t.Run(name, func(t *testing.T) {
			rdb, _ := testenv.PrivateRedis(t)
			rdb.AddHook(replies)
			err, logs, _ := permissions(t, rdb)
			ws := warnings(logs)
			if err != nil || len(ws) != 1 || !strings.Contains(ws[0].Message, "not checked") {
				t.Fatalf("Permissions: %v, warnings %v; want nil and one warning that the check was skipped", err, ws)
			}
		})
	}
}

// TestWatchPermissionsRetriesUnreachableRedis: a Redis that cannot be
// asked is no verdict: WatchPermissions warns and asks again until ctx
// ends, and then returns ctx's error, not a *PermissionError.
func TestWatchPermissionsRetriesUnreachableRedis(t *testing.T) {
	port, err := testenv.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + strconv.Itoa(port), MaxRetries: -1})
	defer rdb.Close()
	core, logs := observer.New(zap.WarnLevel)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- WatchPermissions(ctx, rdb, Queues{Orders: []queue.Keys{queue.NewKeys("q")}}, metrics.New(prometheus.NewRegistry(), "t", "t"), zap.New(core))
	}()
	testenv.WaitFor(t, "a retry warning", time.Minute, func() bool {
		return logs.FilterMessageSnippet("not checked yet; retrying").Len() > 0
	})
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("WatchPermissions: %v, want context.Canceled", err)
	}
}

// TestPermissionsOnEveryClusterMaster: on Redis Cluster every master is
// asked; one that refuses a command is named by its address.
func TestPermissionsOnEveryClusterMaster(t *testing.T) {
	c := testenv.PrivateCluster(t)
	ctx := context.Background()
	for i, a := range c.Addrs {
		n := redis.NewClient(&redis.Options{Addr: a})
		rules := []any{"acl", "setuser", "od", "on", ">pw", "~*", "&*", "+@all"}
		if i == 1 {
			rules = append(rules, "-hdel")
		}
		if err := n.Do(ctx, rules...).Err(); err != nil {
			t.Fatal(err)
		}
		n.Close()
	}
	o, err := redis.ParseClusterURL(c.URL())
	if err != nil {
		t.Fatal(err)
	}
	o.Username, o.Password = "od", "pw"
	rdb := redis.NewClusterClient(o)
	defer rdb.Close()
	err, _, _ = permissions(t, rdb)
	var pe *PermissionError
	if !errors.As(err, &pe) || !strings.Contains(err.Error(), "HDEL") || !strings.Contains(err.Error(), c.Addrs[1]) {
		t.Fatalf("Permissions: %v, want a *PermissionError naming HDEL at %s", err, c.Addrs[1])
	}
	for _, r := range pe.Refusals {
		if r.Addr != c.Addrs[1] {
			t.Errorf("refusal %+v at another master", r)
		}
	}

	err, logs, _ := permissions(t, c.Client(t))
	if err != nil || len(warnings(logs)) != 0 {
		t.Fatalf("default user on the cluster: %v, warnings %v", err, warnings(logs))
	}
}

// readmePermissions is README's "Redis permissions" section and its least
// user's ACL file line ("user orderdelay on >PASSWORD ...").
func readmePermissions(t *testing.T) (section, user string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(b), "\n### Redis permissions\n")
	if !ok {
		t.Fatal("README has no Redis permissions section")
	}
	section, _, _ = strings.Cut(section, "\n## ")
	_, line, ok := strings.Cut(section, "\nuser orderdelay on >PASSWORD ")
	if !ok {
		t.Fatal("README's Redis permissions section has no line user orderdelay on >PASSWORD ...")
	}
	line, _, _ = strings.Cut(line, "\n")
	return section, "user orderdelay on >PASSWORD " + line
}

// TestREADMEListsThePermissions: README's Redis permissions section names
// every command, and its least user grants each.
func TestREADMEListsThePermissions(t *testing.T) {
	section, user := readmePermissions(t)
	rules := strings.Fields(user)
	for _, c := range commands {
		if !strings.Contains(section, "`"+c.Name+"`") {
			t.Errorf("README's Redis permissions section does not list `%s`", c.Name)
		}
		if rule := "+" + strings.ToLower(strings.ReplaceAll(c.Name, " ", "|")); !slices.Contains(rules, rule) {
			t.Errorf("README's least user lacks %s", rule)
		}
	}
}

// TestPermissionsPassTheLeastUser: a server whose ACL file is README's
// least user line takes it, and that user passes, with no warning, on the
// default queue with shards.
func TestPermissionsPassTheLeastUser(t *testing.T) {
	_, user := readmePermissions(t)
	acl := filepath.Join(t.TempDir(), "users.acl")
	line := strings.Replace(user, ">PASSWORD", ">pw", 1)
	if err := os.WriteFile(acl, []byte("user default on nopass ~* &* +@all\n"+line+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, addr := testenv.PrivateRedisWith(t, nil, "--aclfile", acl)
	rdb := redis.NewClient(&redis.Options{Addr: addr, Username: "orderdelay", Password: "pw"})
	defer rdb.Close()
	err, logs, gauge := permissions(t, rdb)
	if err != nil || len(warnings(logs)) != 0 || gauge != 0 {
		t.Fatalf("Permissions: %v, warnings %v, gauge %v; want nil, none, 0", err, warnings(logs), gauge)
	}
}

// TestWatchPermissionsSaysRedisIsDownAndGoesOnWhenItAnswers: while Redis
// cannot be asked, the consumers wait for this check, so it is the check
// that must say Redis is down (dependency_up); its retries back off from
// well under DefaultRedisRetry up to it, like the database's, so a short
// outage at start-up does not hold the consumers for a whole
// DefaultRedisRetry after Redis is back; and once Redis answers it
// returns nil with Redis up.
func TestWatchPermissionsSaysRedisIsDownAndGoesOnWhenItAnswers(t *testing.T) {
	_, addr := testenv.PrivateRedis(t)
	px := testenv.NewProxy(t, addr)
	px.Down()
	rdb := redis.NewClient(&redis.Options{Addr: px.Addr(), MaxRetries: -1})
	defer rdb.Close()
	m := metrics.New(prometheus.NewRegistry(), "t", "t")
	m.SetUp(metrics.DepRedis, true)
	up := func() float64 { return testutil.ToFloat64(m.DependencyUp.WithLabelValues(metrics.DepRedis)) }
	core, logs := observer.New(zap.WarnLevel)
	done := make(chan error, 1)
	go func() {
		done <- WatchPermissions(context.Background(), rdb, Queues{Orders: []queue.Keys{queue.NewKeys("q")}}, m, zap.New(core))
	}()
	retries := func() []observer.LoggedEntry { return logs.FilterMessageSnippet("not checked yet; retrying").All() }
	testenv.WaitFor(t, "two retry warnings", time.Minute, func() bool { return len(retries()) >= 2 })
	if v := up(); v != 0 {
		t.Errorf("dependency_up{redis} = %v while Redis cannot be asked, want 0", v)
	}
	for i, e := range retries() {
		wait, ok := e.ContextMap()["retry_in"].(time.Duration)
		if !ok {
			t.Fatalf("retry warning %d has no retry_in: %v", i, e.ContextMap())
		}
		if wait > DefaultRedisRetry {
			t.Errorf("retry %d waits %v, more than DefaultRedisRetry (%v)", i, wait, DefaultRedisRetry)
		}
		if i == 0 && wait >= DefaultRedisRetry/2 {
			t.Errorf("the first retry waits %v, want a backoff that starts well under DefaultRedisRetry (%v)", wait, DefaultRedisRetry)
		}
	}
	px.Up()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("WatchPermissions after Redis came back: %v, want nil", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("WatchPermissions did not return within a minute of Redis coming back")
	}
	if v := up(); v != 1 {
		t.Errorf("dependency_up{redis} = %v after the check got its answers, want 1", v)
	}
}

// clusterUser gives every node of c user orderdelay (password pw) with
// README's least user's rules and then extra.
func clusterUser(t *testing.T, c *testenv.Cluster, extra ...string) *redis.ClusterClient {
	t.Helper()
	_, user := readmePermissions(t)
	rules := strings.Fields(strings.Replace(user, ">PASSWORD", ">pw", 1))[1:] // orderdelay on >pw ...
	ctx := context.Background()
	for _, a := range c.Addrs {
		n := redis.NewClient(&redis.Options{Addr: a})
		err := n.Do(ctx, append([]any{"acl", "setuser"}, toArgs(append(rules, extra...))...)...).Err()
		n.Close()
		if err != nil {
			t.Fatal(err)
		}
	}
	o, err := redis.ParseClusterURL(c.URL())
	if err != nil {
		t.Fatal(err)
	}
	o.Username, o.Password = "orderdelay", "pw"
	rdb := redis.NewClusterClient(o)
	t.Cleanup(func() { rdb.Close() })
	return rdb
}

// rejectedCalls is how many commands the nodes of c refused since their
// last CONFIG RESETSTAT, by command (INFO commandstats).
func rejectedCalls(t *testing.T, c *testenv.Cluster, reset bool) map[string]int {
	t.Helper()
	ctx := context.Background()
	out := map[string]int{}
	stat := regexp.MustCompile(`(?m)^cmdstat_([^:]+):.*rejected_calls=(\d+)`)
	for _, a := range c.Addrs {
		n := redis.NewClient(&redis.Options{Addr: a})
		if reset {
			n.ConfigResetStat(ctx)
		} else {
			s, err := n.Info(ctx, "commandstats").Result()
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range stat.FindAllStringSubmatch(s, -1) {
				if k, _ := strconv.Atoi(m[2]); k > 0 {
					out[m[1]] += k
				}
			}
		}
		n.Close()
	}
	return out
}

// TestPermissionsAskWhatTheClusterClientSends: on Redis Cluster, go-redis
// sends commands of its own besides CLUSTER SLOTS: COMMAND, the command
// table it routes by (refused, it asks again before every command it
// routes: three refused round trips per command, under one lock for the
// whole client, and a line on stderr each), and ASKING, before a command
// that a slot's migration redirected with -ASK (refused, the command
// fails). So a user that passes the check with no warning, as README's
// least user does, must be able to send them; one refused them is warned
// about.
func TestPermissionsAskWhatTheClusterClientSends(t *testing.T) {
	c := testenv.PrivateCluster(t)
	ctx := context.Background()

	rdb := clusterUser(t, c, "-command", "-asking")
	err, logs, gauge := permissions(t, rdb)
	ws := warnings(logs)
	if err != nil || gauge != 1 || len(ws) != 2 || !strings.Contains(ws[0].Message+ws[1].Message, "COMMAND") ||
		!strings.Contains(ws[0].Message+ws[1].Message, "ASKING") {
		t.Errorf("a user refused COMMAND and ASKING: %v, warnings %v, gauge %v; want nil, a warning naming each, gauge 1", err, ws, gauge)
	}

	rdb = clusterUser(t, c)
	err, logs, gauge = permissions(t, rdb)
	if err != nil || len(warnings(logs)) != 0 || gauge != 0 {
		t.Fatalf("README's least user: %v, warnings %v, gauge %v; want nil, none, 0", err, warnings(logs), gauge)
	}
	dead := queue.NewKeys(queue.DefaultKey).Dead
	rejectedCalls(t, c, true)
	for range 20 {
		if err := rdb.ZScore(ctx, dead, "m").Err(); err != nil && !errors.Is(err, redis.Nil) {
			t.Fatal(err)
		}
	}
	if r := rejectedCalls(t, c, false); len(r) > 0 {
		t.Errorf("README's least user passed the check, yet the nodes refused the cluster client %v for 20 ZSCOREs", r)
	}

	// The queue's slot migrates: the node that has it answers -ASK for a
	// key it no longer holds, and the client sends ASKING to the other.
	src, err := c.NodeFor(ctx, dead)
	if err != nil {
		t.Fatal(err)
	}
	dst := c.Addrs[0]
	if dst == src {
		dst = c.Addrs[1]
	}
	id := func(a string) string {
		n := redis.NewClient(&redis.Options{Addr: a})
		defer n.Close()
		return n.ClusterMyID(ctx).Val()
	}
	slot := queue.HashSlot(queue.DefaultKey)
	for _, s := range [][]any{{dst, "importing", id(src)}, {src, "migrating", id(dst)}} {
		n := redis.NewClient(&redis.Options{Addr: s[0].(string)})
		err := n.Do(ctx, "cluster", "setslot", slot, s[1], s[2]).Err()
		n.Close()
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := rdb.ZAdd(ctx, dead, redis.Z{Score: 1, Member: "m"}).Err(); err != nil {
		t.Errorf("README's least user passed the check, yet a ZADD while the queue's slot migrates: %v", err)
	}
}

// TestWatchPermissionsWaitsForTheLogin: a server that refuses the
// daemon's login — WRONGPASS (a password rotated on one side first, a
// user not created yet or disabled), NOAUTH — cannot be asked either. That
// is not a server that cannot say (which skips the check for good): the
// check waits, saying Redis is down, asks once the login works, and then
// finds what the user may not run.
func TestWatchPermissionsWaitsForTheLogin(t *testing.T) {
	keys := []queue.Keys{queue.NewKeys("q")}
	t.Run("wrongpass", func(t *testing.T) {
		admin, addr := testenv.PrivateRedis(t)
		ctx := context.Background()
		if err := admin.Do(ctx, "acl", "setuser", "od", "on", ">old", "~*", "&*", "+@all", "-hdel").Err(); err != nil {
			t.Fatal(err)
		}
		rdb := redis.NewClient(&redis.Options{Addr: addr, Username: "od", Password: "new", MaxRetries: -1})
		defer rdb.Close()
		m := metrics.New(prometheus.NewRegistry(), "t", "t")
		core, logs := observer.New(zap.WarnLevel)
		done := make(chan error, 1)
		go func() { done <- WatchPermissions(ctx, rdb, Queues{Orders: keys}, m, zap.New(core)) }()
		testenv.WaitFor(t, "a retry warning, or the check's end", time.Minute, func() bool {
			return logs.FilterMessageSnippet("not checked yet; retrying").Len() > 0 || len(done) > 0
		})
		select {
		case err := <-done:
			t.Fatalf("WatchPermissions: %v while the server refuses the login (logs %v); want it to wait for the login", err, logs.All())
		default:
		}
		if v := testutil.ToFloat64(m.DependencyUp.WithLabelValues(metrics.DepRedis)); v != 0 {
			t.Errorf("dependency_up{redis} = %v while the server refuses the login, want 0", v)
		}
		if err := admin.Do(ctx, "acl", "setuser", "od", ">new").Err(); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-done:
			if pe := (*PermissionError)(nil); !errors.As(err, &pe) || !strings.Contains(err.Error(), "HDEL") {
				t.Fatalf("WatchPermissions once the login works: %v, want a *PermissionError naming HDEL", err)
			}
		case <-time.After(time.Minute):
			t.Fatal("WatchPermissions did not return within a minute of the login working")
		}
	})
	t.Run("noauth", func(t *testing.T) {
		rdb, _ := testenv.PrivateRedis(t)
		rdb.AddHook(replyHook{"acl whoami": proto("NOAUTH Authentication required.")})
		ctx, cancel := context.WithCancel(context.Background())
		core, logs := observer.New(zap.WarnLevel)
		done := make(chan error, 1)
		go func() {
			done <- WatchPermissions(ctx, rdb, Queues{Orders: keys}, metrics.New(prometheus.NewRegistry(), "t", "t"), zap.New(core))
		}()
		testenv.WaitFor(t, "a retry warning, or the check's end", time.Minute, func() bool {
			return logs.FilterMessageSnippet("not checked yet; retrying").Len() > 0 || len(done) > 0
		})
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Fatalf("WatchPermissions: %v, want it to retry until ctx ends (context.Canceled)", err)
		}
	})
}

// TestPermissionsRefuseKeysSplitAcrossSelectors: Redis 7 allows a command
// only if one selector (the user's root permissions, or one in
// parentheses) allows all of its keys. A user whose root patterns cover
// the companions and a selector the queue key passed a check that asked a
// script's EVALSHA about one key at a time, yet every script, which gets
// them together, is refused.
func TestPermissionsRefuseKeysSplitAcrossSelectors(t *testing.T) {
	q := queue.DefaultKey
	rdb, _ := aclServer(t, nil, "resetkeys", "&*", "+@all", "~{"+q+"}:*", "~"+q+"#*", "~{"+q+"#*", "(~"+q+" +@all)")
	k := queue.NewKeys(q)
	if err := rdb.Eval(context.Background(), "return 1", []string{k.Queue, k.Inflight}).Err(); err == nil || !strings.Contains(err.Error(), "NOPERM") {
		t.Fatalf("a script on %s and %s: %v; want NOPERM (the test's premise)", k.Queue, k.Inflight, err)
	}
	err, _, _ := permissions(t, rdb)
	if pe := (*PermissionError)(nil); !errors.As(err, &pe) || !strings.Contains(err.Error(), "EVALSHA") {
		t.Fatalf("Permissions: %v, want a *PermissionError naming EVALSHA", err)
	}
}

// TestPermissionsAskOnlyWhatTheConfigurationUses: an order queue alone
// sends no list or stream command (those are the task queues' actions and
// the close-event relay's XADD), so a least-privilege user without them
// that closes orders fine is not refused; the same user is refused once
// task queues are configured, and one without XADD once close events are.
func TestPermissionsAskOnlyWhatTheConfigurationUses(t *testing.T) {
	orders := append([]queue.Keys{queue.NewKeys(queue.DefaultKey)}, queue.ShardKeys(queue.DefaultKey, 2)...)
	task := queue.NewKeys(queue.TaskQueueKey("mail"))
	ask := func(t *testing.T, rdb redis.UniversalClient, q Queues) error {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		return Permissions(ctx, rdb, q, metrics.New(prometheus.NewRegistry(), "t", "t"), zaptest.NewLogger(t))
	}
	refused := func(t *testing.T, err error, want string) {
		t.Helper()
		var pe *PermissionError
		if !errors.As(err, &pe) {
			t.Fatalf("Permissions: %v, want a *PermissionError naming %s", err, want)
		}
		found := false
		for _, r := range pe.Refusals {
			found = found || r.Command == want
		}
		if !found {
			t.Errorf("refusals %+v do not name %s", pe.Refusals, want)
		}
	}
	t.Run("no lists, no streams", func(t *testing.T) {
		rdb, _ := aclServer(t, nil, "~*", "&*", "+@all", "-@list", "-@stream")
		if err := ask(t, rdb, Queues{Orders: orders}); err != nil {
			t.Errorf("order queue alone: %v, want nil", err)
		}
		refused(t, ask(t, rdb, Queues{Orders: orders, Tasks: []queue.Keys{task}}), "LPUSH")
		refused(t, ask(t, rdb, Queues{Orders: orders, CloseEvents: true}), "XADD")
	})
	t.Run("no XADD", func(t *testing.T) {
		rdb, _ := aclServer(t, nil, "~*", "&*", "+@all", "-xadd")
		if err := ask(t, rdb, Queues{Orders: orders}); err != nil {
			t.Errorf("order queue without close events: %v, want nil", err)
		}
		refused(t, ask(t, rdb, Queues{Orders: orders, CloseEvents: true}), "XADD")
	})
}
