#!/usr/bin/env bash
# sweep.sh counts the Redis instructions a message costs, idem.Consume's and
# the two-phase SET NX loop's (idembench -baseline setnx2), at batches of 1,
# 3, 10, 100 and 500, with bench/callgrind.sh, and fits each side's cost of
# a batch to F + v·B: F, what a call costs whatever its size, and v, what
# each message adds.
#
# Usage (from anywhere in the repository):
#
#	bench/sweep.sh [-m MESSAGES] [-w WARMUP] [-B "BATCHES"] [-- IDEMBENCH FLAGS...]
#
#	-m MESSAGES  ids measured a side and a batch size (default 3000)
#	-w WARMUP    ids handled before the window (default 3000)
#	-B BATCHES   the batch sizes (default "1 3 10 100 500")
#	IDEMBENCH FLAGS are added to each run's -batch B -dup 0.2 -c 4 (for
#	             example -markers=false)
#
# About a minute at the defaults on a 2-core machine (Redis under valgrind
# runs some 50 times slower). The fit is a least-squares line through the
# points (1/B, instructions a message), a message's cost being v + F/B, so
# that each batch size counts alike. The counts are exact, since callgrind
# counts instructions, not time; run to run the callers interleave
# differently, about ±1.5k a message at batch 3 and ±0.4k at 500.
set -euo pipefail

messages=3000
warmup=3000
batches="1 3 10 100 500"
while getopts "m:w:B:h" opt; do
	case $opt in
	m) messages=$OPTARG ;;
	w) warmup=$OPTARG ;;
	B) batches=$OPTARG ;;
	*)
		sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
		exit 2
		;;
	esac
done
shift $((OPTIND - 1))

here=$(cd "$(dirname "$0")" && pwd)
rows=""
for b in $batches; do
	echo "sweep.sh: batch $b" >&2
	out=$("$here/callgrind.sh" -m "$messages" -w "$warmup" -- -batch "$b" -dup 0.2 -c 4 "$@")
	idem=$(awk '$1 == "idem.Consume" {print $2}' <<<"$out")
	base=$(awk '$1 == "setnx2" {print $2}' <<<"$out")
	if [ -z "$idem" ] || [ -z "$base" ]; then
		echo "sweep.sh: batch $b: callgrind.sh printed no figures:" >&2
		echo "$out" >&2
		exit 1
	fi
	rows+="$b $idem $base"$'\n'
done

awk -v m="$messages" -v w="$warmup" -v extra="$*" '
NF == 3 {
	n++; B[n] = $1; I[n] = $2; S[n] = $3
}
function fit(Y, which,    i, sx, sy, sxx, sxy, x, y, v, f) {
	# y = v + F·x with x = 1/B: the figure a message of each batch size counts
	# alike, rather than the cost of the largest batch deciding the line.
	for (i = 1; i <= n; i++) {
		x = 1 / B[i]; y = Y[i]
		sx += x; sy += y; sxx += x * x; sxy += x * y
	}
	if (n < 2 || n * sxx == sx * sx) {
		printf "  %-12s  (a fit needs two batch sizes or more)\n", which
		return
	}
	f = (n * sxy - sx * sy) / (n * sxx - sx * sx)
	v = (sy - f * sx) / n
	printf "  %-12s  F = %8.0f a call, v = %6.0f a message\n", which, f, v
}
END {
	printf "Redis instructions a message (bench/callgrind.sh -m %d -w %d -- -batch B -dup 0.2 -c 4 %s):\n", m, w, extra
	printf "  %6s  %12s  %10s  %7s\n", "batch", "idem.Consume", "setnx2", "ratio"
	for (i = 1; i <= n; i++) {
		printf "  %6d  %12.0f  %10.0f  %6.2fx\n", B[i], I[i], S[i], I[i] / S[i]
	}
	print "A batch costs F + v·B (least squares of the cost of a message, v + F/B):"
	fit(I, "idem.Consume")
	fit(S, "setnx2")
}' <<<"$rows"
