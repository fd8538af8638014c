# make test runs every module's tests: the core (idem, idemhttp, idemtest,
# the commands) and the integrations that keep their own go.mod (idemgrpc,
# idemotel, and bench/peers). Tests that need redis-server use it from PATH, or skip with a
# message; IDEM_REQUIRE_REDIS=1 turns the skips into failures.

MODULES := . $(patsubst %/go.mod,%,$(wildcard */go.mod */*/go.mod))

.PHONY: test vet
test:
	@set -e; for m in $(MODULES); do echo "== $$m"; (cd $$m && go test -race -count=1 -timeout 20m ./...); done

vet:
	@set -e; for m in $(MODULES); do echo "== $$m"; (cd $$m && test -z "$$(gofmt -l .)" && go vet ./... && go mod tidy -diff); done
