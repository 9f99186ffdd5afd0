package consumer

import "context"

type heldKey struct{}

// heldBatch is what processTasks tells its action about the batch: the
// items it claimed, to check later that it still holds them.
type heldBatch struct {
	c     *Consumer
	items map[string]item
}

// Held reports which of ids the batch running under ctx still holds: a
// task whose lease record no longer carries the batch's token was deleted
// or moved by a producer (its record goes), or its lease expired and
// another claim took it. An action that runs a task long after its claim
// (a sql action isolating a failing task) checks this first and runs only
// what it holds. ok is false when ctx is no task batch's (nothing to
// check).
func Held(ctx context.Context, ids []string) (held map[string]bool, ok bool, err error) {
	b, _ := ctx.Value(heldKey{}).(*heldBatch)
	if b == nil {
		return nil, false, nil
	}
	if len(ids) == 0 {
		return map[string]bool{}, true, nil
	}
	recs, has, err := b.c.q.LeaseRecords(ctx, ids)
	if err != nil {
		return nil, true, err
	}
	held = make(map[string]bool, len(ids))
	for i, id := range ids {
		if it, claimed := b.items[id]; claimed && has[i] && recs[i].Token == it.token {
			held[id] = true
		}
	}
	return held, true, nil
}

// withHeld lets the action of items check that it still holds them (Held).
func (c *Consumer) withHeld(ctx context.Context, items []item) context.Context {
	m := make(map[string]item, len(items))
	for _, it := range items {
		m[it.serial] = it
	}
	return context.WithValue(ctx, heldKey{}, &heldBatch{c: c, items: m})
}
