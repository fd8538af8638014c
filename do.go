package idem

import (
	"context"
	"errors"
	"fmt"
)

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
	out, err := k.beginCall(ctx, scope, key, opts, false)
	if err != nil {
		var zero T
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
	switch out.kind {
	case kindError, kindFinal:
		// Decoded here, not taken from out.Err: each caller gets an error
		// (and Details) of its own, whoever made the Outcome.
		var zero T
		final, err := openFinal(out.kind, out.Value)
		if err != nil {
			return zero, err
		}
		return zero, final
	}
	if out.shared && (!k.msgpack || isBytes[T]()) {
		// The result would be, or might be, a slice of Value: the caller
		// must own it. msgpackCodec copies what it decodes otherwise.
		out.own()
	}
	if out.kind == kindBytes {
		return replayBytes[T](k, out.Value)
	}
	v, err := openResult[T](k, out.Value)
	if err != nil {
		return v, fmt.Errorf("%w: decoding the stored result into %T: %w", ErrCorrupt, v, err)
	}
	return v, nil
}

// replayBytes is the result of Do for body, bytes that Claim.Complete stored:
// body itself when T is []byte, else body decoded by the Codec.
func replayBytes[T any](k *Keeper, body []byte) (T, error) {
	var v T
	if p, ok := any(&v).(*[]byte); ok {
		*p = body
		return v, nil
	}
	v, err := unmarshalResult[T](k.codec, body)
	if err != nil {
		return v, fmt.Errorf("%w: the result was stored by Claim.Complete, and the Codec cannot decode it into %T: %w", ErrCorrupt, v, err)
	}
	return v, nil
}

// isBytes reports whether T is []byte.
func isBytes[T any]() bool {
	_, ok := any((*T)(nil)).(*[]byte)
	return ok
}

func run[T any](ctx context.Context, k *Keeper, c *Claim, fn func(ctx context.Context) (T, error)) (v T, err error) {
	ka := c.keepAlive(ctx)
	if ka.lostErr() != nil {
		// The claim came back too late to hold the key: fn does not run.
		var zero T
		return zero, ka.stop()
	}
	finished := false
	defer func() {
		if finished {
			return
		}
		// fn panicked: give the key up, then panic again.
		ka.stop()
		cctx, cancel := cleanupContext(ctx)
		defer cancel()
		_ = c.Release(cctx)
	}()
	v, err = fn(&ka.op)
	finished = true
	if lost := ka.stop(); lost != nil {
		// Another attempt may hold the key now: store nothing, release nothing.
		var zero T
		return zero, errors.Join(lost, err)
	}
	cctx, cancel := cleanupContext(ctx)
	defer cancel()
	if err != nil {
		return v, settleError(cctx, k, c, err)
	}
	return v, settle(cctx, k, c, v)
}

// cleanupContext is the context of the store calls after fn returned: never
// cut short by the caller's cancellation, since the side effect happened.
// While the caller's context is live, the client's own timeouts bound the
// calls and no timer is needed; once it is done, cleanupTimeout does.
func cleanupContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if ctx.Err() == nil {
		return detach(ctx), func() {}
	}
	return context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
}

// detach returns ctx without its cancellation: ctx itself when it has
// neither (context.Background, for one), else context.WithoutCancel(ctx).
func detach(ctx context.Context) context.Context {
	if _, ok := ctx.Deadline(); !ok && ctx.Done() == nil {
		return ctx
	}
	return context.WithoutCancel(ctx)
}

// settle stores fn's value v under the claim and returns Do's error: the
// store's, or none. A value that cannot be encoded is stored as a Final
// error instead, so that a retry does not run fn again, and that error is
// returned.
func settle[T any](ctx context.Context, k *Keeper, c *Claim, v T) error {
	env, merr := sealResult(k, v)
	if merr != nil {
		return settleError(ctx, k, c, &FinalError{Err: fmt.Errorf("idem: encoding the result: %w", merr)})
	}
	return c.completeSealed(ctx, env, 0)
}

// settleError records fn's error err under the claim and returns Do's error:
//   - an error that is not Final releases the key, and is returned as is;
//   - a Final error is stored, for the error retention, and returned.
//
// A failure of the store is joined to err.
func settleError(ctx context.Context, k *Keeper, c *Claim, err error) error {
	var final *FinalError
	if !errors.As(err, &final) {
		return withStoreError(err, c.Release(ctx))
	}
	kind, body := sealFinal(final)
	return withStoreError(err, c.complete(ctx, kind, body, k.policy.errorRetention))
}

// withStoreError returns err as is, or joined with serr when the store failed.
func withStoreError(err, serr error) error {
	if serr == nil {
		return err
	}
	return errors.Join(err, serr)
}
