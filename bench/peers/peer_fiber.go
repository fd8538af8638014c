package main

import (
	"context"
	"fmt"
	"net"

	"github.com/gofiber/fiber/v3"
	"github.com/gofiber/fiber/v3/middleware/idempotency"
)

// fiberKeyHeader is the key header of Fiber's middleware by default.
const fiberKeyHeader = "X-Idempotency-Key"

// fiberPeer is a Fiber v3 app in the process, on a loopback port, with its
// idempotency middleware as a user would wire it (defaults: in-memory
// storage and an in-process lock), and its caller.
type fiberPeer struct {
	*httpCaller
	app *fiber.App
}

func openFiber(_ context.Context, e *env) (peer, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("listening on loopback: %w", err)
	}
	app := fiber.New()
	app.Use(idempotency.New())
	app.Post(opPath, func(c fiber.Ctx) error {
		res := e.op.run(c.Get(fiberKeyHeader))
		c.Set(fiber.HeaderContentType, fiber.MIMEApplicationJSON)
		return c.Status(fiber.StatusOK).Send(res)
	})
	go func() { _ = app.Listener(ln, fiber.ListenConfig{DisableStartupMessage: true}) }()
	return &fiberPeer{httpCaller: newHTTPCaller(ln.Addr().String(), fiberKeyHeader, e.pool), app: app}, nil
}

func (p *fiberPeer) close() {
	p.httpCaller.close()
	_ = p.app.Shutdown()
}
