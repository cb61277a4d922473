#!/usr/bin/env bash
# Real-shaped synthetic GGUF files (random weights) for GPU benchmarks, written
# in parallel in the background into /tmp: NAME=preset[:extra synth args] ...
#   scripts/gpu_synth_files.sh start llama8b=llama3-8b qwen2=qwen2.5-7b ...
#   scripts/gpu_synth_files.sh wait NAME...      # until each /tmp/NAME.gguf is complete
set -u
cmd=$1; shift
for spec in "$@"; do
  name=${spec%%=*}; rest=${spec#*=}; preset=${rest%%:*}; extra=""
  [[ $rest == *:* ]] && extra=${rest#*:}
  if [ "$cmd" = start ]; then
    [ -f "/tmp/$name.gguf" ] && continue
    rm -f "/tmp/$name.synth.rc"
    setsid bash -c "python3 -m ptxgen.llm.gguf.synth /tmp/$name.part.gguf --preset $preset $extra \
      --seed 7 --quiet > /tmp/$name.synth.log 2>&1 && mv /tmp/$name.part.gguf /tmp/$name.gguf; \
      echo \$? > /tmp/$name.synth.rc" < /dev/null > /dev/null 2>&1 &
  else
    for _ in $(seq 1 600); do [ -f "/tmp/$name.gguf" ] || [ -f "/tmp/$name.synth.rc" ] && break; sleep 1; done
    [ -f "/tmp/$name.gguf" ] || { echo "no /tmp/$name.gguf"; cat "/tmp/$name.synth.log"; exit 1; }
  fi
done
