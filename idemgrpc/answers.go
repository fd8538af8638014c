package idemgrpc

import (
	"context"
	"errors"
	"time"

	"github.com/idemkit/idem"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/types/known/durationpb"
)

// ErrorDomain is the domain of the ErrorInfo detail in the answers of the
// interceptors' own that carry one of the Reason constants.
const ErrorDomain = "github.com/idemkit/idem"

// The reasons of the ErrorInfo detail in the server interceptor's own
// answers. Clients can match on them.
const (
	// ReasonKeyMissing (InvalidArgument): a guarded call without a key,
	// while the key is required (WithKeyRequired).
	ReasonKeyMissing = "KEY_MISSING"
	// ReasonKeyInvalid (InvalidArgument): the key is empty, longer than
	// idem.MaxKeyLen bytes, holds control characters, or comes in more than
	// one metadata value.
	ReasonKeyInvalid = "KEY_INVALID"
	// ReasonKeyReused (FailedPrecondition): the key was first used with
	// another request message on the same method.
	ReasonKeyReused = "KEY_REUSED"
	// ReasonInProgress (Aborted, with RetryInfo): another call with the key
	// is still running.
	ReasonInProgress = "IN_PROGRESS"
	// ReasonStoreUnavailable (Unavailable, with RetryInfo): the store could
	// not be reached; the handler did not run.
	ReasonStoreUnavailable = "STORE_UNAVAILABLE"
	// ReasonRecordCorrupt (Internal): the record of the key cannot be read;
	// nothing was run or overwritten.
	ReasonRecordCorrupt = "RECORD_CORRUPT"
	// ReasonNotFingerprintable (Internal): the request is not a proto
	// message, so it cannot be fingerprinted; the handler did not run.
	ReasonNotFingerprintable = "REQUEST_NOT_FINGERPRINTABLE"
	// ReasonResultExpired (FailedPrecondition): a call with the key ran and
	// completed, and its answer is no longer kept (idem.ErrResultExpired:
	// only the fact is, a marker); the handler did not run again.
	ReasonResultExpired = "RESULT_EXPIRED"
)

// answer is an answer of the server interceptor's own: code and message,
// with an ErrorInfo of reason, and a RetryInfo when retry is positive.
func answer(code codes.Code, reason, msg string, retry time.Duration) error {
	st := status.New(code, msg)
	details := []protoadapt.MessageV1{&errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain}}
	if retry > 0 {
		details = append(details, &errdetails.RetryInfo{RetryDelay: durationpb.New(retry)})
	}
	if withDetails, err := st.WithDetails(details...); err == nil {
		st = withDetails
	}
	return st.Err()
}

// beginError is the answer to an error of Keeper.Begin.
func (s *server) beginError(err error) error {
	var busy *idem.InProgressError
	switch {
	case errors.As(err, &busy):
		return answer(codes.Aborted, ReasonInProgress,
			"idemgrpc: a call with this idempotency key is still running; retry after the RetryInfo delay to get its answer",
			min(s.retryHint, busy.RetryAfter))
	case errors.Is(err, idem.ErrMismatch):
		return answer(codes.FailedPrecondition, ReasonKeyReused,
			"idemgrpc: this idempotency key was first used with another request; send a new key for a new request", 0)
	case errors.Is(err, idem.ErrInvalidKey):
		return answer(codes.InvalidArgument, ReasonKeyInvalid, "idemgrpc: "+err.Error(), 0)
	case errors.Is(err, idem.ErrResultExpired):
		return answer(codes.FailedPrecondition, ReasonResultExpired,
			"idemgrpc: a call with this idempotency key ran and completed; its answer is no longer kept, and it was not run again", 0)
	case errors.Is(err, idem.ErrCorrupt):
		return corruptAnswer()
	case errors.Is(err, idem.ErrUnavailable):
		return answer(codes.Unavailable, ReasonStoreUnavailable,
			"idemgrpc: whether this call already ran cannot be checked now, so it was not run; retry it with the same idempotency key",
			s.retryHint)
	case errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.DeadlineExceeded, "idemgrpc: the call's deadline passed before its idempotency key was checked; it was not run")
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, "idemgrpc: the call was cancelled before its idempotency key was checked; it was not run")
	}
	return status.Error(codes.Internal, "idemgrpc: "+err.Error())
}

// corruptAnswer is the answer to a record that cannot be read.
func corruptAnswer() error {
	return answer(codes.Internal, ReasonRecordCorrupt,
		"idemgrpc: the stored record of this idempotency key cannot be read, so the call was not run", 0)
}

// keyAnswer is the answer to a guarded call whose key is missing (present
// false) while required, or unusable (err).
func (s *server) keyAnswer(present bool, err error) error {
	if !present {
		return answer(codes.InvalidArgument, ReasonKeyMissing,
			"idemgrpc: this call must carry "+s.header+" metadata: a unique value that the client sends again when it retries the call", 0)
	}
	return answer(codes.InvalidArgument, ReasonKeyInvalid, "idemgrpc: "+err.Error(), 0)
}

// tenantAnswer is the answer to a call the tenant function refused: the
// status err carries, else InvalidArgument.
func tenantAnswer(err error) error {
	if st, ok := status.FromError(err); ok && st.Code() != codes.OK {
		return st.Err()
	}
	return status.Error(codes.InvalidArgument, err.Error())
}
