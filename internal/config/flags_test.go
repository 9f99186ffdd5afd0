package config_test

import (
	"bytes"
	"flag"
	"io"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/orderdelay/orderdelay/internal/config"
)

// parseFlags is load that reports fs.Parse's error instead of failing.
func parseFlags(env map[string]string, args ...string) (config.Config, error, error) {
	fs := flag.NewFlagSet("orderdelay", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	l := config.Register(fs, func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	if err := fs.Parse(args); err != nil {
		return config.Config{}, err, nil
	}
	c, err := l()
	return c, nil, err
}

// A boolean setting is a boolean flag: --dry-run alone means true (it was
// "flag needs an argument: -dry-run"), --dry-run=false beats the variable,
// and a flag still beats a bad variable.
func TestBoolSettingsAreBoolFlags(t *testing.T) {
	tests := []struct {
		name       string
		env        map[string]string
		args       []string
		dry, close bool
	}{
		{"bare", nil, []string{"--dry-run", "--close-events"}, true, true},
		{"single dash", nil, []string{"-dry-run"}, true, false},
		{"=true", nil, []string{"--dry-run=true"}, true, false},
		{"=false beats env", map[string]string{"ORDERDELAY_DRY_RUN": "true", "ORDERDELAY_CLOSE_EVENTS": "1"}, []string{"--dry-run=false"}, false, true},
		{"bare beats env", map[string]string{"ORDERDELAY_DRY_RUN": "false"}, []string{"--dry-run"}, true, false},
		{"flag rescues a bad env", map[string]string{"ORDERDELAY_DRY_RUN": "maybe"}, []string{"--dry-run=0"}, false, false},
		{"env without flag", map[string]string{"ORDERDELAY_DRY_RUN": "true"}, nil, true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, perr, err := parseFlags(tt.env, tt.args...)
			if perr != nil || err != nil {
				t.Fatalf("env %v, args %q: parse %v, load %v", tt.env, tt.args, perr, err)
			}
			if c.DryRun != tt.dry || c.CloseEvents != tt.close {
				t.Errorf("env %v, args %q: DryRun %v, CloseEvents %v; want %v, %v", tt.env, tt.args, c.DryRun, c.CloseEvents, tt.dry, tt.close)
			}
		})
	}
	// A bare boolean flag does not take the next argument as its value.
	fs := flag.NewFlagSet("orderdelay", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	config.Register(fs, func(string) (string, bool) { return "", false })
	if err := fs.Parse([]string{"--dry-run", "serial-1"}); err != nil || !slices.Equal(fs.Args(), []string{"serial-1"}) {
		t.Errorf("--dry-run serial-1: %v, args %q; want serial-1 left as an argument", err, fs.Args())
	}
}

// A malformed number, duration or boolean is refused when the flags are
// parsed, with an error naming the flag and the value.
func TestMalformedFlagNamesFlagAndValue(t *testing.T) {
	for _, s := range config.Settings {
		if s.Kind == config.KindString {
			continue
		}
		bad := "x7y"
		t.Run(s.Flag(), func(t *testing.T) {
			_, perr, _ := parseFlags(nil, "--"+s.Flag()+"="+bad)
			if perr == nil || !strings.Contains(perr.Error(), "-"+s.Flag()) || !strings.Contains(perr.Error(), `"`+bad+`"`) {
				t.Fatalf("--%s=%s: parse error %v, want one naming the flag and the value", s.Flag(), bad, perr)
			}
			if !strings.Contains(perr.Error(), "want ") {
				t.Errorf("--%s=%s: %v does not say what is wanted", s.Flag(), bad, perr)
			}
		})
	}
}

// A value the variable takes is taken as the flag too, to the same
// configuration; one the variable refuses, the flag refuses (at parse or
// at load). The flag's type check never refuses what the setting accepts.
func TestFlagTakesWhatTheVariableTakes(t *testing.T) {
	for _, s := range config.Settings {
		for _, v := range append(slices.Clone(flagValues), s.Default) {
			sameAsVariable(t, s, v)
		}
	}
}

// FuzzFlagTakesWhatTheVariableTakes is TestFlagTakesWhatTheVariableTakes
// over arbitrary values.
func FuzzFlagTakesWhatTheVariableTakes(f *testing.F) {
	for _, v := range flagValues {
		f.Add(v)
	}
	f.Fuzz(func(t *testing.T, v string) {
		for _, s := range config.Settings {
			sameAsVariable(t, s, v)
		}
	})
}

var flagValues = []string{"", "0", "1", "-1", "7", " 8 ", "1.5", "1e3", "+5", "0x10", "abc", "5s", "0s", " 2m ", "1h30m", "-5s",
	"true", "false", "T", "NaN", "inf", "9223372036854775808", "redis://127.0.0.1:6379/1", ":9090", "json", "debug",
	"0123456789abcdef", "\t3\n", "1_000"}

func sameAsVariable(t *testing.T, s config.Setting, v string) {
	t.Helper()
	fromEnv, envErr := load(t, map[string]string{s.Env: v})
	fromFlag, perr, err := parseFlags(nil, "--"+s.Flag()+"="+v)
	flagErr := perr
	if flagErr == nil {
		flagErr = err
	}
	switch {
	case (envErr == nil) != (flagErr == nil):
		t.Errorf("%s=%q: variable gives %v, flag gives %v; want both to take it or both to refuse it", s.Env, v, envErr, flagErr)
	case envErr == nil && !reflect.DeepEqual(fromEnv, fromFlag):
		t.Errorf("%s=%q: variable and flag give different configurations:\n%+v\n%+v", s.Env, v, fromEnv, fromFlag)
	}
}

// Every setting is listed under one of the groups; a secret is a string
// (its flag's parse error would show the value); a typed setting's
// default is of its type.
func TestSettingsHaveGroupAndKind(t *testing.T) {
	for _, s := range config.Settings {
		if !slices.Contains(config.Groups, s.Group) {
			t.Errorf("%s: group %q is not one of %q; give it one in config.Settings", s.Env, s.Group, config.Groups)
		}
		if s.Secret && s.Kind != config.KindString {
			t.Errorf("%s is secret but of kind %s: a malformed flag value would be shown", s.Env, s.Kind)
		}
		if _, perr, err := parseFlags(nil, "--"+s.Flag()+"="+s.Default); perr != nil || err != nil {
			t.Errorf("%s: the default %q as a flag: parse %v, load %v", s.Env, s.Default, perr, err)
		}
	}
	for _, g := range config.Groups {
		if g.About() == "" {
			t.Errorf("group %q says nothing of itself", g)
		}
	}
}

// WriteHelp lists every setting once, under its group's heading, in the
// order of Groups, with its kind (none for a boolean), variable and
// default, and no line wider than asked unless a single word is.
func TestWriteHelp(t *testing.T) {
	var b bytes.Buffer
	config.WriteHelp(&b, 80)
	help := b.String()
	last := -1
	for _, g := range config.Groups {
		i := strings.Index(help, string(g)+": "+g.About()+"\n")
		if i < 0 || i < last {
			t.Errorf("heading %q at %d, previous at %d; want every group, in order", g, i, last)
		}
		last = i
	}
	for _, s := range config.Settings {
		head := "  --" + s.Flag()
		if s.Kind != config.KindBool {
			head += " " + s.Kind.String()
		}
		head += "  (" + s.Env
		if n := strings.Count(help, head); n != 1 {
			t.Errorf("%q appears %d times, want once:\n%s", head, n, help)
		}
		// Under its own group: the last heading before it.
		at := strings.Index(help, head)
		var under config.Group
		for _, g := range config.Groups {
			if i := strings.Index(help, string(g)+": "); i >= 0 && i < at {
				under = g
			}
		}
		if under != s.Group {
			t.Errorf("--%s is listed under %q, want %q", s.Flag(), under, s.Group)
		}
	}
	for _, want := range []string{`--workers int  (ORDERDELAY_WORKERS, default 4)`, `--dry-run  (ORDERDELAY_DRY_RUN, default false)`,
		`--log-format string  (ORDERDELAY_LOG_FORMAT, default "json")`, `--pprof-addr string  (ORDERDELAY_PPROF_ADDR)`,
		`--lease duration  (ORDERDELAY_LEASE, default 1m)`, `--max-close-rate float  (ORDERDELAY_MAX_CLOSE_RATE, default 0)`} {
		if !strings.Contains(help, want) {
			t.Errorf("help does not show %q", want)
		}
	}
	for _, line := range strings.Split(help, "\n") {
		if len(line) > 80 && strings.Contains(strings.TrimSpace(line), " ") && !strings.HasPrefix(line, "  --") {
			t.Errorf("line of %d columns: %q", len(line), line)
		}
	}
}
