package doccheck

import (
	"bufio"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"
)

// root is the repository's top directory, seen from this package.
const root = "../.."

// maxFrontPage is how long README.md may be: a front page, not a manual.
const maxFrontPage = 300

// modulePath is the import path of the repository's root module.
const modulePath = "github.com/idemkit/idem"

// pages returns README.md and docs/*.md, relative to root.
func pages(t *testing.T) []string {
	t.Helper()
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	out := []string{"README.md"}
	for _, d := range docs {
		rel, _ := filepath.Rel(root, d)
		out = append(out, filepath.ToSlash(rel))
	}
	if len(out) < 2 {
		t.Fatal("no docs/*.md found: the test runs from internal/doccheck")
	}
	return out
}

func TestFrontPageLength(t *testing.T) {
	p := parsePage(t, "README.md")
	if p.lines > maxFrontPage {
		t.Errorf("README.md has %d lines, more than the %d of a front page: move the depth into docs/", p.lines, maxFrontPage)
	}
}

func TestLinksResolve(t *testing.T) {
	cache := map[string]*page{}
	get := func(name string) *page {
		if p, ok := cache[name]; ok {
			return p
		}
		p := parsePage(t, name)
		cache[name] = p
		return p
	}
	checked := 0
	for _, name := range pages(t) {
		p := get(name)
		for _, l := range p.links {
			if external(l.target) {
				continue
			}
			checked++
			target, frag, _ := strings.Cut(l.target, "#")
			dest := name // a bare "#anchor" is in the page itself
			if target != "" {
				dest = path.Clean(path.Join(path.Dir(name), target))
				if dest == ".." || strings.HasPrefix(dest, "../") {
					t.Errorf("%s:%d: link %q leaves the repository", name, l.line, l.target)
					continue
				}
				if _, err := os.Stat(filepath.Join(root, filepath.FromSlash(dest))); err != nil {
					t.Errorf("%s:%d: link %q: no such file or directory %s", name, l.line, l.target, dest)
					continue
				}
			}
			if frag == "" {
				continue
			}
			if !strings.HasSuffix(dest, ".md") {
				t.Errorf("%s:%d: link %q: an anchor into %s, which is not a Markdown page", name, l.line, l.target, dest)
				continue
			}
			if !get(dest).anchors[frag] {
				t.Errorf("%s:%d: link %q: %s has no heading or anchor %q", name, l.line, l.target, dest, frag)
			}
		}
	}
	if checked == 0 {
		t.Fatal("no relative link found in the pages: the parser is broken")
	}
}

func TestCommandsExist(t *testing.T) {
	c := newChecker(t)
	for _, name := range pages(t) {
		p := parsePage(t, name)
		for _, b := range p.blocks {
			c.block(name, b)
		}
		for _, s := range p.inline {
			c.inline(name, s)
		}
	}
	if c.checked == 0 {
		t.Fatal("no command found in the pages: the parser is broken")
	}
}

// page is what the test reads of one Markdown page.
type page struct {
	lines   int
	anchors map[string]bool
	links   []link
	blocks  []block // fenced shell blocks
	inline  []span  // inline code spans outside fences
}

type link struct {
	target string
	line   int
}

// block is a fenced code block of shell commands.
type block struct {
	line  int
	lines []string
}

// span is an inline code span.
type span struct {
	text string
	line int
}

var (
	fenceRe    = regexp.MustCompile("^\\s*(```+|~~~+)\\s*([A-Za-z0-9_+-]*)")
	headingRe  = regexp.MustCompile(`^#{1,6}\s+(.*?)\s*#*\s*$`)
	inlineRe   = regexp.MustCompile(`!?\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)
	refDefRe   = regexp.MustCompile(`^\s{0,3}\[[^\]]+\]:\s+(\S+)`)
	htmlIDRe   = regexp.MustCompile(`<a\s+(?:id|name)="([^"]+)"`)
	codeSpanRe = regexp.MustCompile("`([^`]+)`")
)

// shellInfo lists the fence info strings whose blocks hold commands.
var shellInfo = []string{"sh", "shell", "bash", "console"}

func parsePage(t *testing.T, name string) *page {
	t.Helper()
	f, err := os.Open(filepath.Join(root, filepath.FromSlash(name)))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	p := &page{anchors: map[string]bool{}}
	seen := map[string]int{}
	var fence string // the open fence's marker, or ""
	var cur *block
	var prose strings.Builder // text outside fences, for code spans
	proseLine := []int{}      // the page line of each line of prose
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		p.lines++
		line := sc.Text()
		if m := fenceRe.FindStringSubmatch(line); m != nil {
			switch {
			case fence == "":
				fence = m[1]
				if slices.Contains(shellInfo, m[2]) {
					cur = &block{line: p.lines}
				}
				continue
			case strings.HasPrefix(m[1], fence) && m[2] == "":
				fence = ""
				if cur != nil {
					p.blocks = append(p.blocks, *cur)
					cur = nil
				}
				continue
			}
		}
		if fence != "" {
			if cur != nil {
				cur.lines = append(cur.lines, line)
			}
			continue
		}
		prose.WriteString(line)
		prose.WriteByte('\n')
		proseLine = append(proseLine, p.lines)
		if m := headingRe.FindStringSubmatch(line); m != nil {
			slug := slugify(m[1])
			if n := seen[slug]; n > 0 {
				p.anchors[fmt.Sprintf("%s-%d", slug, n)] = true
			} else {
				p.anchors[slug] = true
			}
			seen[slug]++
		}
		for _, m := range htmlIDRe.FindAllStringSubmatch(line, -1) {
			p.anchors[m[1]] = true
		}
		text := codeSpanRe.ReplaceAllString(line, "") // a link inside a code span is not a link
		for _, m := range inlineRe.FindAllStringSubmatch(text, -1) {
			p.links = append(p.links, link{target: m[1], line: p.lines})
		}
		if m := refDefRe.FindStringSubmatch(text); m != nil {
			p.links = append(p.links, link{target: m[1], line: p.lines})
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if fence != "" {
		t.Errorf("%s: a code fence is never closed", name)
	}
	text := prose.String()
	for _, m := range codeSpanRe.FindAllStringSubmatchIndex(text, -1) {
		if strings.Contains(text[m[0]:m[1]], "\n\n") {
			continue // an unmatched backtick paired across paragraphs
		}
		at := proseLine[strings.Count(text[:m[0]], "\n")]
		p.inline = append(p.inline, span{text: strings.Join(strings.Fields(text[m[2]:m[3]]), " "), line: at})
	}
	return p
}

// slugify makes a heading's anchor as GitHub does: lower case, punctuation
// dropped, spaces to hyphens.
func slugify(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case unicode.IsLetter(r) || unicode.IsDigit(r) || r == '-' || r == '_':
			b.WriteRune(r)
		case r == ' ':
			b.WriteByte('-')
		}
	}
	return b.String()
}

func external(target string) bool {
	for _, s := range []string{"http://", "https://", "mailto:"} {
		if strings.HasPrefix(target, s) {
			return true
		}
	}
	return false
}

// checker checks the commands of the pages against the repository.
type checker struct {
	t       *testing.T
	targets map[string]bool     // the Makefile's targets
	tests   map[string][]string // test function names by package directory
	clones  map[string]string   // by page: where a git clone put the repository
	checked int
}

func newChecker(t *testing.T) *checker {
	c := &checker{t: t, targets: map[string]bool{}, tests: map[string][]string{}, clones: map[string]string{}}
	mk, err := os.ReadFile(filepath.Join(root, "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	target := regexp.MustCompile(`^([A-Za-z0-9_.-]+)\s*:([^=]|$)`)
	for l := range strings.SplitSeq(string(mk), "\n") {
		if m := target.FindStringSubmatch(l); m != nil && !strings.HasPrefix(m[1], ".") {
			c.targets[m[1]] = true
		}
	}
	if len(c.targets) == 0 {
		t.Fatal("no target found in the Makefile")
	}
	return c
}

// where is the directory a command runs in: a directory of the repository
// (in a checkout), or the reader's own module beside a clone of it.
type where struct {
	dir     string // relative to root, unless outside
	outside bool   // the command runs in the reader's own module
	// clone is where a git clone earlier on the page put the repository,
	// seen from the reader's module ("../idem"): a path under it names a
	// directory of the repository.
	clone string
}

func (c *checker) errorf(page string, line int, format string, args ...any) {
	c.t.Helper()
	c.t.Errorf("%s:%d: %s", page, line, fmt.Sprintf(format, args...))
}

// block checks each command of a shell block, in order: a cd or a git
// clone changes where the later ones run.
func (c *checker) block(page string, b block) {
	w := &where{dir: ".", clone: c.clones[page]}
	for i := 0; i < len(b.lines); i++ {
		line, at := b.lines[i], b.line+i+1
		for strings.HasSuffix(strings.TrimSpace(line), `\`) && i+1 < len(b.lines) {
			i++
			line = strings.TrimSuffix(strings.TrimSpace(line), `\`) + " " + b.lines[i]
		}
		c.commandLine(page, at, line, w, true)
		c.clones[page] = w.clone
	}
}

// inline checks a code span of prose that runs a command of the
// repository (go test, go run, go doc, make); other spans are code, not
// commands.
func (c *checker) inline(page string, s span) {
	words := shellWords(s.text)
	i := skipPrefix(words)
	if i >= len(words) {
		return
	}
	switch {
	case words[i] == "make" && i == 0:
	case words[i] == "go" && i+1 < len(words) && slices.Contains([]string{"test", "run", "doc"}, words[i+1]):
	default:
		return
	}
	c.commandLine(page, s.line, s.text, &where{dir: ".", clone: c.clones[page]}, false)
}

// skipPrefix returns the index of the program of a simple command: after
// environment assignments and time.
func skipPrefix(words []string) int {
	i := 0
	for i < len(words) && (strings.Contains(words[i], "=") && !strings.HasPrefix(words[i], "-") || words[i] == "time") {
		i++
	}
	return i
}

// programs are the commands a page may show besides go, make and cd.
var programs = []string{
	"git", "curl", "redis-server", "redis-cli", "mkdir", "cat", "echo", "ls", "export", "apt-get", "kill", "bash",
}

func (c *checker) commandLine(page string, line int, text string, w *where, strict bool) {
	for _, cmd := range splitCommands(stripComment(text)) {
		words := shellWords(cmd)
		i := skipPrefix(words)
		if i >= len(words) {
			continue
		}
		c.checked++
		prog, args := words[i], words[i+1:]
		switch prog {
		case "make":
			c.make(page, line, args, w)
		case "cd":
			c.cd(page, line, args, w)
		case "go":
			c.goCommand(page, line, args, w)
		case "git":
			if len(args) >= 3 && args[0] == "clone" {
				// The steps that follow run beside the clone, in the
				// reader's own module.
				w.clone, w.outside, w.dir = path.Clean(args[len(args)-1]), true, ""
			}
		default:
			if strict && !slices.Contains(programs, prog) {
				c.errorf(page, line, "%q runs %q, which is neither a command of the repository nor a known program", cmd, prog)
			}
		}
	}
}

// repoDir maps a directory argument to a directory of the repository, or
// reports that it is not one: in a checkout, it is relative to the current
// directory; beside a clone, it must lie in the clone.
func (w *where) repoDir(arg string) (string, bool) {
	p := path.Clean(arg)
	if w.clone != "" {
		if p == w.clone {
			return ".", true
		}
		if rest, ok := strings.CutPrefix(p, w.clone+"/"); ok {
			return rest, true
		}
	}
	if w.outside {
		return "", false // in the reader's own module
	}
	return path.Clean(path.Join(w.dir, arg)), true
}

func (c *checker) make(page string, line int, args []string, w *where) {
	if w.outside {
		c.errorf(page, line, "make runs outside the repository")
		return
	}
	if w.dir != "." {
		c.errorf(page, line, "make runs in %s, which has no Makefile of its own", w.dir)
		return
	}
	for _, a := range args {
		if strings.HasPrefix(a, "-") || strings.Contains(a, "=") {
			continue
		}
		if !c.targets[a] {
			c.errorf(page, line, "make %s: the Makefile has no target %q", a, a)
		}
	}
}

func (c *checker) cd(page string, line int, args []string, w *where) {
	if len(args) == 0 {
		c.errorf(page, line, "cd without a directory")
		return
	}
	if w.outside {
		if d, ok := w.repoDir(args[0]); ok {
			w.dir, w.outside = d, false // into the clone: a checkout from now on
		}
		return
	}
	d := path.Clean(path.Join(w.dir, args[0]))
	if !isDir(d) {
		c.errorf(page, line, "cd %s: the repository has no directory %s", args[0], d)
		return
	}
	w.dir = d
}

// goValueFlags are the flags of go test and go run that take a value as the
// next word.
var goValueFlags = []string{
	"-run", "-bench", "-benchtime", "-count", "-timeout", "-fuzz", "-fuzztime", "-cpu", "-parallel",
	"-tags", "-coverprofile", "-cpuprofile", "-memprofile", "-skip", "-exec", "-o", "-p", "-list",
}

func (c *checker) goCommand(page string, line int, args []string, w *where) {
	if len(args) == 0 {
		c.errorf(page, line, "go without a subcommand")
		return
	}
	sub, args := args[0], args[1:]
	switch sub {
	case "run":
		c.goRun(page, line, args, w)
	case "test":
		c.goTest(page, line, args, w)
	case "work":
		c.goWork(page, line, args, w)
	case "mod":
		c.goMod(page, line, args, w)
	case "get", "doc":
		for _, a := range args {
			if strings.HasPrefix(a, "-") {
				continue
			}
			pkg, _, _ := strings.Cut(a, "@")
			if strings.HasPrefix(pkg, modulePath) && c.importDir(pkg) == "" {
				c.errorf(page, line, "go %s %s: the repository has no package %s", sub, a, pkg)
			}
		}
	case "build", "vet", "install", "env", "version", "list", "tool", "fmt", "clean":
	default:
		c.errorf(page, line, "go %s: no such go command", sub)
	}
}

// importDir is the directory of the repository that holds the package of
// import path pkg, or "".
func (c *checker) importDir(pkg string) string {
	rest, ok := strings.CutPrefix(pkg, modulePath)
	if !ok || rest != "" && !strings.HasPrefix(rest, "/") {
		return ""
	}
	d := path.Clean("." + rest)
	if !isDir(d) || len(goFiles(d, false)) == 0 {
		return ""
	}
	return d
}

func (c *checker) goRun(page string, line int, args []string, w *where) {
	i := 0
	for i < len(args) && strings.HasPrefix(args[i], "-") {
		if slices.Contains(goValueFlags, args[i]) {
			i++
		}
		i++
	}
	if i >= len(args) {
		c.errorf(page, line, "go run without a package")
		return
	}
	d, ok := w.repoDir(args[i])
	if !ok {
		return
	}
	if !isMain(d) {
		c.errorf(page, line, "go run %s: %s is not a command (no package main)", args[i], d)
		return
	}
	// Every flag given to the command is one it defines.
	src := strings.Join(goFiles(d, false), "\n")
	for _, a := range args[i+1:] {
		if !strings.HasPrefix(a, "-") || a == "-" || a == "--" {
			continue
		}
		name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if name == "" || unicode.IsDigit(rune(name[0])) {
			continue
		}
		if !strings.Contains(src, `"`+name+`"`) {
			c.errorf(page, line, "go run %s: the command defines no flag -%s", args[i], name)
		}
	}
}

func (c *checker) goTest(page string, line int, args []string, w *where) {
	var pkgs []string
	patterns := map[string]string{} // flag -> pattern
	for i := 0; i < len(args); i++ {
		a := args[i]
		if !strings.HasPrefix(a, "-") {
			pkgs = append(pkgs, a)
			continue
		}
		name, value, hasValue := strings.Cut(a, "=")
		if !hasValue && slices.Contains(goValueFlags, name) && i+1 < len(args) {
			i++
			value = args[i]
		}
		switch name {
		case "-run", "-bench", "-fuzz":
			patterns[name] = value
		}
	}
	if len(pkgs) == 0 {
		pkgs = []string{"."}
	}
	var names []string
	for _, p := range pkgs {
		d, ok := w.repoDir(strings.TrimSuffix(p, "/..."))
		if !ok {
			return
		}
		if !isDir(d) {
			c.errorf(page, line, "go test %s: the repository has no directory %s", p, d)
			return
		}
		if !strings.HasSuffix(p, "...") && len(goFiles(d, false))+len(goFiles(d, true)) == 0 {
			c.errorf(page, line, "go test %s: %s holds no Go package", p, d)
			return
		}
		if strings.HasSuffix(p, "...") {
			return // the patterns are checked against named packages only
		}
		names = append(names, c.testNames(d)...)
	}
	prefixes := map[string][]string{"-run": {"Test", "Example", "Fuzz"}, "-bench": {"Benchmark"}, "-fuzz": {"Fuzz"}}
	for flag, pattern := range patterns {
		top, _, _ := strings.Cut(pattern, "/") // a subtest's pattern starts with its test's
		if top == "^$" || top == "." || top == "" {
			continue
		}
		re, err := regexp.Compile(top)
		if err != nil {
			c.errorf(page, line, "go test %s %q: not a regular expression: %v", flag, pattern, err)
			continue
		}
		found := slices.ContainsFunc(names, func(n string) bool {
			return hasAnyPrefix(n, prefixes[flag]) && re.MatchString(n)
		})
		if !found {
			c.errorf(page, line, "go test %s %q %s: no function of the package matches", flag, pattern, strings.Join(pkgs, " "))
		}
	}
}

func (c *checker) goWork(page string, line int, args []string, w *where) {
	if len(args) == 0 || (args[0] != "init" && args[0] != "use") {
		return
	}
	for _, a := range args[1:] {
		if strings.HasPrefix(a, "-") {
			continue
		}
		d, ok := w.repoDir(a)
		if !ok {
			continue // the reader's own module
		}
		if !isFile(path.Join(d, "go.mod")) {
			c.errorf(page, line, "go work %s %s: %s is not a module of the repository", args[0], a, d)
		}
	}
}

func (c *checker) goMod(page string, line int, args []string, w *where) {
	if len(args) == 0 || args[0] != "edit" {
		return
	}
	for i := 1; i < len(args); i++ {
		a := args[i]
		if a == "-replace" && i+1 < len(args) {
			i++
			a = "-replace=" + args[i]
		}
		spec, ok := strings.CutPrefix(a, "-replace=")
		if !ok {
			continue
		}
		mod, dir, ok := strings.Cut(spec, "=")
		if !ok {
			c.errorf(page, line, "go mod edit -replace %s: want module=directory", spec)
			continue
		}
		d, ok := w.repoDir(dir)
		if !ok {
			continue
		}
		if got := moduleOf(d); got != mod {
			c.errorf(page, line, "go mod edit -replace %s: %s holds module %q, not %q", spec, d, got, mod)
		}
	}
}

// testNames returns the names of the top-level functions of the test files
// of directory d.
func (c *checker) testNames(d string) []string {
	if names, ok := c.tests[d]; ok {
		return names
	}
	var names []string
	fset := token.NewFileSet()
	files, _ := filepath.Glob(filepath.Join(root, filepath.FromSlash(d), "*_test.go"))
	for _, f := range files {
		af, err := parser.ParseFile(fset, f, nil, parser.SkipObjectResolution)
		if err != nil {
			c.t.Fatalf("%s: %v", f, err)
		}
		for _, decl := range af.Decls {
			if fn, ok := decl.(*ast.FuncDecl); ok && fn.Recv == nil {
				names = append(names, fn.Name.Name)
			}
		}
	}
	c.tests[d] = names
	return names
}

func hasAnyPrefix(s string, prefixes []string) bool {
	return slices.ContainsFunc(prefixes, func(p string) bool { return strings.HasPrefix(s, p) })
}

// splitCommands splits a command line at &&, ||, ;, | and &, outside quotes.
func splitCommands(line string) []string {
	var out []string
	var cur strings.Builder
	var quote rune
	rs := []rune(line)
	for i := 0; i < len(rs); i++ {
		r := rs[i]
		switch {
		case quote != 0:
			if r == quote {
				quote = 0
			}
			cur.WriteRune(r)
		case r == '\'' || r == '"':
			quote = r
			cur.WriteRune(r)
		case r == ';' || r == '|' || r == '&':
			if i+1 < len(rs) && rs[i+1] == r {
				i++
			}
			out = append(out, cur.String())
			cur.Reset()
		default:
			cur.WriteRune(r)
		}
	}
	return append(out, cur.String())
}

// stripComment drops a shell comment: a # that starts a word, outside
// quotes.
func stripComment(line string) string {
	var quote rune
	prev := ' '
	for i, r := range line {
		switch {
		case quote != 0:
			if r == quote {
				quote = 0
			}
		case r == '\'' || r == '"':
			quote = r
		case r == '#' && unicode.IsSpace(prev):
			return line[:i]
		}
		prev = r
	}
	return line
}

// shellWords splits a simple command into words, removing quotes.
func shellWords(cmd string) []string {
	var words []string
	var cur strings.Builder
	var quote rune
	in := false
	for _, r := range cmd {
		switch {
		case quote != 0:
			if r == quote {
				quote = 0
			} else {
				cur.WriteRune(r)
			}
		case r == '\'' || r == '"':
			quote, in = r, true
		case unicode.IsSpace(r):
			if in {
				words = append(words, cur.String())
				cur.Reset()
				in = false
			}
		default:
			cur.WriteRune(r)
			in = true
		}
	}
	if in {
		words = append(words, cur.String())
	}
	return words
}

func isDir(d string) bool {
	st, err := os.Stat(filepath.Join(root, filepath.FromSlash(d)))
	return err == nil && st.IsDir()
}

func isFile(f string) bool {
	st, err := os.Stat(filepath.Join(root, filepath.FromSlash(f)))
	return err == nil && !st.IsDir()
}

// goFiles returns the contents of the Go files of directory d: its test
// files when tests is set, else the others.
func goFiles(d string, tests bool) []string {
	files, _ := filepath.Glob(filepath.Join(root, filepath.FromSlash(d), "*.go"))
	var out []string
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") != tests {
			continue
		}
		b, err := os.ReadFile(f)
		if err == nil {
			out = append(out, string(b))
		}
	}
	return out
}

var packageMainRe = regexp.MustCompile(`(?m)^package main\b`)

func isMain(d string) bool {
	return slices.ContainsFunc(goFiles(d, false), packageMainRe.MatchString)
}

var moduleRe = regexp.MustCompile(`(?m)^module\s+(\S+)`)

// moduleOf returns the module path that d/go.mod declares, or "".
func moduleOf(d string) string {
	b, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(d), "go.mod"))
	if err != nil {
		return ""
	}
	if m := moduleRe.FindSubmatch(b); m != nil {
		return string(m[1])
	}
	return ""
}
