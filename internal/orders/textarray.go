package orders

import (
	"database/sql/driver"
	"errors"
	"fmt"
	"strings"

	"github.com/lib/pq"
)

// textArray is a text[] parameter ($1 of the close and lookup statements),
// encoded as pq.Array of a []string encodes it — each element quoted, '"'
// and '\' escaped with a backslash, nil as NULL — but in one buffer sized
// in advance: pq grows its buffer from a guess of three bytes an element,
// then copies it into a string, several allocations of the batch's size
// for every statement.
type textArray []string

func (a textArray) Value() (driver.Value, error) {
	if a == nil {
		return nil, nil
	}
	if len(a) == 0 {
		return "{}", nil
	}
	n := 1 + len(a)*3 // braces and commas, and each element's two quotes
	escapes := 0
	for _, s := range a {
		n += len(s)
		for i := 0; i < len(s); i++ {
			if s[i] == '"' || s[i] == '\\' {
				escapes++
			}
		}
	}
	n += escapes
	var b strings.Builder
	b.Grow(n)
	b.WriteByte('{')
	for i, s := range a {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteByte('"')
		// Without escapes in the whole array (every serial a claim reads
		// is so), no element is searched again.
		for escapes > 0 {
			j := strings.IndexAny(s, `"\`)
			if j < 0 {
				break
			}
			b.WriteString(s[:j])
			b.WriteByte('\\')
			b.WriteByte(s[j])
			s = s[j+1:]
		}
		b.WriteString(s)
		b.WriteByte('"')
	}
	b.WriteByte('}')
	return b.String(), nil
}

// textList reads a text[] result column (the one statement's lists of
// serials) without a string per element: the array's text becomes one
// string and each element a part of it. PostgreSQL writes an element
// unquoted when it has no character the array syntax gives a meaning to
// (braces, quotes, backslash, the comma, white space) and is not NULL, as
// every serial a claim reads is; an array with any of those is read by
// pq.StringArray instead, which allocates per element. A NULL array or a
// NULL element is an error: no statement of ours returns one.
type textList []string

func (l *textList) Scan(src any) error {
	var s string
	switch v := src.(type) {
	case []byte:
		s = string(v)
	case string:
		s = v
	case nil:
		return errors.New("NULL list of serials")
	default:
		return fmt.Errorf("list of serials of Go type %T, want text[]", src)
	}
	if inner, ok := plainArray(s); ok {
		if inner == "" {
			*l = textList{}
			return nil
		}
		out := make(textList, 0, strings.Count(inner, ",")+1)
		for part := range strings.SplitSeq(inner, ",") {
			if part == "" || strings.EqualFold(part, "NULL") {
				return errors.New("a NULL or empty unquoted serial in a list")
			}
			out = append(out, part)
		}
		*l = out
		return nil
	}
	var a pq.StringArray
	if err := a.Scan([]byte(s)); err != nil {
		return err
	}
	*l = textList(a)
	return nil
}

// plainArray returns the elements' part of s, a one-dimensional array's
// text, when none of them is quoted, escaped or padded with white space.
func plainArray(s string) (string, bool) {
	if len(s) < 2 || s[0] != '{' || s[len(s)-1] != '}' {
		return "", false
	}
	inner := s[1 : len(s)-1]
	return inner, !strings.ContainsAny(inner, "{}\"\\ \t\n\r\v\f")
}
