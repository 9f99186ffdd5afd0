package bench

import (
	"fmt"
	"image/color"
	"slices"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// plots writes the PNGs a person would rather look at than the tables:
//
//	lateness-cdf.png         lateness distribution per contender (seconds)
//	lateness-orderdelay.png  the same for orderdelay's scenarios only (ms)
//	drain-contenders.png     drain throughput per contender (median)
//	drain-vs-batch.png       orderdelay drain throughput vs batch size
//	drain-vs-workers.png     orderdelay drain throughput vs workers
func plots(r *Report, dir string) error {
	if len(r.Steady) > 0 {
		if err := latencyCDF(r.Steady, 1000, "s", "Close lateness, all contenders",
			outPath(dir, "lateness-cdf.png")); err != nil {
			return err
		}
		var od []SteadyResult
		for _, s := range r.Steady {
			if s.Contender == COrderdelay {
				od = append(od, s)
			}
		}
		if err := latencyCDF(od, 1, "ms", "Close lateness, orderdelay (defaults)",
			outPath(dir, "lateness-orderdelay.png")); err != nil {
			return err
		}
	}
	if len(r.DrainSummary) > 0 {
		if err := contenderBars(r, outPath(dir, "drain-contenders.png")); err != nil {
			return err
		}
	}
	if len(r.Sweep) > 0 {
		ceiling := r.DrainSummary[CCeiling].Median
		if err := sweepPlot(r.Sweep, ceiling, func(s Settings) (float64, bool) { return float64(s.BatchSize), s.Workers == 4 },
			"batch size (serials per claim and close), 4 workers", outPath(dir, "drain-vs-batch.png")); err != nil {
			return err
		}
		if err := sweepPlot(r.Sweep, ceiling, func(s Settings) (float64, bool) { return float64(s.Workers), s.BatchSize == 500 },
			"workers (batches closed concurrently), batch 500", outPath(dir, "drain-vs-workers.png")); err != nil {
			return err
		}
	}
	return nil
}

// latencyCDF draws the empirical distribution of each scenario's lateness,
// divided by scale (1000: seconds).
func latencyCDF(ss []SteadyResult, scale float64, unit, title, path string) error {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = "closed_at − deadline (" + unit + "); negative = closed early"
	p.Y.Label.Text = "fraction of orders closed"
	p.Legend.Top = false
	p.Legend.Left = false
	p.Add(plotter.NewGrid())
	for i, s := range ss {
		l := s.Verdict.LatenessMillis
		if len(l) == 0 {
			continue
		}
		step := max(1, len(l)/600)
		var xy plotter.XYs
		for j := 0; j < len(l); j += step {
			xy = append(xy, plotter.XY{X: l[j] / scale, Y: float64(j+1) / float64(len(l))})
		}
		xy = append(xy, plotter.XY{X: l[len(l)-1] / scale, Y: 1})
		line, err := plotter.NewLine(xy)
		if err != nil {
			return err
		}
		line.Color = plotutil.Color(i)
		line.Width = vg.Points(1.5)
		line.Dashes = plotutil.Dashes(i)
		p.Add(line)
		p.Legend.Add(fmt.Sprintf("%s: p99 %s", s.Scenario, ms(s.P99)), line)
	}
	return p.Save(8*vg.Inch, 4.5*vg.Inch, path)
}

func contenderBars(r *Report, path string) error {
	var names []string
	var vals plotter.Values
	for _, n := range []string{CCeiling, COrderdelay, CTuned, CNaive16, CNaive1, CAsynq} {
		if s, ok := r.DrainSummary[n]; ok {
			names = append(names, n)
			vals = append(vals, s.Median)
		}
	}
	p := plot.New()
	p.Title.Text = fmt.Sprintf("Backlog drain, %d expired orders (median of %d rounds)", r.Options.N, r.Options.Rounds)
	p.Y.Label.Text = "orders handled per second"
	bars, err := plotter.NewBarChart(vals, vg.Points(40))
	if err != nil {
		return err
	}
	bars.Color = color.RGBA{R: 70, G: 110, B: 190, A: 255}
	p.Y.Tick.Marker = thousands{}
	p.Add(plotter.NewGrid(), bars)
	for i, n := range names {
		names[i] = fmt.Sprintf("%s\n%s/s", strings.ReplaceAll(n, "orderdelay-", "od-"), num(vals[i]))
	}
	p.NominalX(names...)
	return p.Save(8*vg.Inch, 4.5*vg.Inch, path)
}

func sweepPlot(sweep []DrainResult, ceiling float64, x func(Settings) (float64, bool), label, path string) error {
	var xy plotter.XYs
	for _, s := range sweep {
		if v, ok := x(s.Settings); ok {
			xy = append(xy, plotter.XY{X: v, Y: s.Rate})
		}
	}
	slices.SortFunc(xy, func(a, b plotter.XY) int { return int(a.X - b.X) })
	p := plot.New()
	p.Title.Text = "orderdelay backlog drain throughput"
	p.X.Label.Text = label
	p.Y.Label.Text = "orders handled per second"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	p.Add(plotter.NewGrid())
	if len(xy) > 0 {
		if err := plotutil.AddLinePoints(p, "orderdelay", xy); err != nil {
			return err
		}
	}
	if ceiling > 0 && len(xy) > 0 {
		lo, hi := xy[0].X, xy[len(xy)-1].X
		if lo == hi {
			lo, hi = lo/2, hi*2
		}
		line, err := plotter.NewLine(plotter.XYs{{X: lo, Y: ceiling}, {X: hi, Y: ceiling}})
		if err != nil {
			return err
		}
		line.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		line.Color = color.RGBA{R: 200, A: 255}
		p.Add(line)
		p.Legend.Add("PostgreSQL batched-UPDATE ceiling (4 conns, 1,000/stmt)", line)
		line60, _ := plotter.NewLine(plotter.XYs{{X: lo, Y: 0.6 * ceiling}, {X: hi, Y: 0.6 * ceiling}})
		line60.Dashes = []vg.Length{vg.Points(1), vg.Points(3)}
		line60.Color = color.RGBA{R: 120, G: 120, B: 120, A: 255}
		p.Add(line60)
		p.Legend.Add("60% of the ceiling (target)", line60)
	}
	p.Y.Min = 0
	p.Y.Tick.Marker = thousands{}
	p.Legend.Top = false
	p.Legend.Left = false
	return p.Save(7*vg.Inch, 4*vg.Inch, path)
}

// thousands labels the default ticks as whole numbers with separators
// (gonum's default prints "250000.00").
type thousands struct{}

func (thousands) Ticks(lo, hi float64) []plot.Tick {
	ts := plot.DefaultTicks{}.Ticks(lo, hi)
	for i := range ts {
		if ts[i].Label != "" {
			ts[i].Label = num(ts[i].Value)
		}
	}
	return ts
}
