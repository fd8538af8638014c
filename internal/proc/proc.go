// Package proc starts the child processes of tests (redis-server,
// nats-server, workers) so that they die with the process that started them,
// however it dies: a test binary killed by SIGKILL, ended by go test's own
// -timeout panic or by the out-of-memory killer runs no t.Cleanup, and a
// server it started would otherwise live on with parent 1.
package proc

import "os/exec"

// Start starts cmd, as cmd.Start does, and ties the child's life to this
// process: on Linux the child gets SIGKILL (or the signal cmd.SysProcAttr's
// Pdeathsig names already) when this process ends, whatever ends it. The caller waits for cmd (cmd.Wait) and stops it as it would
// after cmd.Start. cmd stays in the caller's process group, so an outer
// `timeout` that signals the group still reaches it.
//
// SIGKILL, not a gentler signal: a stopped child (SIGSTOP, as the kill tests
// do to a worker) keeps every other signal pending.
//
// Elsewhere than Linux, Start is cmd.Start.
func Start(cmd *exec.Cmd) error { return start(cmd) }
