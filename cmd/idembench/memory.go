package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// memoryProbe measures, for -workload batch, the Redis memory each side's
// remembered ids take: used_memory after the run minus before, divided by
// the ids the side delivered, with the keys its database gained beside it
// (one an id for a baseline, and in the two-phase baseline a failed id's
// key held for its lease; idem's as its store lays its records out). The
// memory of the connections (CLIENT LIST's tot-mem: their buffers, which
// grow with a batch's commands and shrink when idle) is left out. The
// sides' keys live in databases of their own; after the run the baseline's
// keys are deleted, and its database's hash tables freed, so that what
// remains is idem's alone.
type memoryProbe struct {
	idemC, baseC client
	idemDB       int
	baseDB       int
	withBaseline bool
	// cluster is set on a Cluster: memory and keys are summed over the
	// masters, and both sides' keys share each master's database 0.
	cluster bool
	// why says why memory is not measured; empty when it is.
	why string

	// idemOthers and baseOthers are the keys the databases held before the
	// run began to write; idemKeys0 and baseKeys0 those they held when the
	// clock started, and before the used_memory then.
	idemOthers, baseOthers int64
	idemKeys0, baseKeys0   int64
	before                 memInfo
	// live is -marker-retention, 0 without it: the ids a side remembers
	// are then those it delivered in the last live of its run. started is
	// when the clock started.
	live    time.Duration
	started time.Time
	// prefill is -prefill.
	prefill int64
}

// memInfo is what INFO memory and CLIENT LIST say.
type memInfo struct {
	// used is used_memory, clients the sum of every connection's tot-mem,
	// in bytes.
	used, clients int64
}

// data is the memory of what the server holds, not counting its
// connections, which come and go with the run's clients.
func (m memInfo) data() int64 { return m.used - m.clients }

// memory is what the probe found for one side.
type memory struct {
	// bytes is the used_memory the side's keys took; ids the ids it
	// delivered; keys the keys its database gained.
	bytes, ids, keys int64
}

func (m memory) perID() float64 {
	if m.ids <= 0 {
		return 0
	}
	return float64(m.bytes) / float64(m.ids)
}

// newMemoryProbe counts the keys of the sides' databases before the run
// writes any, on one server, or says why it will not measure.
func newMemoryProbe(ctx context.Context, o *options, idemC, baseC client) *memoryProbe {
	p := &memoryProbe{idemC: idemC, baseC: baseC, withBaseline: o.baseline != "", live: o.markerRetention, prefill: o.prefill}
	p.cluster = o.cluster != ""
	if c, ok := idemC.(*redis.Client); ok {
		p.idemDB = c.Options().DB
	}
	if c, ok := baseC.(*redis.Client); ok {
		p.baseDB = c.Options().DB
	}
	var err error
	if p.idemOthers, p.baseOthers, err = p.dbSizes(ctx); err != nil {
		p.why = "not measured: DBSIZE: " + err.Error()
	}
	return p
}

// start reads the server's memory when the clock starts.
func (p *memoryProbe) start(ctx context.Context) {
	p.started = time.Now()
	if p.why != "" {
		return
	}
	var err error
	if p.before, err = readMemory(ctx, p.idemC); err != nil {
		p.why = "not measured: " + err.Error()
		return
	}
	if p.idemKeys0, p.baseKeys0, err = p.dbSizes(ctx); err != nil {
		p.why = "not measured: DBSIZE: " + err.Error()
	}
}

// dbSizes returns the keys of idem's database and, with a baseline, of the
// baseline's.
func (p *memoryProbe) dbSizes(ctx context.Context) (idem, base int64, err error) {
	if idem, err = p.idemC.DBSize(ctx).Result(); err != nil || !p.withBaseline || p.cluster {
		return idem, 0, err
	}
	base, err = p.baseC.DBSize(ctx).Result()
	return idem, base, err
}

// readMemory reads INFO memory and CLIENT LIST of c's server, in one round
// trip; of a Cluster's masters, summed.
func readMemory(ctx context.Context, c client) (memInfo, error) {
	cc, ok := c.(*redis.ClusterClient)
	if !ok {
		return readNodeMemory(ctx, c)
	}
	var mu sync.Mutex
	var sum memInfo
	err := cc.ForEachMaster(ctx, func(ctx context.Context, node *redis.Client) error {
		m, err := readNodeMemory(ctx, node)
		mu.Lock()
		defer mu.Unlock()
		sum.used, sum.clients = sum.used+m.used, sum.clients+m.clients
		return err
	})
	return sum, err
}

// readNodeMemory reads INFO memory and CLIENT LIST of one server.
func readNodeMemory(ctx context.Context, c client) (memInfo, error) {
	pipe := c.Pipeline()
	info := pipe.Info(ctx, "memory")
	list := pipe.ClientList(ctx)
	_, _ = pipe.Exec(ctx)
	if err := info.Err(); err != nil {
		return memInfo{}, fmt.Errorf("INFO memory: %w", err)
	}
	if err := list.Err(); err != nil {
		return memInfo{}, fmt.Errorf("CLIENT LIST: %w", err)
	}
	var m memInfo
	found := false
	for _, line := range strings.Split(info.Val(), "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "used_memory:"); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return memInfo{}, fmt.Errorf("INFO memory: used_memory: %w", err)
			}
			m.used, found = n, true
		}
	}
	if !found {
		return memInfo{}, errors.New("INFO memory has no used_memory")
	}
	for _, line := range strings.Split(list.Val(), "\n") {
		for _, f := range strings.Fields(line) {
			if v, ok := strings.CutPrefix(f, "tot-mem="); ok {
				n, err := strconv.ParseInt(v, 10, 64)
				if err != nil {
					return memInfo{}, fmt.Errorf("CLIENT LIST: tot-mem: %w", err)
				}
				m.clients += n
			}
		}
	}
	return m, nil
}

// finish reads the memory after the run: with a baseline, before and after
// deleting the baseline's keys, whose ids base's streams delivered. It
// returns what idem's side and the baseline's took, and how it was
// measured; a non-empty why says why not.
func (p *memoryProbe) finish(ctx context.Context, idemSide, base *side) (idem, baseline memory, method string) {
	if p.why != "" {
		return memory{}, memory{}, p.why
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	fail := func(err error) (memory, memory, string) {
		p.why = "not measured: " + err.Error()
		return memory{}, memory{}, p.why
	}
	after, err := readMemory(ctx, p.idemC)
	if err != nil {
		return fail(err)
	}
	idemKeys, baseKeys, err := p.dbSizes(ctx)
	if err != nil {
		return fail(err)
	}
	idem = memory{ids: p.remembered(idemSide), keys: idemKeys - p.idemKeys0}
	alone := after
	if base != nil {
		if err := deleteKeys(ctx, p.baseC, base); err != nil {
			return fail(fmt.Errorf("deleting the baseline's keys: %w", err))
		}
		if alone, err = settledMemory(ctx, p.idemC); err != nil {
			return fail(err)
		}
		baseline = memory{bytes: after.data() - alone.data(), ids: p.remembered(base), keys: baseKeys - p.baseKeys0}
		if p.cluster {
			// One database for both: what the deletion took away was the
			// baseline's.
			left, err := p.idemC.DBSize(ctx).Result()
			if err != nil {
				return fail(err)
			}
			idem.keys, baseline.keys = left-p.idemKeys0, idemKeys-left
		}
	}
	idem.bytes = alone.data() - p.before.data()
	return idem, baseline, p.method()
}

// remembered returns the ids s remembers: those it prefilled and those it
// delivered; with -marker-retention, those it delivered in the last marker
// retention of its run.
func (p *memoryProbe) remembered(s *side) int64 {
	if p.live > 0 && len(s.marks) > 0 {
		return s.liveIDs(s.marks[len(s.marks)-1].at.Add(-p.live))
	}
	return s.prefilled + deliveredIDs(s)
}

// method says how memory was measured.
func (p *memoryProbe) method() string {
	var b strings.Builder
	b.WriteString("used_memory after the run minus before, less the connections' memory (CLIENT LIST tot-mem), over the ids delivered")
	if p.live > 0 {
		fmt.Fprintf(&b, " in the last marker retention (%s) of the side's run, the live ones: a steady state", p.live)
		if ran := time.Since(p.started); ran < 2*p.live {
			fmt.Fprintf(&b, " NOT reached: the run lasted %s, less than twice the marker retention", ran.Round(time.Second))
		}
	} else if p.prefill > 0 {
		b.WriteString(" (the -prefill's ids included)")
	}
	if p.cluster {
		b.WriteString(", summed over the Cluster's masters")
		if p.withBaseline {
			b.WriteString("; both sides' keys in database 0, sharing its hash tables; the baseline's keys then deleted, and the tables shrunk by Redis, to read idem's alone")
		}
		if p.idemOthers > 0 {
			fmt.Fprintf(&b, "; the masters held %d other keys before the run: the figure is approximate", p.idemOthers)
		}
		return b.String()
	}
	shared := func(side string, db int, keys int64) {
		if keys > 0 {
			fmt.Fprintf(&b, "; %s's db %d held %d other keys before the run, whose hash tables its keys share: the figure is approximate", side, db, keys)
		}
	}
	if !p.withBaseline {
		fmt.Fprintf(&b, "; idem's keys on db %d", p.idemDB)
		shared("idem", p.idemDB, p.idemOthers)
		return b.String()
	}
	fmt.Fprintf(&b, "; idem's keys on db %d and the baseline's on db %d, each side's in hash tables of its own; the baseline's keys then deleted, and its tables freed, to read idem's alone", p.idemDB, p.baseDB)
	shared("idem", p.idemDB, p.idemOthers)
	shared("the baseline", p.baseDB, p.baseOthers)
	return b.String()
}

// deliveredIDs counts the new ids the streams of s delivered.
func deliveredIDs(s *side) int64 {
	var n int64
	for _, st := range s.streams {
		n += int64(st.sent)
	}
	return n
}

// deleteKeys deletes the keys of every id the baseline s prefilled, and
// that its streams delivered: 1,000 keys a DEL, 16 DELs a round trip; on a
// Cluster, whose DEL takes the keys of one slot, one key a DEL.
func deleteKeys(ctx context.Context, c client, s *side) error {
	perDel, perPipeline := 1000, 16
	if _, ok := c.(*redis.ClusterClient); ok {
		perDel, perPipeline = 1, 1000
	}
	pipe := c.Pipeline()
	args := make([]any, 0, perDel+1)
	flush := func(force bool) error {
		if len(args) > 0 && (force || len(args) == perDel+1) {
			pipe.Do(ctx, args...)
			args = make([]any, 0, perDel+1)
		}
		if pipe.Len() > 0 && (force || pipe.Len() == perPipeline) {
			if _, err := pipe.Exec(ctx); err != nil {
				return err
			}
		}
		return nil
	}
	for id := range uint64(s.prefilled) {
		if len(args) == 0 {
			args = append(args, "del")
		}
		args = append(args, s.prefix+prefillKey(id))
		if err := flush(false); err != nil {
			return err
		}
	}
	for _, st := range s.streams {
		for j := range st.sent {
			if len(args) == 0 {
				args = append(args, "del")
			}
			args = append(args, s.prefix+st.message(st.index+j*st.callers).key)
			if err := flush(false); err != nil {
				return err
			}
		}
	}
	return flush(true)
}

// settledMemory reads INFO memory until the server's memory has stopped
// falling, so that the hash tables of a database whose keys were deleted,
// which Redis frees on its next cron runs, are freed: until five reads 100ms
// apart find it no lower (by more than 1 KiB), or ten seconds have passed.
func settledMemory(ctx context.Context, c client) (memInfo, error) {
	low, err := readMemory(ctx, c)
	if err != nil {
		return memInfo{}, err
	}
	deadline := time.Now().Add(10 * time.Second)
	for still := 0; still < 5 && time.Now().Before(deadline); {
		time.Sleep(100 * time.Millisecond)
		m, err := readMemory(ctx, c)
		if err != nil {
			return memInfo{}, err
		}
		if m.data() < low.data()-1024 {
			low, still = m, 0
			continue
		}
		still++
	}
	return low, nil
}
