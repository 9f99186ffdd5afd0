package orders

// SetSettleSQL puts q in place of DefaultSettleSQL in s, so tests can feed
// Settle results the reference statement never returns.
func SetSettleSQL(s *Store, q string) { s.settleSQL = q }

// TextArrayForTest is textArray, for tests that write rows in bulk.
func TextArrayForTest(ss []string) any { return textArray(ss) }

// TxRefSQL is the query for the transaction id and the server after the
// close statement alone.
const TxRefSQL = txRefSQL

// Unprepared makes s send its statements unprepared, as it does after a
// pooler lost them, for benchmarks that compare the two.
func Unprepared(s *Store) { s.prep.off.Store(true) }

// ResetPrepared drops s's prepared statements, as a stale plan does.
func ResetPrepared(s *Store) { s.prep.reset() }

// ShapeLookup is the form the lookup statement q is prepared in.
func ShapeLookup(q string) string { return shapeLookup(q) }

// ShapeClose is the form the close statement q is prepared in.
func ShapeClose(q string) string { return shapeClose(q) }

// ShapedSettleSQL is the form DefaultSettleSQL is prepared in.
const ShapedSettleSQL = shapedSettleSQL
