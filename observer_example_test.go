package idem_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"

	"github.com/idemkit/idem"
)

// Log every step with log/slog: replays at Debug, a lost lease at Warn. The
// record's digest stands for the key; the key itself is never logged.
func ExampleSlogObserver() {
	client, done := newClient()
	defer done()
	logger := slog.New(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{
		Level: slog.LevelDebug,
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			switch a.Key { // drop what changes from run to run
			case slog.TimeKey, "idem.id", "idem.token", "idem.took", "idem.held":
				return slog.Attr{}
			}
			return a
		},
	}))
	keeper, err := idem.NewRedis(client, idem.WithObserver(idem.SlogObserver(logger, nil)))
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	for range 2 {
		_, _ = idem.Do(ctx, keeper, "tenant-1", "order-7", func(context.Context) (string, error) { return "shipped", nil })
	}
	// Output:
	// level=DEBUG msg="idem claim: claimed" idem.step=claim idem.result=claimed idem.scope=tenant-1 idem.attempt=1 idem.recovered=false
	// level=DEBUG msg="idem complete: done" idem.step=complete idem.result=done idem.scope=tenant-1 idem.attempt=1 idem.recovered=false
	// level=DEBUG msg="idem claim: replayed" idem.step=claim idem.result=replayed idem.scope=tenant-1 idem.attempt=1 idem.recovered=false
}

// Tell a replay from a run without another signature.
func ExampleWithCallInfo() {
	client, done := newClient()
	defer done()
	keeper, err := idem.NewRedis(client)
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	for range 2 {
		var info idem.CallInfo
		v, _ := idem.Do(ctx, keeper, "tenant-1", "order-8", func(context.Context) (int, error) { return 42, nil }, idem.WithCallInfo(&info))
		fmt.Println(v, "replayed:", info.Replayed)
	}
	// Output:
	// 42 replayed: false
	// 42 replayed: true
}
