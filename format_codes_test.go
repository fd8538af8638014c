package idem

import (
	"go/ast"
	"go/constant"
	"go/parser"
	"go/token"
	"go/types"
	"regexp"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// goReplyCodes reads the reply codes format.go declares: every integer
// constant of the file, by name.
func goReplyCodes(t *testing.T) map[string]int64 {
	t.Helper()
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "format.go", nil, 0)
	require.NoError(t, err)
	codes := map[string]int64{}
	for _, d := range f.Decls {
		gd, ok := d.(*ast.GenDecl)
		if !ok || gd.Tok != token.CONST {
			continue
		}
		for _, spec := range gd.Specs {
			vs := spec.(*ast.ValueSpec)
			require.Len(t, vs.Values, len(vs.Names), "every reply code has its own value")
			for i, name := range vs.Names {
				tv, err := types.Eval(fset, nil, vs.Values[i].Pos(), types.ExprString(vs.Values[i]))
				require.NoError(t, err, name.Name)
				v, exact := constant.Int64Val(tv.Value)
				require.True(t, exact, name.Name)
				codes[name.Name] = v
			}
		}
	}
	return codes
}

// luaLocal is a line of format.lua that names a number: local NAME = N.
var luaLocal = regexp.MustCompile(`(?m)^local ([A-Za-z_][A-Za-z0-9_]*) = (-?[0-9]+)$`)

// TestReplyCodesInLua holds the reply codes of format.go and format.lua
// together, and the numbers of the v3 layout (its sizes, positions and
// state bytes) with them: every Go constant has a Lua local of the same
// name and value, and every Lua local of a Go code's spelling (camelCase,
// not UPPER_CASE) is one of them.
func TestReplyCodesInLua(t *testing.T) {
	goCodes := goReplyCodes(t)
	require.NotEmpty(t, goCodes)
	lua := map[string]int64{}
	for _, m := range luaLocal.FindAllStringSubmatch(luaFormat, -1) {
		_, dup := lua[m[1]]
		require.False(t, dup, "format.lua defines %s twice", m[1])
		v, err := strconv.ParseInt(m[2], 10, 64)
		require.NoError(t, err)
		lua[m[1]] = v
	}
	for name, v := range goCodes {
		lv, ok := lua[name]
		if assert.True(t, ok, "format.lua has no local %s = %d", name, v) {
			assert.Equal(t, v, lv, "%s: Go and format.lua differ", name)
		}
	}
	for name, v := range lua {
		_, ok := goCodes[name]
		assert.True(t, ok, "format.lua's %s = %d is not a reply code of format.go", name, v)
	}
}
