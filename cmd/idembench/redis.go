package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/redis/go-redis/v9"
)

// client is what the tool needs of a go-redis client: a *redis.Client or a
// *redis.ClusterClient.
type client = redis.UniversalClient

// connect returns two clients of the same server, made alike: one for idem
// and one for the baseline, and a function that closes everything. With
// -workload batch and a baseline, on one server, the baseline's client uses
// a database of its own (-baseline-db), so that each side's keys have their
// own hash tables; elsewhere both use the same database.
func connect(o *options, stderr io.Writer) (idemClient, baseClient client, server string, closeAll func(), err error) {
	var mini *miniredis.Miniredis
	mk := func(baseline bool) (client, error) {
		var opt *redis.Options
		switch {
		case o.cluster != "":
			return redis.NewClusterClient(&redis.ClusterOptions{Addrs: strings.Split(o.cluster, ",")}), nil
		case o.redisURL != "":
			var err error
			if opt, err = redis.ParseURL(o.redisURL); err != nil {
				return nil, fmt.Errorf("-redis: %w", err)
			}
		default:
			opt = &redis.Options{Addr: mini.Addr()}
		}
		if baseline && o.workload == workloadBatch && o.baseline != "" {
			db := o.baselineDB
			if db < 0 {
				db = opt.DB + 1
			}
			if db == opt.DB {
				return nil, fmt.Errorf("-baseline-db %d: idem's database; the baseline needs one of its own", db)
			}
			opt.DB = db
		}
		return redis.NewClient(opt), nil
	}
	if o.redisURL == "" && o.cluster == "" {
		mini, err = miniredis.Run()
		if err != nil {
			return nil, nil, "", nil, fmt.Errorf("starting miniredis: %w", err)
		}
		fmt.Fprintln(stderr, "idembench: no -redis given: using an embedded miniredis, whose Lua is several times slower than Redis; pass -redis redis://host:port for figures worth quoting")
		server = "miniredis (embedded)"
	}
	if idemClient, err = mk(false); err == nil {
		baseClient, err = mk(true)
	}
	closeAll = func() {
		if idemClient != nil {
			idemClient.Close()
		}
		if baseClient != nil {
			baseClient.Close()
		}
		if mini != nil {
			mini.Close()
		}
	}
	if err != nil {
		closeAll()
		return nil, nil, "", nil, err
	}
	return idemClient, baseClient, server, closeAll, nil
}

// serverName names the server for the report: "redis 7.0.15", "valkey
// 8.0.1", with "cluster" after the name when CLUSTER INFO answers with a
// cluster_state (a server without cluster support refuses the command).
func serverName(ctx context.Context, c client) string {
	info, err := c.Info(ctx, "server").Result()
	if err != nil {
		return "unknown"
	}
	state, err := c.ClusterInfo(ctx).Result()
	return describeServer(info, err == nil && strings.Contains(state, "cluster_state:"))
}

// describeServer names a server from its INFO server section: its
// server_name and that name's own version (Valkey says redis_version 7.2.4
// for its clients' sake, and valkey_version for itself), else redis and
// redis_version.
func describeServer(info string, cluster bool) string {
	fields := map[string]string{}
	for _, line := range strings.Split(info, "\n") {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), ":"); ok {
			fields[k] = v
		}
	}
	name := cmp.Or(fields["server_name"], "redis")
	version := cmp.Or(fields[name+"_version"], fields["redis_version"])
	if cluster {
		name += " cluster"
	}
	if version == "" {
		return name
	}
	return name + " " + version
}

// newAutoPipeliner returns an AutoPipeliner on c with the settings of
// -ap-batches and -ap-delay.
func newAutoPipeliner(o *options, c client) (*redis.AutoPipeliner, error) {
	apo := redis.DefaultBlockingAutoPipelineOptions()
	apo.MaxConcurrentBatches = o.apBatches
	apo.Unordered = o.apBatches > 1
	apo.MaxFlushDelay = o.apDelay
	ap, err := c.AutoPipelineWithOptions(apo)
	if err != nil {
		return nil, fmt.Errorf("autopipeline: %w", err)
	}
	return ap, nil
}

// newKeeper returns the Keeper under test, on c (through an AutoPipeliner
// with -autopipeline), with its scripts loaded, and a function that closes
// what it opened. In -workload batch its keys start with the run's tag.
func newKeeper(ctx context.Context, o *options, c client) (*idem.Keeper, func(), error) {
	var scripter redis.Scripter = c
	closeAP := func() {}
	if o.autopipeline {
		ap, err := newAutoPipeliner(o, c)
		if err != nil {
			return nil, nil, err
		}
		scripter, closeAP = ap, func() { ap.Close() }
	}
	k, err := func() (*idem.Keeper, error) {
		var opts []idem.Option
		if o.workload == workloadBatch {
			// A prefix of the run's own: its index and memory are the
			// run's alone.
			opts = append(opts, idem.WithPrefix("idembench-"+o.run+":"))
		}
		if !o.markers {
			opts = append(opts, idem.WithoutMarkers())
		}
		opts = append(opts, idem.WithRetention(o.retention), idem.WithCoalescing(o.coalesce))
		if o.set["scope-shards"] {
			opts = append(opts, idem.WithScopeShards(o.scopeShards))
		}
		if o.markerRetention > 0 {
			opts = append(opts, idem.WithMarkerRetention(o.markerRetention))
		}
		if o.cache > 0 {
			opts = append(opts, idem.WithReplayCache(o.cache, int64(o.cache)*int64(o.body+512), o.retention))
		}
		k, err := idem.NewRedis(scripter, opts...)
		if err != nil {
			return nil, err
		}
		// The scripts, and the prefix's record for k: written before the
		// run, so that it counts none of it.
		return k, k.LoadScripts(ctx)
	}()
	if err != nil {
		closeAP()
		return nil, nil, err
	}
	return k, closeAP, nil
}

// counter is a go-redis hook that counts the commands and round trips a
// client sends, a pipeline being one round trip. The handshake of a new
// connection (HELLO, CLIENT SETINFO) is not counted.
type counter struct {
	on         atomic.Bool
	commands   atomic.Int64
	roundTrips atomic.Int64
}

func (c *counter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *counter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if c.on.Load() && !handshake(cmd) {
			c.commands.Add(1)
			c.roundTrips.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (c *counter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if c.on.Load() && len(cmds) > 0 && !handshake(cmds[0]) {
			c.commands.Add(int64(len(cmds)))
			c.roundTrips.Add(1)
		}
		return next(ctx, cmds)
	}
}

func handshake(cmd redis.Cmder) bool {
	switch cmd.Name() {
	case "hello", "client", "auth", "select":
		return true
	}
	return false
}

// serverCPU is what INFO says a server (or every master of a Cluster, summed)
// has spent so far.
type serverCPU struct {
	// usec is INFO commandstats' usec by command name, in lower case; the
	// subcommands of a command (config|get) count under its name.
	usec map[string]int64
	// process is the server process's CPU time, user plus system (INFO
	// cpu), in microseconds.
	process int64
}

// readServerCPU reads INFO commandstats and INFO cpu of c's server, or of
// every master of a Cluster, and sums them.
func readServerCPU(ctx context.Context, c client) (serverCPU, error) {
	sum := serverCPU{usec: map[string]int64{}}
	var mu sync.Mutex
	read := func(ctx context.Context, c redis.Cmdable) error {
		stats, err := c.Info(ctx, "commandstats").Result()
		if err != nil {
			return fmt.Errorf("INFO commandstats: %w", err)
		}
		cpu, err := c.Info(ctx, "cpu").Result()
		if err != nil {
			return fmt.Errorf("INFO cpu: %w", err)
		}
		mu.Lock()
		defer mu.Unlock()
		parseCommandstats(stats, sum.usec)
		sum.process += parseCPU(cpu)
		return nil
	}
	var err error
	if cc, ok := c.(*redis.ClusterClient); ok {
		err = cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return read(ctx, c) })
	} else {
		err = read(ctx, c)
	}
	return sum, err
}

// parseCommandstats adds the usec of each line of INFO commandstats
// ("cmdstat_evalsha:calls=3,usec=66,...") to usec, under the command's name.
func parseCommandstats(info string, usec map[string]int64) {
	for _, line := range strings.Split(info, "\n") {
		rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_")
		if !ok {
			continue
		}
		name, fields, ok := strings.Cut(rest, ":")
		if !ok {
			continue
		}
		name, _, _ = strings.Cut(strings.ToLower(name), "|")
		for _, f := range strings.Split(fields, ",") {
			if v, ok := strings.CutPrefix(f, "usec="); ok {
				if n, err := strconv.ParseInt(v, 10, 64); err == nil {
					usec[name] += n
				}
			}
		}
	}
}

// parseCPU returns used_cpu_user plus used_cpu_sys of INFO cpu, in
// microseconds.
func parseCPU(info string) int64 {
	var usec int64
	for _, line := range strings.Split(info, "\n") {
		name, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok || (name != "used_cpu_user" && name != "used_cpu_sys") {
			continue
		}
		if s, err := strconv.ParseFloat(v, 64); err == nil {
			usec += int64(math.Round(s * 1e6))
		}
	}
	return usec
}
