package idemotel

import (
	"github.com/idemkit/idem"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// The attribute keys.
const (
	keyStep      = attribute.Key("idem.step")
	keyResult    = attribute.Key("idem.result")
	keyScope     = attribute.Key("idem.scope")
	keyID        = attribute.Key("idem.id")
	keyPartition = attribute.Key("idem.partition")
	keyToken     = attribute.Key("idem.token")
	keyAttempt   = attribute.Key("idem.attempt")
	keyRecovered = attribute.Key("idem.recovered")
	keyStatus    = attribute.Key("idem.status")
	keyMarker    = attribute.Key("idem.marker")
	keyErrorType = attribute.Key("error.type")
)

// label is what the metrics and the span of one (step, result) carry, made
// once so that recording allocates nothing.
type label struct {
	add    []metric.AddOption
	record []metric.RecordOption
	// span is the span's name, result its idem.result attribute.
	span   string
	result attribute.KeyValue
}

func newLabel(step idem.Step, result idem.Result) *label {
	set := attribute.NewSet(keyStep.String(step.String()), keyResult.String(result.String()))
	opt := metric.WithAttributeSet(set)
	return &label{
		add:    []metric.AddOption{opt},
		record: []metric.RecordOption{opt},
		span:   "idem." + step.String(),
		result: keyResult.String(result.String()),
	}
}

// labelTable holds a label for every (step, result) below its bounds, which
// leave room above idem's steps and results.
type labelTable [16][24]*label

func newLabelTable() labelTable {
	var t labelTable
	for s := range t {
		for r := range t[s] {
			t[s][r] = newLabel(idem.Step(s), idem.Result(r))
		}
	}
	return t
}

// get returns the label of (step, result); one outside the table is made
// for the call.
func (t *labelTable) get(step idem.Step, result idem.Result) *label {
	if int(step) < len(t) && int(result) < len(t[0]) {
		return t[step][result]
	}
	return newLabel(step, result)
}
