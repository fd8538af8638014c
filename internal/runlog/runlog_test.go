package runlog

import (
	"os"
	"path/filepath"
	"testing"
)

// TestCount: the counts of a log that holds each fault the chaos tests
// look for, and of one that holds none.
func TestCount(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	good := write("good", `start a ra 10 0
run a ra 10 0
stored ra 10
start b rb 10 0
run b rb 10 0
run b rb 20 1
fenced rb 10
stored rb 20
start c rc 10 0
`)
	other := write("other", "run c rc 30 1\nstored rc 30\n")
	l, err := Read(good, other, filepath.Join(dir, "none"))
	if err != nil {
		t.Fatal(err)
	}
	n := l.Count([]string{"a", "b", "c"})
	want := Counts{Messages: 3, Runs: 4, SecondRuns: 1, Recovered: 1, Stored: 3, Fenced: 1}
	if n.String() != want.String() || len(n.Problems) != 0 {
		t.Errorf("got %s %q, want %s", n, n.Problems, want)
	}
	if u, err := Unfinished(good); err != nil || len(u) != 1 || u[0].ID != "c" {
		t.Errorf("unfinished: %v %v, want c", u, err)
	}

	bad := write("bad", `run a ra 10 0
stored ra 10
run a ra 20 1
run b rb 10 0
run b rb 20 0
stored rc 5
run c rc 10 0
run c rc 10 0
stored rc 10
`)
	if l, err = Read(bad); err != nil {
		t.Fatal(err)
	}
	n = l.Count([]string{"a", "b", "c", "d"})
	// a: ran after its outcome was stored; b: a second run not
	// Recovered; c: two outcomes stored, the first without a run, and both
	// runs after it; d lost.
	want = Counts{Messages: 4, Runs: 6, SecondRuns: 3, Recovered: 1, Lost: 1, AgainAfterStored: 4, StoredWithoutRun: 1, Stored: 3}
	if n.String() != want.String() {
		t.Errorf("got %s, want %s", n, want)
	}
	if _, err := Read(write("garbled", "run a\n")); err == nil {
		t.Error("a garbled line was read")
	}
}
