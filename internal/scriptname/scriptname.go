// Package scriptname names the idem package's Lua scripts by their hash,
// for tests that act on the calls of one script (a go-redis hook that holds
// up renewals, or fails claims as a dropped connection would). The idem
// package registers each script as it makes it.
package scriptname

import (
	"crypto/sha1"
	"encoding/hex"
	"strings"
	"sync"
)

var names sync.Map // SHA1 in lower-case hex: the script's name

// Register names the script of hash sha (SHA1, hex) name: its file's name in
// lua/ without ".lua" ("claim", "extend").
func Register(sha, name string) { names.Store(strings.ToLower(sha), name) }

// Of returns the name of the script a command runs, given the command's
// arguments (go-redis's Cmder.Args): an EVALSHA of a registered hash, or an
// EVAL of a registered script's source. It returns "" for any other command.
func Of(args []any) string {
	if len(args) < 2 {
		return ""
	}
	cmd, _ := args[0].(string)
	arg, _ := args[1].(string)
	switch strings.ToLower(cmd) {
	case "evalsha", "evalsha_ro":
	case "eval", "eval_ro":
		sum := sha1.Sum([]byte(arg))
		arg = hex.EncodeToString(sum[:])
	default:
		return ""
	}
	name, _ := names.Load(strings.ToLower(arg))
	s, _ := name.(string)
	return s
}
