package orders

import (
	"database/sql/driver"
	"strings"
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
	for _, s := range a {
		n += len(s)
		for i := 0; i < len(s); i++ {
			if s[i] == '"' || s[i] == '\\' {
				n++
			}
		}
	}
	var b strings.Builder
	b.Grow(n)
	b.WriteByte('{')
	for i, s := range a {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteByte('"')
		for {
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
