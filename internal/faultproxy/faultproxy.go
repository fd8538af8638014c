// Package faultproxy is a TCP proxy on loopback for tests that puts faults
// between a client and a server: it cuts connections, delays replies, and
// drops a reply after the request has reached the server (the server has
// executed the command, the client never hears of it).
//
// Faults are decided per chunk of bytes read from a socket, with a seeded
// random source, so a run is reproducible in kind if not in timing. A proxy
// with no faults set forwards bytes unchanged.
package faultproxy

import (
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Faults are the probabilities, each from 0 to 1, and the delay applied to
// every connection. The zero value forwards everything unchanged.
type Faults struct {
	// Cut is the chance that a request chunk from the client is dropped and
	// the connection closed before the server sees it.
	Cut float64
	// DropReply is the chance that a reply chunk from the server is dropped
	// and the connection closed: the server executed the request, the client
	// sees the connection fail.
	DropReply float64
	// Delay is added before a reply chunk is forwarded: before every chunk
	// when Slow is 0, else with the chance Slow. Data held back when the proxy
	// closes is lost, as it would be in a network that fails.
	Delay time.Duration
	// Slow is the chance that a reply chunk is held back by Delay; 0 means
	// every chunk.
	Slow float64
}

// Stats counts what the proxy did.
type Stats struct {
	Conns, Cuts, DroppedReplies, DelayedReplies int64
}

// Proxy forwards connections from its loopback address to a target.
type Proxy struct {
	target string
	l      net.Listener

	mu     sync.Mutex
	faults Faults
	rnd    *rand.Rand
	conns  map[net.Conn]struct{}
	closed bool
	done   chan struct{} // closed by Close: ends delays at once

	conns64, cuts, drops, delays atomic.Int64
	wg                           sync.WaitGroup
}

// New starts a proxy on a free port of 127.0.0.1 that forwards to target, with
// random decisions seeded by seed.
func New(target string, seed uint64) (*Proxy, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{
		target: target, l: l,
		rnd:   rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
		conns: map[net.Conn]struct{}{},
		done:  make(chan struct{}),
	}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr returns the proxy's address, host:port on 127.0.0.1.
func (p *Proxy) Addr() string { return p.l.Addr().String() }

// Set replaces the faults; it applies to data read from then on, on every
// connection.
func (p *Proxy) Set(f Faults) {
	p.mu.Lock()
	p.faults = f
	p.mu.Unlock()
}

// CutAll closes every open connection at once; new connections are accepted.
func (p *Proxy) CutAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.Close()
		p.cuts.Add(1)
	}
}

// Stats returns what the proxy has done so far.
func (p *Proxy) Stats() Stats {
	return Stats{Conns: p.conns64.Load(), Cuts: p.cuts.Load(), DroppedReplies: p.drops.Load(), DelayedReplies: p.delays.Load()}
}

// Close stops accepting, closes every connection and waits for the proxy's
// goroutines to end.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if !p.closed {
		close(p.done)
	}
	p.closed = true
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	err := p.l.Close()
	p.wg.Wait()
	return err
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		client, err := p.l.Accept()
		if err != nil {
			return
		}
		server, err := net.DialTimeout("tcp", p.target, 2*time.Second)
		if err != nil {
			client.Close()
			continue
		}
		if !p.track(client, server) {
			client.Close()
			server.Close()
			return
		}
		p.conns64.Add(1)
		p.wg.Add(2)
		go p.pipe(client, server, false)
		go p.pipe(server, client, true)
	}
}

func (p *Proxy) track(cs ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	for _, c := range cs {
		p.conns[c] = struct{}{}
	}
	return true
}

func (p *Proxy) untrack(cs ...net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range cs {
		delete(p.conns, c)
	}
}

// decide returns whether to break the connection instead of forwarding a
// chunk, and how long to wait first.
func (p *Proxy) decide(reply bool) (brk bool, delay time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if reply {
		if p.faults.Delay > 0 && (p.faults.Slow == 0 || p.rnd.Float64() < p.faults.Slow) {
			delay = p.faults.Delay
		}
		return p.faults.DropReply > 0 && p.rnd.Float64() < p.faults.DropReply, delay
	}
	return p.faults.Cut > 0 && p.rnd.Float64() < p.faults.Cut, 0
}

// pipe copies from src to dst, chunk by chunk, applying the faults of its
// direction; when either side fails it closes both.
func (p *Proxy) pipe(src, dst net.Conn, reply bool) {
	defer p.wg.Done()
	defer func() {
		src.Close()
		dst.Close()
		p.untrack(src, dst)
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			brk, delay := p.decide(reply)
			if delay > 0 {
				p.delays.Add(1)
				t := time.NewTimer(delay)
				select {
				case <-t.C:
				case <-p.done:
					t.Stop()
					return
				}
			}
			if brk {
				if reply {
					p.drops.Add(1)
				} else {
					p.cuts.Add(1)
				}
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}
