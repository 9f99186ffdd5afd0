package consumer

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/orderdelay/orderdelay/internal/testenv"
)

// batchOf returns n items of one claim, each serial once.
func batchOf(n int) []item {
	items := make([]item, n)
	for i := range items {
		items[i] = item{token: "host-1:n.1", serial: fmt.Sprintf("ORD-%06d", i), deadline: int64(1_700_000_000_000 + i), attempts: i % 3}
	}
	return items
}

// dedupeModel is dedupe's rule stated plainly: the first item of each
// serial, in order.
func dedupeModel(items []item) []item {
	var out []item
	for i, it := range items {
		if !slices.ContainsFunc(items[:i], func(o item) bool { return o.serial == it.serial }) {
			out = append(out, it)
		}
	}
	return out
}

func TestDedupeKeepsTheFirstItemOfEachSerial(t *testing.T) {
	t.Parallel()
	a := item{token: "t1", serial: "a", deadline: 1, attempts: 0}
	b := item{token: "t1", serial: "b", deadline: 2, attempts: 1}
	a2 := item{token: "t2", serial: "a", deadline: 3, attempts: 2}
	b2 := item{token: "t1", serial: "b", deadline: 4, attempts: 0}
	for _, c := range []struct {
		name string
		in   []item
		want []item
	}{
		{"none", nil, nil},
		{"one", []item{a}, []item{a}},
		{"no repeats", []item{a, b}, []item{a, b}},
		{"a repeat keeps the first, whatever the later one carries", []item{a, b, a2}, []item{a, b}},
		{"repeats of every serial", []item{b, a, b2, a2, a, b}, []item{b, a}},
		{"the empty serial is a serial", []item{{serial: ""}, a, {serial: "", attempts: 5}}, []item{{serial: ""}, a}},
	} {
		got := dedupe(slices.Clone(c.in))
		if !slices.Equal(got, c.want) {
			t.Errorf("%s: dedupe = %+v, want %+v", c.name, got, c.want)
		}
	}
}

// Randomised against the model: batches with and without repeats, from
// one claim or several.
func TestDedupeMatchesModel(t *testing.T) {
	t.Parallel()
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	r := rand.New(rand.NewPCG(seed, 0))
	for range 2000 {
		n := r.IntN(40)
		alphabet := 1 + r.IntN(60) // small alphabets repeat serials, large ones seldom do
		items := make([]item, n)
		for i := range items {
			items[i] = item{token: fmt.Sprintf("t%d", r.IntN(2)), serial: fmt.Sprintf("s%d", r.IntN(alphabet)), deadline: int64(i)}
		}
		want := dedupeModel(items)
		in := slices.Clone(items)
		got := dedupe(in)
		if !slices.Equal(got, want) {
			t.Fatalf("seed %d: dedupe(%+v) = %+v, want %+v", seed, items, got, want)
		}
		if !slices.Equal(in, items) {
			t.Fatalf("seed %d: dedupe changed its input: %+v, was %+v", seed, in, items)
		}
	}
}

// A claim's batch has no repeats (the claim script leases a serial once):
// dedupe checks that without an allocation per batch, let alone per item.
func TestDedupeOfABatchWithoutRepeatsAllocatesNothing(t *testing.T) {
	if testenv.RaceEnabled {
		t.Skip("sync.Pool drops what it is given at random under the race detector")
	}
	items := batchOf(500)
	allocs := testing.AllocsPerRun(50, func() { _ = dedupe(items) })
	if allocs > 0 {
		t.Fatalf("dedupe of a %d-item batch without repeats: %.0f allocations, want 0", len(items), allocs)
	}
}

func BenchmarkDedupe(b *testing.B) {
	items := batchOf(500)
	b.ReportAllocs()
	for b.Loop() {
		_ = dedupe(items)
	}
}

type group struct {
	tok     string
	serials []string
}

func groupsOf(items []item) []group {
	var out []group
	for tok, serials := range byToken(items) {
		out = append(out, group{tok, serials})
	}
	return out
}

func TestByTokenGroupsByClaimInOrder(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		in   []item
		want []group
	}{
		{"none", nil, nil},
		{"one claim", []item{{token: "t1", serial: "a"}, {token: "t1", serial: "b"}},
			[]group{{"t1", []string{"a", "b"}}}},
		{"several claims, tokens in the order they first appear", []item{
			{token: "t2", serial: "a"}, {token: "t1", serial: "b"}, {token: "t2", serial: "c"}, {token: "t3", serial: "d"}, {token: "t1", serial: "e"}},
			[]group{{"t2", []string{"a", "c"}}, {"t1", []string{"b", "e"}}, {"t3", []string{"d"}}}},
	} {
		got := groupsOf(c.in)
		if !slices.EqualFunc(got, c.want, func(a, b group) bool { return a.tok == b.tok && slices.Equal(a.serials, b.serials) }) {
			t.Errorf("%s: byToken = %v, want %v", c.name, got, c.want)
		}
	}
	// A caller that stops early is not called again.
	calls := 0
	for range byToken([]item{{token: "t1", serial: "a"}, {token: "t2", serial: "b"}}) {
		calls++
		break
	}
	if calls != 1 {
		t.Fatalf("byToken yielded %d groups after the loop broke, want 1", calls)
	}
}

// A batch is one claim's: its group is its serials, with no map between.
func TestByTokenOfOneClaimAllocatesOnlyTheSerials(t *testing.T) {
	items := batchOf(500)
	allocs := testing.AllocsPerRun(50, func() {
		for _, serials := range byToken(items) {
			_ = serials
		}
	})
	if allocs > 1 {
		t.Fatalf("byToken of a %d-item batch of one claim: %.0f allocations, want 1 (the serials)", len(items), allocs)
	}
}

func BenchmarkByToken(b *testing.B) {
	items := batchOf(500)
	b.ReportAllocs()
	for b.Loop() {
		for _, serials := range byToken(items) {
			_ = serials
		}
	}
}
