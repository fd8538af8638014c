# make test runs every module's tests with -race, as CI does (.ci/run): the
# core (idem, idemhttp, idemtest, the commands) and the integrations that keep
# their own go.mod (idemgrpc, idemotel, idemwatermill, idemjetstream,
# idemkafka and bench/peers). It downloads every module's dependencies first, so that no
# download lands in the middle of a run, and prints each module as it starts
# and how long it took. Tests that need redis-server use it from PATH, or skip
# with a message; IDEM_REQUIRE_REDIS=1 turns the skips into failures.
#
# make check is the loop for editing (.ci/check): the tests of the core and of
# every integration module side by side, without -race and with -short, which
# leaves out the long fault and soak suites (and bench/peers, a benchmark);
# about a minute on 2 shared vCPUs.

MODULES := . $(patsubst %/go.mod,%,$(wildcard */go.mod */*/go.mod))

.PHONY: test check vet download
download:
	@set -e; for m in $(MODULES); do (cd $$m && go mod download); done

test: download
	@set -e; start=$$(date +%s); for m in $(MODULES); do \
		echo "== $$m"; began=$$(date +%s); \
		(cd $$m && go test -race -count=1 -timeout 20m ./...); \
		echo "== $$m: $$(( $$(date +%s) - began ))s"; \
	done; echo "== make test: every module passed in $$(( $$(date +%s) - start ))s"

check: download
	@bash .ci/check

vet:
	@set -e; for m in $(MODULES); do echo "== $$m"; (cd $$m && test -z "$$(gofmt -l .)" && go vet ./... && go mod tidy -diff); done
