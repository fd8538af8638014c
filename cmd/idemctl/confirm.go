package main

import (
	"bufio"
	"fmt"
	"strings"

	"github.com/idemkit/idem"
)

// confirm shows r and asks the person at the terminal whether to remove it;
// it returns nil for yes. Without a terminal it refuses: -yes confirms.
func confirm(con console, r idem.Record) error {
	if !con.terminal {
		return fmt.Errorf("%w: forget: the input is not a terminal to confirm on; pass -yes", errUsage)
	}
	printRecord(con.err, r)
	fmt.Fprint(con.err, "forget this record? [y/N] ")
	line, _ := bufio.NewReader(con.in).ReadString('\n')
	switch strings.ToLower(strings.TrimSpace(line)) {
	case "y", "yes":
		return nil
	}
	fmt.Fprintln(con.err, "not forgotten")
	return errFailed
}
