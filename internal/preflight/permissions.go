package preflight

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/cenkalti/backoff/v5"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/internal/lifecycle"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// The Redis user's permissions.
//
// A script runs each command with the caller's ACL, and Redis keeps a
// script's writes made before a command it refuses: a script that meets a
// refused (or renamed) command halfway leaves its work half done. So the
// daemon asks at start, before its consumers and task queues run, with
// ACL DRYRUN (Redis ≥ 7.0), whether its user may run each command it can
// send on the keys and channels of its queues; a refused command it needs
// stops the start (*PermissionError: exit 2), one it can do without is a
// warning.
//
// commands is the one list of what the daemon sends. Tests hold it to
// the scripts' redis.call and redis.pcall (every Lua source of the
// production code) and to the go-redis calls of the production code. Not
// in it: the check's own ACL WHOAMI and ACL DRYRUN (refused: the check is
// skipped), and what go-redis sends on connecting — HELLO and AUTH, which
// every user may run, CLIENT SETINFO, whose refusal it ignores, and SELECT
// for a database other than 0, without which nothing connects.
//
// Each command is asked about on every key of the kind it works on (a
// superset of the keys it is sent to: HDEL on every hash of every queue),
// and the scripts' EVALSHA and EVAL on every key, since Redis checks a
// script's KEYS too — one by one, and all the keys of each queue together,
// since Redis allows a command only if one of the user's selectors allows
// all of its keys.

// keyArg stands for the key (or channel) a command is asked about.
const keyArg = "<key>"

// Target is what a command is asked about: each key of the queues of one
// kind, their wake channels, or nothing.
type Target int

// Targets of commands.
const (
	NoKey      Target = iota // keyless (TIME, PING)
	AnyKey                   // every key and the wake channel: a script's KEYS (EVALSHA, EVAL)
	SortedSets               // Queue, Inflight, Deadlines, Leases, Dead, Unacked
	Hashes                   // Lease, LeaseBatch, DeadInfo, Payload, Taken, Deliveries, DeliveryIDs, DeliverySeq, Meta
	Strings                  // Paused, Name
	Lists                    // Ready, Processing
	Streams                  // Events, Stream
	Channel                  // Wake, as a pub/sub channel
)

// Command is one Redis command the daemon sends.
type Command struct {
	// Name as Redis knows it, with its subcommand: "HDEL", "OBJECT ENCODING".
	Name string
	On   Target
	// Args follow Name in the dry run; keyArg is each key of On in turn.
	// They only have to satisfy the command's arity.
	Args []string
	// Optional, when set, is what a refusal costs: the daemon starts and
	// warns. Empty: the daemon needs it (a script or a call it cannot do
	// without fails).
	Optional string
	// Cluster: sent only to Redis Cluster (by go-redis itself).
	Cluster bool
}

// nullSHA is a script digest for EVALSHA's dry run (the script need not
// exist: a dry run runs nothing).
const nullSHA = "0000000000000000000000000000000000000000"

// What refusing an optional command costs.
const (
	costObject = "a claim cannot make the lease hash of a large batch a hash table, so lookups in it search a listpack field by field " +
		"(up to 2.6x the Redis time per claimed order; BENCHMARKS.md)"
	costSubscribe = "no wake-ups: an earlier deadline written through the API or the client waits for the head check " +
		"(about 350 ms) or the next scan, and a waiting poll for its recheck"
	costUnsubscribe = "the long polls' subscription stays subscribed to a task queue's wake channel once none of its polls waits " +
		"(while polls of another queue still wait): its wake-ups keep coming and are dropped"
	costCommand = "go-redis's cluster client, refused the command table it routes by, asks for it again before every command: " +
		"three more round trips per command, one command at a time for the whole client (2,000 ZSCOREs from 8 goroutines took 7.5x as long " +
		"in a test), and a line on stderr for each"
	costAsking = "while Redis Cluster migrates the hash slot of a queue, every command on it that the slot's old node redirects with -ASK fails " +
		"(claims back off, enqueues fail) until the slot has moved"
	costInfo   = "the start-up check cannot read the Redis version"
	costConfig = "the start-up check cannot read the eviction policy and persistence"
)

// commands is every command the daemon sends, and what ACL DRYRUN is asked
// about each: "script" marks those the Lua scripts of package queue call,
// the rest (or also) come from the daemon's go-redis calls.
var commands = []Command{
	// Scripts run by digest; on NOSCRIPT go-redis sends EVAL, or SCRIPT
	// LOAD and EVALSHA again. Every key a script touches is in its KEYS.
	{Name: "EVALSHA", On: AnyKey, Args: []string{nullSHA, "1", keyArg}},
	{Name: "EVAL", On: AnyKey, Args: []string{"return 0", "1", keyArg}},
	{Name: "SCRIPT LOAD", Args: []string{"return 0"}},

	// Sorted sets.
	{Name: "ZADD", On: SortedSets, Args: []string{keyArg, "0", "m"}},            // script; the demo's checkout
	{Name: "ZREM", On: SortedSets, Args: []string{keyArg, "m"}},                 // script
	{Name: "ZRANGE", On: SortedSets, Args: []string{keyArg, "0", "0"}},          // script; peek, dead letters, extend, unbatch
	{Name: "ZSCORE", On: SortedSets, Args: []string{keyArg, "m"}},               // script; the order lookup
	{Name: "ZMSCORE", On: SortedSets, Args: []string{keyArg, "m"}},              // script
	{Name: "ZCARD", On: SortedSets, Args: []string{keyArg}},                     // script; task counts, unbatch
	{Name: "ZCOUNT", On: SortedSets, Args: []string{keyArg, "-inf", "+inf"}},    // script
	{Name: "ZREMRANGEBYRANK", On: SortedSets, Args: []string{keyArg, "0", "0"}}, // script (the claim)

	// Hashes.
	{Name: "HGET", On: Hashes, Args: []string{keyArg, "f"}},                             // script; payloads, meta, the order lookup
	{Name: "HSET", On: Hashes, Args: []string{keyArg, "f", "v"}},                        // script; meta
	{Name: "HMGET", On: Hashes, Args: []string{keyArg, "f"}},                            // script; lease records, dead info, payloads, meta
	{Name: "HDEL", On: Hashes, Args: []string{keyArg, "f"}},                             // script; meta
	{Name: "HEXISTS", On: Hashes, Args: []string{keyArg, "f"}},                          // script
	{Name: "HINCRBY", On: Hashes, Args: []string{keyArg, "f", "1"}},                     // script
	{Name: "HSETNX", On: Hashes, Args: []string{keyArg, "f", "v"}},                      // script
	{Name: "HLEN", On: Hashes, Args: []string{keyArg}},                                  // script
	{Name: "HSTRLEN", On: Hashes, Args: []string{keyArg, "f"}},                          // script (a poll's byte budget)
	{Name: "OBJECT ENCODING", On: Hashes, Args: []string{keyArg}, Optional: costObject}, // script, with pcall (the claim)

	// Strings: the pause flag, the obsolete name mark.
	{Name: "EXISTS", On: Strings, Args: []string{keyArg}},     // script; pause
	{Name: "GET", On: Strings, Args: []string{keyArg}},        // pause, name mark
	{Name: "SETNX", On: Strings, Args: []string{keyArg, "v"}}, // pause
	{Name: "DEL", On: Strings, Args: []string{keyArg}},        // resume, name mark

	// Lists (list actions).
	{Name: "LPUSH", On: Lists, Args: []string{keyArg, "v"}},                     // script
	{Name: "RPUSH", On: Lists, Args: []string{keyArg, "v"}},                     // script
	{Name: "LLEN", On: Lists, Args: []string{keyArg}},                           // script
	{Name: "LINDEX", On: Lists, Args: []string{keyArg, "0"}},                    // script
	{Name: "LREM", On: Lists, Args: []string{keyArg, "1", "v"}},                 // script
	{Name: "LMOVE", On: Lists, Args: []string{keyArg, keyArg, "RIGHT", "LEFT"}}, // script

	// Streams (close events, stream actions).
	{Name: "XADD", On: Streams, Args: []string{keyArg, "*", "f", "v"}}, // script; the close-event relay
	{Name: "XACK", On: Streams, Args: []string{keyArg, "g", "0-1"}},    // script
	{Name: "XPENDING", On: Streams, Args: []string{keyArg, "g"}},       // script; stream dead letters
	{Name: "XRANGE", On: Streams, Args: []string{keyArg, "-", "+"}},    // script
	{Name: "XINFO GROUPS", On: Streams, Args: []string{keyArg}},        // stream dead letters

	// The wake channel.
	{Name: "PUBLISH", On: Channel, Args: []string{keyArg, "0"}},                       // script; resume
	{Name: "SUBSCRIBE", On: Channel, Args: []string{keyArg}, Optional: costSubscribe}, // the scanners, waiting polls
	{Name: "UNSUBSCRIBE", Optional: costUnsubscribe},                                  // waiting polls, one queue's last done

	// Keyless.
	{Name: "TIME"}, // script; the Redis clock
	{Name: "PING"}, // /readyz
	{Name: "INFO", Args: []string{"server"}, Optional: costInfo},                   // the start-up check
	{Name: "CONFIG GET", Args: []string{"maxmemory-policy"}, Optional: costConfig}, // the start-up check
	{Name: "CLUSTER SLOTS", Cluster: true},                                         // go-redis's cluster client: the slot map
	{Name: "COMMAND", Cluster: true, Optional: costCommand},                        // go-redis's cluster client: the command table it routes by
	{Name: "ASKING", Cluster: true, Optional: costAsking},                          // go-redis's cluster client, after -ASK (a slot migrating)
}

// targets lists the keys of k by what the commands are asked about.
// TestTargetsCoverTheKeys holds it to queue.Keys.
func targets(k queue.Keys) map[Target][]string {
	t := map[Target][]string{
		SortedSets: {k.Queue, k.Inflight, k.Deadlines, k.Leases, k.Dead, k.Unacked},
		Hashes:     {k.Lease, k.LeaseBatch, k.DeadInfo, k.Payload, k.Taken, k.Deliveries, k.DeliveryIDs, k.DeliverySeq, k.Meta},
		Strings:    {k.Paused, k.Name},
		Lists:      {k.Ready, k.Processing},
		Streams:    {k.Events, k.Stream},
		Channel:    {k.Wake},
	}
	for _, on := range []Target{SortedSets, Hashes, Strings, Lists, Streams, Channel} {
		t[AnyKey] = append(t[AnyKey], t[on]...) // the wake channel too: scripts get it in KEYS
	}
	return t
}

// Refusal is one dry run the server refused the daemon's user.
type Refusal struct {
	Addr    string // the server; on a single server, "" (its address is in the URL)
	User    string
	Command string // Command.Name
	Target  string // the key or channel it was asked about; "" for none
	Channel bool   // Target is a pub/sub channel
	Denied  Denied
	Reason  string // the server's words
}

// Denied is what a refusal is about.
type Denied int

// What the server refused.
const (
	DeniedCommand  Denied = iota // the user may not run the command
	DeniedKey                    // the key is outside the user's key patterns (or their read/write part)
	DeniedChannel                // the channel is outside the user's channel patterns
	UnknownCommand               // the server has no such command: renamed or disabled with rename-command
)

// denied reads a refusal's reason, as Redis 7 words them ("This user has
// no permissions to access the 'k' key", "... the 'c' channel", "... to
// run the 'hdel' command"); anything else is taken for the command's.
func denied(reason string) Denied {
	switch {
	case strings.Contains(reason, "to access the") && strings.HasSuffix(reason, "' key"):
		return DeniedKey
	case strings.Contains(reason, "to access the") && strings.HasSuffix(reason, "' channel"):
		return DeniedChannel
	}
	return DeniedCommand
}

// PermissionError: the daemon's Redis user may not run commands the daemon
// needs. The daemon does not start (exit 2).
type PermissionError struct {
	Refusals []Refusal
}

func (e *PermissionError) Error() string {
	return "redis refuses what orderdelay needs, so it does not start; grant it (README, \"Redis permissions\"): " +
		strings.Join(summarize(e.Refusals), "; ")
}

// summarize says refusals in a few phrases per server and user: the
// commands refused (with a key each was asked on), the keys and channels
// outside the user's patterns (with the commands asked), the commands the
// server does not know.
func summarize(rs []Refusal) []string {
	type bucket struct {
		addr, user string
		// per Denied: the names listed (commands, or keys and channels),
		// and for each what it was asked with
		names [4][]string
		with  [4]map[string][]string
		other []string // command refusals in words this check does not know
	}
	var bs []*bucket
	for _, r := range rs {
		i := slices.IndexFunc(bs, func(b *bucket) bool { return b.addr == r.Addr && b.user == r.User })
		if i < 0 {
			b := &bucket{addr: r.Addr, user: r.User}
			for d := range b.with {
				b.with[d] = map[string][]string{}
			}
			bs = append(bs, b)
			i = len(bs) - 1
		}
		b := bs[i]
		name, with := r.Command, r.Target
		if r.Denied == DeniedKey || r.Denied == DeniedChannel {
			name, with = r.Target, r.Command
		}
		if r.Denied == DeniedCommand && !strings.Contains(r.Reason, "no permissions to run the") &&
			!slices.Contains(b.other, r.Reason) {
			b.other = append(b.other, r.Reason)
		}
		if _, ok := b.with[r.Denied][name]; !ok {
			b.names[r.Denied] = append(b.names[r.Denied], name)
		}
		if with != "" && !slices.Contains(b.with[r.Denied][name], with) {
			b.with[r.Denied][name] = append(b.with[r.Denied][name], with)
		}
	}
	var out []string
	for _, b := range bs {
		who := fmt.Sprintf("user %q", b.user)
		if b.addr != "" {
			who += " at " + b.addr
		}
		// What the first was asked with (on).
		example := func(d Denied, how, what string) string {
			names := b.names[d]
			w := b.with[d][names[0]]
			switch {
			case len(w) == 0:
				return ""
			case len(names) == 1:
				return fmt.Sprintf(" (asked %s %s)", how, few(w, what))
			}
			return fmt.Sprintf(" (%s asked %s %s)", names[0], how, few(w, what))
		}
		if n := b.names[DeniedCommand]; len(n) > 0 {
			s := who + " may not run " + few(n, "commands") + example(DeniedCommand, "on", "keys")
			if len(b.other) > 0 {
				s += ": " + strings.Join(b.other, "; ")
			}
			out = append(out, s)
		}
		if n := b.names[DeniedKey]; len(n) > 0 {
			out = append(out, who+" may not access keys "+few(n, "keys")+", outside its key patterns"+example(DeniedKey, "with", "commands"))
		}
		if n := b.names[DeniedChannel]; len(n) > 0 {
			out = append(out, who+" may not use channels "+few(n, "channels")+", outside its channel patterns"+example(DeniedChannel, "with", "commands"))
		}
		if n := b.names[UnknownCommand]; len(n) > 0 {
			at := ""
			if b.addr != "" {
				at = " at " + b.addr
			}
			out = append(out, "the server"+at+" does not know "+few(n, "commands")+" (renamed or disabled with rename-command?)")
		}
	}
	return out
}

// few lists up to three items and counts the rest.
func few(items []string, what string) string {
	if len(items) <= 3 {
		return strings.Join(items, ", ")
	}
	return fmt.Sprintf("%s and %d more %s", strings.Join(items[:3], ", "), len(items)-3, what)
}

// WatchPermissions runs Permissions until it gets its answers, and returns
// its *PermissionError, or nil; ctx.Err() when ctx ends first. While Redis
// cannot be asked it says Redis is down (dependency_up): the daemon's
// consumers wait for this check, so no claim fails to say it. It asks
// again with an exponential backoff capped at DefaultRedisRetry, as the
// database's check does, so a blip at start-up holds the consumers for
// well under a second after Redis is back.
func WatchPermissions(ctx context.Context, rdb redis.UniversalClient, queues Queues, m *metrics.Metrics, log *zap.Logger) error {
	b := backoff.NewExponentialBackOff()
	b.MaxInterval = DefaultRedisRetry
	for {
		err := Permissions(ctx, rdb, queues, m, log)
		if pe := (*PermissionError)(nil); err == nil || errors.As(err, &pe) {
			m.SetUp(metrics.DepRedis, true)
			return err
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		m.SetUp(metrics.DepRedis, false)
		wait := b.NextBackOff()
		log.Warn("redis permissions not checked yet; retrying", zap.Error(err), zap.Duration("retry_in", wait))
		if !lifecycle.Sleep(ctx, wait) {
			return ctx.Err()
		}
	}
}

// Queues are what the daemon's configuration has it send commands on.
type Queues struct {
	// Orders are the order queue and its shards. Their list and stream
	// keys are never written (those are task queues' actions), so no list
	// or stream command is asked about on them — but XADD on the first
	// one's events stream when CloseEvents is set (the close-event relay).
	Orders      []queue.Keys
	CloseEvents bool
	// Tasks are the task queues: every command, on every key.
	Tasks []queue.Keys
	// Defaults are the keys at the default key (queue.TaskQueueKey) of
	// each task queue that the queues file gives a key of its own: only
	// the commands the daemon sends there (atDefaultKey).
	Defaults []queue.Keys
}

func (q Queues) count() int { return len(q.Orders) + len(q.Tasks) }

// Permissions asks, with ACL DRYRUN, whether the user the daemon logged in
// as (ACL WHOAMI) may run each of commands on each key and wake channel of
// queues that it sends it on (see Queues), on every master of a cluster.
// Commands the daemon needs that
// are refused, or unknown to the server (renamed away with rename-command),
// are returned as a *PermissionError; refused optional ones are warned
// about, and set the redis_permissions warning gauge. A server that cannot
// say (older than 7.0, a user without ACL DRYRUN or ACL WHOAMI, an answer
// that is not one) is warned about once and the check skipped: nil. Any
// other error means Redis could not be asked (unreachable, loading, the
// login refused): try again.
func Permissions(ctx context.Context, rdb redis.UniversalClient, queues Queues, m *metrics.Metrics, log *zap.Logger) error {
	nodes, err := masters(ctx, rdb)
	if err != nil {
		return err
	}
	_, cluster := rdb.(*redis.ClusterClient)
	probes := dryRuns(queues, cluster)
	var refused []Refusal
	for _, n := range nodes {
		rs, skip, err := checkNode(ctx, n, probes)
		if err != nil {
			return err
		}
		if skip != "" {
			log.Warn("redis permissions not checked: the server cannot say what the daemon's user may run (ACL DRYRUN needs Redis 7.0 or later, and the user needs ACL WHOAMI and ACL DRYRUN); check the user against README's Redis permissions yourself",
				zap.String("why", skip), zap.String("addr", nodeAddr(n)))
			m.Warn(metrics.CheckRedisPermissions, false)
			return nil
		}
		if cluster {
			for i := range rs {
				rs[i].Addr = nodeAddr(n)
			}
		}
		refused = append(refused, rs...)
	}
	var needed, optional []Refusal
	for _, r := range refused {
		if optionalCost(r.Command) == "" {
			needed = append(needed, r)
		} else {
			optional = append(optional, r)
		}
	}
	if len(needed) > 0 {
		return &PermissionError{Refusals: needed}
	}
	for _, c := range commands {
		var rs []Refusal
		for _, r := range optional {
			if r.Command == c.Name {
				rs = append(rs, r)
			}
		}
		if len(rs) > 0 {
			log.Warn("the redis user may not run "+c.Name+"; the daemon runs without it, but "+c.Optional,
				zap.Strings("refused", summarize(rs)))
		}
	}
	m.Warn(metrics.CheckRedisPermissions, len(optional) > 0)
	if len(optional) == 0 {
		log.Info("redis permissions checked: the daemon's user may run every command it sends on every key of its queues",
			zap.Int("commands", len(commands)), zap.Int("queues", queues.count()), zap.Int("dry_runs", len(probes)))
	}
	return nil
}

func optionalCost(name string) string {
	for _, c := range commands {
		if c.Name == name {
			return c.Optional
		}
	}
	return ""
}

// probe is one dry run: a command on one key (or none).
type probe struct {
	cmd     *Command
	target  string
	channel bool
	args    []any // after ACL DRYRUN <user>
	// together: a script's dry run on every key of the queue target at
	// once (see dryRuns).
	together bool
}

// atDefaultKey is what the daemon sends to the default key of a task queue
// that the queues file gives a key of its own: package tasks reads the
// name in its meta hash and removes it if it is the queue's (WriteMeta),
// and reads and deletes its legacy name mark (dropLegacyNames). Refused,
// the meta pass stops there, before the meta hashes of the queues after
// it — their durable flag and cap, which producers' scripts obey.
var atDefaultKey = map[string]func(queue.Keys) string{
	"HGET": func(k queue.Keys) string { return k.Meta },
	"HDEL": func(k queue.Keys) string { return k.Meta },
	"GET":  func(k queue.Keys) string { return k.Name },
	"DEL":  func(k queue.Keys) string { return k.Name },
}

// orderTargets are the keys of an order queue k (or shard) by what the
// commands are asked about: targets without the lists and streams, but
// the events stream when the relay publishes on it (events).
func orderTargets(k queue.Keys, events bool) map[Target][]string {
	t := targets(k)
	delete(t, Lists)
	delete(t, Streams)
	if events {
		t[Streams] = []string{k.Events}
	}
	return t
}

// dryRuns lists the dry runs of commands on the keys of queues: on an order
// queue's, of the commands it is sent (orderTargets; of the stream
// commands, XADD only); on a task queue's, of all of them; on a default
// key's, of those atDefaultKey names.
func dryRuns(queues Queues, cluster bool) []probe {
	type on struct {
		keys  queue.Keys
		ts    map[Target][]string
		order bool
	}
	var all []on
	for i, k := range queues.Orders {
		all = append(all, on{k, orderTargets(k, queues.CloseEvents && i == 0), true})
	}
	for _, k := range queues.Tasks {
		all = append(all, on{k, targets(k), false})
	}
	var out []probe
	add := func(c *Command, target string) {
		args := make([]any, 0, 2+len(c.Args))
		for _, w := range strings.Fields(c.Name) {
			args = append(args, w)
		}
		for _, a := range c.Args {
			if a == keyArg {
				args = append(args, target)
			} else {
				args = append(args, a)
			}
		}
		out = append(out, probe{cmd: c, target: target, channel: c.On == Channel, args: args})
	}
	for i := range commands {
		c := &commands[i]
		switch {
		case c.Cluster && !cluster:
		case c.On == NoKey:
			add(c, "")
		default:
			seen := map[string]bool{}
			for _, q := range all {
				if q.order && c.On == Streams && c.Name != "XADD" {
					continue
				}
				for _, key := range q.ts[c.On] {
					if !seen[key] {
						seen[key] = true
						add(c, key)
					}
				}
			}
			if at := atDefaultKey[c.Name]; at != nil {
				for _, k := range queues.Defaults {
					if key := at(k); !seen[key] {
						seen[key] = true
						add(c, key)
					}
				}
			}
			if c.On == AnyKey {
				// Redis allows a command only if one selector (the
				// user's root permissions or one in parentheses) allows
				// all its keys: a script gets a queue's keys together,
				// so it is asked about them together too.
				for _, q := range all {
					k := q.keys
					keys := q.ts[AnyKey]
					args := append(strings.Fields(c.Name), c.Args[0], strconv.Itoa(len(keys)))
					out = append(out, probe{cmd: c, target: k.Queue, together: true, args: toArgs(append(args, keys...))})
				}
			}
		}
	}
	return out
}

func toArgs(ss []string) []any {
	out := make([]any, len(ss))
	for i, s := range ss {
		out[i] = s
	}
	return out
}

// refusedKey is the key a refusal's reason names ("... to access the 'k'
// key"), or "".
func refusedKey(reason string) string {
	_, rest, ok := strings.Cut(reason, "to access the '")
	if !ok {
		return ""
	}
	key, _, _ := strings.Cut(rest, "' key")
	return key
}

// dryRunChunk is how many dry runs go in one pipeline.
const dryRunChunk = 1000

// checkNode asks one server about every probe. It returns what the server
// refuses the user, or why the server cannot say (skip), or the error that
// kept it from asking.
func checkNode(ctx context.Context, n redis.UniversalClient, probes []probe) (refused []Refusal, skip string, err error) {
	v, err := n.Do(ctx, "acl", "whoami").Result()
	if err != nil {
		if transient(err) {
			return nil, "", fmt.Errorf("redis ACL WHOAMI: %w", err)
		}
		return nil, "ACL WHOAMI: " + err.Error(), nil
	}
	user, ok := v.(string)
	if !ok || user == "" {
		return nil, fmt.Sprintf("ACL WHOAMI answered %#v, not a user name", v), nil
	}
	for start := 0; start < len(probes); start += dryRunChunk {
		part := probes[start:min(start+dryRunChunk, len(probes))]
		cmds := make([]*redis.Cmd, len(part))
		_, _ = n.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, pr := range part {
				cmds[i] = p.Do(ctx, append([]any{"acl", "dryrun", user}, pr.args...)...)
			}
			return nil
		}) // each command's error is its own
		for i, cmd := range cmds {
			pr := part[i]
			asked := "ACL DRYRUN " + user + " " + pr.cmd.Name
			v, err := cmd.Result()
			switch {
			case err == nil:
				s, ok := v.(string)
				if !ok {
					return nil, fmt.Sprintf("%s answered %#v, neither OK nor a refusal", asked, v), nil
				}
				if s == "OK" {
					break
				}
				r := Refusal{User: user, Command: pr.cmd.Name, Target: pr.target, Channel: pr.channel, Denied: denied(s), Reason: s}
				if pr.together {
					// Refused together, though maybe allowed one by one.
					key := refusedKey(s)
					if slices.ContainsFunc(refused, func(o Refusal) bool { return o.Command == r.Command && o.Target == key }) {
						break // that key is refused on its own already
					}
					if key != "" {
						r.Target = key + " (with the other keys of " + pr.target +
							": one selector of the user must allow all the keys a script gets)"
					}
				}
				refused = append(refused, r)
			case transient(err):
				return nil, "", fmt.Errorf("redis %s: %w", asked, err)
			case unknownCommand(err):
				refused = append(refused, Refusal{User: user, Command: pr.cmd.Name, Target: pr.target, Channel: pr.channel,
					Denied: UnknownCommand, Reason: err.Error()})
			default:
				// NOPERM for ACL DRYRUN itself, no such subcommand (Redis
				// before 7.0), or an answer this check does not know.
				return nil, asked + ": " + err.Error(), nil
			}
		}
	}
	return refused, "", nil
}

// unknownCommand: ACL DRYRUN's answer for a command the server does not
// have, as after rename-command: "ERR Command 'HDEL' not found".
func unknownCommand(err error) bool {
	var re redis.Error
	if !errors.As(err, &re) {
		return false
	}
	msg := re.Error()
	return strings.HasPrefix(msg, "ERR Command '") && strings.HasSuffix(msg, "' not found")
}

// transient: the server could not be asked, or asks to be asked later;
// any other answer is the server's word. A login the server refuses
// (WRONGPASS: a password rotated on one side first, a user not created
// yet or disabled; NOAUTH) is no answer either: nothing can be asked
// until it works, and then the check must run.
func transient(err error) bool {
	var re redis.Error
	if !errors.As(err, &re) {
		return true // the network, a timeout, a closed client
	}
	for _, p := range []string{"LOADING", "BUSY", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "MOVED", "ASK", "WRONGPASS", "NOAUTH"} {
		if redis.HasErrorPrefix(err, p) {
			return true
		}
	}
	return false
}

// masters is rdb's servers to check: every master of a cluster, else rdb.
func masters(ctx context.Context, rdb redis.UniversalClient) ([]redis.UniversalClient, error) {
	cc, ok := rdb.(*redis.ClusterClient)
	if !ok {
		return []redis.UniversalClient{rdb}, nil
	}
	var mu sync.Mutex
	var nodes []redis.UniversalClient
	err := cc.ForEachMaster(ctx, func(_ context.Context, c *redis.Client) error {
		mu.Lock()
		nodes = append(nodes, c)
		mu.Unlock()
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("redis masters: %w", err)
	}
	return nodes, nil
}

func nodeAddr(n redis.UniversalClient) string {
	if c, ok := n.(*redis.Client); ok {
		return c.Options().Addr
	}
	return ""
}
