package orders

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/lib/pq"
)

// textArray must send exactly what pq.Array sent before it: the statements
// (and custom ones) read $1 as text[] in PostgreSQL's array syntax.
func TestTextArrayEncodesAsPqStringArray(t *testing.T) {
	t.Parallel()
	cases := [][]string{
		nil, {}, {""}, {"a"}, {"ORD-1", "ORD-2"},
		{`a"b`, `c\d`, `\"`, `""`, `\\`, `{x}`, "a,b", " lead", "trail ", "NULL", "null", "订单-🛒", "'; DROP TABLE orders; --"},
	}
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	r := rand.New(rand.NewPCG(seed, 0))
	const alphabet = "ab\"\\{},' \x00é"
	for range 500 {
		ss := make([]string, r.IntN(8))
		for i := range ss {
			var b strings.Builder
			for range r.IntN(6) {
				b.WriteByte(alphabet[r.IntN(len(alphabet))])
			}
			ss[i] = b.String()
		}
		cases = append(cases, ss)
	}
	for _, ss := range cases {
		want, err := pq.Array(ss).Value()
		if err != nil {
			t.Fatal(err)
		}
		got, err := textArray(ss).Value()
		if err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Fatalf("seed %d: textArray(%q) = %#v, pq.Array gives %#v", seed, ss, got, want)
		}
	}
}

// A batch's serials are encoded in one buffer of the right size (the
// other allocation is the driver.Value the string is returned in).
func TestTextArrayAllocatesOneBuffer(t *testing.T) {
	ss := batchSerials(500)
	allocs := testing.AllocsPerRun(50, func() { _, _ = textArray(ss).Value() })
	if allocs > 2 {
		t.Fatalf("textArray of %d serials: %.0f allocations, want 2", len(ss), allocs)
	}
}

func batchSerials(n int) []string {
	ss := make([]string, n)
	for i := range ss {
		ss[i] = fmt.Sprintf("ORD-2026-%06d", i)
	}
	return ss
}

func BenchmarkTextArray(b *testing.B) {
	ss := batchSerials(500)
	b.ReportAllocs()
	for b.Loop() {
		_, _ = textArray(ss).Value()
	}
}

func BenchmarkPqStringArray(b *testing.B) {
	ss := batchSerials(500)
	b.ReportAllocs()
	for b.Loop() {
		_, _ = pq.Array(ss).Value()
	}
}
