package idem

// Internals for the tests of package idem_test, which use idemhttp (an
// import cycle for the tests of package idem).
var (
	Waiting    = waiting
	Eventually = eventually
)
