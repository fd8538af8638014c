// Package idemwatermill runs each message of a watermill handler once per
// key, on an idem.Keeper, and answers every redelivery with the messages the
// first run produced:
//
//	keeper, err := idem.NewRedis(client) // lease 30s, retention 24h
//	...
//	once, err := idemwatermill.Middleware(keeper) // key: the message UUID
//	...
//	retry := middleware.Retry{MaxRetries: 3, InitialInterval: time.Second}
//	router.AddMiddleware(retry.Middleware, once) // once inside the retries
//	router.AddHandler("orders", "orders", sub, "shipments", pub, handle)
//
// It is built on idem.Do, the path that stores results: the first delivery
// of a key runs the handler and stores what it returned (each message's
// UUID, metadata and payload); a redelivery returns equal messages without
// running the handler, so the router publishes them again, even when the
// first run's publish failed or its process died before it. A handler error
// releases the key, so the redelivery runs the handler again.
//
// This differs from two other ways of dropping duplicates. An adapter built
// on idem.Consume stores only a marker: it acknowledges a redelivery without
// publishing what the first run produced, so a first run whose output was
// lost stays without output. watermill's own middleware.Deduplicator marks a
// message before its handler runs: a redelivery after a failed handler is
// dropped, and the message is never handled.
//
// The key is the message's UUID unless WithKeyFunc or WithMetadataKey says
// otherwise; the scope is the handler's name (WithScope); a key reused with
// another payload is refused (WithFingerprint). Middleware documents every
// answer; IsPermanent tells which errors belong in a poison queue.
package idemwatermill
