// Package idemhttp makes unsafe HTTP requests idempotent with the
// Idempotency-Key header, on an idem.Keeper:
//
//	keeper, err := idem.NewRedis(client)
//	...
//	guard, err := idemhttp.New(keeper,
//		idemhttp.WithScope(func(r *http.Request) (string, error) { return accountID(r) }),
//	)
//	...
//	mux.Handle("POST /payments", guard(payments))
//
// The first request with a key runs the handler and stores its response;
// every retry with the key gets the stored response back, with
// Idempotent-Replayed: true; a retry while the first runs gets 409; the same
// key on another request gets 422. New documents every answer. In the
// handler, idem.ClaimFromContext gives the claim (its fencing token) and
// RequestKey the tenant and the key. WithKeyFunc reads the key of a webhook
// or an inbox (the sender's event id) instead; authenticate before the
// middleware, or in the key function, so that a refused request never holds
// its key (see WithKeyFunc).
//
// On the client side, Transport retries a request with one key:
//
//	client := &http.Client{Transport: &idemhttp.Transport{}}
package idemhttp
