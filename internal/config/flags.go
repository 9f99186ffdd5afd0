package config

import (
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"
)

// Kind is the type of a setting's value: how its flag parses and what `-h`
// and the README call it. The zero Kind is a string.
type Kind int

const (
	KindString   Kind = iota
	KindBool          // --flag means true; --flag=false
	KindInt           // an integer
	KindFloat         // a decimal number
	KindDuration      // a Go duration: 500ms, 5s, 2m, 1h30m
)

func (k Kind) String() string {
	switch k {
	case KindBool:
		return "bool"
	case KindInt:
		return "int"
	case KindFloat:
		return "float"
	case KindDuration:
		return "duration"
	default:
		return "string"
	}
}

// check reports whether v is well-formed for the kind. It parses exactly
// as the setting does, so a value the variable takes is never refused as a
// flag; the setting checks the range when the configuration loads.
func (k Kind) check(v string) error {
	v = strings.TrimSpace(v)
	switch k {
	case KindBool:
		if _, err := strconv.ParseBool(v); err != nil {
			return errors.New("want true or false")
		}
	case KindInt:
		if _, err := strconv.ParseInt(v, 10, 64); err != nil {
			return errors.New("want an integer")
		}
	case KindFloat:
		if _, err := strconv.ParseFloat(v, 64); err != nil {
			return errors.New("want a number")
		}
	case KindDuration:
		if _, err := time.ParseDuration(v); err != nil {
			return errors.New("want a duration such as 500ms, 5s or 2m")
		}
	}
	return nil
}

// Group is the heading a setting is listed under, in `-h` and in the
// README's configuration table.
type Group string

const (
	GroupConnection Group = "Connection"
	GroupClosing    Group = "Closing"
	GroupReconciler Group = "Reconciler"
	GroupHTTP       Group = "HTTP"
	GroupOperator   Group = "Operator"
	GroupTaskQueues Group = "Task queues"
)

// Groups lists every group, in the order `-h` and the README show them.
var Groups = []Group{GroupConnection, GroupClosing, GroupReconciler, GroupHTTP, GroupOperator, GroupTaskQueues}

// About says in a line what the group's settings are for.
func (g Group) About() string {
	switch g {
	case GroupConnection:
		return "where Redis, PostgreSQL and the order queue are"
	case GroupClosing:
		return "how due orders are claimed, closed, retried and announced"
	case GroupReconciler:
		return "the safety net that closes pending orders missing from the queue"
	case GroupHTTP:
		return "the listeners (API, metrics and health; admin API; pprof) and their tokens"
	case GroupOperator:
		return "logs, dry runs and dead-letter housekeeping"
	case GroupTaskQueues:
		return "named task queues and order reminders (docs/tasks.md)"
	}
	return ""
}

// flagValue is a setting's flag: it keeps the text given, checked for the
// setting's kind, for Register's loader to apply over the variable.
type flagValue struct {
	kind Kind
	text string
}

func (f *flagValue) String() string { return f.text }

func (f *flagValue) Set(v string) error {
	if err := f.kind.check(v); err != nil {
		return err
	}
	f.text = v
	return nil
}

// IsBoolFlag lets a boolean setting be given as --flag (and --flag=false).
func (f *flagValue) IsBoolFlag() bool { return f.kind == KindBool }

// placeholder is what `-h` writes after the flag name: the kind, none for
// a boolean.
func (s Setting) placeholder() string {
	if s.Kind == KindBool {
		return ""
	}
	return s.Kind.String()
}

// shownDefault is the default as `-h` and the README show it; a secret's
// password masked.
func (s Setting) shownDefault() string {
	if s.Secret && s.Default != "" {
		return Mask(s.Default)
	}
	return s.Default
}

// WriteHelp writes the settings for `-h`: under each group's heading, each
// setting's flag, kind, variable, default and help, wrapped to width
// columns.
func WriteHelp(w io.Writer, width int) {
	for i, g := range Groups {
		if i > 0 {
			fmt.Fprintln(w)
		}
		fmt.Fprintf(w, "%s: %s\n", g, g.About())
		for _, s := range Settings {
			if s.Group != g {
				continue
			}
			head := "  --" + s.Flag()
			if p := s.placeholder(); p != "" {
				head += " " + p
			}
			if def := s.shownDefault(); def == "" {
				head += fmt.Sprintf("  (%s)", s.Env)
			} else if s.Kind == KindString {
				head += fmt.Sprintf("  (%s, default %q)", s.Env, def)
			} else {
				head += fmt.Sprintf("  (%s, default %s)", s.Env, def)
			}
			fmt.Fprintln(w, head)
			WriteWrapped(w, stripMD(s.Help), "        ", width)
		}
	}
}

// WriteWrapped writes text in lines of at most width columns (a word
// longer than that on a line of its own), each starting with indent.
func WriteWrapped(w io.Writer, text, indent string, width int) {
	line := indent
	for _, word := range strings.Fields(text) {
		if line != indent && len(line)+1+len(word) > width {
			fmt.Fprintln(w, line)
			line = indent
		}
		if line != indent {
			line += " "
		}
		line += word
	}
	if line != indent {
		fmt.Fprintln(w, line)
	}
}
