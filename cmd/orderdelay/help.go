package main

import (
	"flag"
	"fmt"
	"strings"

	"github.com/orderdelay/orderdelay/internal/config"
)

// helpWidth is the width -h wraps its text to.
const helpWidth = 80

// exitStatusHelp is the exit statuses of every command but run and demo:
// in the usage, in each command's -h, and in the README.
const exitStatusHelp = `Exit status:
  0  done
  1  failed: the command was right but could not be done (Redis or
     PostgreSQL unreachable, a task queue full, an order not queued)
  2  usage or configuration: unknown command or flag, malformed or
     out-of-range value, missing or extra argument, invalid configuration
     (the message names the flag or setting)
`

// daemonExitStatusHelp is run's and demo's.
const daemonExitStatusHelp = `Exit status:
  0  done: stopped by SIGTERM or SIGINT with in-flight batches finished or
     handed back (demo: also when --duration ends)
  1  failed: a listener's port is taken (demo: also its database cannot be
     created); unreachable Redis or PostgreSQL is not a failure: the daemon
     reports it and retries
  2  usage or configuration: unknown flag, malformed or out-of-range value,
     an argument (run takes none), invalid configuration, a custom statement
     or a task queue that fails verification (the message names the flag or
     setting)
`

// settingsHelp introduces the settings in every command's -h.
const settingsHelp = `Settings: each is also an environment variable; a flag wins over the
variable, the variable over the default. A boolean setting is given as
--flag or --flag=false. The full table, with ranges and examples:
README.md#configuration.

`

// helpRequested is -h or --help: run prints the help on stdout and exits 0.
type helpRequested struct{ text string }

func (h helpRequested) Error() string { return "help requested" }
func (h helpRequested) Unwrap() error { return flag.ErrHelp }

// commandHelp is `orderdelay NAME -h`: the synopsis, the command's own
// flags, the settings by group, and the exit statuses.
func commandHelp(name string, own []*flag.Flag) string {
	var b strings.Builder
	b.WriteString("Usage:\n")
	for _, line := range synopsis(name) {
		b.WriteString(line + "\n")
	}
	if len(own) > 0 {
		b.WriteString("\nFlags:\n")
		for _, f := range own {
			typ, text := flag.UnquoteUsage(f)
			head := "  --" + f.Name
			if typ != "" {
				head += " " + typ
			}
			switch def := f.DefValue; {
			case def == "" || def == "0" || def == "false" || def == "0s":
			case typ == "string":
				head += fmt.Sprintf("  (default %q)", def)
			default:
				head += "  (default " + def + ")"
			}
			b.WriteString(head + "\n")
			config.WriteWrapped(&b, text, "        ", helpWidth)
		}
	}
	b.WriteString("\n" + settingsHelp)
	config.WriteHelp(&b, helpWidth)
	b.WriteString("\n" + exitStatusFor(name))
	return b.String()
}

// exitStatusFor is the exit statuses of the command.
func exitStatusFor(name string) string {
	if name == "run" || name == "demo" {
		return daemonExitStatusHelp
	}
	return exitStatusHelp
}

// synopsis is the lines of usage that show the command (one of its forms
// per line), or a generic one.
func synopsis(name string) []string {
	var out []string
	for line := range strings.Lines(usage) {
		line = strings.TrimRight(line, "\n")
		cmd := strings.TrimSpace(line)
		if strings.HasPrefix(cmd, "orderdelay "+name+" ") || cmd == "orderdelay "+name {
			out = append(out, line)
		}
	}
	if len(out) == 0 {
		out = append(out, "  orderdelay "+name+" [flags]")
	}
	return out
}
