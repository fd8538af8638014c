package idem

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/idemkit/idem/internal/scriptname"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// formatSpelling matches a literal that spells out a format of format.lua:
// a record's or a call record's start, a marker's envelope, the index's
// layout.
var formatSpelling = regexp.MustCompile(`['"]\^?i[123]|\\1m|['"]\^?v2 |['"]\^?v3`)

// TestScriptsSpellNoFormat holds every format in format.lua: no other
// script, lib.lua included, writes or matches a record, a call record, a
// marker or the index's layout with a literal of its own.
func TestScriptsSpellNoFormat(t *testing.T) {
	files, err := filepath.Glob("lua/*.lua")
	require.NoError(t, err)
	require.Greater(t, len(files), 10)
	inFormat := 0
	for _, f := range files {
		src, err := os.ReadFile(f)
		require.NoError(t, err)
		for i, line := range strings.Split(string(src), "\n") {
			code, _, _ := strings.Cut(line, "--")
			if !formatSpelling.MatchString(code) {
				continue
			}
			if filepath.Base(f) == "format.lua" {
				inFormat++
				continue
			}
			t.Errorf("%s:%d spells a format out: %s", f, i+1, strings.TrimSpace(line))
		}
	}
	assert.Greater(t, inFormat, 5, "format.lua spells the formats out")
}

// TestLuaScriptSendsWhatItUses: a script is sent with the shared
// definitions it uses, through others too, in their order, and without the
// rest.
func TestLuaScriptSendsWhatItUses(t *testing.T) {
	has := func(script, name string) bool {
		return regexp.MustCompile(`(?m)^local (function )?` + name + `\b`).MatchString(script)
	}
	// complete.lua, the step every Do ends with, reads records only, by
	// patterns, and writes by one function.
	assert.True(t, has(completeScript.src, "RECORD_PENDING"))
	assert.True(t, has(completeScript.src, "record_completed"))
	assert.True(t, has(completeScript.src, "transitionDone"))
	assert.Equal(t, 1, strings.Count(completeScript.src, "function"))
	assert.False(t, has(completeScript.src, "index_entry"))
	assert.False(t, has(completeScript.src, "claimExisting"))
	assert.False(t, has(completeScript.src, "call_header"))

	// index_entry uses v3_index_entry, index_now and V3_STATE, which come
	// first, though the body names none of them.
	s := luaSource("return index_entry(KEYS[1], ARGV)\n")
	for _, name := range []string{"index_entry", "v3_index_entry", "index_now", "V3_STATE"} {
		assert.True(t, has(s, name), name)
	}
	assert.Less(t, strings.Index(s, "local function v3_index_entry"), strings.Index(s, "local function index_entry"))
	assert.False(t, has(s, "record_long"))
	assert.True(t, strings.HasSuffix(s, "return index_entry(KEYS[1], ARGV)\n"))

	// A name in a comment does not count.
	assert.Equal(t, "-- record_long\nreturn 1\n", luaSource("-- record_long\nreturn 1\n"))
}

// TestLuaFunctionsHere: a body with luaFunctionsHere gets the constants it
// uses first and each function at the first such line above code that
// names it, so that claim.lua's replay returns before any function is
// made; a function named above the first line panics.
func TestLuaFunctionsHere(t *testing.T) {
	s := luaSource("local a = RECORD_SHORT_START\n" + luaFunctionsHere + "\nreturn index_entry(KEYS[1], ARGV)\n")
	at := strings.Index(s, luaFunctionsHere)
	require.Positive(t, at)
	assert.Less(t, strings.Index(s, "local RECORD_SHORT_START"), at)
	assert.Greater(t, strings.Index(s, "local function v3_index_entry"), at)
	assert.Greater(t, strings.Index(s, "local function index_entry"), strings.Index(s, "local function v3_index_entry"))
	assert.True(t, strings.HasSuffix(s, "return index_entry(KEYS[1], ARGV)\n"))
	assert.Panics(t, func() { luaSource("local a = index_now()\n" + luaFunctionsHere + "\nreturn a\n") })

	// At a second line, the functions the code below it names and the
	// first did not define.
	s = luaSource("local z = 1\n" + luaFunctionsHere + "\nlocal a = v3_index_entry\n" + luaFunctionsHere + "\nreturn index_entry(KEYS[1], ARGV)\n")
	first, second := strings.Index(s, luaFunctionsHere), strings.LastIndex(s, luaFunctionsHere)
	require.Less(t, first, second)
	assert.Equal(t, 1, strings.Count(s, "local function v3_index_entry"))
	assert.Less(t, strings.Index(s, "local function v3_index_entry"), second)
	assert.Greater(t, strings.Index(s, "local function index_entry"), second)

	// claim.lua makes no function before its replay returns, and only
	// record_head before a new key's claim returns.
	at = strings.Index(claimScript.src, luaFunctionsHere)
	require.Positive(t, at)
	assert.NotContains(t, claimScript.src[:at], "local function")
	assert.Less(t, strings.Index(claimScript.src, "RECORD_SHORT_START then"), at)
	next := at + len(luaFunctionsHere) + strings.Index(claimScript.src[at+len(luaFunctionsHere):], luaFunctionsHere)
	require.Greater(t, next, at)
	assert.Equal(t, 1, strings.Count(claimScript.src[:next], "local function"))
	assert.Contains(t, claimScript.src[at:next], "local function record_head")
}

// TestLuaDefsRefuseAStatement: the shared Lua only defines; anything else
// at its top level stops the program at its start, not a script at run
// time.
func TestLuaDefsRefuseAStatement(t *testing.T) {
	assert.Panics(t, func() { parseLuaDefs("local a = 1\n\nredis.call('DEL', 'x')\n") })
	assert.Panics(t, func() { parseLuaDefs("local = 1\n") })
	defs := parseLuaDefs("-- a\nlocal a, b = 1, 2\n-- f\nlocal function f(x)\n  return a + x\nend\n")
	require.Len(t, defs, 2)
	assert.Equal(t, []string{"a", "b"}, defs[0].names)
	assert.Equal(t, "local a, b = 1, 2\n", defs[0].code)
	assert.Equal(t, []string{"f"}, defs[1].names)
	assert.Contains(t, defs[1].uses, "a")
}

// TestEveryScriptIsLoaded holds luaScripts to lua/: every file but the
// shared definitions (format.lua, lib.lua) is one script, made once, and
// LoadScripts loads every one of them, on miniredis and a redis-server.
func TestEveryScriptIsLoaded(t *testing.T) {
	files, err := filepath.Glob("lua/*.lua")
	require.NoError(t, err)
	bodies := map[string]int{}
	for _, sc := range luaScripts {
		bodies[sc.body]++
	}
	made := 0
	for _, f := range files {
		name := filepath.Base(f)
		if name == "format.lua" || name == "lib.lua" {
			continue
		}
		src, err := os.ReadFile(f)
		require.NoError(t, err)
		assert.Equal(t, 1, bodies[string(src)], "%s: scripts made of it", f)
		made++
		for _, sc := range luaScripts {
			if sc.body == string(src) {
				assert.Equal(t, strings.TrimSuffix(name, ".lua"), scriptname.Of([]any{"evalsha", sc.Hash()}), "the name tests know %s by", f)
			}
		}
	}
	assert.Len(t, luaScripts, made, "a script that is no file of lua/")

	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		s, err := openRedisStore(b.Client)
		require.NoError(t, err)
		require.NoError(t, s.LoadScripts(context.Background()))
		for _, sc := range luaScripts {
			ok, err := sc.Exists(context.Background(), b.Client).Result()
			require.NoError(t, err)
			assert.Equal(t, []bool{true}, ok, "not loaded: the script of\n%.200s", sc.body)
		}
	})
}
