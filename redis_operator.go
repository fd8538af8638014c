package idem

import (
	"context"
	_ "embed"
	"fmt"
	"strconv"
	"time"
)

// The operator steps of redisStore: Inspect, Forget and Abandon, a script
// each (lua/inspect.lua, lua/forget.lua, lua/abandon.lua), and the reading
// of their answers, which share one shape.

var (
	//go:embed lua/inspect.lua
	inspectBody   string
	inspectScript = newLuaScript("inspect", inspectBody)
)

var (
	//go:embed lua/forget.lua
	forgetBody   string
	forgetScript = newLuaScript("forget", forgetBody)
)

var (
	//go:embed lua/abandon.lua
	abandonBody   string
	abandonScript = newLuaScript("abandon", abandonBody)
)

// Inspect implements recordStore with one read-only script, one round trip.
// id is a record id (Record.ID, or what the Keeper makes of a scope and key).
// Errors: ErrInvalidKey for an id that is not one, ErrCorrupt,
// ErrUnavailable, and the caller's own cancellation.
func (s *redisStore) Inspect(ctx context.Context, id string) (Record, error) {
	if err := checkRecordID(id); err != nil {
		return Record{}, err
	}
	if ctx.Err() != nil {
		return Record{}, canceled(ctx, "inspect")
	}
	rk := s.key(id)
	keys, args, err := s.withIndex(ctx, id, rk, 0)
	if err != nil {
		return Record{ID: id, Key: rk}, err
	}
	res, err := s.runIndexed(ctx, inspectScript, keys, args)
	if err != nil {
		return Record{ID: id, Key: rk}, storeError(ctx, "inspect", s.layoutError(err))
	}
	code, r, err := parseRecordReply(id, rk, res)
	if err == nil && (code == recordUnchanged || code == recordRefused) {
		return r, unexpected(res)
	}
	return r, err
}

// withIndex returns the keys and the arguments after args with which an
// operator script (inspect.lua, forget.lua, abandon.lua) reads the record
// id at key rk and, when there is none, its compact claim or marker: the
// index key and, for a token not 0, the call record key of that token;
// the first 8 bytes of the record's digest and the start of the call
// record keys (see lib.lua).
func (s *redisStore) withIndex(ctx context.Context, id, rk string, token int64, args ...any) ([]string, []any, error) {
	if err := s.layoutReady(ctx); err != nil {
		return nil, nil, err
	}
	d8, index, calls := s.compactIndexArgs(id)
	keys := []string{rk, index}
	if token != 0 {
		keys = append(keys, v3CallKey(calls, token))
	}
	return keys, append(args, d8, calls), nil
}

// runIndexed runs the operator script sc with the keys and args withIndex
// made, and, while it answers {10, token} (the record's entry is held by a
// call whose call record it was not given), again with that call record
// as its third key: every key the script reads is one of its keys.
func (s *redisStore) runIndexed(ctx context.Context, sc *luaScript, keys []string, args []any) ([]any, error) {
	calls := args[len(args)-1].(string)
	for asked := 0; ; asked++ {
		res, err := sc.Run(ctx, s.client, keys, args...).Slice()
		if err != nil {
			return nil, err
		}
		tok, ok := callAsked(res)
		if !ok {
			return res, nil
		}
		if asked == maxCallAsks {
			return nil, fmt.Errorf("%w: the index entry of the key moved to another call %d times while it was read", ErrUnavailable, asked+1)
		}
		keys = append(keys[:2:2], v3CallKey(calls, tok))
	}
}

// checkRecordID refuses an id that no Keeper makes.
func checkRecordID(id string) error {
	if len(id) != idLen || !isBase64URL(id) {
		return fmt.Errorf("%w: record id %q is not %d base64url characters", ErrInvalidKey, id, idLen)
	}
	return nil
}

// parseRecordReply reads a reply of inspect.lua, forget.lua or abandon.lua:
// {code, now_s, now_us} for no record, {code, header, pttl, rest_len,
// rest_head, now_s, now_us[, checkpoints]} for a record (codes 1 to 3),
// {code, header, pttl, rest_len, rest_head, now_s, now_us, 0, done_us} for
// a compact claim or a marker (codes 1 to 3, and 6 for inspect.lua), {5,
// reason} for a value that is not one. It returns the reply's code and the
// record.
func parseRecordReply(id, key string, res []any) (int64, Record, error) {
	r := Record{ID: id, Key: key}
	code := replyCode(res)
	// A record is answered by recordDone, recordUnchanged or recordRefused.
	described := code >= recordDone && code <= recordRefused
	switch {
	case code == replyNotOurs:
		return code, r, corrupt(res)
	case code == recordNone && len(res) == 3:
		return code, r, nil
	case described && (len(res) == 7 || len(res) == 8):
		r, err := parseRecord(r, res)
		return code, r, err
	case (described || code == recordCompact) && len(res) == 9:
		// A compact claim or a marker, described as a record: its call
		// record's PTTL, no checkpoints, when the call completed it.
		r, err := parseRecord(r, res[:7])
		done, ok := res[8].(int64)
		if err == nil && !ok {
			err = unexpected(res)
		}
		r.Compact = true
		if r.State == StateCompleted && done > 0 {
			r.CompletedAgo = max(0, r.ReadAt.Sub(time.UnixMicro(done)))
		}
		return code, r, err
	}
	return code, r, unexpected(res)
}

// parseRecord reads the record in a reply {code, header, pttl, rest_len,
// rest_head, now_s, now_us[, checkpoints]} into r.
func parseRecord(r Record, res []any) (Record, error) {
	head, ok1 := res[1].(string)
	pttl, ok2 := res[2].(int64)
	restLen, ok3 := res[3].(int64)
	restHead, ok4 := res[4].(string)
	if !ok1 || !ok2 || !ok3 || !ok4 {
		return r, unexpected(res)
	}
	now, err := redisNow(res[5], res[6])
	if err != nil {
		return r, err
	}
	if r, err = parseHeader(r, head, now); err != nil {
		return r, err
	}
	r.ExpiresIn = time.Duration(pttl) * time.Millisecond
	if pttl < 0 {
		r.ExpiresIn = -1
	}
	r.ReadAt = time.UnixMicro(now)
	if len(res) == 8 {
		if r.Checkpoints, err = parseCheckpointInfo(res[7]); err != nil {
			return r, err
		}
	}
	return r, r.setResult(restLen, restHead)
}

// parseCheckpointInfo reads the checkpoints of a reply: {name, size, ...}.
func parseCheckpointInfo(v any) ([]CheckpointInfo, error) {
	flat, ok := v.([]any)
	if !ok || len(flat) == 0 || len(flat)%2 != 0 {
		return nil, fmt.Errorf("%w: checkpoints %v", ErrCorrupt, v)
	}
	cps := make([]CheckpointInfo, 0, len(flat)/2)
	for i := 0; i < len(flat); i += 2 {
		name, ok1 := flat[i].(string)
		size, ok2 := flat[i+1].(int64)
		if !ok1 || !ok2 || name == "" || size < 0 {
			return nil, fmt.Errorf("%w: checkpoints %v", ErrCorrupt, v)
		}
		cps = append(cps, CheckpointInfo{Name: name, Size: int(size)})
	}
	return cps, nil
}

// redisNow reads Redis's TIME, seconds and microseconds, as microseconds.
func redisNow(sec, usec any) (int64, error) {
	s, ok1 := sec.(string)
	us, ok2 := usec.(string)
	if ok1 && ok2 {
		a, err1 := strconv.ParseInt(s, 10, 64)
		b, err2 := strconv.ParseInt(us, 10, 64)
		if err1 == nil && err2 == nil {
			return a*1_000_000 + b, nil
		}
	}
	return 0, fmt.Errorf("%w: unexpected TIME %v %v", ErrCorrupt, sec, usec)
}

// setResult reads what follows the header: for a completed record, the
// envelope of its result, of which restHead holds the first two bytes and
// restLen counts every byte. What follows the header of a pending or
// released record is not a result, and is left to the version that wrote it.
func (r *Record) setResult(restLen int64, restHead string) error {
	if r.State != StateCompleted {
		return nil
	}
	switch {
	case restLen < 2 || len(restHead) < 2:
		return fmt.Errorf("%w: envelope of %d bytes", ErrCorrupt, restLen)
	case restHead[0] != envelopeV1:
		return fmt.Errorf("%w: envelope format %d unknown", ErrCorrupt, restHead[0])
	case restHead[1] == 0:
		return fmt.Errorf("%w: envelope kind 0", ErrCorrupt)
	}
	r.Stored, r.Size = StoredKind(restHead[1]), int(restLen-2)
	if restHead[1] == kindMarker {
		// An empty result kept as a marker is (markerEnvelope).
		r.Stored, r.Size = StoredBytes, 0
	}
	return nil
}

// Forget implements recordStore with one script, one round trip. id is a record
// id (Record.ID, or what the Keeper makes of a scope and key). Its contract
// is Keeper.ForgetRecord's; an id that is not one is refused with
// ErrInvalidKey, and a token no claim gets with ErrInvalidConfig.
func (s *redisStore) Forget(ctx context.Context, id string, token int64, force bool) (Record, error) {
	if err := checkRecordID(id); err != nil {
		return Record{}, err
	}
	if err := checkToken("forget", token); err != nil {
		return Record{}, err
	}
	if ctx.Err() != nil {
		return Record{}, canceled(ctx, "forget")
	}
	mode := ""
	if force {
		mode = "force"
	}
	rk := s.key(id)
	keys, args, err := s.withIndex(ctx, id, rk, token, token, strconv.FormatInt(token, 36), mode)
	if err != nil {
		return Record{ID: id, Key: rk}, err
	}
	res, err := forgetScript.Run(ctx, s.client, keys, args...).Slice()
	if err != nil {
		return Record{ID: id, Key: rk}, storeError(ctx, "forget", s.layoutError(err))
	}
	code, r, err := parseRecordReply(id, rk, res)
	if err != nil {
		return r, err
	}
	switch code {
	case recordNone, recordDone:
		return r, nil
	case recordRefused:
		refused := &ForgetRefusedError{Checkpoints: r.Checkpoints}
		if r.State == StatePending && r.LeaseLeft > 0 {
			refused.LeaseLeft = r.LeaseLeft
		}
		return r, refused
	}
	return r, unexpected(res)
}

// Abandon implements recordStore with one script, one round trip. id is a
// record id (Record.ID, or what the Keeper makes of a scope and key). Its
// contract is Keeper.AbandonRecord's; an id that is not one is refused with
// ErrInvalidKey, and a token no claim gets with ErrInvalidConfig.
func (s *redisStore) Abandon(ctx context.Context, id string, token int64) (Record, error) {
	if err := checkRecordID(id); err != nil {
		return Record{}, err
	}
	if err := checkToken("abandon", token); err != nil {
		return Record{}, err
	}
	if ctx.Err() != nil {
		return Record{}, canceled(ctx, "abandon")
	}
	rk := s.key(id)
	keys, args, err := s.withIndex(ctx, id, rk, token, token)
	if err != nil {
		return Record{ID: id, Key: rk}, err
	}
	res, err := s.runIndexed(ctx, abandonScript, keys, args)
	if err != nil {
		return Record{ID: id, Key: rk}, storeError(ctx, "abandon", s.layoutError(err))
	}
	code, r, err := parseRecordReply(id, rk, res)
	if err == nil && code == recordRefused { // forget.lua's, never abandon.lua's
		err = unexpected(res)
	}
	return r, err
}
