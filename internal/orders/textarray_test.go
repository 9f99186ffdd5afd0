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

// textList reads what pq.StringArray reads, for any text: its own path
// (an array of plain elements, split without a copy per element) gives the
// same elements, and whatever pq refuses it refuses too. NULL elements,
// which pq.StringArray refuses as well, are refused on both paths (its own
// also refuses "null" unquoted, which PostgreSQL reads as NULL).
func FuzzTextListReadsAsPqStringArray(f *testing.F) {
	for _, s := range []string{
		"{}", "{a}", "{a,b}", `{"a b",c}`, `{"a\"b"}`, `{a\,b}`, "{NULL}", "{null,a}", `{"NULL"}`,
		"{a,,b}", "{,}", "{{a},{b}}", "[1:2]={a,b}", "{ a , b }", "a,b", "", "{", "}", "{a}}", "{é,订单}",
		`{"",a}`, "{a\tb}", "{Null}", `{\N}`,
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		var got textList
		gotErr := got.Scan([]byte(s))
		var want pq.StringArray
		wantErr := want.Scan([]byte(s))
		switch {
		case wantErr != nil && gotErr == nil:
			t.Fatalf("textList read %q as %q; pq.StringArray refuses it: %v", s, got, wantErr)
		case wantErr == nil && gotErr != nil:
			if _, plain := plainArray(s); !plain {
				t.Fatalf("textList refused %q (%v); pq.StringArray reads %q", s, gotErr, want)
			}
			// The plain path refuses an empty element, which pq reads as
			// "", and an unquoted NULL in any case, which PostgreSQL reads
			// as NULL (array_out quotes a serial spelled so) and pq, but
			// for "NULL", as text.
			for _, e := range want {
				if e == "" || strings.EqualFold(e, "NULL") {
					return
				}
			}
			t.Fatalf("textList refused %q (%v); pq.StringArray reads %q", s, gotErr, want)
		case wantErr == nil && fmt.Sprintf("%q", []string(got)) != fmt.Sprintf("%q", []string(want)):
			t.Fatalf("textList read %q as %q, pq.StringArray as %q", s, got, want)
		}
	})
}

// A NULL list, a value of another Go type, and NULL elements on both paths
// are refused with an error that says so.
func TestTextListRefusesNull(t *testing.T) {
	t.Parallel()
	for _, src := range []any{nil, 42, []byte("{a,NULL}"), []byte("{NULL}"), []byte(`{"a b",NULL}`), []byte("{a,,b}")} {
		var l textList
		if err := l.Scan(src); err == nil {
			t.Errorf("textList.Scan(%#v) = %q, want an error", src, l)
		}
	}
	var l textList
	if err := l.Scan("{a,b}"); err != nil || len(l) != 2 {
		t.Errorf("textList.Scan of a string = %q, %v", l, err)
	}
}
