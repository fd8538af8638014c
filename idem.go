package idem

import (
	"context"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"
)

// Store keeps idempotency records. Every method is one atomic step; the Redis
// implementation (RedisStore) makes each one Lua script and one round trip.
//
// id is the record's fixed-length id, a digest of (scope, key) made by the
// Keeper; a Store never sees raw client keys. Tokens are the fencing tokens
// the Store handed out in Claim.
//
// Errors: ErrLeaseLost when the token is not the current holder's,
// ErrCorrupt when the value at the key is not a record, and anything else is
// read as the store being unavailable (ErrUnavailable).
type Store interface {
	// Claim claims the record for one attempt, or reports its state.
	Claim(ctx context.Context, id string, req ClaimRequest) (ClaimReply, error)
	// Complete stores value as the record's result, kept for keep, if token
	// is the current holder's. A retried Complete with the same token succeeds.
	Complete(ctx context.Context, id string, token int64, value []byte, keep time.Duration) error
	// Release gives the claim up, if token is the current holder's, so the
	// next claim runs the operation again; the token and attempt count are
	// remembered for keep. A retried Release with the same token succeeds.
	Release(ctx context.Context, id string, token int64, keep time.Duration) error
	// Extend renews the lease of token to lease from now, and keeps the
	// pending record for keep.
	Extend(ctx context.Context, id string, token int64, lease, keep time.Duration) error
}

// ClaimRequest is what a Store needs to claim a record.
type ClaimRequest struct {
	// Fingerprint is a digest of the request, in base64url; may be empty.
	// A record claimed with one fingerprint answers StatusMismatch to another.
	Fingerprint string
	// Attempt identifies this attempt, in base64url. A Claim that finds a
	// pending record with the same Attempt answers StatusClaimed with the same
	// token: the caller is retrying a command whose reply was lost.
	Attempt string
	// Lease is how long the claim may run without renewal.
	Lease time.Duration
	// Keep is how long a pending record is kept, at least Lease.
	Keep time.Duration
}

// ClaimStatus is what a Store's Claim found.
type ClaimStatus uint8

// The answers of Store.Claim.
const (
	// StatusClaimed: the caller holds the record and must run the operation.
	StatusClaimed ClaimStatus = iota + 1
	// StatusCompleted: the operation completed; Value holds its result.
	StatusCompleted
	// StatusInProgress: another attempt holds a live lease.
	StatusInProgress
	// StatusMismatch: the record was made for another fingerprint.
	StatusMismatch
)

// ClaimReply is the answer of Store.Claim.
type ClaimReply struct {
	Status ClaimStatus
	// Token is the fencing token of the claim (StatusClaimed) or of the claim
	// that completed the record (StatusCompleted); zero otherwise.
	Token int64
	// Attempt counts the claims of this record, this one included, for
	// StatusClaimed and StatusCompleted; zero otherwise.
	Attempt int
	// Recovered is true when the claim took over a lease that had run out:
	// an earlier attempt may have partly run.
	Recovered bool
	// LeaseLeft is the time left on the other attempt's lease
	// (StatusInProgress); zero otherwise.
	LeaseLeft time.Duration
	// Value is the stored result (StatusCompleted); nil otherwise.
	Value []byte
}

// Keeper runs each operation at most once per (scope, key) within the
// retention, and answers every later call with the first result. It is safe
// for concurrent use.
type Keeper struct {
	store  Store
	policy policy
	codec  Codec
	now    func() time.Time
	// flights holds the claims shared in this process (WithCoalescing);
	// nil when coalescing is off.
	flights *flights
}

// Option configures a Keeper.
type Option func(*config)

type config struct {
	policy   policy
	codec    Codec
	coalesce bool
}

// New returns a Keeper on store. Options and their defaults: WithLease (30s),
// WithRetention (24h), WithErrorRetention (the retention), WithCodec
// (MsgpackCodec), WithCoalescing (off). Invalid settings are refused with
// ErrInvalidConfig.
func New(store Store, opts ...Option) (*Keeper, error) {
	if store == nil {
		return nil, fmt.Errorf("%w: nil store", ErrInvalidConfig)
	}
	cfg := config{policy: defaultPolicy(), codec: MsgpackCodec{}}
	for _, o := range opts {
		o(&cfg)
	}
	if err := cfg.policy.validate(); err != nil {
		return nil, err
	}
	if cfg.codec == nil {
		return nil, fmt.Errorf("%w: nil codec", ErrInvalidConfig)
	}
	return &Keeper{store: store, policy: cfg.policy, codec: cfg.codec, now: time.Now, flights: newFlights(cfg.coalesce)}, nil
}

// Lease returns the lease a claim gets.
func (k *Keeper) Lease() time.Duration { return k.policy.lease }

// Retention returns how long completed results are kept.
func (k *Keeper) Retention() time.Duration { return k.policy.retention }

// ErrorRetention returns how long stored errors are kept.
func (k *Keeper) ErrorRetention() time.Duration { return k.policy.errorRetention }

// CallOption configures one call of Begin or Do.
type CallOption func(*call)

type call struct {
	fingerprint []byte
	wait        time.Duration
}

// Fingerprint binds the call to a digest of its request (for example a hash of
// the body). A later call with the same key and another fingerprint gets
// ErrMismatch instead of a replay. Default: none, and every call with the key
// matches every other call without one.
func Fingerprint(fp []byte) CallOption {
	return func(c *call) { c.fingerprint = fp }
}

// Wait makes a call that finds the operation in progress wait for its result,
// up to max and within the context, instead of returning ErrInProgress at
// once. If the other attempt releases its claim or loses its lease meanwhile,
// the waiting call claims the key and runs the operation itself. Default: 0,
// no waiting.
func Wait(max time.Duration) CallOption {
	return func(c *call) { c.wait = max }
}

// Outcome is the answer of Begin when the operation may not be refused: either
// the caller now holds a Claim and must run the operation, or the operation
// had completed and Value holds its stored result.
type Outcome struct {
	// Claim is set when the caller holds the key: run the operation, then
	// Complete or Release the claim.
	Claim *Claim
	// Replayed is true when the operation had completed; Claim is nil then.
	Replayed bool
	// Value is the stored result when Replayed: the bytes given to
	// Claim.Complete, or, for a result stored by Do, its encoding by the
	// Keeper's Codec, or the message of a final error (see Err).
	Value []byte
	// Err is set when Replayed and the stored result is a final error that
	// Do stored (Final): a *FinalError whose Replayed is true, its message
	// also in Value. Nil otherwise.
	Err error
	// Token is the fencing token of the claim that produced the stored result
	// when Replayed, or of Claim.
	Token int64

	kind byte // envelope kind of Value
}

// Begin claims (scope, key) for one run of an operation, in one round trip.
// It returns an Outcome holding either a Claim or the stored result, or one of
// these errors: ErrInvalidKey (the store was not touched), an *InProgressError
// (another attempt holds the key; see Wait), ErrMismatch (the key was used with
// another Fingerprint), ErrCorrupt, ErrUnavailable, or, when ctx ends before
// the store answers, an error for which errors.Is(err, context.Canceled) (or
// context.DeadlineExceeded) reports true and errors.Is(err, ErrUnavailable)
// does not: the caller's own cancellation is never reported as the store's
// failure.
func (k *Keeper) Begin(ctx context.Context, scope, key string, opts ...CallOption) (Outcome, error) {
	if err := ValidateKey(key); err != nil {
		return Outcome{}, err
	}
	if ctx.Err() != nil {
		return Outcome{}, canceled(ctx, "claim")
	}
	var c call
	if len(opts) > 0 {
		c = callOptions(opts) // apart, so that c is on the heap only with options
	}
	return k.begin(ctx, recordID(scope, key), &c)
}

func callOptions(opts []CallOption) call {
	var c call
	for _, o := range opts {
		o(&c)
	}
	return c
}

func (k *Keeper) begin(ctx context.Context, id string, c *call) (Outcome, error) {
	req := ClaimRequest{
		Fingerprint: fingerprintDigest(c.fingerprint),
		Attempt:     newAttemptID(),
		Lease:       k.policy.lease,
		Keep:        k.policy.pendingKeep(),
	}
	var deadline time.Time
	if c.wait > 0 {
		deadline = k.now().Add(c.wait)
	}
	backoff := 5 * time.Millisecond
	for {
		out, err := k.claimShared(ctx, id, req, deadline)
		if c.wait <= 0 || err == nil {
			return out, err
		}
		var ip *InProgressError // declared here: its address escapes
		if !errors.As(err, &ip) {
			return out, err
		}
		left := deadline.Sub(k.now())
		if left <= 0 {
			return out, err
		}
		sleep := min(backoff, ip.RetryAfter, left)
		backoff = min(2*backoff, 250*time.Millisecond)
		t := time.NewTimer(sleep)
		select {
		case <-ctx.Done():
			t.Stop()
			return Outcome{}, canceled(ctx, "waiting for the attempt in progress")
		case <-t.C:
		}
	}
}

func (k *Keeper) claim(ctx context.Context, id string, req ClaimRequest) (Outcome, error) {
	started := k.now()
	r, err := k.store.Claim(ctx, id, req)
	if err != nil {
		return Outcome{}, storeError(ctx, "claim", err)
	}
	switch r.Status {
	case StatusClaimed:
		cl := &Claim{
			k: k, id: id, token: r.Token, attempt: r.Attempt, recovered: r.Recovered,
			leaseEnd: started.Add(k.policy.lease),
		}
		return Outcome{Claim: cl, Token: r.Token}, nil
	case StatusCompleted:
		kind, body, err := open(r.Value)
		if err != nil {
			return Outcome{}, err
		}
		out := Outcome{Replayed: true, Value: body, Token: r.Token, kind: kind}
		if kind == kindError {
			out.Err = &FinalError{Err: errors.New(string(body)), Replayed: true}
		}
		return out, nil
	case StatusInProgress:
		return Outcome{}, &InProgressError{RetryAfter: max(r.LeaseLeft, time.Millisecond)}
	case StatusMismatch:
		return Outcome{}, ErrMismatch
	}
	return Outcome{}, fmt.Errorf("%w: claim status %d unknown", ErrCorrupt, r.Status)
}

// newAttemptID returns 64 random bits in base64url.
func newAttemptID() string {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], rand.Uint64())
	return base64.RawURLEncoding.EncodeToString(b[:])
}

// Claim is the right to run one operation, held until Complete or Release, or
// until the lease runs out and another attempt takes it over. A Claim is safe
// for concurrent use.
type Claim struct {
	k         *Keeper
	id        string
	token     int64
	attempt   int
	recovered bool

	mu sync.Mutex
	// leaseEnd is when the lease runs out by this process's clock, measured
	// from before the request that last set it was sent, so it is never later
	// than Redis's view.
	leaseEnd time.Time
}

// Token returns the fencing token: it strictly increases every time the key
// is claimed again and is never handed out twice for a key. Pass it on to
// downstream writes so that they can refuse a stale holder.
func (c *Claim) Token() int64 { return c.token }

// Attempt returns how many times the key has been claimed, this claim
// included; 1 for the first.
func (c *Claim) Attempt() int { return c.attempt }

// Recovered reports whether this claim took over a lease that had run out: an
// earlier attempt may have partly run, so reconcile before acting again.
func (c *Claim) Recovered() bool { return c.recovered }

// Complete stores value as the operation's result, replayed to every later
// Begin with the key for retention (zero or less means the Keeper's
// retention; more than MaxDuration is refused with ErrInvalidConfig, nothing
// written). It returns ErrLeaseLost if the claim is no longer the holder;
// nothing is written then.
func (c *Claim) Complete(ctx context.Context, value []byte, retention time.Duration) error {
	return c.complete(ctx, kindBytes, value, retention)
}

func (c *Claim) complete(ctx context.Context, kind byte, body []byte, retention time.Duration) error {
	if retention <= 0 {
		retention = c.k.policy.retention
	}
	if retention > MaxDuration {
		return fmt.Errorf("%w: retention %s is longer than MaxDuration", ErrInvalidConfig, retention)
	}
	err := storeError(ctx, "complete", c.k.store.Complete(ctx, c.id, c.token, seal(kind, body), retention))
	c.endHold(kind, body, err)
	return err
}

// Release gives the claim up so that the next Begin with the key runs the
// operation again, with a higher token. It returns ErrLeaseLost if the claim
// is no longer the holder.
func (c *Claim) Release(ctx context.Context) error {
	err := storeError(ctx, "release", c.k.store.Release(ctx, c.id, c.token, c.k.policy.tombstoneTTL()))
	c.endHold(0, nil, err)
	return err
}

// Extend renews the lease for the Keeper's lease from now. It returns
// ErrLeaseLost if the claim is no longer the holder.
func (c *Claim) Extend(ctx context.Context) error {
	started := c.k.now()
	err := c.k.store.Extend(ctx, c.id, c.token, c.k.policy.lease, c.k.policy.pendingKeep())
	if err != nil {
		err = storeError(ctx, "extend", err)
		if errors.Is(err, ErrLeaseLost) {
			c.endHold(0, nil, err)
		}
		return err
	}
	c.mu.Lock()
	if end := started.Add(c.k.policy.lease); end.After(c.leaseEnd) {
		c.leaseEnd = end
	}
	c.mu.Unlock()
	return nil
}

// endHold ends the in-process hold of the claim (WithCoalescing) once the
// claim is settled or known lost: callers waiting in the process get body
// (of kind) as a replay when the completion stored it, or claim the key
// through the store otherwise. It does nothing without coalescing, and for a
// hold already ended.
func (c *Claim) endHold(kind byte, body []byte, err error) {
	if c.k.flights != nil {
		c.k.flights.finish(c, kind, body, err)
	}
}

// KeepAlive renews the lease in the background every third of the lease
// until stop is called, and returns a context derived from ctx for the
// operation.
//
// Renewals go on until stop, whatever happens to ctx: a caller that gives up
// (a client timeout) does not end an operation that goes on, so its lease
// must not end either, or a retry would take the key over and run the
// operation a second time while the first still runs. The operation's
// context still carries ctx's cancellation, for the operation to honour if
// it can.
//
// The operation's context is also cancelled, with a cause wrapping
// ErrLeaseLost, when the store says the claim is no longer the holder, or
// when the lease runs out because no renewal got through. stop ends the
// renewals and returns once they have ended; it returns that cause if the
// lease was lost, else nil. Call stop exactly when the operation has
// returned; until then the key stays held, for as long as the process lives.
func (c *Claim) KeepAlive(ctx context.Context) (_ context.Context, stop func() error) {
	opCtx, cancel := context.WithCancelCause(ctx)
	ka := &keepAlive{
		c:      c,
		ctx:    context.WithoutCancel(ctx),
		cancel: cancel,
		every:  max(c.k.policy.lease/3, time.Millisecond),
	}
	// A timer, not a goroutine: an operation shorter than a third of the
	// lease (most of them) costs no goroutine and no renewal.
	ka.mu.Lock()
	ka.t = time.AfterFunc(ka.every, ka.renew)
	ka.mu.Unlock()
	return opCtx, ka.stop
}

// keepAlive is the state of one KeepAlive.
type keepAlive struct {
	c *Claim
	// ctx carries the values of the caller's context but not its
	// cancellation: renewals outlive the caller.
	ctx    context.Context
	cancel context.CancelCauseFunc
	every  time.Duration

	once sync.Once
	mu   sync.Mutex
	// t fires the next renewal; stopped is set by stop, after which t is not
	// reset; lost is the cause the operation's context was cancelled with.
	t       *time.Timer
	stopped bool
	lost    error
	// running counts the renewals under way, which stop waits for.
	running sync.WaitGroup
}

// renew runs on the timer: one renewal, then the timer is set again unless
// the lease was lost or stop was called.
func (ka *keepAlive) renew() {
	ka.mu.Lock()
	if ka.stopped {
		ka.mu.Unlock()
		return
	}
	ka.running.Add(1)
	ka.mu.Unlock()
	defer ka.running.Done()

	lost := ka.c.renewal(ka.ctx)
	ka.mu.Lock()
	defer ka.mu.Unlock()
	switch {
	case lost != nil:
		ka.lost = lost
		ka.cancel(lost)
	case !ka.stopped:
		ka.t.Reset(ka.every)
	}
}

// stop ends the renewals, waits for one under way, and returns the cause of
// a lost lease, or nil.
func (ka *keepAlive) stop() error {
	ka.once.Do(func() {
		ka.mu.Lock()
		ka.stopped = true
		ka.t.Stop()
		ka.mu.Unlock()
		ka.running.Wait()
		ka.cancel(nil)
	})
	ka.mu.Lock()
	defer ka.mu.Unlock()
	return ka.lost
}

// renewal extends the lease once, and returns an error wrapping ErrLeaseLost
// if the claim is no longer the holder: the store says so, or the renewal
// failed and the lease has run out by this process's clock.
func (c *Claim) renewal(ctx context.Context) error {
	err := c.Extend(ctx)
	if err == nil {
		return nil
	}
	if errors.Is(err, ErrLeaseLost) {
		return fmt.Errorf("%w: %w", ErrLeaseLost, errors.New("the claim was taken over, released or expired"))
	}
	c.mu.Lock()
	end := c.leaseEnd
	c.mu.Unlock()
	if c.k.now().Before(end) {
		return nil // the next renewal may get through in time
	}
	lost := fmt.Errorf("%w: the lease ran out without renewal: %w", ErrLeaseLost, err)
	c.endHold(0, nil, lost)
	return lost
}

type claimKey struct{}

// ClaimFromContext returns the Claim that Do or the HTTP middleware put in
// the context of the operation or handler it runs, and whether there is one.
func ClaimFromContext(ctx context.Context) (*Claim, bool) {
	c, ok := ctx.Value(claimKey{}).(*Claim)
	return c, ok
}

// ContextWithClaim returns a copy of ctx that carries c, for
// ClaimFromContext.
func ContextWithClaim(ctx context.Context, c *Claim) context.Context {
	return context.WithValue(ctx, claimKey{}, c)
}
