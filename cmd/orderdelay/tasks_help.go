package main

import (
	"fmt"
	"io"
	"strings"
)

// taskHelp is the task queues' part of usage: one line per verb.
func taskHelp() string {
	const from, to = "Named task queues", "\n\nOperator tools"
	i, j := strings.Index(usage, from), strings.Index(usage, to)
	if i < 0 || j < i {
		return usage // usage was reworded; all of it is still right
	}
	return usage[i:j] + "\n\nRun \"orderdelay task VERB -h\" for the flags of a verb.\n\n" + exitStatusHelp
}

// isTaskVerb reports whether verb is one of `orderdelay task`'s.
func isTaskVerb(verb string) bool {
	return verb == "put" || verb == "get" || verb == "delete" || taskOpsVerbs[verb]
}

// taskHelpOrBadVerb handles what `orderdelay task VERB` can decide before
// parsing flags: a request for help (printed to stdout) and an unknown
// verb (bad usage, before anything connects). done is false for a verb
// to run.
func taskHelpOrBadVerb(verb string, stdout io.Writer) (done bool, err error) {
	switch {
	case verb == "-h" || verb == "--help" || verb == "help":
		fmt.Fprint(stdout, taskHelp())
		return true, nil
	case isTaskVerb(verb):
		return false, nil
	}
	return true, usagef("task: unknown verb %q (want put, get, delete, list, dead, requeue, purge, stats, pause or resume)", verb)
}
