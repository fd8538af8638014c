package main

import (
	"bufio"
	"fmt"
	"strings"

	"github.com/idemkit/idem"
)

// confirm shows r, what the command would do (notes), and asks the person
// at the terminal question; it returns nil for yes. Without a terminal it
// refuses: -yes confirms.
func confirm(con console, r idem.Record, question string, notes []string) error {
	if !con.terminal {
		return fmt.Errorf("%w: the input is not a terminal to confirm on; pass -yes", errUsage)
	}
	printRecord(con.err, r)
	for _, n := range notes {
		fmt.Fprintln(con.err, n)
	}
	fmt.Fprintf(con.err, "%s [y/N] ", question)
	line, _ := bufio.NewReader(con.in).ReadString('\n')
	switch strings.ToLower(strings.TrimSpace(line)) {
	case "y", "yes":
		return nil
	}
	fmt.Fprintln(con.err, "nothing done")
	return errFailed
}
