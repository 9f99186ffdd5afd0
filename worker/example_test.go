package worker_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
	"github.com/orderdelay/orderdelay/worker"
)

// A producer schedules a task on a poll queue; a worker runs it and acks
// it. (It runs against the tests' Redis, ORDERDELAY_TEST_REDIS_URL, on a
// key of its own.)
func Example() {
	opt, err := redis.ParseURL(testenv.RedisURL())
	if err != nil {
		panic(err)
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	key := fmt.Sprintf("example:emails:%d", time.Now().UnixNano())
	defer testenv.DeleteQueue(rdb, queue.NewKeys(key))

	// The producer: a task due now (in a shop, days ahead).
	producer, err := client.New(rdb, key)
	if err != nil {
		panic(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	if _, _, err := producer.PutTask(ctx, "welcome-42", json.RawMessage(`{"to":"ada@example.com"}`), time.Now(), client.Create); err != nil {
		panic(err)
	}

	// The worker. In production: worker.FromQueuesFile(path, "emails").
	w, err := worker.New(rdb, worker.Config{})
	if err != nil {
		panic(err)
	}
	err = w.Handle(worker.Queue{Name: "emails", Key: key, Lease: 30 * time.Second, MaxAttempts: 5},
		func(ctx context.Context, t *worker.Task) error {
			var p struct {
				To string `json:"to"`
			}
			if err := json.Unmarshal(t.Payload, &p); err != nil {
				return worker.SkipRetry(err) // a bad payload never gets better
			}
			fmt.Printf("sending welcome email to %s (attempt %d)\n", p.To, t.Attempts+1)
			stop() // for the example: shut down after this task
			return nil
		})
	if err != nil {
		panic(err)
	}
	if err := w.Run(ctx); err != nil { // returns once shut down
		panic(err)
	}
	_, err = producer.GetTask(context.Background(), "welcome-42")
	fmt.Println("acked:", errors.Is(err, client.ErrNotFound))
	// Output:
	// sending welcome email to ada@example.com (attempt 1)
	// acked: true
}
