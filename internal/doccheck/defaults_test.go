package doccheck

import (
	"fmt"
	"go/ast"
	"go/constant"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"
)

// The defaults the prose may spell: the constants named Default* or
// default* of the packages of defaultPackages, and these others, read from
// the source (so a changed default is seen at once). Each package keeps its
// defaults in one file (defaults.go for the root package, options.go for
// the others).
var (
	defaultExtras = []string{"MaxDuration", "MaxScanBatch", "ClusterScopeShards", "idleConsumerLeases",
		"cleanupTimeout", "settleRetryFirst", "settleRetryCap", "settleMarginCap", "idleWait",
		"deadLetterSuffix", "backlogEvery", "streamBlock", "runPauseFirst", "runPauseCap"}
)

// sweepWords are, for a default whose value is a duration or a number of
// at least 2, words of which one near a spelling of its value (within
// sweepWindow bytes) makes that spelling a mention of the default: it must
// name the constant ("30s (DefaultLease)", "ClusterScopeShards (16)") or be
// in knownMentions. Keys are package.Name, the root package's "idem".
var sweepWords = map[string][]string{
	"idem.DefaultLease":               {"lease"},
	"idem.DefaultRetention":           {"retention"},
	"idem.DefaultMarkerRetention":     {"marker"},
	"idem.ClusterScopeShards":         {"shards"},
	"idem.DefaultScanBatch":           {"scan"},
	"idem.MaxScanBatch":               {"scan"},
	"idem.defaultSettleDelay":         {"settle"},
	"idem.defaultSettleCount":         {"settle"},
	"idem.defaultStreamBatch":         {"WithBatchSize"},
	"idem.defaultMaxDeliveries":       {"WithMaxDeliveries"},
	"idem.defaultIdleConsumers":       {"idle"},
	"idem.idleConsumerLeases":         {"leases"},
	"idem.cleanupTimeout":             {"ctx is done", "context is done"},
	"idem.backlogEvery":               {"backlog", "Run` starts", "Run starts"},
	"idem.runPauseCap":                {"pause"},
	"idemhttp.DefaultMaxAttempts":     {"attempts"},
	"idemhttp.DefaultBackoff":         {"backoff"},
	"idemhttp.DefaultMaxDelay":        {"backoff"},
	"idemhttp.DefaultRetryAfter":      {"Retry-After"},
	"idemhttp.DefaultBodyLimit":       {"body"},
	"idemgrpc.DefaultRetryHint":       {"hint"},
	"idemgrpc.DefaultMaxAttempts":     {"attempts"},
	"idemgrpc.DefaultBackoffBase":     {"backoff"},
	"idemgrpc.DefaultBackoffMax":      {"backoff"},
	"idemjetstream.DefaultBatch":      {"Fetch"},
	"idemjetstream.defaultAckWait":    {"AckWait"},
	"idemjetstream.DefaultRetryDelay": {"NakWithDelay", "RetryDelay"},
	"idemjetstream.idleWait":          {"idle wait"},
	"idemjetstream.backlogEvery":      {"backlog"},
	"idemhttp.DefaultResponseLimit":   {"response"},
	"idem.MaxDuration":                {"years"},
	"idem.settleMarginCap":            {"twentieth"},
	"idem.streamBlock":                {"XREADGROUP"},
}

const sweepWindow = 60

// otherValues are words the sweep would take for a default that spell
// another number: the file and the words.
var otherValues = []struct{ file, words string }{
	{"keys.go", "the 16 bytes of the first"},
	{"replaycache.go", "up to 16 shards"},
	{"defaults.go", "ReadTimeout (5s)"},
	{"defaults.go", "MaxRetryBackoff (1s)"},
}

// knownMentions are the places that spell a default without naming its
// constant (an unexported one, or in a sentence a name would clutter): the
// file and the words, each {package.Name} standing for any spelling of
// that default's value ({Name}: the root package's). Each must be found as
// written: a changed default fails here until the words are changed too.
var knownMentions = []struct{ file, words string }{
	// The Keeper's durations, in examples' comments.
	{"defaults.go", "Claim.Complete accepts: {MaxDuration} (of 365 days)."},
	{"README.md", "// lease {DefaultLease}, retention {DefaultRetention}"},
	{"idemtest/idemtest.go", "// lease {DefaultLease}, retention {DefaultRetention}"},
	{"idemwatermill/doc.go", "// lease {DefaultLease}, retention {DefaultRetention}"},
	{"compact.go", "unless WithMarkerRetention says otherwise: {DefaultMarkerRetention}."},
	{"idemjetstream/doc.go", "equal to the lease (both {DefaultLease} by default)"},
	{"docs/consumers.md", "`AckWait` (JetStream's default, {idemjetstream.defaultAckWait})"},
	// Consume's settle window and patience.
	{"defaults.go", "The defaults of WithSettleWindow: {defaultSettleDelay} is a few round trips"},
	{"defaults.go", "returned in that time, or the last {defaultSettleCount}."},
	{"consume.go", "Default: {defaultSettleDelay} and {defaultSettleCount}."},
	{"consume.go", "WithSettleWindow ({defaultSettleDelay}, {defaultSettleCount})"},
	{"docs/consumers.md", "(the tries of the last storing then go on for at most {cleanupTimeout})"},
	{"stream.go", "WithSettleWindow ({defaultSettleDelay}, {defaultSettleCount})"},
	{"README.md", "settle window, {defaultSettleDelay} or {defaultSettleCount} completions by default"},
	{"docs/consumers.md", "(`WithSettleWindow`, default {defaultSettleDelay} after the first unstored one returned, or as soon as {defaultSettleCount} have)"},
	{"docs/consumers.md", "with backoff ({settleRetryFirst}, doubling up to a tenth of the lease, at most {settleRetryCap})"},
	{"docs/demo.md", "the settle window ({defaultSettleDelay})"},
	{"docs/consumers.md", "(a twentieth of it left, at most {settleMarginCap})"},
	{"docs/consumers.md", "(`XREADGROUP` blocks {streamBlock})"},
	// A StreamConsumer's.
	{"stream.go", "WithBatchSize ({defaultStreamBatch})"},
	{"stream.go", "COUNT) and handles at once. Default: {defaultStreamBatch}."},
	{"stream.go", `WithDeadLetter (stream + "{deadLetterSuffix}")`},
	{"stream.go", `Default: the stream's name + "{deadLetterSuffix}".`},
	{"stream.go", "WithMaxDeliveries ({defaultMaxDeliveries})"},
	{"stream.go", "Default: {defaultMaxDeliveries}; n must be at least 1."},
	{"stream.go", "(the longer of {defaultIdleConsumers} and {idleConsumerLeases} leases)"},
	{"stream.go", "Default: the longer of {defaultIdleConsumers} and {idleConsumerLeases} leases;"},
	{"stream.go", "a pause that doubles from {runPauseFirst} up to {runPauseCap}."},
	{"docs/consumers.md", "(default: the longer of {defaultIdleConsumers} and {idleConsumerLeases} leases;"},
	{"docs/consumers.md", "`WithMaxDeliveries(n)` (default {defaultMaxDeliveries}:"},
	{"docs/consumers.md", "starts and every {backlogEvery}"},
	{"docs/consumers.md", "`Run` starts, every {backlogEvery} and after each idle wait."},
	{"docs/observing.md", "as `Run` starts, then every {backlogEvery} (JetStream: also after each idle wait of {idemjetstream.idleWait})"},
	{"observer.go", "starts and then every {backlogEvery};"},
	{"stream.go", "then every {backlogEvery} (by the Keeper's clock"},
	{"idemotel/doc.go", "every {backlogEvery} (idemjetstream's also after each idle wait)"},
	{"idemjetstream/runner.go", "as Run starts, every {idemjetstream.backlogEvery} while messages come"},
	// The Cluster's shards in the figures measured with them.
	{"docs/consumers.md", "| Cluster, default ({ClusterScopeShards} shards) |"},
	{"docs/consumers.md", "With batches of 100 the default's {ClusterScopeShards} shards"},
}

// TestDefaultsSpelled: every default the prose spells is its constant's
// value. Prose is README.md, docs/*.md and the comments of the Go files
// that are not tests. A default is spelled beside its name, "30s
// (DefaultLease)" or "DefaultLease (30s)", and the value must be the
// constant's; or in one of knownMentions, whose values must be the
// constants'. A value spelled near a word of its default (sweepWords) in
// neither form is an error: name the constant beside it, or add it to
// knownMentions.
func TestDefaultsSpelled(t *testing.T) {
	defs := loadDefaults(t)
	texts := proseTexts(t)
	byName := map[string][]*defaultConst{}
	for _, d := range defs {
		byName[d.name] = append(byName[d.name], d)
	}
	if d := defs["idem.DefaultLease"]; d == nil || !d.dur {
		t.Fatalf("idem.DefaultLease not read as a duration from the source: %+v", d)
	}

	// Named mentions.
	nameRe := regexp.MustCompile(`\b(?:(idem[a-z]*)\.)?([A-Za-z]\w*)\b`)
	for _, tx := range texts {
		for _, m := range nameRe.FindAllStringSubmatchIndex(tx.text, -1) {
			name := tx.text[m[4]:m[5]]
			cands := byName[name]
			if len(cands) == 0 {
				continue
			}
			if m[2] >= 0 {
				pkg := tx.text[m[2]:m[3]]
				cands = slices.DeleteFunc(slices.Clone(cands), func(d *defaultConst) bool { return d.pkg != pkg })
			} else if tx.pkg != "" {
				// In a Go file, a bare name is its own package's, else the root's.
				own := slices.DeleteFunc(slices.Clone(cands), func(d *defaultConst) bool { return d.pkg != tx.pkg })
				if len(own) == 0 {
					own = slices.DeleteFunc(slices.Clone(cands), func(d *defaultConst) bool { return d.pkg != "idem" })
				}
				cands = own
			}
			if len(cands) == 0 {
				continue
			}
			checkNamed(t, tx, m[0], m[1], cands)
		}
	}

	// Other values.
	for _, o := range otherValues {
		found := false
		for _, tx := range texts {
			if tx.file != o.file {
				continue
			}
			for i := 0; ; {
				j := strings.Index(tx.text[i:], o.words)
				if j < 0 {
					break
				}
				found = true
				tx.cover(i+j, i+j+len(o.words))
				i += j + len(o.words)
			}
		}
		if !found {
			t.Errorf("otherValues: %q not found in %s", o.words, o.file)
		}
	}

	// Known mentions.
	for _, k := range knownMentions {
		re, err := mentionRe(k.words, defs)
		if err != nil {
			t.Errorf("knownMentions %s %q: %v", k.file, k.words, err)
			continue
		}
		found := false
		for _, tx := range texts {
			if tx.file != k.file {
				continue
			}
			for _, m := range re.FindAllStringIndex(tx.text, -1) {
				found = true
				tx.cover(m[0], m[1])
			}
		}
		if !found {
			t.Errorf("%s: %q not found with the defaults' values (the value there or the default changed: change the words, here and there, together)", k.file, k.words)
		}
	}

	// The sweep.
	for key, words := range sweepWords {
		d := defs[key]
		if d == nil {
			t.Errorf("sweepWords: no default %s in the source", key)
			continue
		}
		for _, tx := range texts {
			for _, sp := range d.spellings() {
				for i := 0; ; {
					j := strings.Index(tx.text[i:], sp)
					if j < 0 {
						break
					}
					at, end := i+j, i+j+len(sp)
					i = end
					if !boundary(tx.text, at, end) || tx.covered(at, end) || !near(tx.text, at, end, words) {
						continue
					}
					t.Errorf("%s: %q spells %s (%s) without naming it: write %q, or add the words to knownMentions", tx.where(at), excerpt(tx.text, at, end), key, sp, sp+" ("+d.name+")")
				}
			}
		}
	}
}

// checkNamed checks the value spelled beside the name at text[at:end], if
// any, against the candidates' values, and covers it: "NAME (VALUE",
// "NAME, VALUE", "NAME: VALUE", "VALUE (NAME" or "(VALUE, NAME".
func checkNamed(t *testing.T, tx *proseText, at, end int, cands []*defaultConst) {
	t.Helper()
	s := tx.text
	// NAME (VALUE
	after := strings.TrimPrefix(s[end:], "`")
	for _, sep := range []string{" (", ", ", ": "} {
		rest, ok := strings.CutPrefix(after, sep)
		if !ok {
			continue
		}
		rest = strings.TrimLeft(rest, "`\"")
		base := len(s) - len(rest)
		if looksLikeValue(rest) {
			if n := matchSpelling(rest, cands); n > 0 {
				tx.cover(base, base+n)
			} else {
				t.Errorf("%s: %q: %s is %s", tx.where(at), excerpt(s, at, base+min(12, len(rest))), cands[0].name, cands[0].show())
			}
		}
		break
	}
	// VALUE (NAME)
	before := strings.TrimSuffix(s[:at], "`")
	head, ok := strings.CutSuffix(before, "(")
	if !ok {
		head, ok = strings.CutSuffix(before, ", ")
	}
	if ok {
		head = strings.TrimRight(strings.TrimSuffix(strings.TrimSuffix(head, " "), "`"), "`\"")
		for _, d := range cands {
			for _, sp := range d.spellings() {
				if strings.HasSuffix(head, sp) && boundary(s, len(head)-len(sp), len(head)) {
					tx.cover(len(head)-len(sp), len(head))
					return
				}
			}
		}
		if valueBefore.MatchString(head) {
			t.Errorf("%s: %q: %s is %s", tx.where(at), excerpt(s, max(0, len(head)-12), end), cands[0].name, cands[0].show())
		}
	}
}

// valueBefore matches a number, or a duration, ending a text.
var valueBefore = regexp.MustCompile(`(?:^|[^\w.])\d[\d,_.]*\s?(?:ns|µs|ms|s|m|h|min|minutes?|hours?|days?|seconds?|milliseconds?|years?|KiB|MiB)?$`)

func looksLikeValue(s string) bool {
	r, _ := utf8.DecodeRuneInString(s)
	return unicode.IsDigit(r)
}

// matchSpelling returns the length of the spelling of one of the
// candidates' values that s starts with, or 0.
func matchSpelling(s string, cands []*defaultConst) int {
	for _, d := range cands {
		for _, sp := range d.spellings() {
			if strings.HasPrefix(s, sp) && boundary(s, 0, len(sp)) {
				return len(sp)
			}
		}
	}
	return 0
}

// boundary reports whether s[at:end] is a whole word: no letter, digit or
// dot-and-digit around it.
func boundary(s string, at, end int) bool {
	if at > 0 {
		r, _ := utf8.DecodeLastRuneInString(s[:at])
		if unicode.IsLetter(r) || unicode.IsDigit(r) || r == '_' || r == '.' && at > 1 && unicode.IsDigit(rune(s[at-2])) {
			return false
		}
	}
	if end < len(s) {
		r, _ := utf8.DecodeRuneInString(s[end:])
		if unicode.IsLetter(r) || unicode.IsDigit(r) || r == '_' || r == 'µ' {
			return false
		}
		if (r == '.' || r == ',') && end+1 < len(s) && unicode.IsDigit(rune(s[end+1])) {
			return false
		}
	}
	return true
}

func near(s string, at, end int, words []string) bool {
	w := strings.ToLower(s[max(0, at-sweepWindow):min(len(s), end+sweepWindow)])
	for _, word := range words {
		if strings.Contains(w, strings.ToLower(word)) {
			return true
		}
	}
	return false
}

func excerpt(s string, at, end int) string {
	return s[max(0, at-40):min(len(s), end+20)]
}

var placeholderRe = regexp.MustCompile(`\{(?:([a-z]+)\.)?(\w+)\}`)

// mentionRe makes a regexp of knownMentions words: the text as is but for
// spaces (any run of them), each placeholder any spelling of its value.
func mentionRe(words string, defs map[string]*defaultConst) (*regexp.Regexp, error) {
	var b strings.Builder
	last := 0
	lit := func(s string) {
		for i, f := range strings.Fields(s) {
			if i > 0 || strings.HasPrefix(s, " ") && b.Len() > 0 {
				b.WriteString(`\s+`)
			}
			b.WriteString(regexp.QuoteMeta(f))
		}
		if strings.HasSuffix(s, " ") && len(strings.Fields(s)) > 0 {
			b.WriteString(`\s+`)
		}
	}
	for _, m := range placeholderRe.FindAllStringSubmatchIndex(words, -1) {
		lit(words[last:m[0]])
		pkg := "idem"
		if m[2] >= 0 {
			pkg = words[m[2]:m[3]]
		}
		key := pkg + "." + words[m[4]:m[5]]
		d := defs[key]
		if d == nil {
			return nil, fmt.Errorf("no default %s", key)
		}
		var alts []string
		for _, sp := range d.spellings() {
			alts = append(alts, regexp.QuoteMeta(sp))
		}
		b.WriteString(`(?:` + strings.Join(alts, "|") + `)\b`)
		last = m[1]
	}
	lit(words[last:])
	return regexp.Compile(b.String())
}

// defaultConst is one default read from the source.
type defaultConst struct {
	pkg, name string
	val       constant.Value
	dur       bool // a time.Duration
	spelled   []string
}

func (d *defaultConst) show() string {
	if d.dur {
		v, _ := constant.Int64Val(d.val)
		return time.Duration(v).String()
	}
	return d.val.ExactString()
}

var smallWords = []string{"zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"}

// spellings are the ways the prose writes d's value, longest first.
func (d *defaultConst) spellings() []string {
	if d.spelled != nil {
		return d.spelled
	}
	var out []string
	num := func(n int64) []string {
		s := []string{strconv.FormatInt(n, 10)}
		if n >= 10000 {
			t := s[0]
			var b strings.Builder
			for i, c := range t {
				if i > 0 && (len(t)-i)%3 == 0 {
					b.WriteByte(',')
				}
				b.WriteRune(c)
			}
			s = append(s, b.String(), strings.ReplaceAll(b.String(), ",", "_"))
		}
		if n < int64(len(smallWords)) {
			s = append(s, smallWords[n])
		}
		return s
	}
	switch {
	case d.val.Kind() == constant.String:
		out = []string{constant.StringVal(d.val)}
	case d.dur:
		v, _ := constant.Int64Val(d.val)
		units := []struct {
			u                  time.Duration
			short, long, alone string
		}{
			{365 * 24 * time.Hour, "", "years", "a year"},
			{24 * time.Hour, "", "days", "a day"},
			{time.Hour, "h", "hours", "an hour"},
			{time.Minute, "min", "minutes", "a minute"},
			{time.Second, "s", "seconds", "a second"},
			{time.Millisecond, "ms", "milliseconds", "a millisecond"},
		}
		for _, u := range units {
			if v < int64(u.u) || v%int64(u.u) != 0 {
				continue
			}
			n := v / int64(u.u)
			for _, ns := range num(n) {
				if n == 1 {
					out = append(out, u.alone, "one "+strings.TrimSuffix(u.long, "s"))
					if u.short != "" {
						out = append(out, "1"+u.short, "1 "+u.short)
					}
					break
				}
				if u.short != "" && ns[0] >= '0' && ns[0] <= '9' {
					out = append(out, ns+u.short, ns+" "+u.short)
				}
				out = append(out, ns+" "+u.long)
			}
		}
	default:
		v, ok := constant.Int64Val(d.val)
		if !ok {
			break
		}
		out = num(v)
		if v >= 1<<20 && v%(1<<20) == 0 {
			out = append(out, fmt.Sprintf("%d MiB", v>>20), fmt.Sprintf("%dMiB", v>>20))
		} else if v >= 1<<10 && v%(1<<10) == 0 {
			out = append(out, fmt.Sprintf("%d KiB", v>>10), fmt.Sprintf("%dKiB", v>>10))
		}
	}
	slices.SortStableFunc(out, func(a, b string) int { return len(b) - len(a) })
	d.spelled = slices.Compact(out)
	return d.spelled
}

// loadDefaults reads the defaults' constants from the packages' source,
// by package.Name.
func loadDefaults(t *testing.T) map[string]*defaultConst {
	t.Helper()
	out := map[string]*defaultConst{}
	for _, dir := range defaultPackages(t) {
		fset := token.NewFileSet()
		specs := map[string]*ast.ValueSpec{}
		index := map[string]int{}
		var pkg string
		files, _ := filepath.Glob(filepath.Join(root, dir, "*.go"))
		for _, f := range files {
			if strings.HasSuffix(f, "_test.go") {
				continue
			}
			af, err := parser.ParseFile(fset, f, nil, 0)
			if err != nil {
				t.Fatal(err)
			}
			pkg = af.Name.Name
			for _, decl := range af.Decls {
				g, ok := decl.(*ast.GenDecl)
				if !ok || g.Tok != token.CONST {
					continue
				}
				for _, spec := range g.Specs {
					vs := spec.(*ast.ValueSpec)
					for i, n := range vs.Names {
						specs[n.Name], index[n.Name] = vs, i
					}
				}
			}
		}
		if pkg == "" {
			t.Fatalf("no Go files in %s", dir)
		}
		ev := &constEval{specs: specs, index: index, done: map[string]evalResult{}}
		for name := range specs {
			if !isDefaultName(name) {
				continue
			}
			r, ok := ev.eval(name)
			if !ok {
				continue // not a constant this evaluator knows (iota, a call)
			}
			out[pkg+"."+name] = &defaultConst{pkg: pkg, name: name, val: r.val, dur: r.dur}
		}
	}
	return out
}

// defaultPackages are the root package, idemhttp, idemtest, and the
// package at the top of every other module but bench/peers (a benchmark
// command): every library of the checkout.
func defaultPackages(t *testing.T) []string {
	t.Helper()
	mods, err := filepath.Glob(filepath.Join(root, "*", "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	out := []string{".", "idemhttp", "idemtest"}
	for _, m := range mods {
		out = append(out, filepath.Base(filepath.Dir(m)))
	}
	if len(out) < 5 {
		t.Fatalf("found the modules %v only: the test runs from internal/doccheck", out)
	}
	return out
}

func isDefaultName(name string) bool {
	if slices.Contains(defaultExtras, name) {
		return true
	}
	for _, p := range []string{"Default", "default"} {
		if rest, ok := strings.CutPrefix(name, p); ok && rest != "" && unicode.IsUpper(rune(rest[0])) {
			return true
		}
	}
	return false
}

type evalResult struct {
	val constant.Value
	dur bool
}

// constEval evaluates the constant expressions of one package that use
// literals, other constants, time's units and time.Duration.
type constEval struct {
	specs map[string]*ast.ValueSpec
	index map[string]int
	done  map[string]evalResult
}

func (e *constEval) eval(name string) (evalResult, bool) {
	if r, ok := e.done[name]; ok {
		return r, r.val != nil
	}
	e.done[name] = evalResult{} // a cycle evaluates to nothing
	vs := e.specs[name]
	i := e.index[name]
	if vs == nil || i >= len(vs.Values) {
		return evalResult{}, false
	}
	r, ok := e.expr(vs.Values[i])
	if ok {
		if sel, isSel := vs.Type.(*ast.SelectorExpr); isSel && sel.Sel.Name == "Duration" {
			r.dur = true
		}
		e.done[name] = r
	}
	return r, ok
}

var timeUnits = map[string]time.Duration{
	"Nanosecond": time.Nanosecond, "Microsecond": time.Microsecond, "Millisecond": time.Millisecond,
	"Second": time.Second, "Minute": time.Minute, "Hour": time.Hour,
}

func (e *constEval) expr(x ast.Expr) (evalResult, bool) {
	switch x := x.(type) {
	case *ast.BasicLit:
		v := constant.MakeFromLiteral(x.Value, x.Kind, 0)
		return evalResult{val: v}, v.Kind() != constant.Unknown
	case *ast.ParenExpr:
		return e.expr(x.X)
	case *ast.Ident:
		return e.eval(x.Name)
	case *ast.SelectorExpr:
		if p, ok := x.X.(*ast.Ident); ok && p.Name == "time" {
			if u, ok := timeUnits[x.Sel.Name]; ok {
				return evalResult{val: constant.MakeInt64(int64(u)), dur: true}, true
			}
		}
	case *ast.CallExpr:
		if sel, ok := x.Fun.(*ast.SelectorExpr); ok && sel.Sel.Name == "Duration" && len(x.Args) == 1 {
			r, ok := e.expr(x.Args[0])
			r.dur = true
			return r, ok
		}
	case *ast.UnaryExpr:
		r, ok := e.expr(x.X)
		if !ok {
			return r, false
		}
		return evalResult{val: constant.UnaryOp(x.Op, r.val, 0), dur: r.dur}, true
	case *ast.BinaryExpr:
		a, ok1 := e.expr(x.X)
		b, ok2 := e.expr(x.Y)
		if !ok1 || !ok2 {
			return evalResult{}, false
		}
		switch x.Op {
		case token.SHL, token.SHR:
			s, _ := constant.Uint64Val(b.val)
			return evalResult{val: constant.Shift(a.val, x.Op, uint(s)), dur: a.dur}, true
		case token.QUO:
			if a.val.Kind() == constant.Int && b.val.Kind() == constant.Int {
				return evalResult{val: constant.BinaryOp(a.val, token.QUO_ASSIGN, b.val), dur: a.dur || b.dur}, true
			}
		}
		return evalResult{val: constant.BinaryOp(a.val, x.Op, b.val), dur: a.dur || b.dur}, true
	}
	return evalResult{}, false
}

// proseText is one stretch of prose: a Markdown page or one comment of a
// Go file, its spaces run together.
type proseText struct {
	file string
	pkg  string // a Go file's package name; "" for Markdown
	text string
	// lineAt maps an offset of text to its line in the file.
	offsets, lines []int
	spans          [][2]int // covered
}

func (p *proseText) where(at int) string {
	i, _ := slices.BinarySearch(p.offsets, at+1)
	return fmt.Sprintf("%s:%d", p.file, p.lines[max(0, i-1)])
}

func (p *proseText) cover(at, end int) { p.spans = append(p.spans, [2]int{at, end}) }

func (p *proseText) covered(at, end int) bool {
	return slices.ContainsFunc(p.spans, func(s [2]int) bool { return s[0] <= at && end <= s[1] })
}

// add appends a line of the file to the text.
func (p *proseText) add(line string, n int) {
	line = strings.Join(strings.Fields(line), " ")
	if line == "" {
		return
	}
	if p.text != "" {
		p.text += " "
	}
	p.offsets, p.lines = append(p.offsets, len(p.text)), append(p.lines, n)
	p.text += line
}

// proseTexts returns README.md and docs/*.md, and every comment of the Go
// files that are not tests, in every module of the checkout.
func proseTexts(t *testing.T) []*proseText {
	t.Helper()
	var out []*proseText
	for _, name := range pages(t) {
		b, err := os.ReadFile(filepath.Join(root, name))
		if err != nil {
			t.Fatal(err)
		}
		p := &proseText{file: name}
		for i, line := range strings.Split(string(b), "\n") {
			p.add(line, i+1)
		}
		out = append(out, p)
	}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if n := d.Name(); path != root && (strings.HasPrefix(n, ".") || n == "testdata") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		fset := token.NewFileSet()
		af, err := parser.ParseFile(fset, path, nil, parser.ParseComments)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		for _, g := range af.Comments {
			p := &proseText{file: filepath.ToSlash(rel), pkg: af.Name.Name}
			for _, c := range g.List {
				line := fset.Position(c.Pos()).Line
				for i, l := range strings.Split(c.Text, "\n") {
					l = strings.TrimPrefix(strings.TrimPrefix(strings.TrimSuffix(l, "*/"), "/*"), "//")
					p.add(l, line+i)
				}
			}
			out = append(out, p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}
