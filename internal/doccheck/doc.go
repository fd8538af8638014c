// Package doccheck holds no code, only a test of the repository's Markdown:
// README.md is a front page of at most 300 lines, every relative link and
// anchor in README.md and docs/*.md resolves, and every command the pages
// show names something that exists (a make target, a command's directory and
// its flags, a package and the tests its -run or -bench pattern selects, a
// module of the checkout), and every default the prose spells (README.md,
// docs/*.md, the Go files' comments) is its constant's value: named beside
// it, or listed in the test (TestDefaultsSpelled).
package doccheck
