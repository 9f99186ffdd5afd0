package orders

import (
	"database/sql"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"testing"

	"github.com/lib/pq"
)

// textList against PostgreSQL's own array_out, not only pq.StringArray: a
// list of serials (valid ones: 1–128 bytes of UTF-8 without control
// characters, but every character the array syntax gives a meaning to, NULL
// in any case, non-ASCII) is aggregated by the server, as the one statement
// does, in text, varchar and blank-padded char(n) form; textList must read
// back exactly the serials (for char(n), padded to n), on both of its paths.
// Read-only: it needs no table.
func TestAdvTextListReadsPostgresArrayOut(t *testing.T) {
	t.Parallel()
	url := os.Getenv("ORDERDELAY_TEST_DATABASE_URL") // testenv's default (testenv imports this package)
	if url == "" {
		url = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	}
	db, err := sql.Open("postgres", url)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	fixed := [][]string{
		{"a"}, {"ORD-1", "ORD-2"}, {"NULL"}, {"null"}, {"NuLl", "a"}, {"nULL"}, {"NULLx", "xNULL"},
		{`"`}, {`\`}, {`\\`}, {`\"`}, {`""`}, {"{"}, {"}"}, {"{}"}, {"{a,b}"}, {","}, {"a,b", "c"},
		{" "}, {" lead"}, {"trail "}, {"in side"}, {"订单-🛒", "é"}, {"\u00a0nbsp\u00a0"}, {"\u2028"},
		{"[1:2]={a}"}, {"'q'"}, {"a=b"}, {"a;b"}, {"(a)"}, {"<a>"}, {"$1"}, {"\u3000"}, {"NULL ", " NULL"},
		{"'; DROP TABLE orders; --"}, {strings.Repeat("x", 128)}, {strings.Repeat("é", 64)},
	}
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	r := rand.New(rand.NewPCG(seed, 0))
	alphabet := []string{"a", "Z", "0", "-", `"`, `\`, "{", "}", ",", " ", "N", "U", "L", "l", "é", "订", "🛒", "'", "[", "]", ":", "=", "\u00a0"}
	cases := fixed
	for range 400 {
		ss := make([]string, 1+r.IntN(6))
		for i := range ss {
			var b strings.Builder
			for n := 1 + r.IntN(6); b.Len() < n; {
				b.WriteString(alphabet[r.IntN(len(alphabet))])
			}
			ss[i] = b.String()
		}
		cases = append(cases, ss)
	}
	for _, typ := range []string{"text", "varchar", "char(130)"} {
		for _, ss := range cases {
			var raw []byte
			q := fmt.Sprintf(`SELECT array_agg(x::%s ORDER BY o) FROM unnest($1::text[]) WITH ORDINALITY AS u(x, o)`, typ)
			if err := db.QueryRow(q, pq.Array(ss)).Scan(&raw); err != nil {
				t.Fatalf("%s %q: %v", typ, ss, err)
			}
			var got textList
			if err := got.Scan(raw); err != nil {
				t.Errorf("%s %q: array_out %s: textList: %v", typ, ss, raw, err)
				continue
			}
			want := ss
			if typ == "char(130)" {
				want = make([]string, len(ss))
				for i, s := range ss {
					want[i] = s + strings.Repeat(" ", 130-len([]rune(s)))
				}
			}
			if fmt.Sprintf("%q", []string(got)) != fmt.Sprintf("%q", want) {
				t.Errorf("%s: array_out %s: textList read %q, want %q", typ, raw, []string(got), want)
			}
		}
	}
}
