package orders

// TextArrayForTest is textArray, for tests that write rows in bulk.
func TextArrayForTest(ss []string) any { return textArray(ss) }
