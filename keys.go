package idem

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"fmt"
)

// MaxKeyLen is the longest key accepted, in bytes.
const MaxKeyLen = 255

// ValidateKey reports whether key can be used: it must be 1 to MaxKeyLen bytes
// long and hold no control characters (bytes below 0x20, and 0x7f). The error
// wraps ErrInvalidKey.
func ValidateKey(key string) error {
	if key == "" {
		return fmt.Errorf("%w: empty", ErrInvalidKey)
	}
	if len(key) > MaxKeyLen {
		return fmt.Errorf("%w: %d bytes, longer than %d", ErrInvalidKey, len(key), MaxKeyLen)
	}
	for i := 0; i < len(key); i++ {
		if c := key[i]; c < 0x20 || c == 0x7f {
			return fmt.Errorf("%w: control character 0x%02x at byte %d", ErrInvalidKey, c, i)
		}
	}
	return nil
}

// idLen is the length of a record id: 16 bytes of SHA-256, base64url.
const idLen = 22

// RecordID returns the id of the record of (scope, key): the digest under
// which a Store keeps it, as Event.ID and Record.ID name it, so that an
// operator or a log can tie an id to a key they know. The key is not
// checked (see ValidateKey).
func RecordID(scope, key string) string { return recordID(scope, key) }

// recordID is the fixed-length digest of (scope, key) under which a record is
// stored. Raw client keys never reach the store. The scope's length is hashed
// first so that ("ab", "c") and ("a", "bc") differ.
func recordID(scope, key string) string {
	var id [idLen]byte
	putRecordID(&id, scope, key)
	return string(id[:])
}

// putRecordID writes the record id of (scope, key) into id.
func putRecordID(id *[idLen]byte, scope, key string) {
	// Hash from a buffer on the stack when (scope, key) fits in it.
	var stack [512]byte
	b := binary.BigEndian.AppendUint64(stack[:0], uint64(len(scope)))
	b = append(append(b, scope...), key...)
	sum := sha256.Sum256(b)
	base64.RawURLEncoding.Encode(id[:], sum[:16])
}

// fingerprintLen is how many bytes of a fingerprint's SHA-256 are stored.
const fingerprintLen = 12

// fingerprintDigest reduces a caller's fingerprint of any length to the short
// form kept in the record; an empty fingerprint stays empty.
func fingerprintDigest(fp []byte) string {
	if len(fp) == 0 {
		return ""
	}
	sum := sha256.Sum256(fp)
	return base64.RawURLEncoding.EncodeToString(sum[:fingerprintLen])
}
