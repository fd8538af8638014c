package idem

import (
	_ "embed"
	"fmt"
	"regexp"
	"strings"

	"github.com/idemkit/idem/internal/scriptname"
	"github.com/redis/go-redis/v9"
)

// The definitions the scripts share: lua/format.lua (the formats and the
// reply codes) and lua/lib.lua (the id index), in that order.
var (
	//go:embed lua/format.lua
	luaFormat string
	//go:embed lua/lib.lua
	luaLib string

	luaDefs = parseLuaDefs(luaFormat + "\n" + luaLib)
)

// luaDef is one top-level definition of the shared Lua: a "local" statement
// (a constant or a function) up to the next top-level "local" or comment.
type luaDef struct {
	names []string // the locals it defines
	code  string   // its code, comments at the top level left out
	uses  []string // the names its code mentions
	fn    bool     // a function ("local function")
}

var (
	luaDefName  = regexp.MustCompile(`^local\s+(?:function\s+([A-Za-z_]\w*)|([A-Za-z_][\w\s,]*?)\s*=)`)
	luaNameword = regexp.MustCompile(`[A-Za-z_]\w*`)
)

// parseLuaDefs splits src, Lua that only defines top-level locals, into its
// definitions. A definition's lines after its first are indented, or close
// it (end, } or ) at the line's start). It panics on any other top-level
// line: the scripts are part of the program.
func parseLuaDefs(src string) []luaDef {
	var defs []luaDef
	var cur *luaDef
	var code strings.Builder
	flush := func() {
		if cur != nil {
			cur.code = strings.TrimRight(code.String(), "\n") + "\n"
			cur.uses = luaNames(cur.code)
			defs = append(defs, *cur)
			cur = nil
		}
		code.Reset()
	}
	for _, line := range strings.SplitAfter(src, "\n") {
		switch {
		case strings.HasPrefix(line, "--"):
			flush()
			continue
		case strings.HasPrefix(line, "local "):
			flush()
			m := luaDefName.FindStringSubmatch(line)
			if m == nil {
				panic(fmt.Sprintf("idem: lua: unreadable definition %q", line))
			}
			cur = &luaDef{fn: m[1] != ""}
			if m[1] != "" {
				cur.names = []string{m[1]}
			} else {
				for _, n := range strings.Split(m[2], ",") {
					cur.names = append(cur.names, strings.TrimSpace(n))
				}
			}
		case strings.TrimSpace(line) == "" || line[0] == ' ' || line[0] == '\t':
			// a blank line, or one within a definition
		case cur == nil || !(strings.HasPrefix(line, "end") || strings.HasPrefix(line, "}") || strings.HasPrefix(line, ")")):
			panic(fmt.Sprintf("idem: lua: a top-level statement, not a definition: %q", line))
		}
		if cur != nil {
			code.WriteString(line)
		}
	}
	flush()
	return defs
}

// luaNames lists the names Lua code mentions, its comments left out (a
// name in a string counts too: at worst a definition is sent unused).
func luaNames(code string) []string {
	var names []string
	for _, line := range strings.Split(code, "\n") {
		if i := strings.Index(line, "--"); i >= 0 {
			line = line[:i]
		}
		names = append(names, luaNameword.FindAllString(line, -1)...)
	}
	return names
}

// luaScript is one of the store's scripts: the go-redis Script that runs it
// (EVALSHA, then EVAL on NOSCRIPT), its source, and its hash and source
// boxed once, for the calls that send EVALSHA and EVAL themselves (evalArgs
// begins them).
type luaScript struct {
	*redis.Script
	body           string // the file of lua/ it is made of
	src            string // what it sends: body after the definitions it uses (luaSource)
	shaArg, srcArg any
}

// luaScripts are the store's scripts, every one newLuaScript made: the list
// LoadScripts loads, and TestEveryScriptIsLoaded holds to the files of lua/.
var luaScripts []*luaScript

// newLuaScript is the script of body, the file name.lua of lua/, sent as
// luaSource makes it, added to luaScripts and named to the tests that watch
// a script's calls (internal/scriptname).
func newLuaScript(name, body string) *luaScript {
	sc := makeLuaScript(body)
	luaScripts = append(luaScripts, sc)
	scriptname.Register(sc.Hash(), name)
	return sc
}

// makeLuaScript is the script of body, sent as luaSource makes it, and not
// one of the store's (a test's).
func makeLuaScript(body string) *luaScript {
	src := luaSource(body)
	sc := &luaScript{Script: redis.NewScript(src), body: body, src: src}
	sc.shaArg, sc.srcArg = sc.Hash(), src
	return sc
}

// evalArgs begins the arguments of an EVALSHA of sc with keys, with room for
// n arguments more: the command, the hash, the number of keys, the keys.
// redisStore.eval sends them (EVAL after NOSCRIPT).
func (sc *luaScript) evalArgs(n int, keys ...string) []any {
	args := make([]any, 3, 3+len(keys)+n)
	args[0], args[1], args[2] = "evalsha", sc.shaArg, len(keys)
	for _, k := range keys {
		args = append(args, k)
	}
	return args
}

// luaSource is the script body after the definitions of format.lua and
// lib.lua that it uses, directly or through other definitions, in their
// order there: a script pays for no definition it does not use (a Lua
// function is made anew each time a script runs).
//
// A body may hold the line luaFunctionsHere at its top level, once or more:
// its constants still go before it, and each of its functions (with any
// constant made with one) at the first of those lines that the code below
// names it, and is made only when a run gets there; a path that returns
// before the first line makes none. The body above the first line must not
// name a function (luaSource panics: the scripts are part of the program).
func luaSource(body string) string {
	byName := map[string]int{}
	for i, d := range luaDefs {
		for _, n := range d.names {
			byName[n] = i
		}
	}
	var reach func(names []string, into []bool)
	reach = func(names []string, into []bool) {
		for _, n := range names {
			if i, ok := byName[n]; ok && !into[i] {
				into[i] = true
				reach(luaDefs[i].uses, into)
			}
		}
	}
	used := make([]bool, len(luaDefs))
	reach(luaNames(body), used)
	var b strings.Builder
	parts := strings.Split(body, "\n"+luaFunctionsHere+"\n")
	if len(parts) == 1 {
		for i, d := range luaDefs {
			if used[i] {
				b.WriteString(d.code)
			}
		}
		b.WriteString(body)
		return b.String()
	}
	// late[i]: definition i is a function or needs one. A definition uses
	// only the ones before it.
	late := make([]bool, len(luaDefs))
	for i, d := range luaDefs {
		late[i] = d.fn
		for _, n := range d.uses {
			if j, ok := byName[n]; ok && j < i && late[j] {
				late[i] = true
			}
		}
		if used[i] && !late[i] {
			b.WriteString(d.code)
		}
	}
	for _, n := range luaNames(parts[0]) {
		if i, ok := byName[n]; ok && late[i] {
			panic(fmt.Sprintf("idem: lua: %s is named before %q", n, luaFunctionsHere))
		}
	}
	b.WriteString(parts[0])
	placed := make([]bool, len(luaDefs))
	for _, part := range parts[1:] {
		b.WriteString("\n" + luaFunctionsHere + "\n")
		need := make([]bool, len(luaDefs))
		reach(luaNames(part), need)
		for i, d := range luaDefs {
			if need[i] && late[i] && !placed[i] {
				placed[i] = true
				b.WriteString(d.code)
			}
		}
		b.WriteString(part)
	}
	return b.String()
}

// luaFunctionsHere is the line of a script body where luaSource defines the
// functions it uses (see luaSource).
const luaFunctionsHere = "-- (the functions of format.lua and lib.lua)"
