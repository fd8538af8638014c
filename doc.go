// Package idem runs each logical operation once, however often it is retried
// or redelivered, and answers every retry with the first result, on Redis.
//
// A Keeper claims a key (scope plus the client's idempotency key) with one Lua
// script: the first caller gets a Claim with a fencing token and runs the
// operation; callers while it runs get ErrInProgress; callers after it
// completed get the stored result in the same single round trip. Leases bound
// how long a crashed caller blocks its key, and fencing tokens make sure a
// caller that paused past its lease can never overwrite the next holder's work.
//
// Do is the generic entry point for any caller (queue consumers, webhook
// handlers); Keeper.Begin with Claim.Complete and Claim.Release is the
// lower-level form for callers that need the steps apart. Consume serves
// message consumers in one round trip per batch; Claim.Checkpoint records recovery points that an attempt which
// takes over an abandoned claim receives. An Observer (WithObserver) is told
// of every step. The HTTP middleware is package idemhttp.
//
// Redis replicates asynchronously: a failover can lose the newest claims and
// results, and a retry may then run an operation again: docs/durability.md in
// the repository says what each setting buys.
package idem
