package idem

import (
	"context"
	"errors"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The upgrade rule: readers ship before writers. A format is written only
// once a release whose readers read it has shipped, so that the processes of
// a rolling upgrade, old and new, read each other's keys. shippedFormats are
// what the readers of the last release read, frozen as grammars here and
// changed only when a release ships: every value the writers of this tree
// leave in Redis must parse under one of them. A writer that adds a field, a
// state, a kind or a key of a new shape fails TestWritersWriteWhatShippedReadersRead
// until a release with a reader of it has shipped, and its grammar is added
// then (format.go says each format in full; these grammars only what a
// reader needs to accept it).

// shippedFormat is one format the last release's readers read: the keys it
// is found at, and whether a value there parses.
type shippedFormat struct {
	name string
	// key tells a key of it, past the prefix.
	key   func(name string) bool
	typ   string                          // the Redis type at the key
	value func(field, value string) error // a string's value (field ""), or each field of a hash
}

var shippedFormats = []shippedFormat{
	{"prefix record", func(n string) bool { return n == "layout" }, "string", func(_, v string) error {
		// Fields after the shards are left for later versions.
		return matches(shippedPrefixRecord, v)
	}},
	{"record", func(n string) bool { return strings.HasPrefix(n, "{") && !v3Name(n, "i3", 0) && !v3Name(n, "c3:", 6) },
		"string", func(_, v string) error { _, err := shippedRecord(v); return err }},
	{"v3 index", func(n string) bool { return v3Name(n, "i3", 0) }, "hash", shippedIndexField},
	{"v3 call record", func(n string) bool { return v3Name(n, "c3:", 6) }, "string", func(_, v string) error { return shippedCallRecord(v) }},
}

// v3Name tells whether n is name followed by size bytes, after a hash tag
// or none.
func v3Name(n, name string, size int) bool {
	if tag, rest, ok := strings.Cut(n, "}"); ok && strings.HasPrefix(tag, "{") {
		n = rest
	}
	rest, ok := strings.CutPrefix(n, name)
	return ok && len(rest) == size
}

// The grammars of shippedFormats that are regular expressions.
var (
	shippedPrefixRecord = regexp.MustCompile(`^v3 shards=(0|[1-9][0-9]{0,4})( [^ =]+=[^ ]*)*$`)
	shippedShortHead    = regexp.MustCompile(`^[A-Za-z0-9_-]*:[0-9a-z]+:[0-9]+:[01]:`)
	shippedLongHead     = regexp.MustCompile(`^i1([PCR])[0-9]+:[0-9]+:[01]:[0-9]+:[A-Za-z0-9_-]*:[A-Za-z0-9_-]*:`)
)

func matches(re *regexp.Regexp, v string) error {
	if !re.MatchString(v) {
		return errors.New("does not match " + re.String())
	}
	return nil
}

// shippedRecord reads a record as format.go's two forms, and its rest:
// checkpoints (LEN ":" BYTES pairs) or a payload in an envelope of format
// 1 and a kind the readers know. form names what it read: the state, and a
// completed record's form and kind ("C:v": the short form, a value of Do).
func shippedRecord(v string) (form string, err error) {
	if rest, ok := strings.CutPrefix(v, "i1C:"); ok {
		m := shippedShortHead.FindString(rest)
		if m == "" {
			return "", errors.New("completed record's header")
		}
		return shippedPayload("C:", rest[len(m):])
	}
	m := shippedLongHead.FindStringSubmatch(v)
	if m == nil {
		return "", errors.New("record's header")
	}
	rest := v[len(m[0]):]
	if m[1] == "C" {
		return shippedPayload("C", rest)
	}
	for rest != "" {
		n, after, ok := strings.Cut(rest, ":")
		size, err := strconv.Atoi(n)
		if !ok || err != nil || size < 0 || size > len(after) {
			return "", errors.New("checkpoints")
		}
		rest = after[size:]
	}
	return m[1], nil
}

func shippedPayload(form, p string) (string, error) {
	if len(p) < 2 || p[0] != 1 || !strings.ContainsRune("bveEm", rune(p[1])) {
		return "", errors.New("payload envelope")
	}
	return form + p[1:2], nil
}

// shippedIndexField reads a field of a v3 index: its state (field "") or a
// block of 16-byte entries named by 3 bytes.
func shippedIndexField(field, v string) error {
	switch {
	case field == "":
		if len(v) != 32 || v[:2] != "v3" || v[2] > 24 {
			return errors.New("index state")
		}
	case len(field) != 3 || v == "" || len(v)%16 != 0:
		return errors.New("index block")
	}
	return nil
}

// shippedCallRecord reads a v3 call record: its 37-byte head and a state,
// an attempt and a fingerprint a place.
func shippedCallRecord(v string) error {
	if len(v) < 37 || v[:3] != "i3B" || v[35] > 64 || (v[36] != 0 && v[36] != 2) {
		return errors.New("call record's head")
	}
	place := 1 + int(v[36]) + int(v[35])
	n := (len(v) - 37) / place
	if n*place != len(v)-37 {
		return errors.New("call record's places")
	}
	for _, st := range v[37 : 37+n] {
		if !strings.ContainsRune("PCRXTMF", st) {
			return errors.New("call record's place state " + strconv.QuoteRune(st))
		}
	}
	return nil
}

// TestWritersWriteWhatShippedReadersRead drives every writer (Do's
// results and final errors, Begin's claims with checkpoints, releases and
// completions, compact claims of BeginBatch, Consume's markers, failures,
// final errors and checkpoints, Abandon and Forget), then reads every key
// they left: each must parse under a format of shippedFormats.
func TestWritersWriteWhatShippedReadersRead(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		ctx := context.Background()
		k := newKeeper(t, b)
		writeEveryFormat(t, ctx, k)

		seen, forms := map[string]bool{}, map[string]bool{}
		keys, err := b.Client.Keys(ctx, "*").Result()
		require.NoError(t, err)
		for _, key := range keys {
			name, ok := strings.CutPrefix(key, DefaultPrefix)
			require.True(t, ok, "a key outside the prefix: %q", key)
			typ, err := b.Client.Type(ctx, key).Result()
			require.NoError(t, err)
			fields := map[string]string{}
			switch typ {
			case "string":
				v, err := b.Client.Get(ctx, key).Result()
				require.NoError(t, err)
				fields[""] = v
			case "hash":
				fields, err = b.Client.HGetAll(ctx, key).Result()
				require.NoError(t, err)
			}
			format := ""
			for _, f := range shippedFormats {
				if f.key(name) && f.typ == typ {
					format = f.name
					for field, v := range fields {
						assert.NoError(t, f.value(field, v), "%s at %q (field %q): %q\nno reader of the last release reads it: ship the reader in a release first", f.name, key, field, v)
					}
					break
				}
			}
			assert.NotEmpty(t, format, "a %s at %q of no shipped format", typ, key)
			seen[format] = true
			if format == "record" {
				form, _ := shippedRecord(fields[""])
				forms[form] = true
			}
		}
		for _, f := range shippedFormats {
			assert.True(t, seen[f.name], "no %s written: the writers this test drives changed", f.name)
		}
		// The record's forms: pending, released, and completed with each
		// kind of payload (Do's value, a final error, one with a code,
		// Claim.Complete's bytes, a compact claim's empty result moved).
		for _, form := range []string{"P", "R", "C:v", "C:e", "C:E", "C:b", "C:m"} {
			assert.True(t, forms[form], "no record of form %s written: the writers this test drives changed", form)
		}
	})
}

// writeEveryFormat takes k through every step that writes to Redis.
func writeEveryFormat(t *testing.T, ctx context.Context, k *Keeper) {
	t.Helper()
	for _, key := range []string{"do-value", "do-kept"} {
		_, err := Do(ctx, k, "s", key, func(context.Context) (string, error) { return "v", nil })
		require.NoError(t, err)
	}
	_, err := Do(ctx, k, "s", "do-final", func(context.Context) (int, error) { return 0, Final(errors.New("no")) })
	require.Error(t, err)
	_, err = Do(ctx, k, "s", "do-code", func(context.Context) (int, error) {
		return 0, FinalCode(errors.New("no"), "declined", map[string]string{"why": "funds"})
	})
	require.Error(t, err)
	_, err = Do(ctx, k, "s", "do-failed", func(context.Context) (int, error) { return 0, errors.New("try again") })
	require.Error(t, err)

	begin := func(key string) *Claim {
		out, err := k.Begin(ctx, "s", key)
		require.NoError(t, err)
		require.NotNil(t, out.Claim, key)
		return out.Claim
	}
	c := begin("pending")
	require.NoError(t, c.Checkpoint(ctx, "step", []byte("one")))
	c = begin("released")
	require.NoError(t, c.Checkpoint(ctx, "step", []byte("one")))
	require.NoError(t, c.Release(ctx))
	require.NoError(t, begin("bytes").Complete(ctx, []byte("raw"), k.policy.retention))
	c = begin("abandoned")
	_, err = k.abandonKey(ctx, "s", "abandoned", c.Token())
	require.NoError(t, err)
	_, err = k.Forget(ctx, "s", "do-value", true)
	require.NoError(t, err)

	res, err := k.batchBegin(ctx, "b", []string{"m1", "m2", "m3", "m4"}, withCompactClaims())
	require.NoError(t, err)
	for _, r := range res {
		require.NoError(t, r.Err)
	}
	require.NoError(t, res[0].Outcome.Claim.Complete(ctx, nil, k.policy.retention))
	require.NoError(t, res[1].Outcome.Claim.Complete(ctx, []byte("value"), k.policy.retention))
	require.NoError(t, res[2].Outcome.Claim.Release(ctx))
	require.NoError(t, res[3].Outcome.Claim.Checkpoint(ctx, "step", []byte("one")))

	msgs := []string{"c1", "c2", "c3", "c4", "c5"}
	_, err = Consume(ctx, k, "c", msgs, func(m string) string { return m }, func(ctx context.Context, m string) error {
		switch m {
		case "c2":
			return errors.New("try again")
		case "c3":
			return Final(errors.New("no"))
		case "c4":
			c, _ := ClaimFromContext(ctx)
			return c.Checkpoint(ctx, "step", []byte("one"))
		}
		return nil
	})
	require.NoError(t, err)
	_, err = k.Forget(ctx, "c", "c1", true)
	require.NoError(t, err)
}
