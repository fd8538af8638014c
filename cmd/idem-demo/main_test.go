package main

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// smallStorm is a storm quick enough for a test. Every payment is also sent
// with another amount and without a key, so those counts are exact.
func smallStorm() stormConfig {
	return stormConfig{
		Payments: 24, Copies: 3, Resends: 1, Clients: 4, Work: 4 * time.Millisecond,
		CutRate: 0.2, ChangeRate: 1, NoKeyRate: 1, Seed: 7,
	}
}

// guardedAPI serves the demo's API on miniredis.
func guardedAPI(t *testing.T, book *ledger, events *eventCounts) http.Handler {
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { c.Close() })
	k, err := newKeeper(c, events)
	require.NoError(t, err)
	api, err := newAPI(k, book, smallStorm().Work)
	require.NoError(t, err)
	return api
}

func TestStormChargesEachPaymentOnce(t *testing.T) {
	book, events := newLedger(), &eventCounts{}
	srv := httptest.NewServer(guardedAPI(t, book, events))
	defer srv.Close()
	cfg := smallStorm()
	rep, err := storm(context.Background(), srv.URL, cfg)
	require.NoError(t, err)
	v := check(rep, book)
	assert.True(t, v.ok(rep), "verdict %+v, unexpected %v", v, rep.Unexpected)
	assert.Equal(t, cfg.Payments, v.Charges)
	assert.Equal(t, cfg.Payments, v.Charged)
	assert.Empty(t, rep.Unexpected)
	assert.Zero(t, rep.Unanswered)
	assert.Equal(t, cfg.Payments, rep.Mismatches, "each changed amount: 422")
	assert.Equal(t, cfg.Payments, rep.MissingKey, "each request without a key: 400")
	assert.GreaterOrEqual(t, rep.Replays, cfg.Payments, "each resend is a replay")
	assert.Equal(t, rep.Fresh+rep.Replays, v.Answers)
	assert.EqualValues(t, cfg.Payments, events.get(idem.ResultDone))

	var out bytes.Buffer
	printTable(&out, cfg, rep, v, events, time.Second)
	assert.Contains(t, out.String(), "ledger check: OK, 24 charges for 24 distinct payments")
	assert.Contains(t, out.String(), "replay check: OK")
	assert.NotContains(t, out.String(), "FAIL")
}

func TestStormCatchesDoubleCharges(t *testing.T) {
	book := newLedger()
	srv := httptest.NewServer(pay(book, smallStorm().Work)) // no middleware
	defer srv.Close()
	cfg := smallStorm()
	cfg.CutRate, cfg.ChangeRate, cfg.NoKeyRate = 0, 0, 0
	rep, err := storm(context.Background(), srv.URL, cfg)
	require.NoError(t, err)
	v := check(rep, book)
	assert.False(t, v.ok(rep))
	assert.Len(t, v.Double, cfg.Payments, "every copy of every payment charged")
	assert.Equal(t, cfg.Payments*(cfg.Copies+cfg.Resends), v.Charges)

	var out bytes.Buffer
	printTable(&out, cfg, rep, v, &eventCounts{}, time.Second)
	assert.Contains(t, out.String(), "ledger check: FAIL")
	assert.Contains(t, out.String(), "idem-demo: FAILED")
}

// Without the middleware, a payment sent again without a key is charged
// again, under the payment it names: the ledger names every payment
// charged twice, none with a blank id.
func TestStormChargesWithoutAKeyUnderThePayment(t *testing.T) {
	book := newLedger()
	srv := httptest.NewServer(unguardedAPI(book, smallStorm().Work))
	defer srv.Close()
	cfg := smallStorm()
	cfg.CutRate, cfg.ChangeRate, cfg.NoKeyRate = 0, 0, 1
	rep, err := storm(context.Background(), srv.URL, cfg)
	require.NoError(t, err)
	v := check(rep, book)
	assert.Equal(t, cfg.Payments, v.Charged, "every charge is one of the payments")
	assert.Equal(t, cfg.Payments*(cfg.Copies+cfg.Resends+1), v.Charges, "each copy, each resend and the request without a key")
	assert.NotContains(t, book.snapshot(), "", "no charge under a blank payment")
	require.Len(t, v.Double, cfg.Payments)
	for _, d := range v.Double {
		assert.Regexp(t, `^order-\d{5} charged \d+ times$`, d)
	}

	var out bytes.Buffer
	printTable(&out, cfg, rep, v, &eventCounts{}, time.Second)
	assert.NotRegexp(t, `(?m)^\s+charged`, out.String(), "no line with a blank payment id")
}

func TestStormCatchesReplaysThatDiffer(t *testing.T) {
	book := newLedger()
	api := guardedAPI(t, book, &eventCounts{})
	// A proxy that spoils replayed bodies.
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := httptest.NewRecorder()
		api.ServeHTTP(rec, r)
		body := rec.Body.Bytes()
		if rec.Header().Get(idemhttp.ReplayedHeader) == "true" {
			body = bytes.Replace(body, []byte("ch_"), []byte("ch_9"), 1)
		}
		for k, vs := range rec.Header() {
			w.Header()[k] = vs
		}
		w.Header().Del("Content-Length")
		w.WriteHeader(rec.Code)
		w.Write(body)
	}))
	defer srv.Close()
	cfg := smallStorm()
	rep, err := storm(context.Background(), srv.URL, cfg)
	require.NoError(t, err)
	v := check(rep, book)
	assert.False(t, v.ok(rep))
	assert.Len(t, v.Differ, cfg.Payments, "every payment had a replay")
	assert.Empty(t, v.Double)
}

// runDemo runs the command with args and returns its status and output.
func runDemo(t *testing.T, ctx context.Context, args ...string) (int, string, string) {
	var out, errb bytes.Buffer
	code := run(ctx, args, &out, &errb)
	return code, out.String(), errb.String()
}

var smallFlags = []string{"-payments", "20", "-copies", "3", "-clients", "4", "-work", "4ms", "-seed", "3"}

func TestRunOnMiniredis(t *testing.T) {
	code, out, errs := runDemo(t, context.Background(), smallFlags...)
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", out, errs)
	assert.Contains(t, out, "Redis: embedded miniredis")
	for _, want := range []string{"requests sent", "charges executed", "201 replayed", "409 in progress",
		"422 same key", "400 no key", "latency p50 / p99", "ledger check: OK, 20 charges for 20 distinct payments"} {
		assert.Contains(t, out, want)
	}
}

func TestRunOnRedisServer(t *testing.T) {
	s := redistest.Start(t)
	args := append([]string{"-redis", "redis://" + s.Addr + "/3"}, smallFlags...)
	code, out, errs := runDemo(t, context.Background(), args...)
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", out, errs)
	assert.Contains(t, out, "Redis: redis at "+s.Addr+", db 3")
	assert.Contains(t, out, "ledger check: OK")
	db3 := redis.NewClient(&redis.Options{Addr: s.Addr, DB: 3})
	defer db3.Close()
	keys, err := db3.Keys(context.Background(), "idem-demo:*{*").Result()
	require.NoError(t, err)
	assert.Len(t, keys, 20, "one record per payment, in the database the URL names")
	layouts, err := db3.Keys(context.Background(), "idem-demo:*layout").Result()
	require.NoError(t, err)
	assert.Len(t, layouts, 1, "beside them, the prefix's record")
	ttl, err := db3.PTTL(context.Background(), keys[0]).Result()
	require.NoError(t, err)
	assert.True(t, ttl > 0 && ttl <= 10*time.Minute, "demo records expire: %s", ttl)
}

func TestRunRefusesBadInput(t *testing.T) {
	for name, args := range map[string][]string{
		"bad URL scheme":    {"-redis", "http://127.0.0.1:6379"},
		"unreachable redis": {"-redis", "redis://127.0.0.1:1/0"},
		"no payments":       {"-payments", "0"},
		"cut rate 1":        {"-cut", "1"},
		"unknown flag":      {"-nope"},
		"extra argument":    {"storm"},
	} {
		code, _, errs := runDemo(t, context.Background(), args...)
		assert.Equal(t, 2, code, name)
		assert.NotEmpty(t, errs, name)
	}
}

func TestServeMode(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pr, pw := io.Pipe()
	done := make(chan int)
	go func() {
		done <- run(ctx, []string{"-serve", "127.0.0.1:0", "-work", "2ms"}, pw, io.Discard)
		pw.Close()
	}()
	sc := bufio.NewScanner(pr)
	base := ""
	for base == "" && sc.Scan() {
		if m := regexp.MustCompile(`serving POST (http://\S+)/payments`).FindStringSubmatch(sc.Text()); m != nil {
			base = m[1]
		}
	}
	require.NotEmpty(t, base)
	go io.Copy(io.Discard, pr)

	post := func(body string) *http.Response {
		req, err := http.NewRequest(http.MethodPost, base+"/payments", strings.NewReader(body))
		require.NoError(t, err)
		req.Header.Set("Idempotency-Key", "order-1")
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		return resp
	}
	body := `{"payment":"order-1","amount":1000,"currency":"EUR"}`
	assert.Equal(t, http.StatusCreated, post(body).StatusCode)
	again := post(body)
	assert.Equal(t, http.StatusCreated, again.StatusCode)
	assert.Equal(t, "true", again.Header.Get(idemhttp.ReplayedHeader))
	assert.Equal(t, http.StatusUnprocessableEntity, post(strings.Replace(body, "1000", "2000", 1)).StatusCode)

	resp, err := http.Get(base + "/payments")
	require.NoError(t, err)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	assert.Equal(t, 1, strings.Count(string(b), `"payment":"order-1"`), "one charge in the ledger: %s", b)

	cancel()
	assert.Equal(t, 0, <-done)
}

// smallConsumers is a consumer scenario quick enough for a test, with every
// kind of trouble.
func smallConsumers() consumerConfig {
	return consumerConfig{
		Events: 240, Partitions: 3, Consumers: 3, Batch: 20, DupRate: 0.1,
		CrashRate: 0.5, MaxCrashes: 3, Rebalances: 3, Lease: time.Second, Seed: 9,
	}
}

func miniredisClient(t *testing.T) *redis.Client {
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { c.Close() })
	return c
}

func TestConsumersTakeEachEffectOnce(t *testing.T) {
	for name, client := range map[string]func(t *testing.T) *redis.Client{
		"miniredis": miniredisClient,
		"redis":     func(t *testing.T) *redis.Client { return redistest.Real(t).Client },
	} {
		t.Run(name, func(t *testing.T) {
			cfg := smallConsumers()
			rep, err := consume(context.Background(), client(t), cfg, true)
			require.NoError(t, err)
			v := checkEffects(rep)
			assert.True(t, v.ok(), "twice: %v, lost: %v", v.Twice, v.Lost)
			assert.Equal(t, cfg.Events*len(steps), v.Effects)
			// A crashed batch stores the outcomes of its handlers that
			// returned within the settle window before the crash: those are
			// handled by the dead consumer, unreported, and replayed after.
			assert.LessOrEqual(t, rep.Handled, cfg.Events, "each event handled once at most")
			assert.Positive(t, rep.Crashes)
			assert.Positive(t, rep.Recovered, "a dead consumer's events are taken over")
			assert.Positive(t, rep.Rebalances)
			assert.Positive(t, rep.Redeliveries)
			assert.GreaterOrEqual(t, rep.Suppressed, rep.Duplicates, "every duplicate of the producer acknowledged without running")
			assert.Positive(t, rep.Batches)
			// Claim, a renewal, and the completions: one at the end, and one
			// per settle window (10 ms) that a handler returned in, since each
			// handler checkpoints every step and the batch outlasts a window.
			assert.LessOrEqual(t, float64(rep.BatchRoundTrips)/float64(rep.Batches), float64(2+cfg.Batch), "claim, a renewal, a completion per event at most")

			var out bytes.Buffer
			assert.True(t, printConsumerTable(&out, cfg, rep, v))
			for _, want := range []string{"events published", "redeliveries", "duplicates suppressed", "effects",
				"round trips per batch", "claims recovered from a dead consumer", "effects check: OK"} {
				assert.Contains(t, out.String(), want)
			}
			assert.NotContains(t, out.String(), "FAIL")
		})
	}
}

func TestConsumersWithoutIdemTakeEffectTwice(t *testing.T) {
	cfg := smallConsumers()
	rep, err := consume(context.Background(), miniredisClient(t), cfg, false)
	require.NoError(t, err)
	v := checkEffects(rep)
	assert.False(t, v.ok())
	assert.NotEmpty(t, v.Twice, "the producer's duplicates and the redeliveries run again")
	assert.Empty(t, v.Lost)
	var out bytes.Buffer
	assert.False(t, printConsumerTable(&out, cfg, rep, v))
	assert.Contains(t, out.String(), "effects check: FAIL")
	assert.Contains(t, out.String(), "idem-demo: FAILED")
}

var smallConsumerFlags = []string{"-events", "120", "-partitions", "2", "-batch", "20", "-crash", "0.5", "-maxcrashes", "1"}

func TestRunPrintsTheConsumersBesideTheStorm(t *testing.T) {
	code, out, errs := runDemo(t, context.Background(), append(slices.Clone(smallFlags), smallConsumerFlags...)...)
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", out, errs)
	storm, consumers, ok := strings.Cut(out, "\nconsumers: ")
	require.True(t, ok, "no consumer scenario in:\n%s", out)
	assert.Contains(t, storm, "ledger check: OK")
	for _, want := range []string{"3 consumer processes, with idem.Consume and checkpoints", "events published", "120 distinct",
		"redeliveries", "duplicates suppressed", "round trips per batch", "effects check: OK, every one of 120 events"} {
		assert.Contains(t, consumers, want)
	}

	code, out, _ = runDemo(t, context.Background(), append(slices.Clone(smallFlags), append(smallConsumerFlags, "-unguarded")...)...)
	assert.Equal(t, 1, code)
	assert.Contains(t, out, "WITHOUT idem (-unguarded)")
	assert.Contains(t, out, "effects check: FAIL")

	code, out, _ = runDemo(t, context.Background(), append(slices.Clone(smallFlags), "-consume=false")...)
	assert.Equal(t, 0, code)
	assert.NotContains(t, out, "consumers:")

	for name, args := range map[string][]string{
		"no events":    {"-events", "0"},
		"crash rate 2": {"-crash", "2"},
		"tiny lease":   {"-lease", "1ms"},
	} {
		code, _, errs := runDemo(t, context.Background(), args...)
		assert.Equal(t, 2, code, name)
		assert.NotEmpty(t, errs, name)
	}
}
