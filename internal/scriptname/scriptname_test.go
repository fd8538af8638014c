package scriptname

import "testing"

func TestOf(t *testing.T) {
	const src = "return 1"
	const sha = "e0e1f9fabfc9d4800c877a703b823ac0578ff8db" // SHA1 of src
	Register(sha, "one")
	for _, c := range []struct {
		args []any
		want string
	}{
		{[]any{"evalsha", sha, 0}, "one"},
		{[]any{"EVALSHA", "E0E1F9FABFC9D4800C877A703B823AC0578FF8DB", 0}, "one"},
		{[]any{"eval", src, 0}, "one"},
		{[]any{"eval", "return 2", 0}, ""},
		{[]any{"evalsha", "0000000000000000000000000000000000000000", 0}, ""},
		{[]any{"get", sha}, ""},
		{[]any{"evalsha"}, ""},
	} {
		if got := Of(c.args); got != c.want {
			t.Errorf("Of(%v) = %q, want %q", c.args, got, c.want)
		}
	}
}
