#!/usr/bin/env bash
# callgrind.sh counts the Redis instructions a message costs: idem.Consume's,
# and the hand-written consumer's (idembench -baseline, setnx2 by default),
# each on a fresh redis-server of its own run under valgrind's callgrind.
#
# Usage (from anywhere in the repository):
#
#	bench/callgrind.sh [-m MESSAGES] [-w WARMUP] [-b BASELINE] [-s SIDE] [-k DIR] [-- IDEMBENCH FLAGS...]
#
#	-m MESSAGES  new message ids in the measured window, a side (default 20000)
#	-w WARMUP    ids handled before the window, a side (idembench -prefill;
#	             default 20000): the warm-up, and the ids the window finds
#	             remembered
#	-b BASELINE  the baseline whose loop is counted (default setnx2)
#	-s SIDE      count one side only: idem or baseline (default: both, and
#	             their ratio)
#	-k DIR       keep each side's callgrind dumps in DIR/SIDE (for
#	             callgrind_annotate), instead of removing them
#	IDEMBENCH FLAGS replace the workload's flags, they are not added to
#	             them: the default is -batch 500 -dup 0.2 -c 4, and
#	             `-- -batch 10` runs -batch 10 alone (no -dup, -c 1); give
#	             every flag of the workload you want
#
# For each side (idem, then the baseline) it starts
#
#	valgrind --tool=callgrind --instr-atstart=no redis-server --port P --save '' --appendonly no
#
# in a temporary directory on a free loopback port, and runs
#
#	idembench -workload batch -messages MESSAGES -prefill WARMUP -side SIDE -on-measure HOOK
#
# whose HOOK turns instrumentation on (callgrind_control -i on, then -z)
# when the prefill has ended, and dumps the counts (callgrind_control -d)
# when the measured window ends, before idembench reads and cleans up. It
# prints the instructions (Ir) of the window over its messages (redeliveries
# included; the same stream on both sides), and the ratio. The window also
# holds what idembench does around its slices (INFO reads, about 40): about
# 0.4M instructions a side, some 20 a message at the default sizes, less
# with a larger -m. It stops every process it started, and removes its
# directory, whatever happens. Redis under valgrind runs some 50 times
# slower: keep the sizes small. Needs valgrind, redis-server, redis-cli, go
# and python3 (to find a free port).
set -euo pipefail

messages=20000
warmup=20000
baseline=setnx2
sides="idem baseline"
keep=""
while getopts "m:w:b:s:k:h" opt; do
	case $opt in
	m) messages=$OPTARG ;;
	w) warmup=$OPTARG ;;
	b) baseline=$OPTARG ;;
	s)
		case $OPTARG in
		idem | baseline) sides=$OPTARG ;;
		*)
			echo "callgrind.sh: -s takes idem or baseline, not $OPTARG" >&2
			exit 2
			;;
		esac
		;;
	k) keep=$OPTARG ;;
	*)
		sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
		exit 2
		;;
	esac
done
shift $((OPTIND - 1))
workload=(-batch 500 -dup 0.2 -c 4)
if [ $# -gt 0 ]; then
	workload=("$@")
fi

for tool in valgrind callgrind_control redis-server redis-cli go python3; do
	command -v "$tool" >/dev/null || {
		echo "callgrind.sh: $tool not found" >&2
		exit 1
	}
done

root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/idem-callgrind.XXXXXX")
vg=""
cleanup() {
	if [ -n "$vg" ] && kill -0 "$vg" 2>/dev/null; then
		kill "$vg" 2>/dev/null || true
		wait "$vg" 2>/dev/null || true
	fi
	rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

(cd "$root" && go build -o "$tmp/idembench" ./cmd/idembench)

# count SIDE writes the instructions of SIDE's measured window, and its
# messages, as "IR MESSAGES", to $tmp/SIDE/counts.
count() {
	local side=$1 dir="$tmp/$1" port
	mkdir -p "$dir"
	port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
	(cd "$dir" && exec valgrind --tool=callgrind --instr-atstart=no \
		--callgrind-out-file="$dir/callgrind.out" \
		redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
		>"$dir/redis.log" 2>&1) &
	vg=$!
	for _ in $(seq 600); do
		redis-cli -p "$port" ping >/dev/null 2>&1 && break
		kill -0 "$vg" 2>/dev/null || {
			echo "callgrind.sh: redis-server under valgrind did not start:" >&2
			cat "$dir/redis.log" >&2
			exit 1
		}
		sleep 0.1
	done
	cat >"$dir/hook" <<EOF
#!/bin/sh
set -e
case \$1 in
start) callgrind_control -i on $vg >/dev/null; callgrind_control -z $vg >/dev/null ;;
stop) callgrind_control -d $vg >/dev/null; callgrind_control -i off $vg >/dev/null ;;
esac
EOF
	chmod +x "$dir/hook"
	echo "callgrind.sh: $side: prefill of $warmup ids, then $messages ids measured, on port $port" >&2
	"$tmp/idembench" -redis "redis://127.0.0.1:$port" -workload batch -baseline "$baseline" \
		"${workload[@]}" -messages "$messages" -prefill "$warmup" -side "$side" \
		-on-measure "$dir/hook" -json >"$dir/result.json" 2>"$dir/idembench.err" || {
		echo "callgrind.sh: idembench failed:" >&2
		cat "$dir/idembench.err" >&2
		exit 1
	}
	redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || kill "$vg"
	wait "$vg" 2>/dev/null || true
	vg=""
	local dumps ir ops field=ops
	[ "$side" = baseline ] && field=baseline_ops
	dumps=$(ls "$dir"/callgrind.out.[0-9]* 2>/dev/null || true)
	[ -n "$dumps" ] || {
		echo "callgrind.sh: $side: no dump written" >&2
		exit 1
	}
	# The window's dump, the one callgrind_control -d wrote
	# (callgrind.out.1); callgrind.out, written at exit, is not the
	# window's.
	ir=$(grep -h '^summary:' $dumps | awk '{s += $2} END {printf "%.0f", s}')
	ops=$(sed -n "s/^  \"$field\": \([0-9]*\),$/\1/p" "$dir/result.json")
	echo "$ir $ops" >"$dir/counts"
	if [ -n "$keep" ]; then
		mkdir -p "$keep/$side"
		cp $dumps "$keep/$side/"
		echo "callgrind.sh: $side: dumps kept in $keep/$side" >&2
	fi
}

for side in $sides; do
	count "$side"
done
if [ "$sides" != "idem baseline" ]; then
	read -r ir msgs <"$tmp/$sides/counts"
	name=idem.Consume
	[ "$sides" = baseline ] && name=$baseline
	awk -v a="$ir" -v n="$msgs" -v name="$name" -v w="$warmup" 'BEGIN {
		printf "Redis instructions per message (callgrind Ir over the window; %d ids prefilled before it):\n", w
		printf "  %-12s  %8.0f  (%.0f instructions, %d messages)\n", name, a / n, a, n
	}'
	exit 0
fi
read -r idem_ir idem_msgs <"$tmp/idem/counts"
read -r base_ir base_msgs <"$tmp/baseline/counts"
awk -v a="$idem_ir" -v n="$idem_msgs" -v b="$base_ir" -v m="$base_msgs" -v name="$baseline" -v w="$warmup" 'BEGIN {
	printf "Redis instructions per message (callgrind Ir over the window; %d ids prefilled before it):\n", w
	printf "  idem.Consume  %8.0f  (%.0f instructions, %d messages)\n", a / n, a, n
	printf "  %-12s  %8.0f  (%.0f instructions, %d messages)\n", name, b / m, b, m
	printf "  ratio         %8.2fx\n", (a / n) / (b / m)
}'
