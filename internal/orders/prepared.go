package orders

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/jmoiron/sqlx"
	"github.com/lib/pq"
	"go.uber.org/zap"
)

// prepared runs the statements of a batch (the one statement, or the close
// statement and the query for the transaction id; the lookup) as
// server-side prepared statements: parsed and described once per
// connection, then only bound and executed. An unnamed statement — what
// lib/pq sends for a query with parameters — costs a Parse/Describe round
// trip before the Bind/Execute one, and PostgreSQL plans it afresh every
// time; a prepared one takes one round trip, and after five executions
// PostgreSQL may keep a generic plan instead of planning each batch.
//
// A *sql.Stmt per statement, made on the pool, keeps one prepared statement
// per connection (database/sql prepares it on a connection the first time
// it runs there, and again on any new connection the pool dials after one
// died); Tx.StmtContext reuses the connection's in a transaction, and the
// transaction's copy is closed at its end without closing the connection's.
//
// Three things can go wrong with a statement prepared long ago:
//   - the table changed under it so that its result would change type
//     (ALTER COLUMN … TYPE of a column it returns): PostgreSQL answers 0A000
//     "cached plan must not change result type" to every execution. The
//     statements are dropped and prepared again (reset), and the batch is
//     run again at once: nothing was committed (the error aborts the
//     transaction), no attempt is spent. Other changes (a column added or
//     dropped elsewhere, an index) are replanned by PostgreSQL itself.
//   - a pooler between the daemon and PostgreSQL that hands each
//     transaction to another server session (PgBouncer in transaction
//     pooling, before 1.21 or without max_prepared_statements) loses them
//     (26000 "prepared statement … does not exist") or finds another
//     client's of the same name (42P05 "… already exists"; 08P01 when
//     ours is bound to theirs and the parameters or columns differ). The store
//     falls back, for good, to unprepared statements, says so once at Warn,
//     and runs the batch again at once.
//   - the connection dies: the pool dials another, and the statement is
//     prepared there the first time it runs on it.
type prepared struct {
	db  *sqlx.DB
	log atomic.Pointer[zap.Logger]
	// off: fall back to unprepared statements (a pooler lost ours).
	off      atomic.Bool
	warnOnce sync.Once

	// shapes: the queries prepared in a shaped form (see shape), by
	// query text; set before use.
	shapes map[string]shape

	mu sync.Mutex
	// stmts: the prepared statements, by query text; nil for a query
	// whose shaped form PostgreSQL refused: it runs unprepared.
	stmts map[string]*sql.Stmt
}

// newPrepared returns the prepared statements of a store whose lookup and
// close statements are lookup and close: both are prepared shaped.
func newPrepared(db *sqlx.DB, lookup, close string) *prepared {
	p := &prepared{db: db, stmts: map[string]*sql.Stmt{}, shapes: map[string]shape{
		close:  {form: shapeClose(close), extra: 2},
		lookup: {form: shapeLookup(lookup), extra: 1},
	}}
	p.log.Store(zap.NewNop())
	return p
}

// shape is the form a query is prepared in, and how many parameters that
// form takes after the query's own (each bound to shapeArg).
type shape struct {
	form  string
	extra int
}

// A mix-up behind a pooler (see prepared) is harmless only if PostgreSQL
// refuses it, and it refuses a Bind only when the statement of that name
// takes another number of parameters (08P01 from exec_bind_message) or,
// where lib/pq asks for some columns in binary, returns another number of
// columns (08P01 from PortalSetResultFormat). lib/pq reads as many columns
// of a row as its own statement has and ignores the rest, so a statement
// that takes the same parameters and returns at least as many columns, all
// asked for as text, runs in place of ours without an error:
//   - a lookup bound to a close or the one statement would close orders
//     outside any fenced transaction (an order its producer just
//     rescheduled, before its new deadline);
//   - a close bound to the one statement would report closed every
//     serial the one statement returns, paid orders included (a close
//     event for a paid order), and a close bound to a lookup every serial
//     that has a row, closing none (removed from the queue while pending).
//
// So every statement a replica prepares takes a number of parameters no
// other statement of the fleet takes — other configurations included (a
// custom lookup or close set replica by replica), and the release before
// this one, which prepared the one statement — then answering per serial —
// with one parameter, and the release before that, which prepared the
// lookup and the close as they are (one text[]): the query for the
// transaction id none, the lookup two (shapeLookup), the close three
// (shapeClose), the one statement four (shapedSettleSQL).
//
// The wrapping changes neither the rows nor the plan (PostgreSQL pulls the
// lookup's subquery up; a data-modifying WITH runs to completion whatever
// the query around it reads; the conditions on the extra parameters are
// one-time filters). A custom statement that cannot be wrapped (PostgreSQL
// refuses the shaped form: a lookup with a data-modifying WITH, a close
// with a WITH of its own that modifies data) runs unprepared.
func shapeLookup(q string) string {
	return "SELECT * FROM (\n" + strings.TrimRight(q, "; \t\r\n") + "\n) AS lookup WHERE $2::int IS NOT NULL"
}

// shapeClose is the close statement q wrapped so that it takes two more
// parameters (see shapeLookup).
func shapeClose(q string) string {
	return "WITH orderdelay_close AS (\n" + strings.TrimRight(q, "; \t\r\n") +
		"\n) SELECT * FROM orderdelay_close WHERE $2::int IS NOT NULL AND $3::int IS NOT NULL"
}

// shapeArg is what a shaped statement's extra parameter is bound to.
const shapeArg = 1

// ensure makes the statements for queries that are not made yet, on the
// pool, before the caller takes a connection for its transaction (made in
// a transaction, a *sql.Stmt would belong to it). A query that does not
// prepare is run unprepared this time, and reports its own error then, as
// it always has (so do the queries after it); an error that says a pooler
// is in the way turns prepared statements off.
func (p *prepared) ensure(ctx context.Context, queries ...string) {
	if p.off.Load() {
		return
	}
	for _, q := range queries {
		p.mu.Lock()
		_, ok := p.stmts[q]
		p.mu.Unlock()
		if ok {
			continue
		}
		form := q
		sh, shaped := p.shapes[q]
		if shaped {
			form = sh.form
		}
		st, err := p.db.PrepareContext(ctx, form)
		// A name another client's statement holds (42P05) is a pooler's
		// doing, not the shaped form's: cured below, like any other.
		if err != nil && shaped && unwrappable(err) && !pooledAway(err) {
			p.log.Load().Info("this statement cannot be prepared in the shape that guards against a pooler's mix-ups; it runs unprepared",
				zap.String("statement", q), zap.Error(err))
			p.mu.Lock()
			p.stmts[q] = nil
			p.mu.Unlock()
			continue
		}
		if err != nil {
			// The statement reports it when it runs (or the database is
			// away: then BEGIN does, and one connection attempt is enough).
			p.cure(err)
			return
		}
		p.mu.Lock()
		if _, ok := p.stmts[q]; ok || p.off.Load() {
			// Another goroutine made it first, or fallen back: left to
			// its connection, never closed (see reset).
			p.mu.Unlock()
			continue
		}
		p.stmts[q] = st
		p.mu.Unlock()
	}
}

// stmt returns the statement for q, or nil: run it unprepared.
func (p *prepared) stmt(q string) *sql.Stmt {
	if p.off.Load() {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stmts[q]
}

// on returns a Querier that runs the prepared statements on tx (nil: on the
// pool) and any other query as it is.
// unprepared runs every statement unprepared (a probe: see suspect).
func (p *prepared) on(tx *sql.Tx, unprepared bool) preparedOn {
	return preparedOn{p: p, tx: tx, ran: new(bool), used: new(bool), skip: unprepared}
}

type preparedOn struct {
	p  *prepared
	tx *sql.Tx
	// ran: the last statement run on it ran prepared (see decodePanic);
	// used: any did (see suspect).
	ran, used *bool
	skip      bool
}

func (q preparedOn) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	st := q.p.stmt(query)
	if q.skip {
		st = nil
	}
	if st != nil {
		*q.used = true
	}
	bound := args
	if sh, ok := q.p.shapes[query]; ok && st != nil {
		bound = slices.Grow(args[:len(args):len(args)], sh.extra)
		for range sh.extra {
			bound = append(bound, shapeArg)
		}
	}
	*q.ran = st != nil
	switch {
	case st != nil && q.tx != nil:
		// The transaction's copy uses the connection's prepared statement
		// (preparing it there the first time) and is closed when the
		// transaction ends; the connection's stays.
		return q.tx.StmtContext(ctx, st).QueryContext(ctx, bound...)
	case st != nil:
		rows, err := st.QueryContext(ctx, bound...)
		if err != nil && q.p.stmt(query) != st {
			// Dropped by a reset (or a fallback) on another worker
			// meanwhile: only the pool's read-only lookup runs here, so
			// it runs again, as it is.
			*q.ran = false
			return q.p.db.QueryContext(ctx, query, args...)
		}
		return rows, err
	case q.tx != nil:
		return q.tx.QueryContext(ctx, query, args...)
	default:
		return q.p.db.QueryContext(ctx, query, args...)
	}
}

// errMixedUp says lib/pq could not decode a row of a statement of ours
// that ran prepared (see decodePanic).
var errMixedUp = errors.New("a row of a prepared statement did not decode as its columns: " +
	"another client's statement of that name ran in its place")

// decodePanic, deferred by a function that reads the rows of a statement
// run on q, turns a runtime panic while they were read into errMixedUp in
// *err, when the statement ran prepared. lib/pq decodes each column as the
// type our statement was described with, in the format it asked for: the
// server sends what the statement that ran returns, so another client's
// statement under our statement's name, taking our parameters and
// returning as many columns of other types, can come back as an int8 in
// binary shorter than 8 bytes or an empty boolean, and lib/pq indexes out
// of range. That is a pooler mixing statements up, as the errors of
// pooledAway are (lib/pq has read the whole message: the connection is
// sound, and the rows are closed before this runs). Any other panic, and
// any panic of a statement sent unprepared, goes on.
func decodePanic(q Querier, err *error) {
	on, ok := q.(preparedOn)
	if !ok || !*on.ran {
		return
	}
	r := recover()
	if r == nil {
		return
	}
	re, ok := r.(runtime.Error)
	if !ok {
		panic(r)
	}
	*err = fmt.Errorf("%w (%v)", errMixedUp, re)
}

// cure reports whether err is one that running the statement again can
// cure, after doing what cures it: a cached plan whose result type changed
// (drop the prepared statements, so they are prepared again), or a pooler
// that loses prepared statements (fall back to unprepared ones). It is told
// every error of a call that ran prepared statements; it ignores the rest.
func (p *prepared) cure(err error) bool {
	switch {
	case StalePlan(err):
		p.reset()
		return true
	case pooledAway(err):
		// Another worker may have fallen back since this one's statement
		// was sent (every worker meets the pooler at about the same
		// time): its batch runs again too, unprepared now.
		p.fallBack(err)
		return true
	}
	return false
}

// fallBack turns prepared statements off for good, saying why (err) once.
func (p *prepared) fallBack(err error) {
	if p.off.Swap(true) {
		return
	}
	p.warnOnce.Do(func() {
		p.log.Load().Warn("PostgreSQL, or a pooler in front of it, lost or mixed up this daemon's prepared statements; "+
			"closing batches with unprepared statements from now on (one more round trip and a fresh plan per batch). "+
			"PgBouncer in transaction pooling does this before 1.21 or without max_prepared_statements: "+
			"set max_prepared_statements (PgBouncer 1.21 or later) or use session pooling to keep them",
			zap.Error(err))
	})
	p.reset()
}

// suspect reports an error of a call that ran prepared statements that a
// pooler's mix-up may have caused, though PostgreSQL does not say so: a
// data exception (class 22) raised while the Bind's parameters were read
// as the statement's types. Another client's statement under the name of
// ours, taking as many parameters of other types, reads our text[] as,
// say, a bigint (22P02). The context PostgreSQL gives such an error is
// one line naming the parameter and its value ("unnamed portal parameter
// $1 = '...'": the words are translated, "$1 = " is not); one of a
// shop's function or trigger names the function (and a query inside it
// sets InternalQuery). Our own parameters (a text[] we encode, an int)
// always read, but to be sure the caller runs the call once more
// unprepared: if that runs, the prepared statement was not ours, and it
// falls back (fallBack); if not, the second error is the call's.
func suspect(err error) bool {
	var pqErr *pq.Error
	return errors.As(err, &pqErr) && pqErr.Code.Class() == "22" && pqErr.InternalQuery == "" &&
		!strings.Contains(pqErr.Where, "\n") && bindParameter.MatchString(pqErr.Where)
}

// bindParameter matches the context of an error raised reading a Bind's
// parameter (see suspect).
var bindParameter = regexp.MustCompile(`\$[0-9]+ = `)

// reset drops the statements: the next batch prepares them again on each
// connection. The dropped ones are not closed: they stay prepared in their
// sessions, unused, until their connections close (database/sql closes a
// connection's statements then). Closing a *sql.Stmt makes database/sql
// send each idle connection's Close and wait for the answer while it holds
// the pool's lock: on a connection whose replies are held up (a network
// partition, a failover that blackholes the old primary) that stops every
// user of the pool, however short their deadlines, and every db.Stats (the
// pool metrics), until TCP gives up. A reset happens when a migration
// changes a returned column's type, or once behind a pooler: a few
// statements per session each time. A query whose shaped form PostgreSQL
// refused stays unprepared: that is the statement's form, which no
// migration changes, and it is not offered (nor said) again.
func (p *prepared) reset() {
	p.mu.Lock()
	kept := map[string]*sql.Stmt{}
	for q, st := range p.stmts {
		if st == nil {
			kept[q] = nil
		}
	}
	p.stmts = kept
	p.mu.Unlock()
}

// StalePlan reports PostgreSQL's refusal to run a prepared statement whose
// result would change type since it was prepared (0A000 "cached plan must
// not change result type", raised by RevalidateCachedQuery, told by the
// routine rather than the message, which lc_messages translates): the
// statement, not any order, is stale; it runs once prepared again.
func StalePlan(err error) bool {
	var pqErr *pq.Error
	return errors.As(err, &pqErr) && pqErr.Code == "0A000" && pqErr.Routine == "RevalidateCachedQuery"
}

// pooledAway reports an error about the name of a prepared statement of
// ours, raised by the statement itself (not inside a shop's function): 26000
// it does not exist in this session, 42P05 one of that name already exists,
// 08P01 from exec_bind_message (the statement of that name in this session
// takes other parameters than ours) or from PortalSetResultFormat (it
// returns another number of columns than ours, and lib/pq asked for some
// of ours in binary). lib/pq binds its own statement as the server
// described it to it, so either says another client's is in its place.
// Behind a pooler that hands transactions to any server session, all of
// them mean prepared statements cannot be kept; so does a row of ours that
// lib/pq could not decode (errMixedUp).
func pooledAway(err error) bool {
	if errors.Is(err, errMixedUp) {
		return true
	}
	var pqErr *pq.Error
	if !errors.As(err, &pqErr) || pqErr.Where != "" || pqErr.InternalQuery != "" {
		return false
	}
	return pqErr.Code == "26000" || pqErr.Code == "42P05" ||
		pqErr.Code == "08P01" && (pqErr.Routine == "exec_bind_message" || pqErr.Routine == "PortalSetResultFormat")
}

// unwrappable reports PostgreSQL's refusal of a statement's shaped form
// as a statement (syntax, names, a feature not allowed in a subquery):
// not the database being away.
func unwrappable(err error) bool {
	var pqErr *pq.Error
	if !errors.As(err, &pqErr) {
		return false
	}
	c := pqErr.Code.Class()
	return c == "42" || c == "0A"
}
