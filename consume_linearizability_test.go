package idem

// Linearizability histories of the batch calls and Consume: every store call
// a Keeper makes for BeginBatch (compact claims and records), CompleteBatch,
// ReleaseBatch, ExtendBatch, the steps of a Claim of a batch and Consume is
// cut into one operation per record (a batch step is atomic per record, not
// across records, so each record's history is checked on its own: the
// model of TestLinearizability, whose promises hold per key), through a
// fault proxy that drops replies after Redis ran the command, cuts
// connections, and delays replies past the client's read timeout, so that
// go-redis sends scripts again.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/idemkit/idem/internal/faultproxy"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// batchLinRecorder is a store that passes every call on and records, for
// each record the call names, an operation of that record's history.
type batchLinRecorder struct {
	cfStore
	base time.Time
	mu   sync.Mutex
	ops  map[string][]porcupine.Operation // by record id
}

func newBatchLinRecorder(s cfStore) *batchLinRecorder {
	return &batchLinRecorder{cfStore: s, base: time.Now(), ops: map[string][]porcupine.Operation{}}
}

func (r *batchLinRecorder) since() int64 { return time.Since(r.base).Nanoseconds() }

// add records in id's history a call made at call that answered out and err
// (see linOperation).
func (r *batchLinRecorder) add(ctx context.Context, id string, in linInput, call int64, out linOutput, err error) {
	op := linOperation(ctx, in, call, r.since(), out, err)
	r.mu.Lock()
	r.ops[id] = append(r.ops[id], op)
	r.mu.Unlock()
}

func claimOutput(rep claimReply) linOutput {
	return linOutput{status: rep.Status, token: rep.Token, attempt: rep.Attempt, recovered: rep.Recovered, value: string(rep.Value)}
}

func (r *batchLinRecorder) Claim(ctx context.Context, id string, req claimRequest) (claimReply, error) {
	call := r.since()
	rep, err := r.cfStore.Claim(ctx, id, req)
	r.add(ctx, id, linInput{kind: linClaim, fp: req.Fingerprint, attempt: req.Attempt}, call, claimOutput(rep), err)
	return rep, err
}

func (r *batchLinRecorder) Complete(ctx context.Context, id string, token int64, value []byte, keep time.Duration) (bool, error) {
	call := r.since()
	stored, err := r.cfStore.Complete(ctx, id, token, value, keep)
	r.add(ctx, id, linInput{kind: linComplete, token: token, value: linValue(value)}, call, linOutput{}, err)
	return stored, err
}

func (r *batchLinRecorder) Release(ctx context.Context, id string, token int64, keep time.Duration) error {
	call := r.since()
	err := r.cfStore.Release(ctx, id, token, keep)
	r.add(ctx, id, linInput{kind: linRelease, token: token}, call, linOutput{}, err)
	return err
}

func (r *batchLinRecorder) Extend(ctx context.Context, id string, token int64, lease, keep time.Duration) error {
	call := r.since()
	err := r.cfStore.Extend(ctx, id, token, lease, keep)
	r.add(ctx, id, linInput{kind: linExtend, token: token}, call, linOutput{}, err)
	return err
}

func (r *batchLinRecorder) ClaimBatch(ctx context.Context, req batchClaimRequest) []batchClaimReply {
	call := r.since()
	out := r.cfStore.ClaimBatch(ctx, req)
	for j, id := range req.IDs {
		in := linInput{kind: linClaim, attempt: req.Attempt}
		if req.Fingerprints != nil {
			in.fp = req.Fingerprints[j]
		}
		r.add(ctx, id, in, call, claimOutput(out[j].Reply), out[j].Err)
	}
	return out
}

func (r *batchLinRecorder) SettleBatch(ctx context.Context, items []batchCompletion, release []claimFence, keep time.Duration) (done, given []error) {
	call := r.since()
	done, given = r.cfStore.SettleBatch(ctx, items, release, keep)
	for j, it := range items {
		r.add(ctx, it.ID, linInput{kind: linComplete, token: it.Token, value: linValue(it.Value)}, call, linOutput{}, done[j])
	}
	for j, f := range release {
		r.add(ctx, f.ID, linInput{kind: linRelease, token: f.Token}, call, linOutput{}, given[j])
	}
	return done, given
}

func (r *batchLinRecorder) ExtendBatch(ctx context.Context, claims []claimFence, lease, keep time.Duration) []error {
	call := r.since()
	errs := r.cfStore.ExtendBatch(ctx, claims, lease, keep)
	for j, f := range claims {
		r.add(ctx, f.ID, linInput{kind: linExtend, token: f.Token}, call, linOutput{}, errs[j])
	}
	return errs
}

func (r *batchLinRecorder) histories() map[string][]porcupine.Operation {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[string][]porcupine.Operation, len(r.ops))
	for id, ops := range r.ops {
		out[id] = slices.Clone(ops)
	}
	return out
}

// TestLinearizabilityBatches records histories of BeginBatch (with and
// without compact claims), CompleteBatch (with an empty result, which a
// compact claim keeps as a marker, and with a value), ReleaseBatch,
// ExtendBatch, the single steps of a Claim of a batch, Consume (whose
// handlers succeed, fail, or fail for good), and Begin and Do, which claim
// one key by the single scripts among the batches, from three clients on three
// keys at once, with markers on, and WithoutMarkers; through a fault proxy
// that drops replies, cuts connections and delays replies past the read
// timeout. Each key's history is checked with porcupine against the model of
// a record: a key is held by one claim at a time, tokens are fresh, a
// completion by a stale token is refused, a replay is of the value stored
// by the holder, and a retried step answers as its first run did.
func TestLinearizabilityBatches(t *testing.T) {
	markerModes(t, func(t *testing.T, opts ...Option) {
		histories := 60
		if len(opts) > 0 {
			histories = 30 // the record path, which TestLinearizability covers already
		}
		srv := redistest.Start(t)
		p := newFaultProxy(t, srv.Addr, 45+uint64(len(opts)))
		p.Set(faultproxy.Faults{DropReply: 0.04, Cut: 0.02, Delay: 300 * time.Millisecond, Slow: 0.01})
		c := redis.NewClient(&redis.Options{
			Addr: p.Addr(), ReadTimeout: 100 * time.Millisecond, WriteTimeout: 100 * time.Millisecond,
			MaxRetries: 3, MinRetryBackoff: time.Millisecond, MaxRetryBackoff: 4 * time.Millisecond, PoolSize: 32,
		})
		t.Cleanup(func() { c.Close() })
		rs, err := openRedisStore(c, append(slices.Clone(opts), WithPrefix("linb:"))...)
		require.NoError(t, err)
		var tally linTally
		var mu sync.Mutex
		answers := map[string]int{}
		for h := 0; h < histories; h++ {
			rec := newBatchLinRecorder(rs)
			k, err := keeperOn(rec, append(slices.Clone(opts), WithLease(time.Minute), WithRetention(time.Minute))...)
			require.NoError(t, err)
			scope := "h" + strconv.Itoa(h)
			keys := []string{"a", "b", "c"}
			var wg sync.WaitGroup
			for cl := 0; cl < 3; cl++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					r := rand.New(rand.NewPCG(uint64(h), uint64(cl)))
					ctx := context.WithValue(context.Background(), linClientKey{}, cl)
					note := func(step string, err error) {
						kind := cfKind(err)
						mu.Lock()
						answers[step+": "+kind]++
						mu.Unlock()
						if !typedErr(err, errFlaky) || errors.Is(err, ErrCorrupt) {
							assert.Failf(t, "violation", "history %d, client %d: %s answered %s: %v", h, cl, step, kind, err)
						}
					}
					held := map[string]*Claim{}
					someHeld := func() []*Claim {
						var out []*Claim
						for _, key := range keys {
							if c := held[key]; c != nil && r.IntN(3) > 0 {
								out = append(out, c)
							}
						}
						return out
					}
					for i := 0; i < 8; i++ {
						sub := slices.DeleteFunc(slices.Clone(keys), func(string) bool { return r.IntN(3) == 0 })
						if len(sub) == 0 {
							sub = keys[:1]
						}
						fps := make([][]byte, len(sub))
						for j := range fps {
							fps[j] = []byte("A")
							if r.IntN(12) == 0 {
								fps[j] = []byte("B")
							}
						}
						switch x := r.IntN(24); {
						case x < 6:
							bopts := []Option{WithFingerprints(fps)}
							if r.IntN(3) > 0 {
								bopts = append(bopts, withCompactClaims())
							}
							res, err := k.batchBegin(ctx, scope, sub, bopts...)
							if !assert.NoError(t, err) {
								return
							}
							for j, br := range res {
								note("BeginBatch", br.Err)
								if br.Err == nil && br.Outcome.Claim != nil {
									held[sub[j]] = br.Outcome.Claim
								}
							}
						case x < 9:
							var items []completion
							for _, c := range someHeld() {
								var v []byte
								if r.IntN(2) == 0 {
									v = []byte(fmt.Sprintf("c%d-%d", cl, i))
								}
								items = append(items, completion{Claim: c, Value: v})
							}
							for _, err := range k.completeClaims(ctx, items) {
								note("CompleteBatch", err)
							}
						case x < 11:
							for _, err := range k.releaseClaims(ctx, someHeld()) {
								note("ReleaseBatch", err)
							}
						case x < 13:
							for _, err := range k.extendClaims(ctx, someHeld()) {
								note("ExtendBatch", err)
							}
						case x < 15:
							if hs := someHeld(); len(hs) > 0 {
								var v []byte
								if r.IntN(2) == 0 {
									v = []byte(fmt.Sprintf("s%d-%d", cl, i))
								}
								note("Claim.Complete", hs[0].Complete(ctx, v, 0))
							}
						case x >= 22:
							// Do on a key a batch may hold or have settled:
							// one claim, one completion or release, by the
							// single scripts.
							v, fail := []byte(fmt.Sprintf("d%d-%d", cl, i)), r.IntN(3) == 0
							_, err := Do(ctx, k, scope, sub[0], func(context.Context) ([]byte, error) {
								if fail {
									return nil, errFlaky
								}
								return v, nil
							}, WithFingerprint(fps[0]))
							note("Do", err)
						case x >= 20:
							out, err := k.Begin(ctx, scope, sub[0], WithFingerprint(fps[0]))
							note("Begin", err)
							if err == nil && out.Claim != nil {
								held[sub[0]] = out.Claim
							}
						default:
							batch := make([]msg, len(sub))
							for j, key := range sub {
								batch[j] = msg{ID: key, Body: []string{"ok", "ok", "fail", "final"}[r.IntN(4)]}
							}
							res, err := Consume(ctx, k, scope, batch, msgID, func(ctx context.Context, m msg) error {
								switch m.Body {
								case "fail":
									return errFlaky
								case "final":
									return Final(errors.New("declined"))
								}
								return nil
							}, WithFingerprints(fps))
							if err != nil && !unreachableAnswer(res, err) {
								assert.NoError(t, err)
								return
							}
							for _, mr := range res {
								note("Consume "+mr.Status.String(), mr.Err)
							}
						}
					}
				}()
			}
			wg.Wait()
			for _, ops := range rec.histories() {
				tally.check(t, h, ops)
			}
		}
		t.Logf("answers: %s", sortedCounts(answers))
		tally.report(t, p)
	})
}

// linValue is the result a completion stores, as a replay answers it: a
// marker's empty result kept in a record (markerEnvelope) replays empty.
func linValue(env []byte) string {
	if _, ok := markerUntil(env); ok {
		return string(emptyBytes)
	}
	return string(env)
}
