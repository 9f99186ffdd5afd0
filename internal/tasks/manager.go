package tasks

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/jmoiron/sqlx"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/orderdelay/orderdelay/client"
	"github.com/orderdelay/orderdelay/internal/consumer"
	"github.com/orderdelay/orderdelay/internal/metrics"
	"github.com/orderdelay/orderdelay/internal/orders"
	"github.com/orderdelay/orderdelay/internal/queue"
)

// Runtime is one configured queue, ready to use.
type Runtime struct {
	Config Queue
	Keys   queue.Keys
	// Client is the public client of the queue: on a durable queue its
	// puts and deletes are refused (use Durable, which writes PostgreSQL
	// first and then Redis through its own client).
	Client  *client.Client
	Metrics *metrics.Metrics
	Redis   redis.UniversalClient
	Store   *queue.Store // the queue's data: Keys on Redis
	Durable *Durable     // nil unless the queue is durable
}

// Manager runs the task queues of a file.
type Manager struct {
	queues map[string]*Runtime
	order  []string
	rdb    redis.UniversalClient
	db     *sqlx.DB
	log    *zap.Logger
	owner  string
	// cons is the consumer of each queue the daemon serves (all but poll
	// queues), built with the queues so that a configuration it cannot
	// run is refused before anything starts.
	cons map[string]*consumer.Consumer
}

// NewManager prepares the queues of f. db is needed only by sql actions.
func NewManager(f File, rdb redis.UniversalClient, db *sqlx.DB, fam *metrics.TaskFamilies, log *zap.Logger, owner string) (*Manager, error) {
	m := &Manager{queues: map[string]*Runtime{}, rdb: rdb, db: db, log: log, owner: owner, cons: map[string]*consumer.Consumer{}}
	for _, q := range f.Queues {
		cl, err := client.New(rdb, q.Key)
		if err != nil {
			return nil, fmt.Errorf("queue %q: %w", q.Name, err)
		}
		k := queue.NewKeys(q.Key)
		r := &Runtime{Config: q, Keys: k, Client: cl, Metrics: fam.For(q.Name), Redis: rdb, Store: queue.NewStore(rdb, k)}
		if q.Durable {
			if db == nil {
				return nil, fmt.Errorf("queue %q: a durable queue needs the database", q.Name)
			}
			if r.Durable, err = NewDurable(db, q, rdb, log.Named(q.Name)); err != nil {
				return nil, err
			}
		}
		m.queues[q.Name] = r
		m.order = append(m.order, q.Name)
		if q.Action.Type != ActionPoll {
			c, err := consumer.New(m.consumerConfig(r), rdb, nil, r.Metrics, log.Named(q.Name))
			if err != nil {
				return nil, fmt.Errorf("queue %q: %w", q.Name, err)
			}
			m.cons[q.Name] = c
		}
	}
	return m, nil
}

// Queue returns the named queue.
func (m *Manager) Queue(name string) (*Runtime, bool) {
	r, ok := m.queues[name]
	return r, ok
}

// Names lists the queues in file order.
func (m *Manager) Names() []string { return m.order }

// Verify checks the sql actions' statements.
func (m *Manager) Verify(ctx context.Context) error {
	for _, name := range m.order {
		q := m.queues[name].Config
		if q.Action.Type != ActionSQL {
			continue
		}
		if err := orders.VerifyStatement(ctx, m.db, q.Action.Statement); err != nil {
			return fmt.Errorf("queue %q: statement: %w", name, err)
		}
	}
	return nil
}

// Run runs a consumer for every queue the daemon itself serves (all but
// poll queues, which consumers poll through the API) until ctx ends. It
// runs once per Manager.
func (m *Manager) Run(ctx context.Context) {
	var wg sync.WaitGroup
	for _, name := range m.order {
		r, c := m.queues[name], m.cons[name]
		if c == nil { // a poll queue
			continue
		}
		if r.Durable != nil {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r.Durable.RunLoader(ctx)
			}()
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.Run(ctx) //nolint:errcheck // returns nil when ctx ends
		}()
	}
	wg.Wait()
}

// LongestDrain is the longest a queue the daemon serves lets its batches
// run after a stop begins (half its lease, see consumerConfig); 0 when it
// serves none.
func (m *Manager) LongestDrain() time.Duration {
	var d time.Duration
	for _, c := range m.cons {
		if c != nil {
			d = max(d, c.DrainTimeout())
		}
	}
	return d
}

// consumerConfig is the consumer of a queue the daemon serves: its keys,
// batch, lease, retry policy and action. A shutdown lets in-flight batches
// finish for half the lease (DrainTimeout), then hands back what is left.
func (m *Manager) consumerConfig(r *Runtime) consumer.Config {
	q := r.Config
	lease := time.Duration(q.Lease)
	retry := q.Retry
	cfg := consumer.Config{
		Keys: r.Keys, Workers: q.Workers, BatchSize: q.BatchSize, Lease: lease,
		StatementTimeout: lease * 3 / 4, DrainTimeout: lease / 2, MaxAttempts: retry.MaxAttempts,
		Retry: func(a int) time.Duration { return retry.Delay(a, rand.Float64) },
		Owner: m.owner + "/" + q.Name,
	}
	switch q.Action.Type {
	case ActionStream, ActionList:
		cfg.Workers = 1
		cfg.Forward = &consumer.Forward{Kind: q.Action.Type, Queue: q.Name, MaxLen: q.Action.MaxLen,
			Reliable: q.Action.Reliable, AckTimeout: time.Duration(q.Action.AckTimeout)}
	case ActionSQL:
		cfg.Process = sqlAction(m.db, q.Action.Statement)
	case ActionWebhook:
		cfg.Process = webhookAction(q.Name, q.Action.URL, time.Duration(q.Action.Timeout), q.Action.secret, q.Action.previousSecret, nil)
	}
	if r.Durable != nil {
		cfg.Process = r.Durable.Executor(cfg.Process, retry.MaxAttempts)
	}
	return cfg
}
