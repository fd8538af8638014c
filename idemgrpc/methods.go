package idemgrpc

import (
	"slices"
	"strings"

	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
)

// methods says which full methods an interceptor guards (WithMethods).
type methods struct {
	// only lists the guarded methods when listed is set.
	only   []string
	listed bool
}

// guards reports whether fullMethod is guarded: listed, or, without a list,
// not declared free of side effects or idempotent in its proto.
func (m *methods) guards(fullMethod string) bool {
	if m.listed {
		return slices.Contains(m.only, fullMethod)
	}
	return !declaredIdempotent(fullMethod)
}

// declaredIdempotent reports whether the proto declaration of fullMethod
// ("/package.Service/Method"), found in the global registry, sets
// idempotency_level to NO_SIDE_EFFECTS or IDEMPOTENT: such a method is safe
// to repeat without a key, as HTTP's GET and PUT are.
func declaredIdempotent(fullMethod string) bool {
	name := protoreflect.FullName(strings.Replace(strings.TrimPrefix(fullMethod, "/"), "/", ".", 1))
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(name)
	if err != nil {
		return false
	}
	md, ok := d.(protoreflect.MethodDescriptor)
	if !ok {
		return false
	}
	opts, ok := md.Options().(*descriptorpb.MethodOptions)
	if !ok {
		return false
	}
	switch opts.GetIdempotencyLevel() {
	case descriptorpb.MethodOptions_NO_SIDE_EFFECTS, descriptorpb.MethodOptions_IDEMPOTENT:
		return true
	}
	return false
}
