package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
)

// report is what a run of the command found: where it ran, with what, each
// cell, idem's targets against the peers, and what failed.
type report struct {
	Machine  machine      `json:"machine"`
	Versions versions     `json:"versions"`
	Settings settings     `json:"settings"`
	Cells    []cellResult `json:"cells"`
	Targets  []target     `json:"targets"`
	// Problems lists the checks that failed; the command exits with status
	// 1 when there is any.
	Problems []string `json:"problems"`
}

type machine struct {
	CPUs     int    `json:"cpus"`
	CPUModel string `json:"cpu_model"`
	OS       string `json:"os"`
	Arch     string `json:"arch"`
}

// versions names the software measured; a server not started is "".
type versions struct {
	Go       string            `json:"go"`
	Redis    string            `json:"redis,omitempty"`
	Postgres string            `json:"postgres,omitempty"`
	Modules  map[string]string `json:"modules"`
}

type settings struct {
	SecondsPerCell float64 `json:"seconds_per_cell"`
	WarmupSeconds  float64 `json:"warmup_seconds"`
	ReplayKeys     int     `json:"replay_keys"`
	ResultBytes    int     `json:"result_bytes"`
	Pool           int     `json:"pool"`
	Rounds         int     `json:"rounds"`
	// PostgresDesign is -pg-design: lookup or claim.
	PostgresDesign string `json:"postgres_design"`
}

// The modules whose versions the report names.
var reportedModules = []string{
	"github.com/jackc/pgx/v5",
	"github.com/bsm/redislock",
	"github.com/gofiber/fiber/v3",
	"github.com/valyala/fasthttp",
	"github.com/redis/go-redis/v9",
}

func newReport(o *options, e *env) *report {
	r := &report{
		Machine:  machine{CPUs: runtime.NumCPU(), CPUModel: cpuModel(), OS: runtime.GOOS, Arch: runtime.GOARCH},
		Versions: versions{Go: runtime.Version(), Modules: map[string]string{}},
		Settings: settings{
			SecondsPerCell: o.duration.Seconds(), WarmupSeconds: o.warmup.Seconds(),
			ReplayKeys: o.keys, ResultBytes: resultSize, Pool: o.pool, Rounds: o.rounds, PostgresDesign: o.pgDesign,
		},
		Problems: []string{},
	}
	if e.redis != nil {
		r.Versions.Redis = e.redis.version
	}
	if e.postgres != nil {
		r.Versions.Postgres = e.postgres.version
	}
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, d := range bi.Deps {
			if slices.Contains(reportedModules, d.Path) {
				r.Versions.Modules[d.Path] = d.Version
			}
		}
	}
	return r
}

// cpuModel returns the model name in /proc/cpuinfo, or "" without one.
func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return ""
	}
	return strings.TrimSpace(infoField(strings.ReplaceAll(string(b), "\t", ""), "model name"))
}

func (r *report) problem(format string, args ...any) {
	r.Problems = append(r.Problems, fmt.Sprintf(format, args...))
}

// cell returns the cell of peer, workload and callers, if it ran.
func (r *report) cell(peer, workload string, callers int) (cellResult, bool) {
	for _, c := range r.Cells {
		if c.Peer == peer && c.Workload == workload && c.Callers == callers {
			return c, true
		}
	}
	return cellResult{}, false
}

// target is one of idem's targets: the ops/s of one cell over another's,
// at the same callers, at least Want.
type target struct {
	Name     string  `json:"name"`
	Workload string  `json:"workload"`
	Callers  int     `json:"callers"`
	Peer     string  `json:"peer"`
	Against  string  `json:"against"`
	Ratio    float64 `json:"ratio"`
	Want     float64 `json:"want"`
	Met      bool    `json:"met"`
}

// idem's targets against the peers, at 64 callers.
var targetSpecs = []target{
	{Name: "idem Do, first execution, over the Postgres design (synchronous commit)", Workload: workloadFirst, Peer: "idem", Against: "postgres", Want: 3},
	{Name: "idem Do, replay, over the Postgres design (synchronous commit)", Workload: workloadReplay, Peer: "idem", Against: "postgres", Want: 1.5},
	{Name: "idem middleware, first execution, over Fiber's", Workload: workloadFirst, Peer: "idemhttp", Against: "fiber", Want: 1.2},
	{Name: "idem middleware, replay, over Fiber's", Workload: workloadReplay, Peer: "idemhttp", Against: "fiber", Want: 1.2},
}

// targetsOf returns the targets whose two cells ran, at the largest number
// of callers (the targets are set at 64).
func targetsOf(cells []cellResult, callers []int) []target {
	r := &report{Cells: cells}
	most := slices.Max(callers)
	out := []target{}
	for _, t := range targetSpecs {
		a, okA := r.cell(t.Peer, t.Workload, most)
		b, okB := r.cell(t.Against, t.Workload, most)
		if !okA || !okB || b.OpsPerSec == 0 {
			continue
		}
		t.Callers, t.Ratio = most, a.OpsPerSec/b.OpsPerSec
		t.Met = t.Ratio >= t.Want
		out = append(out, t)
	}
	return out
}

func printJSON(w io.Writer, r *report) {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(r)
}

func printText(w io.Writer, r *report) {
	fmt.Fprintf(w, "\n%s\n%s\n", r.machineLine(), r.versionsLine())
	s := r.Settings
	fmt.Fprintf(w, "each cell %gs after a %gs warm-up; replays over %d keys; %d-byte results; %d connections per pool",
		s.SecondsPerCell, s.WarmupSeconds, s.ReplayKeys, s.ResultBytes, s.Pool)
	if r.Versions.Postgres != "" {
		fmt.Fprintf(w, "; Postgres design: %s first", s.PostgresDesign)
	}
	if s.Rounds > 1 {
		fmt.Fprintf(w, "; ops/s: the median of %d rounds", s.Rounds)
	}
	fmt.Fprint(w, "\n\n")
	const row = "%-44s %-8s %7s %9s %8s %8s %9s %6s\n"
	fmt.Fprintf(w, row, "peer", "workload", "callers", "ops/s", "p50 µs", "p99 µs", "allocs/op", "errors")
	for _, c := range r.Cells {
		fmt.Fprintf(w, row, c.Label, c.Workload, strconv.Itoa(c.Callers), fmt.Sprintf("%.0f", c.OpsPerSec),
			fmt.Sprintf("%.0f", c.P50us), fmt.Sprintf("%.0f", c.P99us), fmt.Sprintf("%.1f", c.AllocsPerOp),
			strconv.FormatInt(c.Errors, 10))
	}
	if len(r.Targets) > 0 {
		fmt.Fprintf(w, "\ntargets (ops/s over ops/s, %d callers):\n", r.Targets[0].Callers)
	}
	for _, t := range r.Targets {
		verdict := "met"
		if !t.Met {
			verdict = "NOT met"
		}
		fmt.Fprintf(w, "  %-75s %5.2fx (want >= %gx): %s\n", t.Name, t.Ratio, t.Want, verdict)
	}
}

func (r *report) machineLine() string {
	m := r.Machine
	return fmt.Sprintf("machine: %d CPUs (%s), %s/%s, shared by the callers and the servers", m.CPUs, m.CPUModel, m.OS, m.Arch)
}

func (r *report) versionsLine() string {
	v := r.Versions
	parts := []string{v.Go}
	if v.Redis != "" {
		parts = append(parts, "redis-server "+v.Redis)
	}
	if v.Postgres != "" {
		parts = append(parts, "PostgreSQL "+v.Postgres)
	}
	for _, m := range reportedModules {
		if ver, ok := v.Modules[m]; ok {
			parts = append(parts, m+" "+ver)
		}
	}
	return "versions: " + strings.Join(parts, ", ")
}
