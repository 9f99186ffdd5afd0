package bench

import (
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"time"
)

// DrainResult is one drain run.
type DrainResult struct {
	Contender string   `json:"contender"`
	Settings  Settings `json:"settings,omitzero"`
	Round     int      `json:"round"`
	Orders    int      `json:"orders"`  // backlog given
	Handled   int      `json:"handled"` // orders closed or found settled
	Seconds   float64  `json:"seconds"`
	Rate      float64  `json:"orders_per_second"`
	TimeBoxed bool     `json:"time_boxed"`
	CPU       CPU      `json:"cpu_us_per_order"`
	Verdict   Verdict  `json:"verdict"`

	// orderdelay only
	RSSKB              int64   `json:"daemon_peak_rss_kb,omitempty"`
	APIMaxMs           float64 `json:"api_max_ms,omitempty"`
	APICalls           int     `json:"api_calls,omitempty"`
	APIFailures        int     `json:"api_failures,omitempty"`
	SlowMaxMicros      int64   `json:"redis_slowest_us,omitempty"`
	SlowOver10ms       int     `json:"redis_over_10ms,omitempty"`
	SlowestCmd         string  `json:"redis_slowest_cmd,omitempty"`
	AllocBytesPerOrder float64 `json:"alloc_bytes_per_order,omitempty"`
	MallocsPerOrder    float64 `json:"mallocs_per_order,omitempty"`
	// Execution time inside Redis per order, by command or daemon script
	// (from SLOWLOG with a threshold of 0), and the number of calls.
	RedisMicrosPerOrder map[string]float64 `json:"redis_exec_us_per_order,omitempty"`
	RedisCalls          map[string]int     `json:"redis_calls,omitempty"`
}

// Summary aggregates a contender's rounds.
type Summary struct {
	Median, Min, Max float64
	CPU              CPU // medians, µs per order
	Rounds           int
	TimeBoxed        bool
	Orders           int
}

// SteadyResult is one steady-arrival scenario.
type SteadyResult struct {
	Scenario    string  `json:"scenario"`
	Contender   string  `json:"contender"`
	Rate        int     `json:"rate"`
	Seconds     float64 `json:"seconds"`
	Orders      int     `json:"orders"`
	P50         float64 `json:"p50_ms"`
	P99         float64 `json:"p99_ms"`
	Max         float64 `json:"max_ms"`
	Min         float64 `json:"min_ms"`
	KeepsUp     bool    `json:"keeps_up"`
	TailSeconds float64 `json:"tail_seconds"`
	Verdict     Verdict `json:"verdict"`
}

// EnqueueResult is one enqueue method and round.
type EnqueueResult struct {
	Method   string  `json:"method"`
	Round    int     `json:"round"`
	Orders   int     `json:"orders"`
	Seconds  float64 `json:"seconds"`
	Rate     float64 `json:"orders_per_second"`
	RedisCPU float64 `json:"redis_cpu_us_per_order"`
	AppCPU   float64 `json:"app_cpu_us_per_order"`
}

// IdleResult is Redis traffic with nothing due.
type IdleResult struct {
	What           string           `json:"what"`
	CommandsPerSec float64          `json:"commands_per_second"`
	Commands       map[string]int64 `json:"commands"`
}

// MemoryResult is Redis memory per pending order.
type MemoryResult struct {
	What          string  `json:"what"`
	Orders        int     `json:"orders"`
	BytesPerOrder float64 `json:"bytes_per_order"`
}

// Target is one of issue 4's or issue 13's targets and whether this run
// met it.
type Target struct {
	Issue    int    `json:"issue"`
	What     string `json:"what"`
	Measured string `json:"measured"`
	Met      bool   `json:"met"`
}

// Report is everything one invocation measured.
type Report struct {
	Options      Options            `json:"-"`
	Machine      Machine            `json:"machine"`
	Started      time.Time          `json:"started"`
	Finished     time.Time          `json:"finished"`
	Drains       []DrainResult      `json:"drains"`
	DrainSummary map[string]Summary `json:"drain_summary"`
	Sweep        []DrainResult      `json:"sweep"`
	Big          *DrainResult       `json:"big_drain,omitempty"`
	Steady       []SteadyResult     `json:"steady"`
	Enqueue      []EnqueueResult    `json:"enqueue"`
	Idle         []IdleResult       `json:"idle"`
	Memory       []MemoryResult     `json:"memory"`
	Targets      []Target           `json:"targets"`
	ProfileTop   map[string]string  `json:"-"`
	Violations   []string           `json:"violations"`
	Errors       []string           `json:"errors"`
	Command      string             `json:"command"`
}

func (v Verdict) summary() string {
	switch {
	case len(v.Violations) == 0:
		return "ok"
	case v.KnownDefect:
		return "known defect: " + strings.Join(v.Violations, "; ")
	default:
		return "VIOLATION: " + strings.Join(v.Violations, "; ")
	}
}

func (r *Report) check(what string, v Verdict) {
	if !v.OK() {
		r.Violations = append(r.Violations, what+": "+strings.Join(v.Violations, "; "))
	}
}

func (r *Report) summarizeDrains() {
	r.DrainSummary = map[string]Summary{}
	by := map[string][]DrainResult{}
	for _, d := range r.Drains {
		by[d.Contender] = append(by[d.Contender], d)
	}
	for name, ds := range by {
		var rates, pg, rd, app, dm []float64
		s := Summary{Rounds: len(ds), Orders: ds[0].Orders}
		for _, d := range ds {
			rates = append(rates, d.Rate)
			pg, rd, app = append(pg, d.CPU.PG), append(rd, d.CPU.Redis), append(app, d.CPU.App)
			dm = append(dm, d.CPU.Daemon)
			s.TimeBoxed = s.TimeBoxed || d.TimeBoxed
		}
		s.Median, s.Min, s.Max = median(rates), slices.Min(rates), slices.Max(rates)
		s.CPU = CPU{PG: median(pg), Redis: median(rd), App: median(app), Daemon: median(dm)}
		r.DrainSummary[name] = s
	}
}

// ratio of a's median to b's, per round where both ran: medians of
// same-round ratios are steadier than a ratio of medians on a shared machine.
func (r *Report) ratio(a, b string) (med, lo, hi float64, ok bool) {
	ra, rb := map[int]float64{}, map[int]float64{}
	for _, d := range r.Drains {
		switch d.Contender {
		case a:
			ra[d.Round] = d.Rate
		case b:
			rb[d.Round] = d.Rate
		}
	}
	var xs []float64
	for round, x := range ra {
		if y, ok := rb[round]; ok && y > 0 {
			xs = append(xs, x/y)
		}
	}
	if len(xs) == 0 {
		return 0, 0, 0, false
	}
	return median(xs), slices.Min(xs), slices.Max(xs), true
}

func (r *Report) enqueueMedian(method string) (med, lo, hi float64) {
	var xs []float64
	for _, e := range r.Enqueue {
		if e.Method == method {
			xs = append(xs, e.Rate)
		}
	}
	if len(xs) == 0 {
		return 0, 0, 0
	}
	return median(xs), slices.Min(xs), slices.Max(xs)
}

func (r *Report) steady(name string) *SteadyResult {
	for i := range r.Steady {
		if r.Steady[i].Scenario == name {
			return &r.Steady[i]
		}
	}
	return nil
}

// evaluate fills Targets from issue 4, section 2.
func (r *Report) evaluate() {
	r.Targets = nil
	add := func(what, measured string, met bool) {
		r.Targets = append(r.Targets, Target{Issue: 4, What: what, Measured: measured, Met: met})
	}
	defer r.evaluate13()
	if m, lo, hi, ok := r.ratio(COrderdelay, CCeiling); ok {
		add("drain ≥ 60% of the PostgreSQL batched-UPDATE ceiling (defaults)",
			fmt.Sprintf("%.0f%% (rounds %.0f–%.0f%%)", 100*m, 100*lo, 100*hi), m >= 0.6)
	}
	if m, lo, hi, ok := r.ratio(CTuned, CCeiling); ok {
		add(fmt.Sprintf("drain ≥ 60%% of the ceiling (tuned: %s)", r.Options.Tuned),
			fmt.Sprintf("%.0f%% (rounds %.0f–%.0f%%)", 100*m, 100*lo, 100*hi), m >= 0.6)
	}
	for _, base := range []string{CNaive16, CAsynq} {
		if m, lo, hi, ok := r.ratio(COrderdelay, base); ok {
			add("drain ≥ 25× "+base, fmt.Sprintf("%.1f× (rounds %.1f–%.1f×)", m, lo, hi), m >= 25)
		}
	}
	for _, name := range []string{"orderdelay constant (Go client)", "orderdelay mixed (Go client)"} {
		if s := r.steady(name); s != nil {
			add("lateness p99 ≤ 50 ms, "+strings.TrimPrefix(name, "orderdelay "),
				fmt.Sprintf("p99 %.1f ms (p50 %.1f, max %.1f)", s.P99, s.P50, s.Max), s.P99 <= 50 && s.KeepsUp)
		}
	}
	if s := r.steady("orderdelay mixed (raw ZADD)"); s != nil {
		add("lateness p99 ≤ 250 ms, mixed (raw ZADD)",
			fmt.Sprintf("p99 %.1f ms (p50 %.1f, max %.1f)", s.P99, s.P50, s.Max), s.P99 <= 250 && s.KeepsUp)
	}
	early := 0
	for _, s := range r.Steady {
		if s.Contender == COrderdelay {
			early += s.Verdict.Early
		}
	}
	for _, d := range append(slices.Clone(r.Drains), r.Sweep...) {
		if strings.HasPrefix(d.Contender, "orderdelay") {
			early += d.Verdict.Early
		}
	}
	add("never early: zero orders closed before their deadline", fmt.Sprintf("%d early", early), early == 0)
	if b := r.Big; b != nil {
		add(fmt.Sprintf("%d expired orders drained, daemon peak RSS < 150 MB", b.Orders),
			fmt.Sprintf("%.0f MB, %.1f s", float64(b.RSSKB)/1024, b.Seconds), b.RSSKB < 150*1024 && b.Verdict.OK())
		add("no Redis command slower than 10 ms (SLOWLOG) during that drain",
			fmt.Sprintf("slowest %.2f ms (%s), %d over 10 ms", float64(b.SlowMaxMicros)/1000, b.SlowestCmd, b.SlowOver10ms),
			b.SlowOver10ms == 0 && b.SlowMaxMicros >= 0)
		add("API still answering during that drain",
			fmt.Sprintf("%d calls, %d failed, slowest %.1f ms", b.APICalls, b.APIFailures, b.APIMaxMs),
			b.APIFailures == 0 && b.APICalls > 0)
	}
	for _, i := range r.Idle {
		if strings.HasPrefix(i.What, "orderdelay") {
			add("idle ≤ 10 Redis commands/s per replica: "+strings.TrimPrefix(i.What, "orderdelay, "),
				fmt.Sprintf("%.1f/s", i.CommandsPerSec), i.CommandsPerSec <= 10)
		}
	}
	cm, _, _ := r.enqueueMedian("Go client EnqueueMany")
	zm, _, _ := r.enqueueMedian("raw ZADD NX, pipelined")
	if zm > 0 {
		add("enqueue through the Go package ≥ 50% of raw pipelined ZADD",
			fmt.Sprintf("%.0f%% (%.0f/s vs %.0f/s)", 100*cm/zm, cm, zm), cm/zm >= 0.5)
	}
}

// Markdown renders the report's tables.
func (r *Report) Markdown() string {
	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	o := r.Options
	w("### Backlog drain: %d expired orders, 10%% paid, %d round(s), contenders interleaved\n\n", o.N, o.Rounds)
	w("| contender | orders/s (median) | min–max | × PG ceiling | × naive-16 | × asynq | CPU µs/order: PostgreSQL | Redis | app | of which daemon | total |\n")
	w("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, name := range []string{CCeiling, COrderdelay, CTuned, CNaive16, CNaive1, CAsynq} {
		s, ok := r.DrainSummary[name]
		if !ok {
			continue
		}
		label := name
		switch name {
		case CTuned:
			label += " (" + o.Tuned.String() + ")"
		case COrderdelay:
			label += " (defaults)"
		}
		if s.TimeBoxed || s.Orders < o.N {
			label += " ¹"
		}
		rat := func(b string) string {
			if name == b {
				return "1"
			}
			m, _, _, ok := r.ratio(name, b)
			if !ok {
				return "–"
			}
			if m < 10 {
				return fmt.Sprintf("%.2f", m)
			}
			return fmt.Sprintf("%.0f", m)
		}
		dm := "–"
		if s.CPU.Daemon > 0 {
			dm = fmt.Sprintf("%.1f", s.CPU.Daemon)
		}
		w("| %s | %s | %s–%s | %s | %s | %s | %.1f | %.1f | %.1f | %s | %.1f |\n", label, num(s.Median), num(s.Min), num(s.Max),
			rat(CCeiling), rat(CNaive16), rat(CAsynq), s.CPU.PG, s.CPU.Redis, s.CPU.App, dm, s.CPU.Total())
	}
	w("\n¹ time-boxed: given min(N, %d) orders and at most %s; rate = orders handled / time.\n", o.SlowCap, o.TimeBox)
	w("Ratios are medians of same-round ratios. CPU is machine CPU time per order handled, from /proc: PostgreSQL = backends of the run's database + background processes; Redis = the private redis-server; app = the harness process (+ the daemon process for orderdelay, also shown alone).\n")

	if len(r.Sweep) > 0 {
		w("\n### orderdelay drain throughput vs settings (1 round each)\n\n| workers | batch | orders/s | CPU µs/order PG / Redis / daemon |\n|---:|---:|---:|---|\n")
		for _, s := range r.Sweep {
			w("| %d | %d | %s | %.1f / %.1f / %.1f |\n", s.Settings.Workers, s.Settings.BatchSize, num(s.Rate), s.CPU.PG, s.CPU.Redis, s.CPU.Daemon)
		}
	}
	if b := r.Big; b != nil {
		w("\n### Big drain: %d expired orders, orderdelay defaults\n\n", b.Orders)
		w("| orders/s | seconds | daemon peak RSS | slowest Redis command | commands > 10 ms | API calls / failed / slowest | allocated per order | mallocs per order |\n|---:|---:|---:|---|---:|---|---:|---:|\n")
		w("| %s | %.1f | %.0f MB | %.2f ms (%s) | %d | %d / %d / %.1f ms | %.0f B | %.1f |\n", num(b.Rate), b.Seconds,
			float64(b.RSSKB)/1024, float64(b.SlowMaxMicros)/1000, b.SlowestCmd, b.SlowOver10ms, b.APICalls, b.APIFailures, b.APIMaxMs,
			b.AllocBytesPerOrder, b.MallocsPerOrder)
	}
	r.redisBreakdown(w)
	if len(r.Steady) > 0 {
		w("\n### Steady arrival: %d orders/s (unless the scenario says) for %s; timeouts %s (mixed: every other order %s)\n\n", o.SteadyRate, o.SteadyFor, o.ShortTimeout, o.LongTimeout)
		w("| scenario | orders | lateness p50 | p99 | max | min | closed early | keeps up (last close after last deadline) |\n|---|---:|---:|---:|---:|---:|---:|---|\n")
		for _, s := range r.Steady {
			keep := "no"
			if s.KeepsUp {
				keep = fmt.Sprintf("yes (%.2f s)", s.TailSeconds)
			}
			w("| %s | %d | %s | %s | %s | %s | %d | %s |\n", s.Scenario, s.Orders, ms(s.P50), ms(s.P99), ms(s.Max), ms(s.Min), s.Verdict.Early, keep)
		}
		w("\nLateness = closed_at − expires_at from the orders table (closed_at is now() of the closing transaction).\n")
	}
	if len(r.Enqueue) > 0 {
		zm, _, _ := r.enqueueMedian("raw ZADD NX, pipelined")
		w("\n### Enqueue throughput (deadlines 1 h ahead, daemon running)\n\n| method | orders | orders/s (median) | min–max | × raw ZADD | Redis CPU µs/order |\n|---|---:|---:|---:|---:|---:|\n")
		seen := map[string]bool{}
		for _, e := range r.Enqueue {
			if seen[e.Method] {
				continue
			}
			seen[e.Method] = true
			m, lo, hi := r.enqueueMedian(e.Method)
			var rc []float64
			for _, x := range r.Enqueue {
				if x.Method == e.Method {
					rc = append(rc, x.RedisCPU)
				}
			}
			w("| %s | %d | %s | %s–%s | %.2f | %.1f |\n", e.Method, e.Orders, num(m), num(lo), num(hi), m/zm, median(rc))
		}
	}
	if len(r.Memory) > 0 {
		w("\n### Redis memory per pending and per leased order (20-byte serials)\n\n| what | orders | bytes/order |\n|---|---:|---:|\n")
		for _, m := range r.Memory {
			w("| %s | %d | %.0f |\n", m.What, m.Orders, m.BytesPerOrder)
		}
	}
	if len(r.Idle) > 0 {
		w("\n### Idle cost: Redis commands per second with nothing due (INFO commandstats on the private server, %s)\n\n| what | commands/s | commands |\n|---|---:|---|\n", o.IdleFor)
		for _, i := range r.Idle {
			var parts []string
			for k, v := range i.Commands {
				parts = append(parts, fmt.Sprintf("%s %d", k, v))
			}
			slices.Sort(parts)
			w("| %s | %.1f | %s |\n", i.What, i.CommandsPerSec, strings.Join(parts, ", "))
		}
	}
	for _, issue := range []int{13, 4} {
		head := false
		for _, t := range r.Targets {
			if t.Issue != issue {
				continue
			}
			if !head {
				w("\n### Targets (issue %d)\n\n| target | measured | met |\n|---|---|---|\n", issue)
				head = true
			}
			met := "**not met**"
			if t.Met {
				met = "met"
			}
			w("| %s | %s | %s |\n", t.What, t.Measured, met)
		}
	}
	w("\n### Correctness\n\n")
	if len(r.Violations) == 0 {
		w("Every run checked: every unpaid order closed once, no paid order closed, none closed before its deadline (asynq's early closes excepted as its known defect, see steady arrival).\n")
	} else {
		for _, v := range r.Violations {
			w("- VIOLATION: %s\n", v)
		}
	}
	for _, e := range r.Errors {
		w("- ERROR: %s\n", e)
	}
	return b.String()
}

func num(x float64) string {
	switch {
	case x >= 100:
		s := fmt.Sprintf("%.0f", x)
		// thousands separators
		var out []byte
		for i, c := range []byte(s) {
			if i > 0 && (len(s)-i)%3 == 0 {
				out = append(out, ',')
			}
			out = append(out, c)
		}
		return string(out)
	default:
		return fmt.Sprintf("%.1f", x)
	}
}

func ms(x float64) string {
	if x >= 1000 || x <= -1000 {
		return fmt.Sprintf("%.2f s", x/1000)
	}
	return fmt.Sprintf("%.1f ms", x)
}

func (r *Report) write(dir string) error {
	var b strings.Builder
	m := r.Machine
	fmt.Fprintf(&b, "Run %s (%s mode, %s), orderdelay at %s. Machine: %d CPUs (%s), %d MB RAM, Linux %s, %s, PostgreSQL %s, Redis %s; load average at start %s.\n\n",
		r.Started.UTC().Format(time.RFC3339), r.Options.Mode, r.Finished.Sub(r.Started).Round(time.Second), m.Revision, m.CPUs, m.CPUModel,
		m.MemoryMB, m.Kernel, m.GoVersion, m.PostgreSQL, m.Redis, m.LoadAvg)
	b.WriteString(r.Markdown())
	if err := os.WriteFile(outPath(dir, "report.md"), []byte(b.String()), 0o644); err != nil {
		return err
	}
	for name, top := range r.ProfileTop {
		if err := os.WriteFile(outPath(dir, "profile-"+name+".txt"), []byte(top), 0o644); err != nil {
			return err
		}
	}
	return writeJSON(outPath(dir, "results.json"), r)
}

// redisBreakdown renders where orderdelay's Redis time goes, per order:
// execution time inside Redis by script (SLOWLOG at threshold 0) beside the
// server's whole CPU time from /proc (the rest is network I/O and protocol).
func (r *Report) redisBreakdown(w func(string, ...any)) {
	var cols []DrainResult
	for _, name := range []string{COrderdelay, CTuned} {
		for _, d := range r.Drains {
			if d.Contender == name && len(d.RedisMicrosPerOrder) > 0 {
				cols = append(cols, d)
				break
			}
		}
	}
	if r.Big != nil && len(r.Big.RedisMicrosPerOrder) > 0 {
		cols = append(cols, *r.Big)
	}
	if len(cols) == 0 {
		return
	}
	names := map[string]bool{}
	for _, c := range cols {
		for k := range c.RedisMicrosPerOrder {
			names[k] = true
		}
	}
	rows := slices.Sorted(maps.Keys(names))
	w("\n### Where orderdelay's Redis time goes (µs per order)\n\n| | ")
	for _, c := range cols {
		w("%s, %d orders (round %d) | ", c.Contender, c.Orders, c.Round)
	}
	w("\n|---|")
	for range cols {
		w("---:|")
	}
	w("\n")
	for _, k := range rows {
		label := k + " (execution)"
		if !strings.HasSuffix(k, "script") {
			label = k + " (called by a script, > 50 µs; included above)"
		}
		w("| %s |", label)
		for _, c := range cols {
			w(" %.2f (%d calls) |", c.RedisMicrosPerOrder[k], c.RedisCalls[k])
		}
		w("\n")
	}
	w("| redis-server CPU, all of it (/proc) |")
	for _, c := range cols {
		w(" %.2f |", c.CPU.Redis)
	}
	w("\n\nExecution times come from SLOWLOG with the threshold at 50 µs during the drain, which catches every batch script and no single-key command; scripts are told apart by their number of keys. The rest of redis-server's CPU is network I/O, protocol parsing and the commands under 50 µs (the harness's ZCARD polls among them).\n")
}

// evaluate13 adds issue 13's targets: drain at 0.6× the ceiling (aim
// 0.75×), Redis and daemon CPU per order, PostgreSQL CPU per order against
// the ceiling's, lateness at 500 and 5,000 orders/s (mixed), never early,
// the big drain, idle commands, and memory per pending and leased order.
func (r *Report) evaluate13() {
	add := func(what, measured string, met bool) {
		r.Targets = append(r.Targets, Target{Issue: 13, What: what, Measured: measured, Met: met})
	}
	if m, lo, hi, ok := r.ratio(COrderdelay, CCeiling); ok {
		add("drain ≥ 0.6× the lib/pq batched ceiling, defaults (aim 0.75×)",
			fmt.Sprintf("%.2f× (rounds %.2f–%.2f×)", m, lo, hi), m >= 0.6)
	}
	od, okD := r.DrainSummary[COrderdelay]
	ceil, okC := r.DrainSummary[CCeiling]
	if okD {
		add("Redis CPU ≤ 2.5 µs per order (drain, defaults)", fmt.Sprintf("%.1f µs", od.CPU.Redis), od.CPU.Redis <= 2.5)
		add("daemon CPU ≤ 2 µs per order (drain, defaults)", fmt.Sprintf("%.1f µs", od.CPU.Daemon), od.CPU.Daemon <= 2)
	}
	if okD && okC && ceil.CPU.PG > 0 {
		x := od.CPU.PG / ceil.CPU.PG
		add("PostgreSQL CPU per order ≤ 1.15× the ceiling's",
			fmt.Sprintf("%.2f× (%.1f vs %.1f µs)", x, od.CPU.PG, ceil.CPU.PG), x <= 1.15)
	}
	early := 0
	for _, s := range r.Steady {
		if s.Contender == COrderdelay {
			early += s.Verdict.Early
		}
	}
	for _, name := range []string{"orderdelay mixed 500/s (Go client)", "orderdelay mixed 5000/s (Go client)"} {
		if s := r.steady(name); s != nil {
			add("lateness p99 ≤ 10 ms, "+strings.TrimPrefix(name, "orderdelay "),
				fmt.Sprintf("p99 %.1f ms (p50 %.1f, max %.1f), %d early", s.P99, s.P50, s.Max, s.Verdict.Early),
				s.P99 <= 10 && s.KeepsUp && s.Verdict.Early == 0)
		}
	}
	if len(r.Steady) > 0 {
		add("none early (every orderdelay steady scenario)", fmt.Sprintf("%d early", early), early == 0)
	}
	if b := r.Big; b != nil {
		add(fmt.Sprintf("%d-order drain: daemon RSS < 150 MB", b.Orders),
			fmt.Sprintf("%.0f MB, %.1f s", float64(b.RSSKB)/1024, b.Seconds), b.RSSKB < 150*1024 && b.Verdict.OK())
		add(fmt.Sprintf("%d-order drain: no Redis command > 10 ms", b.Orders),
			fmt.Sprintf("slowest %.2f ms (%s), %d over 10 ms", float64(b.SlowMaxMicros)/1000, b.SlowestCmd, b.SlowOver10ms),
			b.SlowOver10ms == 0)
	}
	for _, i := range r.Idle {
		if strings.HasPrefix(i.What, "orderdelay") {
			add("idle ≤ 5 Redis commands/s: "+strings.TrimPrefix(i.What, "orderdelay, "),
				fmt.Sprintf("%.1f/s", i.CommandsPerSec), i.CommandsPerSec <= 5)
		}
	}
	for _, m := range r.Memory {
		if strings.HasPrefix(m.What, "orderdelay pending") || strings.HasPrefix(m.What, "orderdelay leased") {
			add("Redis memory reported: "+strings.TrimPrefix(m.What, "orderdelay "),
				fmt.Sprintf("%.0f B per order (%d orders)", m.BytesPerOrder, m.Orders), true)
		}
	}
}
