// Package layout chooses the layout of the index of compact claims and
// markers that RedisStores made after it is set use: v3, the marker
// floor's layout and the default, or v2, the layout before it, kept until
// it is deleted. It is for idem's own tests and tools (IDEM_TEST_LAYOUT=v2,
// idembench -layout v2): an internal package, so no user can reach it.
package layout

import (
	"fmt"
	"os"
	"sync/atomic"
)

// v2 is set while stores are to be made in the v2 layout: its zero value
// is the default, v3.
var v2 atomic.Bool

// SetV3 makes the RedisStores made from now on use the v3 layout (on, the
// default) or v2 (off), on every client and with WithReplicas.
func SetV3(on bool) { v2.Store(!on) }

// V3 reports whether stores are made in the v3 layout: unless SetV3 was
// last given false.
func V3() bool { return !v2.Load() }

// FromEnv sets the layout that IDEM_TEST_LAYOUT names ("v2", "v3"; unset or
// empty: v3), for idem's test binaries and the programs their tests start,
// so that every process of a test writes one layout. It panics on another
// value.
func FromEnv() {
	switch v := os.Getenv("IDEM_TEST_LAYOUT"); v {
	case "", "v3":
		SetV3(true)
	case "v2":
		SetV3(false)
	default:
		panic(fmt.Sprintf("IDEM_TEST_LAYOUT=%s: want v2 or v3", v))
	}
}
