package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/tasks"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

type taskOpsCLI struct {
	rdb    *redis.Client
	keys   queue.Keys
	cl     *client.Client
	getenv func(string) (string, bool)
}

func newTaskOpsCLI(t *testing.T) *taskOpsCLI {
	t.Helper()
	rdb, keys := testenv.Redis(t)
	file := filepath.Join(t.TempDir(), "queues.yaml")
	if err := os.WriteFile(file, []byte("queues:\n  - name: jobs\n    key: '"+keys.Queue+"'\n    action: {type: poll}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"ORDERDELAY_REDIS_URL": testenv.RedisURL(), "ORDERDELAY_QUEUES_FILE": file}
	cl, err := client.New(rdb, keys.Queue)
	if err != nil {
		t.Fatal(err)
	}
	return &taskOpsCLI{rdb: rdb, keys: keys, cl: cl, getenv: func(k string) (string, bool) { v, ok := env[k]; return v, ok }}
}

// run runs `orderdelay task ARGS...` and returns its exit status and output.
func (c *taskOpsCLI) run(t *testing.T, args ...string) (int, string) {
	t.Helper()
	var out bytes.Buffer
	code := run(context.Background(), append([]string{"task"}, args...), &out, testWriter{t}, c.getenv)
	return code, out.String()
}

func (c *taskOpsCLI) putDead(t *testing.T, ids ...string) {
	t.Helper()
	ctx := context.Background()
	for _, id := range ids {
		if _, _, err := c.cl.PutTask(ctx, id, json.RawMessage(`{"id":"`+id+`"}`), time.Now().Add(-time.Minute), client.Create); err != nil {
			t.Fatal(err)
		}
		c.rdb.ZRem(ctx, c.keys.Queue, id)
		c.rdb.ZAdd(ctx, c.keys.Dead, redis.Z{Member: id, Score: float64(time.Now().UnixMilli())})
		c.rdb.HSet(ctx, c.keys.DeadInfo, id, "failed|2|0|boom")
	}
}

func TestTaskOpsVerbs(t *testing.T) {
	c := newTaskOpsCLI(t)
	ctx := context.Background()
	for _, id := range []string{"p1", "p2"} {
		if _, _, err := c.cl.PutTask(ctx, id, json.RawMessage(`{}`), time.Now().Add(time.Hour), client.Create); err != nil {
			t.Fatal(err)
		}
	}
	c.putDead(t, "d1", "d2", "d3")

	code, out := c.run(t, "list", "jobs", "--limit", "1")
	var page tasks.TaskPage
	if err := json.Unmarshal([]byte(out), &page); code != 0 || err != nil || len(page.Tasks) != 1 || page.Tasks[0].ID != "p1" || page.Next == "" {
		t.Fatalf("list: exit %d, %s (%v); want p1 and a next cursor", code, out, err)
	}
	code, out = c.run(t, "list", "jobs", "--after", page.Next, "--payload")
	page = tasks.TaskPage{}
	if err := json.Unmarshal([]byte(out), &page); code != 0 || err != nil || len(page.Tasks) != 1 || page.Tasks[0].ID != "p2" ||
		string(page.Tasks[0].Payload) != `{}` || page.Next != "" {
		t.Fatalf("list page 2: exit %d, %s (%v); want p2 with its payload, last page", code, out, err)
	}
	code, out = c.run(t, "dead", "jobs")
	page = tasks.TaskPage{}
	if err := json.Unmarshal([]byte(out), &page); code != 0 || err != nil || len(page.Tasks) != 3 || page.Tasks[0].Reason != "failed" || page.Tasks[0].Attempts != 2 {
		t.Fatalf("dead: exit %d, %s (%v)", code, out, err)
	}

	if code, out = c.run(t, "requeue", "jobs", "d1", "p1", "nope"); code != 0 || !strings.Contains(out, "requeued 1") ||
		!strings.Contains(out, "skipped nope: "+tasks.WhyNotDead) {
		t.Errorf("requeue: exit %d, %q", code, out)
	}
	if tk, err := c.cl.GetTask(ctx, "d1"); err != nil || tk.State != client.StateQueued || string(tk.Payload) != `{"id":"d1"}` {
		t.Errorf("d1 after requeue: %+v %v", tk, err)
	}
	if code, out = c.run(t, "purge", "jobs", "--older-than", "1h"); code != 0 || out != "purged 0 dead letters\n" {
		t.Errorf("purge --older-than 1h: exit %d, %q", code, out)
	}
	if code, out = c.run(t, "purge", "jobs", "d2"); code != 0 || out != "purged 1 dead letters\n" {
		t.Errorf("purge d2: exit %d, %q", code, out)
	}
	if code, out = c.run(t, "requeue", "jobs", "--all"); code != 0 || !strings.Contains(out, "requeued 1") {
		t.Errorf("requeue --all: exit %d, %q", code, out)
	}

	if code, out = c.run(t, "pause", "jobs", "--reason", "partner down"); code != 0 || !strings.Contains(out, "partner down") {
		t.Errorf("pause: exit %d, %q", code, out)
	}
	code, out = c.run(t, "stats", "jobs")
	var st tasks.Stats
	if err := json.Unmarshal([]byte(out), &st); code != 0 || err != nil || !st.Paused || st.PausedReason != "partner down" ||
		st.Pending != 4 || st.Due != 2 || st.Dead != 0 || st.Action != "poll" {
		t.Errorf("stats: exit %d, %s (%v); want paused, 4 pending of which 2 due (d1, d3), no dead", code, out, err)
	}
	if code, out = c.run(t, "resume", "jobs"); code != 0 {
		t.Errorf("resume: exit %d, %q", code, out)
	}
	code, out = c.run(t, "stats")
	var all []tasks.Stats
	if err := json.Unmarshal([]byte(out), &all); code != 0 || err != nil || len(all) != 1 || all[0].Queue != "jobs" || all[0].Paused {
		t.Errorf("stats of all queues: exit %d, %s (%v)", code, out, err)
	}
}

func TestTaskOpsVerbsRefuseBadUsage(t *testing.T) {
	c := newTaskOpsCLI(t)
	c.putDead(t, "d1")
	for _, args := range [][]string{
		{"list"},
		{"list", "jobs", "--limit", "0"},
		{"list", "jobs", "--limit", "5000"},
		{"list", "jobs", "--limit", "many"},
		{"list", "jobs", "--state", "done"},
		{"list", "jobs", "--after", "%%"},
		{"list", "jobs", "extra"},
		{"list", "nope"},
		{"dead", "nope"},
		{"requeue", "jobs"},
		{"requeue", "jobs", "d1", "--all"},
		{"requeue", "jobs", ""},
		{"requeue", "jobs", "a\x01"},
		{"requeue", "nope", "d1"},
		{"purge", "jobs"},
		{"purge", "jobs", "--all", "--older-than", "1h"},
		{"purge", "jobs", "d1", "--all"},
		{"purge", "jobs", "--older-than", "soon"},
		{"purge", "jobs", "--older-than", "-1h"},
		{"stats", "jobs", "other"},
		{"stats", "nope"},
		{"pause", "jobs", "extra"},
		{"resume"},
		{"frobnicate", "jobs"},
	} {
		if code, out := c.run(t, args...); code != 2 || out != "" {
			t.Errorf("task %q: exit %d, output %q; want 2 and nothing done", args, code, out)
		}
	}
	if n, _ := c.rdb.ZCard(context.Background(), c.keys.Dead).Result(); n != 1 {
		t.Errorf("%d dead letters after refused commands, want 1", n)
	}
	if n, _ := c.rdb.Exists(context.Background(), c.keys.Paused).Result(); n != 0 {
		t.Error("paused by a refused command")
	}
	// Too many ids.
	ids := make([]string, tasks.MaxRequeue+1)
	for i := range ids {
		ids[i] = fmt.Sprint("x", i)
	}
	if code, _ := c.run(t, append([]string{"requeue", "jobs"}, ids...)...); code != 2 {
		t.Errorf("requeue of %d ids: exit %d, want 2", len(ids), code)
	}
}
