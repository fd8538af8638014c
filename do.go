package idem

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// cleanupTimeout bounds how long Do spends storing or releasing a claim after
// the operation returned when the caller's context is done by then: the
// operation's side effect has happened, so its outcome is still recorded.
// While the caller's context is live, its deadline does not cut the store
// short either; the Redis client's own timeouts bound it.
const cleanupTimeout = 5 * time.Second

// Do runs fn at most once per (scope, key) within the Keeper's retention, and
// gives every later call the stored result, decoded into T by the Keeper's
// Codec.
//
//   - The first call claims the key (one round trip), runs fn, and stores its
//     result (a second round trip). fn's context carries the Claim
//     (ClaimFromContext) and is cancelled, with a cause wrapping ErrLeaseLost,
//     if the lease is lost; the result is then not stored.
//   - A later call gets the stored result in one round trip, without running fn.
//   - A call while another attempt runs gets an *InProgressError, or with Wait
//     waits for the result.
//   - fn's error releases the claim, so the next call runs fn again, and is
//     returned as is. An error wrapped with Final or FinalCode is stored
//     instead, and replayed as a *FinalError with its message, Code and
//     Details.
//   - A panic in fn releases the claim and panics again.
//
// A key may be completed by Do or by Begin and Claim.Complete, and read by
// either: Do hands a result stored by Claim.Complete over as is when T is
// []byte, and decodes it with the Keeper's Codec otherwise (ErrCorrupt when
// it cannot); Begin hands a result stored by Do over as its Codec encoding,
// and a final error as Outcome.Err.
//
// Other errors: ErrInvalidKey, ErrMismatch (see Fingerprint), ErrCorrupt,
// ErrUnavailable when the store cannot be reached, and the caller's own
// cancellation (errors.Is(err, context.Canceled) or DeadlineExceeded, never
// ErrUnavailable) when ctx ends before the claim is answered: fn does not
// run then. Once fn runs, the lease is renewed until fn returns, whatever
// happens to ctx: a caller that gives up does not let a retry run fn again
// while it still runs. fn's context carries ctx's cancellation. If fn
// succeeded but its result could not be stored, Do returns fn's value together
// with the store's error (ErrUnavailable or ErrLeaseLost): the operation ran,
// and a retry finds the key in progress until the lease runs out, then claims
// it with Claim.Recovered set.
func Do[T any](ctx context.Context, k *Keeper, scope, key string, fn func(ctx context.Context) (T, error), opts ...Option) (T, error) {
	var zero T
	out, err := k.Begin(ctx, scope, key, opts...)
	if err != nil {
		return zero, err
	}
	if out.Replayed {
		return replay[T](k, out)
	}
	return run(ctx, k, out.Claim, fn)
}

// replay decodes a stored result into T. A result that Claim.Complete stored
// (bytes, not a Codec's encoding) is handed over as is when T is []byte, and
// decoded by the Codec otherwise, so that the two ways of completing a key
// can share it.
func replay[T any](k *Keeper, out Outcome) (T, error) {
	var v T
	switch out.kind {
	case kindError, kindFinal:
		// Decoded here, not taken from out.Err: each caller gets an error
		// (and Details) of its own, whoever made the Outcome.
		final, err := openFinal(out.kind, out.Value)
		if err != nil {
			return v, err
		}
		return v, final
	case kindBytes:
		if p, ok := any(&v).(*[]byte); ok {
			*p = out.Value
			return v, nil
		}
		if err := k.codec.Unmarshal(out.Value, &v); err != nil {
			return v, fmt.Errorf("%w: the result was stored by Claim.Complete, and the Codec cannot decode it into %T: %w", ErrCorrupt, v, err)
		}
		return v, nil
	}
	if err := k.codec.Unmarshal(out.Value, &v); err != nil {
		return v, fmt.Errorf("%w: decoding the stored result into %T: %w", ErrCorrupt, v, err)
	}
	return v, nil
}

func run[T any](ctx context.Context, k *Keeper, c *Claim, fn func(ctx context.Context) (T, error)) (v T, err error) {
	opCtx, stop := c.KeepAlive(ContextWithClaim(ctx, c))
	if errors.Is(context.Cause(opCtx), ErrLeaseLost) {
		// The claim came back too late to hold the key: fn does not run.
		var zero T
		return zero, stop()
	}
	finished := false
	defer func() {
		if finished {
			return
		}
		// fn panicked: give the key up, then panic again.
		stop()
		cctx, cancel := cleanupContext(ctx)
		defer cancel()
		_ = c.Release(cctx)
	}()
	v, err = fn(opCtx)
	finished = true
	if lost := stop(); lost != nil {
		// Another attempt may hold the key now: store nothing, release nothing.
		var zero T
		return zero, errors.Join(lost, err)
	}
	cctx, cancel := cleanupContext(ctx)
	defer cancel()
	return v, settle(cctx, k, c, v, err)
}

// cleanupContext is the context of the store calls after fn returned: never
// cut short by the caller's cancellation, since the side effect happened.
// While the caller's context is live, the client's own timeouts bound the
// calls and no timer is needed; once it is done, cleanupTimeout does.
func cleanupContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if ctx.Err() == nil {
		return context.WithoutCancel(ctx), func() {}
	}
	return context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
}

// settle records fn's outcome under the claim and returns Do's error:
//   - an error that is not Final releases the key, and is returned as is;
//   - a Final error is stored, for the error retention, and returned;
//   - a value is encoded and stored; one that cannot be encoded is stored as
//     a Final error instead, so that a retry does not run fn again.
//
// A failure of the store is joined to fn's error.
func settle[T any](ctx context.Context, k *Keeper, c *Claim, v T, err error) error {
	var final *FinalError
	switch {
	case err != nil && !errors.As(err, &final):
		return withStoreError(err, c.Release(ctx))
	case err != nil:
		kind, body := sealFinal(final)
		return withStoreError(err, c.complete(ctx, kind, body, k.policy.errorRetention))
	}
	body, merr := k.codec.Marshal(v)
	if merr != nil {
		final = &FinalError{Err: fmt.Errorf("idem: encoding the result: %w", merr)}
		kind, body := sealFinal(final)
		return withStoreError(final, c.complete(ctx, kind, body, k.policy.errorRetention))
	}
	return c.complete(ctx, kindValue, body, 0)
}

// withStoreError returns err as is, or joined with serr when the store failed.
func withStoreError(err, serr error) error {
	if serr == nil {
		return err
	}
	return errors.Join(err, serr)
}
