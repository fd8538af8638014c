package faultproxy

import (
	"bufio"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// echo starts a server that answers every line with the same line, and
// counts the lines it received.
func echo(t *testing.T) (addr string, lines *atomic.Int64) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
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
	require.NoError(t, err)
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
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	return p
}

func TestForwardsUnchanged(t *testing.T) {
	addr, lines := echo(t)
	p := start(t, addr)
	got, err := roundTrip(t, p.Addr(), "hello")
	require.NoError(t, err, "want the line back")
	assert.Equal(t, "hello\n", got, "want the line back")
	assert.Equal(t, int64(1), lines.Load(), "lines the server saw")
}

func TestDropReplyAfterTheServerGotTheRequest(t *testing.T) {
	addr, lines := echo(t)
	p := start(t, addr)
	p.Set(Faults{DropReply: 1})
	got, err := roundTrip(t, p.Addr(), "pay")
	require.Error(t, err, "got %q; want the connection to fail", got)
	assert.Equal(t, int64(1), lines.Load(), "lines the server saw: the request must reach it")
	s := p.Stats()
	assert.Equal(t, int64(1), s.DroppedReplies, "stats %+v, want one dropped reply", s)
}

func TestCutBeforeTheServerGetsTheRequest(t *testing.T) {
	addr, lines := echo(t)
	p := start(t, addr)
	p.Set(Faults{Cut: 1})
	got, err := roundTrip(t, p.Addr(), "pay")
	require.Error(t, err, "got %q; want the connection to fail", got)
	assert.Equal(t, int64(0), lines.Load(), "lines the server saw")
}

func TestCutAllClosesOpenConnections(t *testing.T) {
	addr, _ := echo(t)
	p := start(t, addr)
	c, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer c.Close()
	_, err = c.Write([]byte("a\n"))
	require.NoError(t, err)
	r := bufio.NewReader(c)
	_, err = r.ReadString('\n')
	require.NoError(t, err)
	p.CutAll()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	_, _ = c.Write([]byte("b\n"))
	got, err := r.ReadString('\n')
	require.Error(t, err, "got %q after CutAll; want the connection closed", got)
}

func TestDelayHoldsReplies(t *testing.T) {
	addr, _ := echo(t)
	p := start(t, addr)
	p.Set(Faults{Delay: 300 * time.Millisecond})
	c, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	defer c.Close()
	_, err = c.Write([]byte("a\n"))
	require.NoError(t, err)
	// A reader with a deadline shorter than the delay times out: the reply
	// is held back, not lost.
	_ = c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	r := bufio.NewReader(c)
	_, err = r.ReadString('\n')
	require.Error(t, err, "the reply came before the delay")
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, err := r.ReadString('\n')
	require.NoError(t, err, "after the delay")
	assert.Equal(t, "a\n", got, "after the delay")
}
