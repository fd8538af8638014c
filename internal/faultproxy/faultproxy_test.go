package faultproxy

import (
	"bufio"
	"net"
	"sync/atomic"
	"testing"
	"time"
)

// echo starts a server that answers every line with the same line, and
// counts the lines it received.
func echo(t *testing.T) (addr string, lines *atomic.Int64) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	lines = new(atomic.Int64)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					s, err := r.ReadString('\n')
					if err != nil {
						return
					}
					lines.Add(1)
					if _, err := c.Write([]byte(s)); err != nil {
						return
					}
				}
			}()
		}
	}()
	return l.Addr().String(), lines
}

func roundTrip(t *testing.T, addr, msg string) (string, error) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write([]byte(msg + "\n")); err != nil {
		return "", err
	}
	return bufio.NewReader(c).ReadString('\n')
}

func start(t *testing.T, target string) *Proxy {
	t.Helper()
	p, err := New(target, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func TestForwardsUnchanged(t *testing.T) {
	addr, lines := echo(t)
	p := start(t, addr)
	got, err := roundTrip(t, p.Addr(), "hello")
	if err != nil || got != "hello\n" {
		t.Fatalf("got %q, %v; want the line back", got, err)
	}
	if lines.Load() != 1 {
		t.Fatalf("server saw %d lines, want 1", lines.Load())
	}
}

func TestDropReplyAfterTheServerGotTheRequest(t *testing.T) {
	addr, lines := echo(t)
	p := start(t, addr)
	p.Set(Faults{DropReply: 1})
	if got, err := roundTrip(t, p.Addr(), "pay"); err == nil {
		t.Fatalf("got %q; want the connection to fail", got)
	}
	if lines.Load() != 1 {
		t.Fatalf("server saw %d lines, want 1: the request must reach it", lines.Load())
	}
	if s := p.Stats(); s.DroppedReplies != 1 {
		t.Fatalf("stats %+v, want one dropped reply", s)
	}
}

func TestCutBeforeTheServerGetsTheRequest(t *testing.T) {
	addr, lines := echo(t)
	p := start(t, addr)
	p.Set(Faults{Cut: 1})
	if got, err := roundTrip(t, p.Addr(), "pay"); err == nil {
		t.Fatalf("got %q; want the connection to fail", got)
	}
	if lines.Load() != 0 {
		t.Fatalf("server saw %d lines, want 0", lines.Load())
	}
}

func TestCutAllClosesOpenConnections(t *testing.T) {
	addr, _ := echo(t)
	p := start(t, addr)
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("a\n")); err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(c)
	if _, err := r.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	p.CutAll()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	_, _ = c.Write([]byte("b\n"))
	if got, err := r.ReadString('\n'); err == nil {
		t.Fatalf("got %q after CutAll; want the connection closed", got)
	}
}

func TestDelayHoldsReplies(t *testing.T) {
	addr, _ := echo(t)
	p := start(t, addr)
	p.Set(Faults{Delay: 300 * time.Millisecond})
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("a\n")); err != nil {
		t.Fatal(err)
	}
	// A reader with a deadline shorter than the delay times out: the reply
	// is held back, not lost.
	_ = c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	r := bufio.NewReader(c)
	if _, err := r.ReadString('\n'); err == nil {
		t.Fatal("the reply came before the delay")
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if got, err := r.ReadString('\n'); err != nil || got != "a\n" {
		t.Fatalf("got %q, %v after the delay", got, err)
	}
}
