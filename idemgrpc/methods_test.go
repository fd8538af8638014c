package idemgrpc_test

import (
	"testing"

	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/internal/redistest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// init registers the proto declaration of ledgerService, as generated code
// would: Get has no side effects, Put is idempotent, Post is neither.
func init() {
	_ = wrapperspb.String // google/protobuf/wrappers.proto is registered by its package
	method := func(name string, level descriptorpb.MethodOptions_IdempotencyLevel) *descriptorpb.MethodDescriptorProto {
		return &descriptorpb.MethodDescriptorProto{
			Name:       proto.String(name),
			InputType:  proto.String(".google.protobuf.StringValue"),
			OutputType: proto.String(".google.protobuf.StringValue"),
			Options:    &descriptorpb.MethodOptions{IdempotencyLevel: level.Enum()},
		}
	}
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name:       proto.String("idemgrpc/test/ledger.proto"),
		Package:    proto.String("idemgrpc.test"),
		Dependency: []string{"google/protobuf/wrappers.proto"},
		Syntax:     proto.String("proto3"),
		Service: []*descriptorpb.ServiceDescriptorProto{{
			Name: proto.String("Ledger"),
			Method: []*descriptorpb.MethodDescriptorProto{
				method("Get", descriptorpb.MethodOptions_NO_SIDE_EFFECTS),
				method("Put", descriptorpb.MethodOptions_IDEMPOTENT),
				method("Post", descriptorpb.MethodOptions_IDEMPOTENCY_UNKNOWN),
			},
		}},
	}, protoregistry.GlobalFiles)
	if err != nil {
		panic(err)
	}
	if err := protoregistry.GlobalFiles.RegisterFile(fd); err != nil {
		panic(err)
	}
}

// By default, both interceptors leave alone the methods whose proto says
// they are safe to repeat: the client attaches no key, the server claims
// none; the others are guarded. WithMethods replaces the rule with a list.
func TestMethodsDeclaredIdempotentPassThrough(t *testing.T) {
	redistest.Each(t, func(t *testing.T, b *redistest.Backend) {
		var runs ledger
		conn := dial(t, serve(t, newKeeper(t, b.Client), runs.handle), nil, []idemgrpc.Option{})
		ctx := idemgrpc.ContextWithKey(t.Context(), "k1")

		for _, m := range []string{"Get", "Put", "Post"} {
			for range 2 {
				require.NoError(t, call(ctx, conn, "/"+ledgerService+"/"+m, "x").err)
			}
		}
		assert.Equal(t, []string{
			"/idemgrpc.test.Ledger/Get x", "/idemgrpc.test.Ledger/Get x",
			"/idemgrpc.test.Ledger/Put x", "/idemgrpc.test.Ledger/Put x",
			"/idemgrpc.test.Ledger/Post x",
		}, runs.all(), "Post runs once, its retry is a replay")
		assert.Equal(t, []string{"", "", "", "", "k1"}, runs.allKeys(), "a key only on Post")
	})
}

func TestWithMethodsListsTheGuarded(t *testing.T) {
	var runs ledger
	k, _ := newMiniKeeper(t)
	only := idemgrpc.WithMethods("/" + ledgerService + "/Get")
	conn := dial(t, serve(t, k, runs.handle, only), nil, []idemgrpc.Option{only})
	ctx := idemgrpc.ContextWithKey(t.Context(), "k1")

	for _, m := range []string{"Get", "Post"} {
		for range 2 {
			require.NoError(t, call(ctx, conn, "/"+ledgerService+"/"+m, "x").err)
		}
	}
	assert.Equal(t, []string{"/idemgrpc.test.Ledger/Get x", "/idemgrpc.test.Ledger/Post x", "/idemgrpc.test.Ledger/Post x"}, runs.all())
	assert.Equal(t, []string{"k1", "", ""}, runs.allKeys())
}
