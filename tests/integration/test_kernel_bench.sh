#!/usr/bin/env bash
# ds4-kernel-bench (the developers' benchmark of one CPU kernel) runs every
# weight type the CPU backend computes with, in every kernel table this CPU
# has, and the tables agree on the product to the bit (kernels.h's contract:
# the same weights and activations give the same outputs in every table), so
# that a figure it reports is the speed of a right product.
#
# Environment: DS4_BIN (folder with ds4-kernel-bench).
set -euo pipefail
bin=${DS4_BIN:?DS4_BIN must name the folder holding ds4-kernel-bench}
fail() { echo "FAIL: $*" >&2; exit 1; }
[[ -x $bin/ds4-kernel-bench ]] || fail "$bin/ds4-kernel-bench is missing (build the ds4-kernel-bench target)"

flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
tables=(generic)
[[ $flags == *" avx2 "* && $flags == *" fma "* && $flags == *" f16c "* ]] && tables+=(avx2)
[[ $flags == *" avx512f "* && $flags == *" avx512bw "* && $flags == *" avx512vl "* && $flags == *" avx512dq "* ]] && tables+=(avx512)
[[ ${tables[*]} == *avx512* && $flags == *" avx512_vnni "* ]] && tables+=(avx512vnni)
echo "tables on this CPU: ${tables[*]}"

field() { sed -n "s/.*\"$1\":\([^,}]*\).*/\1/p" <<<"$2"; }
for type in F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 IQ4_NL Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_XS; do
  # K = 768: three 256-blocks (eight-block groups: a partial one only); 2816: a full group and three;
  # 256, 512, 1024: rows of one, two, four blocks, which decode several rows at a time (27 rows:
  # full groups of them and a rest taken row by row). 5, 9 and 17 tokens: prefill tiles of eight
  # tokens with a rest; the VNNI table's groups of sixteen (Q8_0 family from 9 tokens, Q2_K..Q6_K
  # from 12), part-filled, full and a rest.
  for shape in "256 1" "512 1" "768 1" "768 5" "1024 1" "2816 1" "2816 9" "768 17"; do
    read -r k tokens <<<"$shape"
    ref=
    # Several tokens: both prefill tilings of the AVX-512 tables (one row x eight tokens, two x four).
    runs=("${tables[@]}")
    ((tokens > 1)) && runs=("${tables[@]/%/:1}" "${tables[@]/%/:2}")
    for run in "${runs[@]}"; do
      table=${run%%:*} rows=${run#*:}
      [[ $rows == "$run" ]] && rows=
      out=$(DS4_CPU_KERNELS=$table DS4_CPU_PREFILL_ROWS=$rows "$bin/ds4-kernel-bench" --type "$type" -k "$k" \
            --rows 27 -t "$tokens" --seconds 0.02 --rounds 1) || fail "$type in $table exited with $?"
      [[ $(field table "$out") == "\"$table\"" ]] || fail "$type: asked for table $table, got: $out"
      gbs=$(field weights_gb_s "$out")
      awk -v g="$gbs" 'BEGIN { exit !(g > 0) }' || fail "$type in $table: no speed in: $out"
      y0=$(field y0 "$out")
      [[ $y0 =~ ^-?[0-9] ]] || fail "$type in $table: the product is not a number: $out"
      bits=$(field y_bits "$out")
      [[ $bits =~ ^\"[0-9a-f]{16}\"$ ]] || fail "$type in $table: no y_bits in: $out"
      if [[ -z $ref ]]; then ref=$bits; elif [[ $bits != "$ref" ]]; then
        fail "$type, K $k, $tokens token(s): $table's outputs${rows:+ (prefill rows $rows)} (y_bits $bits) differ from generic's ($ref)"
      fi
    done
    echo "ok: $type, K $k, $tokens token(s), outputs $ref in ${runs[*]}"
  done
done
# Bad arguments are refused with the reason, not run.
if "$bin/ds4-kernel-bench" --type Q7_Z >/dev/null 2>"${TMPDIR:-/tmp}/kb.err"; then fail "an unknown type ran"; fi
grep -q "unknown type Q7_Z" "${TMPDIR:-/tmp}/kb.err" || fail "no reason for an unknown type: $(cat "${TMPDIR:-/tmp}/kb.err")"
if "$bin/ds4-kernel-bench" -k 100 >/dev/null 2>&1; then fail "K = 100 (not a multiple of 256) ran"; fi
echo "PASS"
