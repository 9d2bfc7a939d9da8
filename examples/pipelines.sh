#!/usr/bin/env bash
# Example shell pipelines with kvcli (run from the repository root after ./setup.sh).
# stdout carries only the answer; the one-line summary and progress go to stderr.
set -euo pipefail
KV=${KVCLI:-.venv/bin/kvcli}

# 1. Summarise a file read from standard input into a file.
cat examples/solar-garden.txt | $KV run "Summarise this document in three sentences." > /tmp/solar-summary.txt

# 2. One question per document, for every text file in a folder.
for f in examples/*.txt; do
    printf '%s: ' "$(basename "$f")"
    $KV run --quiet --doc "$f" --max-tokens 40 "In one sentence, what is this document about?"
done

# 3. Machine-readable: answer and cache statistics as JSON, filtered with python.
$KV run --doc examples/station-log.txt --json --max-tokens 32 "What is the access code of the radio mast?" \
    | python3 -c 'import json,sys; r=json.load(sys.stdin); print(r["answer"].strip(), "|", r["stats"]["kv_cells"], "cells")'
