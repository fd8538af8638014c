package idem

import (
	"fmt"
	"slices"
)

// v3Packer packs the claim argument of a v3 call and reads its reply (see
// format.go for both), in buffers it keeps from call to call: one packer
// serves one caller at a time. It remembers the index's level and split
// point from the last reply it read, and packs the next call by them.
type v3Packer struct {
	level uint8
	split uint32
	// buf is the packed argument of the last call.
	buf []byte
	// sorted holds, by place, block<<32 | the caller's index of the
	// message at that place.
	sorted []uint64
	// places holds the place (from 1) of each of the caller's messages.
	places []uint16
}

// pack packs the messages whose v3 keys are keys (in the caller's order)
// and returns the argument, valid until the next call of pack; false for
// more than v3MaxPlaces messages (a call's places), and nothing packed.
func (p *v3Packer) pack(keys []v3Key) ([]byte, bool) {
	if len(keys) > v3MaxPlaces {
		return nil, false
	}
	p.sorted = p.sorted[:0]
	for i, k := range keys {
		p.sorted = append(p.sorted, uint64(v3Block(k.h, p.level, p.split))<<32|uint64(i))
	}
	slices.Sort(p.sorted)
	p.places = slices.Grow(p.places[:0], len(keys))[:len(keys)]
	buf := slices.Grow(p.buf[:0], len(keys)*v3PackedSize)
	for j, x := range p.sorted {
		k := &keys[uint32(x)]
		p.places[uint32(x)] = uint16(j + 1)
		buf = v3AppendBlockName(buf, uint32(x>>32))
		buf = append(buf, k.d5[:]...)
		buf = append(buf, byte(k.h>>16), byte(k.h>>8), byte(k.h), byte((j+1)>>8), byte(j+1))
	}
	p.buf = buf
	return buf, true
}

// index is the caller's index of the message at place (from 1) of the
// last call packed.
func (p *v3Packer) index(place int) int { return int(uint32(p.sorted[place-1])) }

// place is the place (from 1) of the caller's message i in the last call
// packed.
func (p *v3Packer) place(i int) int { return int(p.places[i]) }

// v3Answer is a message's answer in a v3 claim reply: its code (one of the
// v3Answer constants) and the number it carries, if any.
type v3Answer struct {
	code byte
	n    int64
	// attempt, of a done or expired answer: the attempt that completed it
	// (n is then the low 48 bits of its token); of an earlier run's claim,
	// its attempt (plus v3RecoveredBit when recovered) and place.
	attempt, place uint16
}

// v3AnswerNumbered reports whether answer code carries a number.
func v3AnswerNumbered(code byte) bool {
	return code == v3AnswerBusy || code == v3AnswerTakenOver || code == v3AnswerReclaimed
}

// decode reads the reply r of the call last packed: each message's answer
// into ans (len(ans) messages, in the caller's order), the call's token
// and, when an answer is v3AnswerRefused, Redis's error that refused the
// call's write.
// It keeps the reply's level and split point for the next call. A reply
// that is not one (of another length, an unknown answer, a number
// unreadable) is ErrCorrupt: the level and split point are kept as they
// were, and what ans holds is not an answer.
func (p *v3Packer) decode(r string, ans []v3Answer) (token int64, refusal string, err error) {
	n := len(p.sorted)
	if len(ans) != n || len(r) < v3ReplyHeadSize+n {
		return 0, "", fmt.Errorf("%w: v3 claim reply of %d bytes for %d messages", ErrCorrupt, len(r), n)
	}
	for i := 0; i < 7; i++ {
		token = token<<8 | int64(r[i])
	}
	m := v3State{level: r[7], split: uint32(r[8])<<16 | uint32(r[9])<<8 | uint32(r[10]), token: token}
	if !m.valid() {
		return 0, "", fmt.Errorf("%w: v3 claim reply: index state or token out of range", ErrCorrupt)
	}
	answers, nums := r[v3ReplyHeadSize:v3ReplyHeadSize+n], r[v3ReplyHeadSize+n:]
	refused := 0
	for j := 0; j < n; j++ {
		a := v3Answer{code: answers[j]}
		switch a.code {
		case v3AnswerClaimed, v3AnswerRepeat, v3AnswerMismatch, v3AnswerNotOurs, v3AnswerRecord, v3AnswerCallMissing:
		case v3AnswerRefused:
			refused++
		case v3AnswerDone, v3AnswerExpired:
			if len(nums) < 8 {
				return 0, "", fmt.Errorf("%w: v3 claim reply: token of place %d", ErrCorrupt, j+1)
			}
			a.n = be48(nums)
			a.attempt, nums = uint16(nums[6])<<8|uint16(nums[7]), nums[8:]
		case v3AnswerEarlier:
			if len(nums) < 10 {
				return 0, "", fmt.Errorf("%w: v3 claim reply: earlier claim of place %d", ErrCorrupt, j+1)
			}
			a.n = be48(nums)
			a.place, a.attempt, nums = uint16(nums[6])<<8|uint16(nums[7]), uint16(nums[8])<<8|uint16(nums[9]), nums[10:]
		case v3AnswerBusy, v3AnswerTakenOver, v3AnswerReclaimed:
			var ok bool
			if a.n, nums, ok = cutV3Number(nums); !ok {
				return 0, "", fmt.Errorf("%w: v3 claim reply: number of place %d", ErrCorrupt, j+1)
			}
		default:
			return 0, "", fmt.Errorf("%w: v3 claim reply: answer %q", ErrCorrupt, a.code)
		}
		ans[uint32(p.sorted[j])] = a
	}
	if (nums != "") != (refused > 0) {
		return 0, "", fmt.Errorf("%w: v3 claim reply: %d bytes after the numbers, %d answers refused", ErrCorrupt, len(nums), refused)
	}
	p.level, p.split = m.level, m.split
	return token, nums, nil
}

// be48 is the big-endian number in the first 6 bytes of s: the low 48
// bits of a token, as v3 entries and replies hold them.
func be48(s string) int64 {
	var n int64
	for k := 0; k < 6; k++ {
		n = n<<8 | int64(s[k])
	}
	return n
}

// cutV3Number cuts a number of a v3 claim reply, 1 to 18 decimal digits
// without a leading zero (but 0 itself) and ',', off the front of s.
func cutV3Number(s string) (n int64, rest string, ok bool) {
	for i := 0; i < len(s) && i <= 18; i++ {
		c := s[i]
		if c == ',' {
			return n, s[i+1:], i > 0
		}
		if i == 1 && s[0] == '0' {
			return 0, s, false
		}
		if c < '0' || c > '9' {
			return 0, s, false
		}
		n = n*10 + int64(c-'0')
	}
	return 0, s, false
}
