// Package doccheck holds no code, only a test of the repository's Markdown:
// README.md is a front page of at most 300 lines, every relative link and
// anchor in README.md and docs/*.md resolves, and every command the pages
// show names something that exists (a make target, a command's directory and
// its flags, a package and the tests its -run or -bench pattern selects, a
// module of the checkout).
package doccheck
