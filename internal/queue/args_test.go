package queue_test

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/orderdelay/orderdelay/internal/queue"
	"github.com/orderdelay/orderdelay/internal/testenv"
)

// Every script that takes serials gets them through scriptArgs: Redis must
// see each one byte for byte, after the fixed arguments, whatever it holds.
func TestScriptArgsReachRedisAsWritten(t *testing.T) {
	rdb, _ := testenv.Redis(t)
	serials := []string{"ORD-1", "", "a|b|c", "x\ny", "订单-🛒", "\x00\xff", "-1", "1e3"}
	for _, c := range []struct {
		name    string
		serials []string
		head    []any
		want    []string
	}{
		{"fixed arguments then serials", serials, []any{"tok:1", int64(1500), "0"},
			append([]string{"tok:1", "1500", "0"}, serials...)},
		// go-redis takes a lone argument apart when it is a slice or a
		// struct: a lone serial must still arrive as itself.
		{"one serial alone", []string{"only"}, nil, []string{"only"}},
		{"no serials", nil, []any{"tok:1"}, []string{"tok:1"}},
	} {
		got, err := redis.NewScript(`return ARGV`).Run(context.Background(), rdb, nil,
			queue.ScriptArgs(c.serials, c.head...)...).StringSlice()
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if !slices.Equal(got, c.want) {
			t.Errorf("%s: Redis saw %q, want %q", c.name, got, c.want)
		}
	}
}

// A batch's serials go to Redis without an allocation each: boxing a
// string into an interface costs one, and a claim's fence and finish each
// send every serial of the batch.
func TestScriptArgsAllocatePerCallNotPerSerial(t *testing.T) {
	serials := make([]string, 500)
	for i := range serials {
		serials[i] = fmt.Sprintf("ORD-%06d", i)
	}
	allocs := testing.AllocsPerRun(50, func() { _ = queue.ScriptArgs(serials, "tok:1", "0") })
	// The slice, and the fixed arguments' boxes.
	if allocs > 3 {
		t.Fatalf("scriptArgs of %d serials: %.0f allocations, want at most 3", len(serials), allocs)
	}
}

func BenchmarkScriptArgs(b *testing.B) {
	serials := make([]string, 500)
	for i := range serials {
		serials[i] = fmt.Sprintf("ORD-%06d", i)
	}
	b.ReportAllocs()
	for b.Loop() {
		_ = queue.ScriptArgs(serials, "tok:1", "0")
	}
}
