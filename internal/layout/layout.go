// Package layout chooses the layout of the index of compact claims and
// markers that RedisStores made after it is set use: v2 (the default) or
// v3, the marker floor's layout. It is for idem's own tests and tools (IDEM_TEST_LAYOUT=v3, idembench
// -layout v3): an internal package, so no user can reach it.
package layout

import (
	"fmt"
	"os"
	"sync/atomic"
)

var v3 atomic.Bool

// SetV3 makes the RedisStores made from now on use the v3 layout (on) or v2
// (off), on every client and with WithReplicas.
func SetV3(on bool) { v3.Store(on) }

// V3 reports whether SetV3 was last given true.
func V3() bool { return v3.Load() }

// FromEnv sets the layout that IDEM_TEST_LAYOUT names ("v2", "v3"; unset or
// empty: v2), for idem's test binaries and the programs their tests start,
// so that every process of a test writes one layout. It panics on another
// value.
func FromEnv() {
	switch v := os.Getenv("IDEM_TEST_LAYOUT"); v {
	case "", "v2":
		SetV3(false)
	case "v3":
		SetV3(true)
	default:
		panic(fmt.Sprintf("IDEM_TEST_LAYOUT=%s: want v2 or v3", v))
	}
}
