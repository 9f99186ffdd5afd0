package tasks

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// The meta hash the daemon writes from its queues file is what makes the
// public client refuse a durable queue, while the durable tier still
// writes it; rewritten for a queue switched back to not durable, the
// client writes again.
func TestWriteMetaMakesThePublicClientRefuseADurableQueue(t *testing.T) {
	t.Parallel()
	rdb, keys := testenv.Redis(t)
	db, _ := testenv.Postgres(t)
	ctx := context.Background()
	file := func(durable bool) File {
		s := "queues:\n  - name: q\n    key: '" + keys.Queue + "'\n    durable: " + map[bool]string{true: "true", false: "false"}[durable] +
			"\n    action: {type: sql, statement: 'SELECT unnest($1::text[])'}\n"
		f, err := Parse([]byte(s))
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	f := file(true)
	if err := WriteMeta(ctx, rdb, f); err != nil {
		t.Fatal(err)
	}
	pub, err := client.New(rdb, keys.Queue)
	if err != nil {
		t.Fatal(err)
	}
	due := time.Now().Add(time.Second)
	if _, _, err := pub.PutTask(ctx, "t-1", nil, due, client.Create); !errors.Is(err, client.ErrDurableQueue) {
		t.Fatalf("public PutTask on a durable queue: %v; want ErrDurableQueue", err)
	}
	d, err := NewDurable(db, f.Queues[0], rdb, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	if res, _, err := d.Put(ctx, "t-1", nil, due, client.Create); err != nil || res != client.Created {
		t.Fatalf("durable Put: %v, %v", res, err)
	}
	if _, err := pub.GetTask(ctx, "t-1"); err != nil {
		t.Errorf("the durable tier's put did not reach Redis: %v", err)
	}
	if err := d.Cancel(ctx, "t-1"); err != nil {
		t.Fatal(err)
	}
	if _, err := pub.GetTask(ctx, "t-1"); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("the durable tier's cancel left the Redis entry: %v", err)
	}
	if err := WriteMeta(ctx, rdb, file(false)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := pub.PutTask(ctx, "t-2", nil, due, client.Create); err != nil {
		t.Errorf("public PutTask once the queue is not durable: %v", err)
	}
	if v, _ := rdb.HGetAll(ctx, keys.Meta).Result(); v["durable"] != "0" || !strings.HasPrefix(v["max_pending"], "1000000") {
		t.Errorf("meta %v; want durable 0, max_pending 1000000", v)
	}
}
