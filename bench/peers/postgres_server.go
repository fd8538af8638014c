package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/idemkit/idem/internal/proc"
	"github.com/jackc/pgx/v5"
)

// postgresServer is a Postgres the command started: a cluster made by initdb
// in a temporary directory, listening only on a unix socket there.
type postgresServer struct {
	dir     string
	version string
	cmd     *exec.Cmd
	exited  chan struct{}
	// cred is the user the server runs as, when the command runs as root;
	// nil otherwise.
	cred *syscall.Credential
}

// The cluster's superuser, who connects without a password over the socket,
// and the port that names the socket file.
const (
	pgUser = "bench"
	pgPort = 5432
)

// startPostgres makes a cluster with binDir's initdb, starts its postgres
// with room for maxConns connections, and waits until it accepts one.
func startPostgres(ctx context.Context, binDir string, maxConns int) (_ *postgresServer, err error) {
	if binDir, err = postgresBinDir(binDir); err != nil {
		return nil, err
	}
	s := &postgresServer{}
	if s.dir, err = os.MkdirTemp("", "idem-peers-pg-"); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			s.stop()
		}
	}()
	if err := s.dropRoot(); err != nil {
		return nil, err
	}
	if err := s.initdb(binDir); err != nil {
		return nil, err
	}
	if err := s.start(binDir, maxConns); err != nil {
		return nil, err
	}
	return s, s.await(ctx)
}

// postgresBinDir returns dir if given, else where pg_config says the
// programs are, else the directory of initdb on PATH, else the newest
// /usr/lib/postgresql/*/bin (Debian's layout).
func postgresBinDir(dir string) (string, error) {
	if dir != "" {
		return dir, nil
	}
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		if d := strings.TrimSpace(string(out)); fileExists(filepath.Join(d, "initdb")) {
			return d, nil
		}
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		return filepath.Dir(p), nil
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	slices.SortFunc(dirs, func(a, b string) int { return versionOf(a) - versionOf(b) })
	if len(dirs) > 0 && fileExists(filepath.Join(dirs[len(dirs)-1], "initdb")) {
		return dirs[len(dirs)-1], nil
	}
	return "", fmt.Errorf("postgres not found (no pg_config, no initdb on PATH, nothing in /usr/lib/postgresql): install it (apt-get install postgresql), pass -pg-bin, or leave out the peers that need it (-peers)")
}

// versionOf returns the major version in a path /usr/lib/postgresql/N/bin.
func versionOf(dir string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(dir)))
	return n
}

func fileExists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// dropRoot, when the command runs as root, picks the user the server runs as
// (postgres if there is one, else nobody), since Postgres refuses to run as
// root, and hands it the directory.
func (s *postgresServer) dropRoot() error {
	if os.Geteuid() != 0 {
		return nil
	}
	var u *user.User
	var err error
	for _, name := range []string{"postgres", "nobody"} {
		if u, err = user.Lookup(name); err == nil {
			break
		}
	}
	if err != nil {
		return fmt.Errorf("running as root, and neither a postgres nor a nobody user to run Postgres as: %w", err)
	}
	uid, _ := strconv.ParseUint(u.Uid, 10, 32)
	gid, _ := strconv.ParseUint(u.Gid, 10, 32)
	s.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	if err := os.Chown(s.dir, int(uid), int(gid)); err != nil {
		return fmt.Errorf("handing %s to user %s: %w", s.dir, u.Username, err)
	}
	return nil
}

// command returns a command of binDir's program name, run as the server's
// user, in its directory, with a plain environment, in a process group of its
// own (an interrupt reaches the command, which stops the server in order),
// and told to quit at once if the command dies first.
func (s *postgresServer) command(binDir, name string, args ...string) *exec.Cmd {
	cmd := exec.Command(filepath.Join(binDir, name), args...)
	cmd.Dir = s.dir
	cmd.Env = []string{"PATH=/usr/bin:/bin", "LC_ALL=C", "HOME=" + s.dir}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred, Setpgid: true, Pdeathsig: syscall.SIGQUIT}
	return cmd
}

// initdb makes the cluster in dir/data: superuser pgUser, trusted over the
// socket (the directory is the server user's alone), C locale.
func (s *postgresServer) initdb(binDir string) error {
	cmd := s.command(binDir, "initdb", "-D", s.dataDir(), "-U", pgUser, "-A", "trust",
		"-E", "UTF8", "--locale=C", "--no-sync")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("initdb: %w: %s", err, tailOf(out.Bytes()))
	}
	return nil
}

func (s *postgresServer) dataDir() string { return filepath.Join(s.dir, "data") }

// start starts postgres with no TCP listener, its socket in dir, fsync and
// synchronous commit on (the defaults), its output going to postgres.log.
func (s *postgresServer) start(binDir string, maxConns int) error {
	log, err := os.Create(filepath.Join(s.dir, "postgres.log"))
	if err != nil {
		return err
	}
	defer log.Close()
	s.cmd = s.command(binDir, "postgres", "-D", s.dataDir(),
		"-c", "listen_addresses=", "-c", "unix_socket_directories="+s.dir,
		"-c", "port="+strconv.Itoa(pgPort), "-c", "max_connections="+strconv.Itoa(maxConns),
		"-c", "fsync=on", "-c", "synchronous_commit=on")
	s.cmd.Stdout, s.cmd.Stderr = log, log
	if err := proc.Start(s.cmd); err != nil {
		return fmt.Errorf("starting postgres: %w", err)
	}
	s.exited = make(chan struct{})
	go func() { _ = s.cmd.Wait(); close(s.exited) }()
	return nil
}

// connString returns the connection string of the server's socket.
func (s *postgresServer) connString() string {
	return fmt.Sprintf("host=%s port=%d user=%s dbname=postgres sslmode=disable", s.dir, pgPort, pgUser)
}

// await waits, up to 60 seconds, until the server accepts a connection, and
// reads its version.
func (s *postgresServer) await(ctx context.Context) error {
	deadline := time.Now().Add(60 * time.Second)
	for {
		err := s.readVersion(ctx)
		if err == nil {
			return nil
		}
		select {
		case <-s.exited:
			return fmt.Errorf("postgres exited: %s", logTail(filepath.Join(s.dir, "postgres.log")))
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("postgres in %s did not accept a connection: %w", s.dir, err)
		}
	}
}

func (s *postgresServer) readVersion(ctx context.Context) error {
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	conn, err := pgx.Connect(cctx, s.connString())
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	return conn.QueryRow(cctx, "SHOW server_version").Scan(&s.version)
}

// stop asks the server for a fast shutdown, kills it if it has not stopped
// within 30 seconds, and removes its directory.
func (s *postgresServer) stop() {
	if s.cmd != nil && s.cmd.Process != nil {
		_ = s.cmd.Process.Signal(syscall.SIGINT)
		select {
		case <-s.exited:
		case <-time.After(30 * time.Second):
			_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
			<-s.exited
		}
	}
	_ = os.RemoveAll(s.dir)
}

// tailOf returns the end of a program's output, for an error message.
func tailOf(b []byte) string {
	if len(b) > 1500 {
		b = b[len(b)-1500:]
	}
	return strings.TrimSpace(string(b))
}
