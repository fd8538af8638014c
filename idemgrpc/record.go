package idemgrpc

import (
	"fmt"

	"github.com/idemkit/idem"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

// recordFormat is the first byte of every stored record. A reader skips
// fields it does not know, so a later format may add fields; one that
// changes a field's meaning takes a new format byte, read by a release
// before any release writes it.
const recordFormat = 1

// Field numbers of a record, after its format byte. Both are
// length-delimited.
const (
	// fieldStatus holds the answer's status, a google.rpc.Status: code,
	// message and details.
	fieldStatus protowire.Number = 1
	// fieldResponse holds the response message as a google.protobuf.Any
	// (its type URL and bytes); present only when the status is OK.
	fieldResponse protowire.Number = 2
)

// record is what the server interceptor stores for one call.
type record struct {
	status   *spb.Status
	response *anypb.Any // nil unless status.Code is OK
}

// answerRecord is the record of the handler's answer (resp, err). A
// response that cannot be stored (not a proto.Message) is recorded as an
// Internal status: the side effect happened, so the key must not be
// released.
func answerRecord(resp any, err error) *record {
	if err != nil {
		return &record{status: statusOf(err).Proto()}
	}
	msg, ok := resp.(proto.Message)
	if !ok {
		return notStorable(fmt.Sprintf("idemgrpc: the response of the first call, a %T, is not a proto message and was not kept", resp))
	}
	a, merr := anypb.New(msg)
	if merr != nil {
		return notStorable("idemgrpc: the response of the first call could not be encoded and was not kept: " + merr.Error())
	}
	return &record{status: &spb.Status{}, response: a}
}

func notStorable(msg string) *record {
	return &record{status: status.New(codes.Internal, msg).Proto()}
}

// code is the status code the record answers.
func (r *record) code() codes.Code { return codes.Code(r.status.GetCode()) }

// marshal encodes the record.
func (r *record) marshal() ([]byte, error) {
	st, err := proto.Marshal(r.status)
	if err != nil {
		return nil, err
	}
	b := []byte{recordFormat}
	b = protowire.AppendTag(b, fieldStatus, protowire.BytesType)
	b = protowire.AppendBytes(b, st)
	if r.response != nil {
		resp, err := proto.Marshal(r.response)
		if err != nil {
			return nil, err
		}
		b = protowire.AppendTag(b, fieldResponse, protowire.BytesType)
		b = protowire.AppendBytes(b, resp)
	}
	return b, nil
}

// unmarshalRecord decodes a record; an error wraps idem.ErrCorrupt.
func unmarshalRecord(b []byte) (*record, error) {
	if len(b) == 0 || b[0] != recordFormat {
		return nil, fmt.Errorf("%w: idemgrpc: not a record of this format", idem.ErrCorrupt)
	}
	r := &record{}
	for b = b[1:]; len(b) > 0; {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil, corrupt(protowire.ParseError(n))
		}
		b = b[n:]
		if (num == fieldStatus || num == fieldResponse) && typ == protowire.BytesType {
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return nil, corrupt(protowire.ParseError(n))
			}
			if err := r.setField(num, v); err != nil {
				return nil, corrupt(err)
			}
			b = b[n:]
			continue
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return nil, corrupt(protowire.ParseError(n))
		}
		b = b[n:]
	}
	return r, r.check()
}

// setField decodes one known field into r.
func (r *record) setField(num protowire.Number, v []byte) error {
	if num == fieldStatus {
		r.status = &spb.Status{}
		return proto.Unmarshal(v, r.status)
	}
	r.response = &anypb.Any{}
	return proto.Unmarshal(v, r.response)
}

// check reports a record whose fields do not fit together.
func (r *record) check() error {
	switch {
	case r.status == nil:
		return corrupt(fmt.Errorf("no status"))
	case r.code() == codes.OK && r.response == nil:
		return corrupt(fmt.Errorf("status OK without a response"))
	case r.code() != codes.OK && r.response != nil:
		return corrupt(fmt.Errorf("status %s with a response", r.code()))
	}
	return nil
}

func corrupt(err error) error {
	return fmt.Errorf("%w: idemgrpc: %w", idem.ErrCorrupt, err)
}

// answer is the gRPC answer of the record: the response message, or the
// status as an error.
func (r *record) answer() (any, error) {
	if r.code() != codes.OK {
		return nil, status.ErrorProto(r.status)
	}
	msg, err := r.response.UnmarshalNew()
	if err != nil {
		return nil, corrupt(fmt.Errorf("the stored response (%s) cannot be decoded: %w", r.response.GetTypeUrl(), err))
	}
	return msg, nil
}
