package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/idemkit/idem"
	"github.com/stretchr/testify/assert"
)

// Every JSON object idemctl prints is a line of its own, ended by a newline,
// so that a shell prompt or the next object never runs on after it.
func TestPrintJSONEndsWithANewline(t *testing.T) {
	for name, v := range map[string]any{
		"record":   toJSON(idem.Record{Key: "idem:{x}", State: idem.StateCompleted}),
		"absent":   toJSON(idem.Record{Key: "idem:{x}", State: idem.StateAbsent}),
		"unusable": func() {}, // json.Marshal fails: the error object is a line too
	} {
		var buf bytes.Buffer
		printJSON(&buf, v)
		out := buf.String()
		assert.True(t, strings.HasSuffix(out, "}\n"), "%s: %q", name, out)
		assert.Equal(t, 1, strings.Count(out, "\n"), "%s: one line: %q", name, out)
	}
}
