package idem

import (
	"context"
	"errors"
	"fmt"
	"slices"
)

// Limits of the checkpoints of one claim; Checkpoint refuses more with an
// error wrapping ErrInvalidCheckpoint.
const (
	// MaxCheckpointName is the longest checkpoint name, in bytes.
	MaxCheckpointName = 64
	// MaxCheckpointValue is the longest checkpoint value, in bytes.
	MaxCheckpointValue = 1024
	// MaxCheckpoints is how many checkpoints, by distinct name, one record
	// holds.
	MaxCheckpoints = 16
)

// ErrInvalidCheckpoint reports a checkpoint refused before it was written: an
// empty name, a name or value over its limit, or one name more than
// MaxCheckpoints.
var ErrInvalidCheckpoint = errors.New("idem: invalid checkpoint")

// recoveryPoint is a checkpoint: a step of an operation that has happened,
// named, with a small value (an id the step produced, say).
type recoveryPoint struct {
	// Name names the step: 1 to MaxCheckpointName bytes, any bytes.
	Name string
	// Value is what the step left to remember, at most MaxCheckpointValue
	// bytes; may be empty.
	Value []byte
}

// Checkpoint records that the claim's operation passed the step name, with a
// small value, in the record, in one round trip. It is written under the
// claim's fence: a claim that is no longer the holder gets ErrLeaseLost and
// nothing is written. Recording a name again replaces its value, and makes it
// the last.
//
// The checkpoints are handed to the next claim of the key when this one is
// abandoned (its lease runs out: the next claim is Recovered) or released, so
// that the next attempt continues after the last step done instead of doing
// it again; they are dropped when the claim completes. So record a checkpoint
// right after each step whose side effect must not happen twice (a charge, a
// shipment), and before the next one. A step whose effect happened but whose
// checkpoint was not recorded (the process died in between) is not known to
// the next attempt: make that step idempotent, or reconcile it.
//
// A released record that holds checkpoints keeps them, and its fingerprint,
// for as long as a pending one: the next claim with the same fingerprint
// continues from them, one with another is answered ErrMismatch.
//
// The name must be 1 to MaxCheckpointName bytes, the value at most
// MaxCheckpointValue bytes, and a record holds at most MaxCheckpoints names;
// anything else is refused with ErrInvalidCheckpoint, nothing written.
// Other errors are those of Extend. Record the checkpoints of one claim one
// after another, not concurrently.
func (c *Claim) Checkpoint(ctx context.Context, name string, value []byte) error {
	if c == nil {
		return errNoClaim("checkpoint")
	}
	started := c.k.startStep()
	err := c.checkpoint(ctx, name, value)
	c.report(ctx, StepCheckpoint, started, err)
	return err
}

// checkpoint records one checkpoint; see Checkpoint.
func (c *Claim) checkpoint(ctx context.Context, name string, value []byte) error {
	if err := c.checkCheckpoint(name, value); err != nil {
		return err
	}
	if ctx.Err() != nil {
		return canceled(ctx, "checkpoint")
	}
	// A compact claim's first checkpoint moves it to a record of its own,
	// kept as Extend keeps one, in the same round trip.
	f := c.fence()
	err := storeError(ctx, "checkpoint", c.k.store.Checkpoint(ctx, f, name, value, c.lease+c.k.policy.retention))
	if err == nil && f.Ref > 0 {
		c.mu.Lock()
		c.ref = 0
		c.mu.Unlock()
	}
	switch {
	case errors.Is(err, ErrLeaseLost):
		c.endHold(0, nil, err)
		return err
	case err != nil:
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.checkpoints = append(withoutCheckpoint(c.checkpoints, name), recoveryPoint{Name: name, Value: slices.Clone(value)})
	return nil
}

// checkCheckpoint refuses a checkpoint over the limits.
func (c *Claim) checkCheckpoint(name string, value []byte) error {
	switch {
	case name == "":
		return fmt.Errorf("%w: empty name", ErrInvalidCheckpoint)
	case len(name) > MaxCheckpointName:
		return fmt.Errorf("%w: name of %d bytes, longer than %d", ErrInvalidCheckpoint, len(name), MaxCheckpointName)
	case len(value) > MaxCheckpointValue:
		return fmt.Errorf("%w: value of %d bytes, longer than %d", ErrInvalidCheckpoint, len(value), MaxCheckpointValue)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(withoutCheckpoint(c.checkpoints, name)) >= MaxCheckpoints {
		return fmt.Errorf("%w: the record holds %d checkpoints, the most it may", ErrInvalidCheckpoint, MaxCheckpoints)
	}
	return nil
}

// allCheckpoints returns the record's recovery points, oldest first: those an
// earlier attempt recorded (when this claim took the key over, Recovered, or
// after a release), then those this claim recorded. Empty for a fresh key.
// The slice is the caller's; the values must not be changed. Nil for a nil
// Claim.
func (c *Claim) allCheckpoints() []recoveryPoint {
	if c == nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.checkpoints)
}

// Checkpointed returns the value of the checkpoint name and true, if the
// record holds one; nil and false otherwise, and for a
// nil Claim.
func (c *Claim) Checkpointed(name string) ([]byte, bool) {
	if c == nil {
		return nil, false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, cp := range c.checkpoints {
		if cp.Name == name {
			return cp.Value, true
		}
	}
	return nil, false
}

// withoutCheckpoint returns cps without the checkpoint name, in a new slice.
func withoutCheckpoint(cps []recoveryPoint, name string) []recoveryPoint {
	out := make([]recoveryPoint, 0, len(cps)+1)
	for _, cp := range cps {
		if cp.Name != name {
			out = append(out, cp)
		}
	}
	return out
}
