package idem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// Fuzz targets. `go test` runs their seeds (f.Add and testdata/fuzz); run one
// for longer with -fuzztime as a count, for example:
//
//	go test -run '^$' -fuzz '^FuzzStoredValue$' -fuzztime 20000x .
//
// A fuzz run without -fuzztime never ends (docs/testing.md).

// FuzzParseCompleted: the Go side of reading a completed record never
// panics, and either answers ErrCorrupt or a reply whose value is the tail of
// the record.
//
// Fuzz it with -fuzztime as a count (-fuzztime 50000x): without a bound
// it never ends.
func FuzzParseCompleted(f *testing.F) {
	for _, s := range []string{
		"i1C1:1:0:0::AAAA:\x01bpayload",
		"i1C1795988292094037:3:1:0:::\x01v\x81\xa1a\x01",
		"i1C",
		"i1C1:1:0:0::",
		"i1C-1:1:0:0:::x",
		"i1C99999999999999999999:1:0:0:::x",
		"i1P1:1:0:5:att:fp:",
		"",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, rec string) {
		r, err := parseCompleted(rec)
		if err != nil {
			require.ErrorIs(t, err, ErrCorrupt, "parseCompleted(%q)", rec)
			return
		}
		require.Equal(t, statusCompleted, r.Status, "parseCompleted(%q) = %+v", rec, r)
		require.True(t, strings.HasPrefix(rec, "i1C"), "parseCompleted(%q) = %+v: not a completed record", rec, r)
		require.True(t, strings.HasSuffix(rec, string(r.Value)), "parseCompleted(%q) = %+v: the value is not the tail of the record", rec, r)
	})
}

// FuzzOpenEnvelope: opening an envelope never panics; what opens seals back
// to the same bytes, and everything else is ErrCorrupt.
//
// Fuzz it with -fuzztime as a count (-fuzztime 50000x): without a bound
// it never ends.
func FuzzOpenEnvelope(f *testing.F) {
	for _, b := range [][]byte{
		seal(kindBytes, []byte("hello")), seal(kindValue, []byte{0x81, 0xa1, 'a', 1}), seal(kindError, []byte("boom")),
		{}, {envelopeV1}, {2, kindBytes}, {envelopeV1, 'x', 1}, {0xff, 0xff, 0xff},
	} {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		kind, body, err := open(b)
		if err != nil {
			require.ErrorIs(t, err, ErrCorrupt, "open(%x)", b)
			return
		}
		require.True(t, bytes.Equal(seal(kind, body), b), "open(%x) = %q %x, which seals to %x", b, kind, body, seal(kind, body))
	})
}

// FuzzValidateKey: ValidateKey accepts exactly the keys of 1 to MaxKeyLen
// bytes without control characters, and every key, valid or not, gets a
// record id of fixed length.
//
// Fuzz it with -fuzztime as a count (-fuzztime 50000x): without a bound
// it never ends.
func FuzzValidateKey(f *testing.F) {
	for _, k := range []string{"a", "order-42", "", strings.Repeat("k", MaxKeyLen), strings.Repeat("k", MaxKeyLen+1),
		"tab\there", "nl\n", "del\x7f", "ключ", "\xff\xfe", "\"quoted\""} {
		f.Add(k)
	}
	f.Fuzz(func(t *testing.T, key string) {
		want := len(key) >= 1 && len(key) <= MaxKeyLen
		for i := 0; i < len(key); i++ {
			if key[i] < 0x20 || key[i] == 0x7f {
				want = false
			}
		}
		err := ValidateKey(key)
		require.Equal(t, want, err == nil, "ValidateKey(%q) = %v, want valid=%v", key, err, want)
		if err != nil {
			require.ErrorIs(t, err, ErrInvalidKey, "ValidateKey(%q)", key)
		}
		id := recordID("scope", key)
		require.Len(t, id, idLen, "recordID of %q = %q", key, id)
		require.True(t, isBase64URL(id), "recordID of %q = %q: not base64url", key, id)
	})
}

// fuzzStore returns a redisStore on a miniredis that lives as long as f.
func fuzzStore(f *testing.F) (*redisStore, *redis.Client) {
	m := miniredis.RunT(f)
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	f.Cleanup(func() { c.Close() })
	s, err := openRedisStore(c, WithPrefix("fuzz:"))
	require.NoError(f, err)
	return s, c
}

// FuzzStoredValue puts arbitrary bytes where a record lives and runs every
// step of the store on it: nothing panics, every error is typed, a value that
// is not a record is never overwritten, and a claim that succeeds leaves a
// record that the next claim reads.
//
// Fuzz it with -fuzztime as a count (-fuzztime 2000x): without a bound it
// never ends, and after about 50 s it stalls at 0 execs/s while its
// miniredis grows about 100 MB a minute.
func FuzzStoredValue(f *testing.F) {
	for _, v := range []string{
		"i1C1:1:0:0:::\x01bok", "i1P5:1:0:99999999999999999:att:fp:", "i1R5:2:0:0:::",
		"i1C1:1:0:0::", "i1X1:1:0:0:::", "i2C1:1:0:0:::x", "i1C1:1:0:0:::\x02bnew", "i1C1:1:0:0:::\x01",
		"plain string", "", "i1", "i1P:::::::", "i1P1:1:2:0:::", "i1Pa:1:0:0:::",
		"i1P99999999999999999999:1:0:0:att:fp:", "i1R9223372036854775807:1:0:0:::", "i1R5:99999999999999999999:0:0:::",
	} {
		f.Add([]byte(v), int64(1))
	}
	s, c := fuzzStore(f)
	ctx := context.Background()
	var n atomic.Int64
	f.Fuzz(func(t *testing.T, value []byte, token int64) {
		id := recordID("fuzz", fmt.Sprint(n.Add(1)))
		key := s.key(id)
		require.NoError(t, c.Set(ctx, key, value, time.Minute).Err())
		typed := func(step string, err error) {
			if err != nil && !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrLeaseLost) {
				require.Failf(t, "untyped error", "%s on %q: %v", step, value, err)
			}
			if errors.Is(err, ErrCorrupt) {
				got, _ := c.Get(ctx, key).Bytes()
				require.True(t, bytes.Equal(got, value), "%s on %q overwrote it with %q", step, value, got)
			}
		}
		typed("Complete", errOf(s.Complete(ctx, id, token, []byte("x"), time.Minute)))
		typed("Release", s.Release(ctx, id, token, time.Minute))
		typed("Extend", s.Extend(ctx, id, token, time.Minute, time.Minute))
		before, _ := c.Get(ctx, key).Bytes()
		r, err := s.Claim(ctx, id, claimRequest{Fingerprint: "fp", Attempt: "att2", Lease: time.Minute, Keep: time.Minute})
		if err != nil {
			require.ErrorIs(t, err, ErrCorrupt, "Claim on %q: untyped error", value)
			got, _ := c.Get(ctx, key).Bytes()
			require.True(t, bytes.Equal(got, before), "Claim on %q overwrote it with %q", before, got)
			return
		}
		switch r.Status {
		case statusClaimed:
			again, err := s.Claim(ctx, id, claimRequest{Fingerprint: "fp", Attempt: "att2", Lease: time.Minute, Keep: time.Minute})
			require.NoError(t, err, "claim on %q then its retry: %+v then an error", before, r)
			require.Equal(t, statusClaimed, again.Status, "claim on %q then its retry: %+v then %+v", before, r, again)
			require.Equal(t, r.Token, again.Token, "claim on %q then its retry: %+v then %+v", before, r, again)
		case statusCompleted:
			if _, _, err := open(r.Value); err != nil {
				require.ErrorIs(t, err, ErrCorrupt, "open of the stored value of %q", before)
			}
		case statusInProgress, statusMismatch:
		default:
			require.Failf(t, "unknown status", "Claim on %q: status %d", before, r.Status)
		}
	})
}
