package queue

import (
	"slices"
	"testing"
)

func TestDistinctKeepsFirstSeenOrder(t *testing.T) {
	for _, tc := range []struct{ in, want []string }{
		{nil, nil},
		{[]string{"a"}, []string{"a"}},
		{[]string{"a", "b"}, []string{"a", "b"}},
		{[]string{"a", "a"}, []string{"a"}},
		{[]string{"a", "b", "a", "c", "b", "c", "d"}, []string{"a", "b", "c", "d"}},
		{[]string{"", "", "x"}, []string{"", "x"}},
	} {
		in := slices.Clone(tc.in)
		if got := distinct(in); !slices.Equal(got, tc.want) {
			t.Errorf("distinct(%q) = %q, want %q", tc.in, got, tc.want)
		}
		if !slices.Equal(in, tc.in) {
			t.Errorf("distinct changed its argument: %q, was %q", in, tc.in)
		}
	}
}
