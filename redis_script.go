package idem

import (
	_ "embed"
	"fmt"
	"regexp"
	"strings"

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
// (EVALSHA, then EVAL on NOSCRIPT) and its source, for the calls that send
// EVAL themselves.
type luaScript struct {
	*redis.Script
	src string
}

// newLuaScript is the script of the file body of lua/, sent as luaSource
// makes it.
func newLuaScript(body string) *luaScript {
	src := luaSource(body)
	return &luaScript{Script: redis.NewScript(src), src: src}
}

// luaSource is the script body after the definitions of format.lua and
// lib.lua that it uses, directly or through other definitions, in their
// order there: a script pays for no definition it does not use (a Lua
// function is made anew each time a script runs).
//
// A body may hold the line luaFunctionsHere, at its top level: the
// functions it uses (and any constant made with one) are defined there
// instead, the constants still before the body, so that a path that returns
// before that line makes no function at all. The body above it must not
// name a function (luaSource panics: the scripts are part of the program).
func luaSource(body string) string {
	byName := map[string]int{}
	for i, d := range luaDefs {
		for _, n := range d.names {
			byName[n] = i
		}
	}
	used := make([]bool, len(luaDefs))
	var visit func(names []string)
	visit = func(names []string) {
		for _, n := range names {
			if i, ok := byName[n]; ok && !used[i] {
				used[i] = true
				visit(luaDefs[i].uses)
			}
		}
	}
	visit(luaNames(body))
	// late[i]: definition i is a function or needs one, so it goes at
	// luaFunctionsHere when the body has it. A definition uses only the
	// ones before it.
	late := make([]bool, len(luaDefs))
	for i, d := range luaDefs {
		late[i] = d.fn
		for _, n := range d.uses {
			if j, ok := byName[n]; ok && j < i && late[j] {
				late[i] = true
			}
		}
	}
	head, tail, split := strings.Cut(body, "\n"+luaFunctionsHere+"\n")
	if split {
		head += "\n" + luaFunctionsHere + "\n"
		for _, n := range luaNames(head) {
			if i, ok := byName[n]; ok && late[i] {
				panic(fmt.Sprintf("idem: lua: %s is named before %q", n, luaFunctionsHere))
			}
		}
	}
	var b strings.Builder
	write := func(late0 bool) {
		for i, d := range luaDefs {
			if used[i] && late[i] == late0 {
				b.WriteString(d.code)
			}
		}
	}
	if !split {
		for i, d := range luaDefs {
			if used[i] {
				b.WriteString(d.code)
			}
		}
		b.WriteString(body)
		return b.String()
	}
	write(false)
	b.WriteString(head)
	write(true)
	b.WriteString(tail)
	return b.String()
}

// luaFunctionsHere is the line of a script body where luaSource defines the
// functions it uses (see luaSource).
const luaFunctionsHere = "-- (the functions of format.lua and lib.lua)"
