package histogram

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

func TestQuantiles(t *testing.T) {
	var h Histogram
	for i := 1; i <= 1000; i++ {
		h.Record(time.Duration(i) * time.Microsecond)
	}
	for q, want := range map[float64]float64{0.5: 500, 0.95: 950, 0.99: 990} {
		assert.InEpsilon(t, want, h.Quantile(q), 0.04, "q%v", q)
	}
	var empty Histogram
	assert.Zero(t, empty.Quantile(0.5))
	var sum Histogram
	sum.Add(&h)
	assert.Equal(t, h.Quantile(0.5), sum.Quantile(0.5))
	h.Record(time.Hour) // beyond the last bucket: counted in it
	assert.Positive(t, h.Quantile(1))
	h.Record(-time.Second) // counted as zero
	assert.Positive(t, h.Quantile(0.5))
}
