package tasks

import (
	"context"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// A durable row whose payload the door refuses now (stored before payload
// nesting was bounded) is left in the table and reported; the loader still
// loads the rows beside it instead of failing the whole page every pass.
func TestLoaderSkipsARowWhosePayloadIsRefusedNow(t *testing.T) {
	t.Parallel()
	rdb, keys := testenv.Redis(t)
	db, _ := testenv.Postgres(t)
	cl, err := client.New(rdb, keys.Queue)
	if err != nil {
		t.Fatal(err)
	}
	deep := strings.Repeat("[", client.MaxPayloadDepth+1) + strings.Repeat("]", client.MaxPayloadDepth+1)
	_, err = db.Exec(`INSERT INTO orderdelay_tasks (queue, id, due_at, payload) VALUES
		('q', 'deep', now(), $1::jsonb), ('q', 'ok', now(), '{"n":1}')`, deep)
	if err != nil {
		t.Fatal(err)
	}
	d := &Durable{DB: db, Queue: "q", Window: time.Minute, Client: cl, Log: zaptest.NewLogger(t)}
	n, err := d.Load(context.Background())
	if err != nil || n != 1 {
		t.Fatalf("Load: %d added, %v; want the one acceptable row", n, err)
	}
	if _, err := cl.GetTask(context.Background(), "ok"); err != nil {
		t.Errorf("the acceptable row is not in Redis: %v", err)
	}
	var state string
	if err := db.Get(&state, `SELECT state FROM orderdelay_tasks WHERE queue = 'q' AND id = 'deep'`); err != nil || state != StateScheduled {
		t.Errorf("the refused row: state %q, %v; want it kept as SCHEDULED", state, err)
	}
}
