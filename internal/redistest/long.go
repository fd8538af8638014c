package redistest

import "testing"

// Long marks tb as a long fault or soak suite: under go test -short (make
// check, the loop for editing) it is skipped with a message; make test and
// CI run it in full.
func Long(tb testing.TB) {
	tb.Helper()
	if testing.Short() {
		tb.Skip("a long fault or soak suite: -short (make check) leaves it out; make test runs it")
	}
}
