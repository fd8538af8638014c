package main

import (
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
)

// resultSize is the size of every operation's result, a JSON object.
const resultSize = 200

// keyLen is the length of every key: the shape of a UUID, which Fiber's
// middleware insists on by default.
const keyLen = 36

// keyPrefix starts every key; the last 12 characters are the key's id in hex.
const keyPrefix = "00000000-0000-4000-8000-"

// keyOf returns the key of id.
func keyOf(id uint64) string {
	b := make([]byte, 0, keyLen)
	b = append(b, keyPrefix...)
	hex := strconv.FormatUint(id, 16)
	for range keyLen - len(keyPrefix) - len(hex) {
		b = append(b, '0')
	}
	return string(append(b, hex...))
}

// idOf returns the id of a key made by keyOf.
func idOf(key string) (uint64, error) {
	if len(key) != keyLen || key[:len(keyPrefix)] != keyPrefix {
		return 0, fmt.Errorf("key %q is not one of the command's", key)
	}
	return strconv.ParseUint(key[len(keyPrefix):], 16, 64)
}

// The result of key k is {"key":"k","data":"abc..."}, resultSize bytes.
const (
	resultOpen = `{"key":"`
	resultMid  = `","data":"`
	resultEnd  = `"}`
)

// resultTemplate is a result with the key's place empty.
var resultTemplate = func() []byte {
	b := make([]byte, 0, resultSize)
	b = append(b, resultOpen...)
	b = append(b, make([]byte, keyLen)...)
	b = append(b, resultMid...)
	for i := 0; len(b) < resultSize-len(resultEnd); i++ {
		b = append(b, 'a'+byte(i%26))
	}
	return append(b, resultEnd...)
}()

// resultOf returns the result of the operation for key, a key of keyOf.
func resultOf(key string) []byte {
	b := make([]byte, resultSize)
	copy(b, resultTemplate)
	copy(b[len(resultOpen):], key)
	return b
}

// checkResult returns an error unless res is the result of key.
func checkResult(res []byte, key string) error {
	switch {
	case len(res) != resultSize:
		return fmt.Errorf("a %d-byte result, want %d", len(res), resultSize)
	case string(res[len(resultOpen):len(resultOpen)+keyLen]) != key:
		return fmt.Errorf("the result of key %q for key %q", res[len(resultOpen):len(resultOpen)+keyLen], key)
	}
	return nil
}

// operation is what every peer guards: it produces the key's result, and
// counts how often it ran for each key. Safe for concurrent use.
type operation struct {
	// ran has a bit for each key id that ran, over the whole command: ids
	// are never reused.
	ran bitset
	// tally counts the executions of the current cell; swapped by count.
	tally atomic.Pointer[tally]
	// foreign counts calls with a key that is not one of the command's.
	foreign atomic.Int64
}

// tally is what the operation did during one cell.
type tally struct {
	// executions counts the runs, and repeats the runs of a key that had
	// run before.
	executions, repeats atomic.Int64
}

func newOperation() *operation {
	op := &operation{}
	op.tally.Store(&tally{})
	return op
}

// count starts counting anew and returns the tally that counts from now on.
func (op *operation) count() *tally {
	t := &tally{}
	op.tally.Store(t)
	return t
}

// run runs the operation for key: counts it and returns its result.
func (op *operation) run(key string) []byte {
	id, err := idOf(key)
	if err != nil {
		op.foreign.Add(1)
		return resultOf(keyPrefix + "000000000000")
	}
	t := op.tally.Load()
	t.executions.Add(1)
	if !op.ran.mark(id) {
		t.repeats.Add(1)
	}
	return resultOf(key)
}

// errInProgress is a peer's answer when another call holds the key: in these
// workloads, where no two calls share a fresh key and every replayed key was
// completed beforehand, it is always an error.
var errInProgress = errors.New("the key is in progress")

// bitset records which ids ran. It grows in chunks, without a lock on the
// path that marks.
type bitset struct {
	chunks [1 << 16]atomic.Pointer[[chunkWords]atomic.Uint64]
}

const chunkWords = 1 << 10 // 65536 ids a chunk; 2^32 ids in all

// mark records that id ran; it returns false if it had run before.
func (b *bitset) mark(id uint64) bool {
	c := id >> 16
	if c >= uint64(len(b.chunks)) {
		panic("peers: more than 2^32 keys")
	}
	chunk := b.chunks[c].Load()
	if chunk == nil {
		b.chunks[c].CompareAndSwap(nil, new([chunkWords]atomic.Uint64))
		chunk = b.chunks[c].Load()
	}
	bit := uint64(1) << (id & 63)
	return chunk[(id>>6)&(chunkWords-1)].Or(bit)&bit == 0
}
