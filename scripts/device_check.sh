#!/usr/bin/env bash
# The device check: what a short session on a bare, offline GPU machine runs (docs/gpu.md).
#
#   scripts/device_check.sh part1   # tests on the device, syncs, FP8 GEMMs              (< 6 min)
#   scripts/device_check.sh part2   # end to end, optimizer steps, CUDA-vs-CPU fidelity  (< 6 min)
#   scripts/device_check.sh all     # both, one after the other
#
# Needs no package index: the wheels `make device-bundle` puts in build/device-bundle (carried
# to the machine with the tree) are installed with --no-index into a folder put on PYTHONPATH.
# Results go to $OUT (else build/device): <section>.json and <section>.md for each section,
# rewritten row by row, and <part>.log; the markdown tables are printed again at the end.
# Without a CUDA device the GPU sections say "no CUDA device" and the rest runs;
# DEVICE_CHECK_SMOKE=1 runs the GPU sections on CPU at toy sizes instead (checks their code).
# Each section has a time budget (bench/device_check.py PARTS; DEVICE_CHECK_BUDGET_<SECTION>
# overrides one), and the part stops starting sections at DEVICE_CHECK_SECONDS (330).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PART=${1:-}
case "$PART" in
part1 | part2 | all) ;;
*)
	echo "usage: $0 part1|part2|all" >&2
	exit 2
	;;
esac
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$ROOT/build/device}
BUNDLE=${DEVICE_BUNDLE:-$ROOT/build/device-bundle}
SITE=${DEVICE_SITE:-/tmp/hf_lowprec-device-site}
LIMIT=${DEVICE_CHECK_SECONDS:-330}
export DEVICE_BUNDLE=$BUNDLE PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export HF_LOWPREC_CACHE=${HF_LOWPREC_CACHE:-$ROOT/build/cache}
export HF_HOME=${HF_HOME:-$ROOT/build/hf_home}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$ROOT/build/torch_extensions}
# Kept while the machine stays warm: part2's processes reuse the kernels part1's compiled.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$ROOT/build/device-inductor}
mkdir -p "$OUT"

install_bundle() {
	if ! ls "$BUNDLE"/*.whl >/dev/null 2>&1; then
		echo "no wheels in $BUNDLE (make device-bundle, and carry build/device-bundle): going on without them"
	else
		local stamp
		stamp="$SITE/.bundle-$(cksum <"$BUNDLE/bundle.json" | cut -d' ' -f1)"
		if [ ! -e "$stamp" ]; then
			rm -rf "$SITE"
			"$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
				"$BUNDLE"/*.whl || return 1
			touch "$stamp"
		fi
		echo "bundle: $(cd "$BUNDLE" && ls ./*.whl | xargs -n1 basename | tr '\n' ' ')installed in $SITE"
	fi
	# The tree first: what runs is the tree the bundle's manifest describes (the wheel of the
	# package in the bundle shows it installs offline).
	export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
}

run_part() {
	local start=$SECONDS status=0 section budget left rc override
	echo "== device check $PART, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), results in $OUT"
	install_bundle || return 1
	local device=(--device cuda)
	if ! "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
		if [ "${DEVICE_CHECK_SMOKE:-0}" = 1 ]; then
			device=(--device cpu --smoke)
			echo "no CUDA device: the GPU sections run on CPU at toy sizes (DEVICE_CHECK_SMOKE=1), measuring nothing"
		else
			echo "no CUDA device: the GPU sections will say so; the rest runs"
		fi
	fi
	"$PYTHON" "$ROOT/bench/device_check.py" versions || status=1
	while read -r section budget; do
		override="DEVICE_CHECK_BUDGET_${section^^}"
		budget=${!override:-$budget}
		left=$((LIMIT - (SECONDS - start)))
		if [ "$left" -lt 30 ]; then
			echo "== $section: not started, $left s left of the part's $LIMIT s"
			"$PYTHON" "$ROOT/bench/device_check.py" cut "$section" --out "$OUT" --budget 0 </dev/null
			continue
		fi
		[ "$budget" -gt "$left" ] && budget=$left
		echo "== $section (budget $budget s, $left s left in the part)"
		timeout -k 10 $((budget + 15)) "$PYTHON" "$ROOT/bench/device_check.py" run "$section" \
			--out "$OUT" --budget "$budget" "${device[@]}" </dev/null
		rc=$?
		if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
			"$PYTHON" "$ROOT/bench/device_check.py" cut "$section" --out "$OUT" --budget "$budget" </dev/null
		fi
		[ $rc -eq 0 ] || {
			echo "== $section exited $rc"
			status=1
		}
	done < <("$PYTHON" "$ROOT/bench/device_check.py" plan "$PART")
	for section in $("$PYTHON" "$ROOT/bench/device_check.py" plan "$PART" | cut -d' ' -f1); do
		[ "$section" = steps ] && set -- syncs fp8_gemms || set -- "$section"
		for name in "$@"; do [ -f "$OUT/$name.md" ] && cat "$OUT/$name.md"; done
	done
	echo "== device check $PART done in $((SECONDS - start)) s"
	return $status
}

cd "$ROOT" || exit 1
run_part 2>&1 | tee -a "$OUT/$PART.log"
exit "${PIPESTATUS[0]}"
