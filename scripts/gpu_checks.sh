#!/usr/bin/env bash
# GPU checks and benchmarks on one H200; results go to $OUT (or ./out). Usage:
#   bash scripts/gpu_checks.sh tests | offline L [QUANT] | executor | executor_serve | spec L | serve L QUANT CONCS PPC | itl L QUANT CONC PROMPTS | profile L B ISL | pd L | vllm
#   | startup L | kvacc L | specrank N [MODES] | indexreuse [N] [QUANT] [FREQS] | optins [N] [QUANT]   (serve / itl: RANK=N for one TP N rank at full depth)
# Environment: POINTS (offline ISL:batch groups), OSL, MAXSEQS, TMO (per-step timeout, s), TAG
# (result-file suffix), PACK=1 (at the end, every result file in $OUT goes into one
# $OUT/results-<check>.tgz: the device returns only a few files per call). Each step prints the
# exact command it ran into its result file.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
if [ -n "${PACK:-}" ]; then
  pack() { cd "$OUT" && ls *.txt > /dev/null 2>&1 && tar czf "results-$1-$(date +%s).tgz" *.txt && rm -f *.txt; }
  trap "pack ${1:-tests}" EXIT
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export M3SERVE_CACHE=/tmp/m3cache
step() { local name=$1; shift; echo "\$ $*" > "$OUT/$name.txt"; ( "$@" ) >> "$OUT/$name.txt" 2>&1; echo "[$name rc=$?]" >> "$OUT/$name.txt"; }
case "${1:-tests}" in
  tests)
    step kernel_tests timeout ${TMO:-240} python -m pytest tests/kernels -q -m gpu -p no:cacheprovider
    step model_gpu_tests timeout ${TMO:-300} python -m pytest tests/model/test_gpu_model.py -q -m gpu -s -p no:cacheprovider ;;
  offline)
    L=${2:-4}
    python -m m3serve bench make-realshape /tmp/rs$L --layers $L > /dev/null
    step offline_L$L${3:+_$3}${TAG:-} timeout ${TMO:-420} python -m m3serve bench offline --model /tmp/rs$L --load-format dummy \
      --points ${POINTS:-1024:1,8,32 8192:4,16,64} --osl ${OSL:-64} --max-model-len 9472 \
      --max-num-seqs ${MAXSEQS:-64} --max-num-batched-tokens 16384 ${3:+--quantization $3} ${EXTRA:-} ;;
  executor)
    # the uni-process executor against the multiprocess one at world size 1 (engine process,
    # NCCL world of one), L = 4 real shapes, twice each, interleaved
    python -m m3serve bench make-realshape /tmp/rs4 --layers 4 > /dev/null
    for run in ${RUNS:-1 2}; do
      for backend in uni mp; do
        step executor_${backend}_$run timeout ${TMO:-300} python -m m3serve bench offline --model /tmp/rs4 \
          --load-format dummy --points ${POINTS:-1024:1,8} --osl ${OSL:-128} --max-model-len 9472 \
          --max-num-seqs 8 --max-num-batched-tokens 16384 --cudagraph-capture-sizes 1,2,4,8 \
          --distributed-executor-backend $backend
      done
    done ;;
esac
# executor_serve: the same comparison through the server (bench serve at concurrency 1 and 8,
# 1024 in / 256 out, fixed lengths), rounds interleaved
if [ "${1:-}" = executor_serve ]; then
  python -m m3serve bench make-realshape /tmp/rs4 --layers 4 > /dev/null
  for run in ${RUNS:-1 2}; do
    for backend in uni mp; do
      log="$OUT/server_${backend}_$run.txt"
      echo "\$ python -m m3serve serve /tmp/rs4 --load-format dummy --port 8012 --max-model-len 9472 --max-num-seqs 8 --cudagraph-capture-sizes 1,2,4,8 --distributed-executor-backend $backend" > "$log"
      python -m m3serve serve /tmp/rs4 --load-format dummy --port 8012 --max-model-len 9472 --max-num-seqs 8 \
        --cudagraph-capture-sizes 1,2,4,8 --distributed-executor-backend $backend >> "$log" 2>&1 &
      srv=$!
      for i in $(seq 1 240); do curl -sf http://127.0.0.1:8012/ready > /dev/null && break; sleep 1; done
      for conc in ${CONCS:-1 8}; do
        step serve_${backend}_${run}_c$conc timeout 200 python -m m3serve bench serve --base-url http://127.0.0.1:8012 \
          --tokenizer /tmp/rs4 --random-input-len 1024 --random-output-len 256 --random-range-ratio 0 --ignore-eos \
          --num-prompts $((conc * ${PPC:-4})) --num-warmups $conc --max-concurrency $conc --disable-tqdm \
          --save-result --result-dir "$OUT/json" --result-filename ${backend}_${run}_c$conc.json
      done
      kill $srv; wait $srv 2>/dev/null
    done
  done
fi
# spec L: speculation off vs on (EAGLE3-GQA draft of real shapes, dummy weights, k = 3,
# synthetic acceptance 2.78), offline, 8K contexts
if [ "${1:-}" = spec ]; then
  L=${2:-4}
  python -m m3serve bench make-realshape /tmp/rs$L --layers $L > /dev/null
  python -m m3serve make-tiny /tmp/eg$L --draft eagle3-gqa --target /tmp/rs$L --no-weights > /dev/null
  SPEC='{"method": "eagle3", "model": "/tmp/eg'$L'", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.78}'
  for mode in off on; do
    extra=(); [ $mode = on ] && extra=(--speculative-config "$SPEC")
    step spec_L${L}_$mode timeout ${TMO:-280} python -m m3serve bench offline --model /tmp/rs$L --load-format dummy \
      --points ${POINTS:-8192:1,4,16,64} --osl ${OSL:-64} --max-model-len 9472 --max-num-seqs 64 \
      --max-num-batched-tokens 16384 --cudagraph-capture-sizes ${SIZES:-1,4,16,64} "${extra[@]}"
  done
fi
# serve L QUANT CONCURRENCIES PROMPTS_PER_CONC: the real server on a real-shape L-layer model
# (dummy weights) and the 8K/1K sweep through `m3serve bench sweep`.
# itl L QUANT CONC PROMPTS: the same server, one 8K/1K point through `m3serve bench serve` with
# every request's gaps saved, and the distribution of the gaps (where the tail comes from).
# RANK=N: one TP N rank at full depth instead (60 layers, `make-realshape --tp-rank N`; L then
# only names the results), with its DSpark and EAGLE3 drafts cut to the rank for SPEC_JSON
# (/tmp/rankN/dspark, /tmp/eg_rankN).
if [ "${1:-}" = serve ] || [ "${1:-}" = itl ]; then
  L=${2:-8}; Q=${3:-none}; CONC=${4:-1,4,16,64}; PPC=${5:-2}
  if [ -n "${RANK:-}" ]; then
    python -m m3serve bench make-realshape /tmp/rank$RANK --layers 60 --dense-layers 3 --tp-rank $RANK > /dev/null
    python -m m3serve make-tiny /tmp/rank$RANK --draft dspark --target /tmp/rank$RANK --no-weights > /dev/null
    python -m m3serve make-tiny /tmp/eg_rank$RANK --draft eagle3-gqa --target /tmp/rank$RANK --no-weights > /dev/null
    rm -rf /tmp/rs$L; ln -s /tmp/rank$RANK /tmp/rs$L
  else
    python -m m3serve bench make-realshape /tmp/rs$L --layers $L > /dev/null
  fi
  qflag=""; [ "$Q" != none ] && qflag="--quantization $Q"
  sflag=(); [ -n "${SPEC_JSON:-}" ] && sflag=(--speculative-config "$SPEC_JSON")
  echo "\$ python -m m3serve serve /tmp/rs$L --load-format dummy --port 8011 --max-model-len 9472 --max-num-seqs 64 --max-num-batched-tokens 16384 $qflag ${EXTRA:-} ${SPEC_JSON:+--speculative-config '$SPEC_JSON'}" > "$OUT/server_L${L}_$Q${TAG:-}.txt"
  python -m m3serve serve /tmp/rs$L --load-format dummy --port 8011 --max-model-len 9472 \
    --max-num-seqs 64 --max-num-batched-tokens 16384 $qflag ${EXTRA:-} "${sflag[@]}" >> "$OUT/server_L${L}_$Q${TAG:-}.txt" 2>&1 &
  srv=$!
  for i in $(seq 1 240); do curl -sf http://127.0.0.1:8011/ready > /dev/null && break; sleep 1; done
  if [ "$1" = serve ]; then
    step sweep_L${L}_$Q${TAG:-} timeout ${TMO:-560} python -m m3serve bench sweep --base-url http://127.0.0.1:8011 \
      --tokenizer /tmp/rs$L --random-input-len 8192 --random-output-len 1024 --concurrencies $CONC \
      --prompts-per-concurrency $PPC --warmups-per-concurrency 1 --num-gpus 1 --label L${L}_$Q${TAG:-} \
      --result-dir "$OUT" --disable-tqdm
  else
    name=itl_L${L}_$Q${TAG:-}_c$CONC
    step $name timeout ${TMO:-400} python -m m3serve bench serve --base-url http://127.0.0.1:8011 \
      --tokenizer /tmp/rs$L --dataset-name random --random-input-len 8192 --random-output-len 1024 \
      --random-range-ratio 0.8 --ignore-eos --max-concurrency $CONC --num-prompts $PPC --num-warmups $CONC \
      --metric-percentiles 10,25,50,75,90,95,99 --save-result --save-detailed --result-dir "$OUT" \
      --result-filename $name.json --disable-tqdm
    python scripts/itl_histogram.py "$OUT/$name.json" >> "$OUT/$name.txt" 2>&1
  fi
  curl -s http://127.0.0.1:8011/metrics | grep -E "^m3serve:(num_requests|kv_cache|prefix)" >> "$OUT/server_L${L}_$Q${TAG:-}.txt"
  kill $srv; wait $srv 2>/dev/null
fi
# rank N QUANT [ep]: one rank of TP N at full depth (60 layers, 3 dense; bench make-realshape
# --tp-rank N), offline points (default 8K at batch 1, 4, 16, 64); TAG names the result;
# FULLVOCAB=1 keeps the whole vocabulary head (the vLLM peer_rank.py comparison)
if [ "${1:-}" = rank ]; then
  N=${2:-8}; Q=${3:-none}; EP=${4:-}
  dir=/tmp/rank$N${EP:+ep}${FULLVOCAB:+fv}
  python -m m3serve bench make-realshape $dir --layers 60 --dense-layers 3 --tp-rank $N ${EP:+--ep} ${FULLVOCAB:+--full-vocab} > /dev/null
  qflag=(); [ "$Q" != none ] && qflag=(--quantization $Q)
  step rank_tp${N}${EP:+ep}_$Q${TAG:-} timeout ${TMO:-400} python -m m3serve bench offline --model $dir --load-format dummy \
    --points ${POINTS:-8192:1,4,16,64} --osl ${OSL:-64} --max-model-len 9472 --max-num-seqs 64 \
    --max-num-batched-tokens 16384 --cudagraph-capture-sizes ${SIZES:-1,4,16,64} "${qflag[@]}" ${EXTRA:-}
  if [ -n "${PROFILE_B:-}" ]; then
    step rank_profile_tp${N}_${Q}_b$PROFILE_B${TAG:-} timeout 300 python -m m3serve.bench.step_profile $dir --batch $PROFILE_B --isl 8192 "${qflag[@]}"
  fi
fi
# specrank N [MODES]: speculation at one TP N rank's shapes at full depth (dummy weights,
# synthetic acceptance): off, EAGLE3-GQA cut to the rank (k 3, 2.78), DSpark cut to the rank
# (k 7, 2.3 and 3.0), DSpark replicated (the released widths on every rank, 2.3), and (not by
# default) dspark23d4 (disable_by_batch_size 4), dspark23k3 (k 3) and mtp (the target's MTP
# modules, k 3, 2.78); MODES picks a subset
# (default: the first five); POINTS / OSL / SIZES as for rank. Each mode runs the engine's
# default rule for which batches speculate (on a GPU: by measured step speed); MODE+ (e.g.
# eagle3+) speculates at every batch size (disable_by_batch_size 1000)
if [ "${1:-}" = specrank ]; then
  N=${2:-8}; dir=/tmp/rank$N
  python -m m3serve bench make-realshape $dir --layers 60 --dense-layers 3 --tp-rank $N > /dev/null
  python -m m3serve make-tiny $dir --draft dspark --target $dir --no-weights > /dev/null
  python -m m3serve make-tiny /tmp/eg_rank$N --draft eagle3-gqa --target $dir --no-weights > /dev/null
  python -c "import json, sys; from pathlib import Path; from m3serve.distill.tiny_drafts import dspark_config_dict
p = Path('/tmp/dsrep$N'); p.mkdir(exist_ok=True); (p / 'config.json').write_text(json.dumps(dspark_config_dict(Path('$dir'), replicated=True)))"
  syn='"rejection_sample_method": "synthetic", "synthetic_acceptance_length"'
  # mtp: the release's config names 7 MTP modules (its BF16 files ship none); dummy weights
  # for the ones k = 3 uses, each one MSA + MoE layer cut to the rank like the target's
  case " ${3:-} " in *" mtp "*) python -c "import json; p = '$dir/config.json'; c = json.load(open(p))
c.setdefault('text_config', c)['num_mtp_modules'] = 7; json.dump(c, open(p, 'w'), indent=1)" ;; esac
  for name in ${3:-off eagle3 dspark23 dspark30 dsparkrep}; do
    mode=${name%+}
    case $mode in
      off) spec=() ;;
      eagle3) spec=(--speculative-config '{"method": "eagle3", "model": "/tmp/eg_rank'$N'", "num_speculative_tokens": 3, '"$syn"': 2.78}') ;;
      dspark23) spec=(--speculative-config '{"method": "dspark", '"$syn"': 2.3}') ;;
      dspark30) spec=(--speculative-config '{"method": "dspark", '"$syn"': 3.0}') ;;
      dsparkrep) spec=(--speculative-config '{"method": "dspark", "model": "/tmp/dsrep'$N'", '"$syn"': 2.3}') ;;
      dspark23d4) spec=(--speculative-config '{"method": "dspark", "disable_by_batch_size": 4, '"$syn"': 2.3}') ;;
      dspark23k3) spec=(--speculative-config '{"method": "dspark", "num_speculative_tokens": 3, '"$syn"': 2.3}') ;;
      mtp) spec=(--speculative-config '{"method": "mtp", "num_speculative_tokens": 3, '"$syn"': 2.78}') ;;
    esac
    [ "$name" != "$mode" ] && [ ${#spec[@]} -gt 0 ] && spec[1]="{\"disable_by_batch_size\": 1000, ${spec[1]#\{}"
    always=${name#$mode}; always=${always/+/_always}     # (no "+" in names: the device does not return them)
    step specrank_tp${N}_${mode}${always}${TAG:-} timeout ${TMO:-200} python -m m3serve bench offline --model $dir --load-format dummy \
      --points ${POINTS:-8192:1,4,16,64} --osl ${OSL:-128} --max-model-len 9472 --max-num-seqs 64 \
      --max-num-batched-tokens 16384 --cudagraph-capture-sizes ${SIZES:-1,4,16,64} ${QUANT:+--quantization $QUANT} "${spec[@]}"
  done
fi
# optins [N] [QUANT]: the opt-in kernel switches checked and measured at one TP N rank (default
# 8, fp8): their GPU tests (tensor-core router logits, PDL bit-identical replay, the FP8
# perplexity against the CPU), then the prompt step of two 8K prompts with the tensor-core
# router off and on (profiled), then decode at POINTS (default 8K at 1, 4, 16) with PDL off and on
if [ "${1:-}" = optins ]; then
  N=${2:-8}; Q=${3:-fp8}; dir=/tmp/rank$N
  step optin_tests timeout ${TMO:-300} python -m pytest -q -m gpu -s -p no:cacheprovider tests/kernels/test_fused_moe.py \
    tests/model/test_gpu_model.py -k "tensor_core or bf16_matches_ref or pdl or perplexity"
  python -m m3serve bench make-realshape $dir --layers 60 --dense-layers 3 --tp-rank $N > /dev/null
  for tc in 0 1; do
    step optin_prefill_tc$tc env M3SERVE_ROUTE_TENSOR_CORES=$tc timeout 200 python -m m3serve.bench.step_profile $dir \
      --batch 2 --isl 8192 --prefill --quantization $Q
  done
  for p in 0 1; do
    step optin_rank_pdl$p env M3SERVE_PDL=$p timeout ${TMO:-300} python -m m3serve bench offline --model $dir \
      --load-format dummy --points ${POINTS:-8192:1,4,16} --osl ${OSL:-64} --max-model-len 9472 --max-num-seqs 64 \
      --max-num-batched-tokens 16384 --cudagraph-capture-sizes 1,4,16 --quantization $Q
  done
fi
# profile L B ISL [QUANT]: where one decode step's time goes
if [ "${1:-}" = profile ]; then
  L=${2:-4}; B=${3:-4}; ISL=${4:-8192}
  python -m m3serve bench make-realshape /tmp/rs$L --layers $L > /dev/null
  step profile_L${L}_b${B}_isl${ISL} timeout 300 python -m m3serve.bench.step_profile /tmp/rs$L --batch $B --isl $ISL ${5:+--quantization $5} ${MIXED:+--mixed $MIXED} ${SYNCDBG:+--sync-debug}
fi
# pd L: a prefill server and a decode server sharing the GPU (NIXL moving device memory, the
# nixl-cu13 wheel carried), real-shape L layers, dummy weights; TTFT of 8K
# prompts split into prefill / transfer / first decode by scripts/pd_split.py
if [ "${1:-}" = pd ]; then
  L=${2:-4}
  python -m m3serve bench make-realshape /tmp/rs$L --layers $L > /dev/null
  common=(--load-format dummy --max-model-len 9472 --max-num-seqs 8 --max-num-batched-tokens 16384
          --cudagraph-capture-sizes 1,2,4,8)
  kv() { echo '{"kv_connector": "NixlConnector", "kv_role": "'$1'"}'; }
  echo "\$ python -m m3serve serve /tmp/rs$L --port 8021 --gpu-memory-utilization 0.45 ${common[*]} --kv-transfer-config '$(kv kv_producer)'" > "$OUT/pd_prefill_L$L.txt"
  python -m m3serve serve /tmp/rs$L --port 8021 --gpu-memory-utilization 0.45 "${common[@]}" \
    --kv-transfer-config "$(kv kv_producer)" >> "$OUT/pd_prefill_L$L.txt" 2>&1 &
  p=$!
  for i in $(seq 1 240); do curl -sf http://127.0.0.1:8021/ready > /dev/null && break; sleep 1; done
  echo "\$ python -m m3serve serve /tmp/rs$L --port 8022 --gpu-memory-utilization 0.92 ${common[*]} --kv-transfer-config '$(kv kv_consumer)'" > "$OUT/pd_decode_L$L.txt"
  UCX_PROTO_INFO=${UCX_PROTO_INFO:-n} python -m m3serve serve /tmp/rs$L --port 8022 --gpu-memory-utilization 0.92 "${common[@]}" \
    --kv-transfer-config "$(kv kv_consumer)" >> "$OUT/pd_decode_L$L.txt" 2>&1 &
  d=$!
  for i in $(seq 1 240); do curl -sf http://127.0.0.1:8022/ready > /dev/null && break; sleep 1; done
  step pd_split_L$L timeout ${TMO:-300} python scripts/pd_split.py --prefill http://127.0.0.1:8021 \
    --decode http://127.0.0.1:8022 --isl ${ISL:-8193} --osl ${OSL:-32} --prompts ${PROMPTS:-6}
  for port in 8021 8022; do curl -s http://127.0.0.1:$port/metrics | grep -E "^m3serve:(kv_transfer|nixl)" >> "$OUT/pd_metrics_L$L.txt"; done
  kill $p $d; wait $p $d 2>/dev/null
fi
# vllm: vLLM 0.26 side by side with us in one call (after six calls that each carried one batch:
# `mkdir -p /tmp/w && cp -r .vbN/* /tmp/w/`, N = 1..6, peer.py in .vb6), then ours at the same points.
if [ "${1:-}" = vllm ]; then
  POINTS=${POINTS:-"1024:1,8 8192:4"} bash "$0" offline 4
  ( bash /tmp/w/install.sh /tmp/w /tmp/vsite > /dev/null &&
    cd /tmp && PYTHONPATH=/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
      VP=${VP:-"1024:1,8 8192:4"} timeout 400 python /tmp/w/peer.py 4 none all ) > "$OUT/vllm_L4.txt" 2>&1
fi
# startup L: start-up of the offline engine on a cold Triton cache, then warm (same machine), and
# the server's time to /ready warm (RUNS=none: only the server); weights generated on the GPU (dummy), default graph sizes
if [ "${1:-}" = startup ]; then
  L=${2:-4}
  python -m m3serve bench make-realshape /tmp/rs$L --layers $L > /dev/null
  for run in ${RUNS:-cold warm}; do
    [ $run = cold ] && rm -rf ~/.triton/cache "$M3SERVE_CACHE"
    step startup_L${L}_$run timeout 300 python -m m3serve bench offline --model /tmp/rs$L --load-format dummy \
      --points 1024:1 --osl 8 --max-model-len 9472 --max-num-seqs 64 --max-num-batched-tokens 16384
  done
  log="$OUT/startup_L${L}_server_warm.txt"
  echo "\$ python -m m3serve serve /tmp/rs$L --load-format dummy --port 8013 --max-model-len 9472 --max-num-seqs 64 --log-level debug (lines stamped with seconds since launch)" > "$log"
  t0=$(date +%s.%N)
  python -m m3serve serve /tmp/rs$L --load-format dummy --port 8013 --max-model-len 9472 --max-num-seqs 64 --log-level debug 2>&1 |
    python3 -u -c "import sys, time; [print(f'{time.time() - $t0:6.2f} {line}', end='', flush=True) for line in sys.stdin]" >> "$log" &
  srv=$!
  for i in $(seq 1 2400); do curl -sf http://127.0.0.1:8013/ready > /dev/null && break; sleep 0.1; done
  echo "time to /ready: $(python3 -c "import time; print(round(time.time() - $t0, 1))") s" >> "$log"
  pkill -f "port 8013"; wait $srv 2>/dev/null
fi
# kvacc L: FP8 KV (and FP8 index cache) against bf16 KV on the same weights, teacher-forced
if [ "${1:-}" = kvacc ]; then
  L=${2:-4}
  python -m m3serve bench make-realshape /tmp/rs$L --layers $L > /dev/null
  step kv_accuracy_L$L timeout ${TMO:-400} python scripts/kv_dtype_accuracy.py /tmp/rs$L --isl ${ISL:-4096} --steps 64 --batch 4
fi
# vision: the encoder bench (varlen flash attention, and the per-size SDPA calls for A/B), its
# profile at batch 1 and 16, the GPU vision tests and the tiny checkpoint's GPU == CPU tokens
# (mm_cpu_ref.json from `cd .whl && python ../scripts/vision_gpu_check.py cpu`). With
# BEFORE_VISION=FILE (an older model/vision.py) the same bench on a copy of the tree using it.
if [ "${1:-}" = vision ]; then
  if [ -n "${BEFORE_VISION:-}" ]; then
    rm -rf /tmp/before && mkdir -p /tmp/before && cp -r m3serve /tmp/before/ && cp "$BEFORE_VISION" /tmp/before/m3serve/model/vision.py
    sed -i 's/VisionEncoder, _use_varlen, parse_vision_config/VisionEncoder, parse_vision_config/; s/"varlen" if _use_varlen(.*) else "runs"}/"before"}/' /tmp/before/m3serve/bench/vision.py
    step vision_bench_before env PYTHONPATH=/tmp/before:$PYTHONPATH timeout 300 python -m m3serve.bench.vision
  fi
  step vision_bench timeout 300 python -m m3serve.bench.vision
  step vision_profile_b1 timeout 200 python -m m3serve.bench.vision --profile
  if [ -n "${FULL:-}" ]; then
    step vision_bench_runs env M3SERVE_VISION_ATTENTION=runs timeout 300 python -m m3serve.bench.vision
    step vision_profile_b16 timeout 200 python -m m3serve.bench.vision --profile --profile-batch 16
  fi
  step vision_gpu_tests timeout 300 python -m pytest tests/multimodal/test_vision_model.py tests/unit/test_graph_nodes.py -q -m gpu -p no:cacheprovider
  [ -f .whl/mm_cpu_ref.json ] && step vision_tokens bash -c "cd .whl && python ../scripts/vision_gpu_check.py cuda mm_cpu_ref.json"
  # TTFT of one 672² image + 1K text (and of the same text alone) at the real-shape L = 4 model
  # with a random real-width vision tower, through the server
  python -m m3serve bench make-realshape /tmp/rs4v --layers 4 --vision > /dev/null
  log="$OUT/vision_server.txt"
  python -m m3serve serve /tmp/rs4v --load-format dummy --port 8013 --max-model-len 9472 --max-num-seqs 8 >> "$log" 2>&1 &
  srv=$!
  for i in $(seq 1 240); do curl -sf http://127.0.0.1:8013/ready > /dev/null && break; sleep 1; done
  for ds in random-mm random; do
    step vision_ttft_$ds timeout 200 python -m m3serve bench serve --base-url http://127.0.0.1:8013 --backend openai-chat \
      --tokenizer /tmp/rs4v --dataset-name $ds --random-input-len 1024 --random-output-len 16 --random-range-ratio 0 \
      --ignore-eos --num-prompts 8 --num-warmups 2 --max-concurrency 1 --disable-tqdm
  done
  kill $srv; wait $srv 2>/dev/null
fi
# kernels L: the captured decode graphs' kernel counts (total, per MoE layer, by class) at an
# L-layer real-shape model, bf16, from `bench offline`'s graph_kernels column
if [ "${1:-}" = kernels ]; then
  L=${2:-4}
  step graph_nodes_test timeout 120 python -m pytest tests/unit/test_graph_nodes.py -q -m gpu -p no:cacheprovider
  python -m m3serve bench make-realshape /tmp/rs$L --layers $L > /dev/null
  step kernels_L$L timeout ${TMO:-300} python -m m3serve bench offline --model /tmp/rs$L --load-format dummy \
    --points ${POINTS:-1024:1,4,16} --osl ${OSL:-32} --max-model-len 9472 --max-num-seqs 16 \
    --max-num-batched-tokens 16384 --cudagraph-capture-sizes 1,4,16
fi
# indexreuse [N] [QUANT] [FREQS]: cross-layer top-k reuse (docs/model.md §4). Speed: one TP N rank
# at full depth (as `rank`; bf16 needs an H200, use QUANT fp8 on an H100), the exact model and
# each index_topk_freq F on the same machine; quality: KL and greedy agreement of each F against
# exact on the real-shape L = 4 model with dummy weights, 8K-token prompts (bench index_reuse)
if [ "${1:-}" = indexreuse ]; then
  N=${2:-8}; Q=${3:-none}; FREQS=${4:-2 4}
  dir=/tmp/rank$N
  python -m m3serve bench make-realshape $dir --layers 60 --dense-layers 3 --tp-rank $N > /dev/null
  qflag=(); [ "$Q" != none ] && qflag=(--quantization $Q)
  for F in 1 $FREQS; do
    ov=(); [ "$F" != 1 ] && ov=(--hf-overrides '{"text_config": {"use_index_cache": true, "index_topk_freq": '$F'}}')
    step indexreuse_rank_tp${N}_${Q}_f$F${TAG:-} timeout ${TMO:-400} python -m m3serve bench offline --model $dir \
      --load-format dummy --points ${POINTS:-8192:1,4,16} --osl ${OSL:-64} --max-model-len 9472 --max-num-seqs 64 \
      --max-num-batched-tokens 16384 --cudagraph-capture-sizes ${SIZES:-1,4,16} "${qflag[@]}" "${ov[@]}"
  done
  if [ -z "${SKIP_QUALITY:-}" ]; then
    python -m m3serve bench make-realshape /tmp/rs4 --layers 4 > /dev/null
    step indexreuse_quality_L4${TAG:-} timeout ${TMO:-400} python -m m3serve.bench.index_reuse /tmp/rs4 \
      --load-format dummy --freqs $FREQS --prompt-len ${ISL:-8192} --gen-len ${OSL:-64} --num-prompts ${PROMPTS:-4}
  fi
fi
