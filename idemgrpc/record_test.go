package idemgrpc

import (
	"context"
	"errors"
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/idemkit/idem"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

func TestRecordRoundTrip(t *testing.T) {
	declined, err := status.New(codes.FailedPrecondition, "declined").WithDetails(&errdetails.ErrorInfo{Reason: "CARD_DECLINED"})
	require.NoError(t, err)
	for name, rec := range map[string]*record{
		"response":   answerRecord(wrapperspb.String("charged"), nil),
		"empty":      answerRecord(&wrapperspb.StringValue{}, nil),
		"error":      answerRecord(nil, declined.Err()),
		"plain":      answerRecord(nil, errors.New("not a status")),
		"not proto":  answerRecord("a string", nil),
		"nil answer": answerRecord(nil, nil),
	} {
		b, err := rec.marshal()
		require.NoError(t, err, name)
		got, err := unmarshalRecord(b)
		require.NoError(t, err, name)
		assert.True(t, proto.Equal(rec.status, got.status), name)
		assert.True(t, proto.Equal(rec.response, got.response), name)
	}
	resp, err := answerRecord(wrapperspb.String("charged"), nil).answer()
	require.NoError(t, err)
	assert.True(t, proto.Equal(wrapperspb.String("charged"), resp.(proto.Message)))
	_, err = answerRecord(nil, declined.Err()).answer()
	assert.True(t, proto.Equal(declined.Proto(), status.Convert(err).Proto()))
	_, err = answerRecord(nil, nil).answer()
	assert.Equal(t, codes.Internal, status.Code(err))
}

// A later format may add fields: a reader skips those it does not know.
func TestRecordSkipsUnknownFields(t *testing.T) {
	b, err := answerRecord(wrapperspb.String("charged"), nil).marshal()
	require.NoError(t, err)
	b = protowire.AppendTag(b, 9, protowire.VarintType)
	b = protowire.AppendVarint(b, 42)
	b = protowire.AppendTag(b, 10, protowire.BytesType)
	b = protowire.AppendBytes(b, []byte("later"))
	got, err := unmarshalRecord(b)
	require.NoError(t, err)
	assert.Equal(t, codes.OK, got.code())
}

// encode writes the fields of a record as given, without checking them.
func encode(st *spb.Status, resp *anypb.Any) []byte {
	b := []byte{recordFormat}
	if st != nil {
		sb, _ := proto.Marshal(st)
		b = protowire.AppendBytes(protowire.AppendTag(b, fieldStatus, protowire.BytesType), sb)
	}
	if resp != nil {
		rb, _ := proto.Marshal(resp)
		b = protowire.AppendBytes(protowire.AppendTag(b, fieldResponse, protowire.BytesType), rb)
	}
	return b
}

func TestRecordCorrupt(t *testing.T) {
	resp, err := anypb.New(wrapperspb.String("charged"))
	require.NoError(t, err)
	ok := encode(&spb.Status{}, resp)
	for name, b := range map[string][]byte{
		"empty":               nil,
		"other format":        append([]byte{2}, ok[1:]...),
		"truncated":           ok[:len(ok)-1],
		"no status":           encode(nil, resp),
		"OK without response": encode(&spb.Status{}, nil),
		"error with response": encode(status.New(codes.NotFound, "x").Proto(), resp),
		"bad tag":             {recordFormat, 0xff},
		"status not proto":    protowire.AppendBytes(protowire.AppendTag([]byte{recordFormat}, fieldStatus, protowire.BytesType), []byte{0xff, 0xff}),
		"status as varint":    protowire.AppendVarint(protowire.AppendTag([]byte{recordFormat}, fieldStatus, protowire.VarintType), 1),
	} {
		_, err := unmarshalRecord(b)
		assert.ErrorIs(t, err, idem.ErrCorrupt, name)
	}
	_, err = unmarshalRecord(ok)
	assert.NoError(t, err)

	unknown, err := anypb.New(wrapperspb.String("x"))
	require.NoError(t, err)
	unknown.TypeUrl = "type.googleapis.com/no.such.Message"
	rec, err := unmarshalRecord(encode(&spb.Status{}, unknown))
	require.NoError(t, err)
	_, err = rec.answer()
	assert.ErrorIs(t, err, idem.ErrCorrupt, "a response type not in the registry")
}

// A record completed by something else than the interceptor (idem.Do with
// the same scope, key and fingerprint) is not replayed as if it were one.
func TestForeignRecordIsNotReplayed(t *testing.T) {
	m := miniredis.RunT(t)
	client := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { client.Close() })
	k, err := idem.NewRedis(client)
	require.NoError(t, err)
	guard, err := UnaryServerInterceptor(k)
	require.NoError(t, err)
	fp, err := fingerprint(wrapperspb.String("x"))
	require.NoError(t, err)
	const method = "/idemgrpc.test.Payments/Charge"
	for key, fn := range map[string]func(context.Context) ([]byte, error){
		"final error": func(context.Context) ([]byte, error) { return nil, idem.Final(errors.New("declined")) },
		"value":       func(context.Context) ([]byte, error) { return []byte("plain bytes"), nil },
	} {
		_, _ = idem.Do(t.Context(), k, method+" ", key, fn, idem.WithFingerprint(fp))
		ctx := metadata.NewIncomingContext(t.Context(), metadata.Pairs(DefaultKeyMetadata, key))
		_, err = guard(ctx, wrapperspb.String("x"), &grpc.UnaryServerInfo{FullMethod: method}, func(context.Context, any) (any, error) {
			t.Error("the handler ran")
			return nil, nil
		})
		assert.Equal(t, codes.Internal, status.Code(err), key)
	}
}

// FuzzRecord: any bytes read as a stored answer are ErrCorrupt or a
// record that marshals back to the same status and response; never a panic.
//
// Fuzz it with -fuzztime as a count (-fuzztime 50000x): without a bound
// it never ends.
func FuzzRecord(f *testing.F) {
	for _, rec := range []*record{
		answerRecord(wrapperspb.String("charged"), nil),
		answerRecord(nil, status.Error(codes.NotFound, "no such account")),
	} {
		b, err := rec.marshal()
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{recordFormat, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		rec, err := unmarshalRecord(b)
		if err != nil {
			if !errors.Is(err, idem.ErrCorrupt) {
				t.Fatalf("error %v does not wrap ErrCorrupt", err)
			}
			return
		}
		again, err := rec.marshal()
		if err != nil {
			return // a status message that is not UTF-8: settle stores a replacement
		}
		back, err := unmarshalRecord(again)
		if err != nil || !proto.Equal(rec.status, back.status) || !proto.Equal(rec.response, back.response) {
			t.Fatalf("a decoded record does not survive a round trip: %v", err)
		}
		_, _ = rec.answer()
	})
}
