package idemkafka

// OnRelease sets f to be called each time r's rebalance callback has
// stopped the partitions revoked (lost false) or lost, before it waits for
// their handlers: a test that holds a handler lets it go from f's signal,
// not from a log line kgo writes before the callback runs.
func OnRelease(r *Runner, f func(lost bool)) { r.released = f }
