#!/usr/bin/env bash
# Issue 11, same call: the 64-client load on the main port (one process) against the same load through N ingest
# workers (python -m server --ingest-workers N: POST /track/binary and WS /track/stream on the track port,
# receive/parse/decode in N processes, frames to the GPU process through page-locked shared memory). Per variant: a
# fresh server (--renderer triton --fast; the inductor cache of the first start makes later starts ~20 s); with
# workers, first a parity check (the same stateless body on both ports: identical poses); one binary client for 6 s,
# then 64 clients (8 processes, MODES: http-binary and/or stream) + 4 register-only clients offering 8 registers/s for
# 10 s each, py-spy sampling the GPU process for 6 s of the first 64-client window.
#   VARIANTS="main ingest8" MODES="http-binary stream" bash tools/h200/ingest.sh     (~2 min per variant)
# Variants: main (the main port, defaults), nostage / nostage_omp1 (the lane copies whole batches, as before
# --track-stage-in-caller became the default; with OMP_NUM_THREADS=1), ingestN (N ingest workers, the track port);
# each with optional suffixes _sw<ms> (the GIL switch interval, e.g. _sw5 = Python's default, _sw0.2; the server's
# default is 0.5 ms) and
# _fl<N> (--track-batches-in-flight N; default 3), _nodrv (--no-track-driver-launch: PyTorch launches of the staged
# track batches), _sib / _nosib (--[no-]track-step-in-batcher; on by default since session 9) and _loop / _thsub
# (--[no-]ingest-submit-in-loop: page-locked ingest frames validated and submitted on the event loop, the default
# since session 10, or in a worker thread each), e.g. ingest8_thsub;
# _p<N>: N load-generator processes for the 64 clients (default 8); _fif<N>: --frames-in-flight N (registers)
# (numbered suffixes strip from the end in the order of the case below: write them as NAME_rr5_fif1_p16);
# _rr<N>: N registers/s offered alongside the 64 clients (default 8; the issue asks >= 5 answered; _rr0: none);
# HTTP_CLIENTS="raw httpx": the 64 http-binary clients once per listed load-generator client (loadtest
# --http-client; default raw), recorded as http-binary_64 and http-binary_64_httpx.
# ONE_STREAM=1: the one-session stream run also when MODES has no stream; ONE_STREAM_FRAGMENTS="0 64 0 64": then
# again once per listed client fragment size in KiB (loadtest --stream-fragment-kib; 0 = one WebSocket frame per
# message), recorded as stream_1_f<KiB>_<i>.
# _pow2 / _fine (--track-batch-ladder: the padded batch sizes of the captured track steps; fine is the default);
# _mb<N> (--track-max-batch N; default 16; written last, e.g. ingest8_rr5_mb32); _rsm<N> (--register-sms N: the
# registers' kernels on N SMs; written just before _mb, e.g. ingest8_rr5_rsm96_mb32);
# _nogcf (--no-gc-freeze: start-up's objects stay in Python's full garbage collections; the track_lane row of
# ingest.json has every variant's collections while serving: gc {generation: [count, total s, longest s]});
# _nobal (--no-ingest-balance: every worker accepts on the shared socket, as before session 13, instead of the GPU
# process handing each connection to the worker with the fewest open ones);
# _dinl / _dthr (--[no-]ingest-decode-inline: the workers copy raw frames on their loop, the default since session
# 10, or in a thread each); _one: the one-client runs only (one
# binary client; one streaming session with MODES stream).
# Wheels: ../shared/tools/device-wheels.sh py-spy==0.4.3 websockets==15.0.1 uvloop==0.21.0 httptools==0.6.4 \
#   fastapi-offline==1.7.7 imagecodecs==2026.3.6 orjson==3.10.18   (carry [".whl"])
# $OUT: ingest.json (per variant and run: tracks/s, registers/s, p50/p90/p99, refusals, the server's phases of the
#   track endpoint; with MODES stream also one streaming session), parity.txt, pyspy_<variant>.txt (the GPU process:
#   threads and top self frames, all threads and the GIL holder), cpu_<variant>.json (tools/proc_cpu.py: CPU per
#   process and thread of the server tree and the load generator, same window), server_<variant>.log (tail).
set -uo pipefail
OUT=${OUT:-/tmp/ingest_out}; mkdir -p "$OUT"
# CPU dry run of this script: INGEST_DRY=1 (no wheels, --device cpu, a tiny config, 320x240, CLIENTS=4)
if [ -z "${INGEST_DRY:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  DEVICE=cuda IMAGE=640x480
else
  DEVICE=cpu IMAGE=320x240 CLIENTS=${CLIENTS:-4}
  SERVER_ARGS=${SERVER_ARGS:-"--hypotheses 4 --register-iterations 1 --track-iterations 1"}
fi
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/torch_ext PATH=/tmp/site/bin:$PATH
export PYTHONUNBUFFERED=1 PYTHONIOENCODING=utf-8 LANG=C.UTF-8 MAX_JOBS=16
PORT=8765; URL=http://127.0.0.1:$PORT; TPORT=8766
VARIANTS=${VARIANTS:-"main ingest8"}
MODES=${MODES:-"http-binary stream"}
SERVER_ARGS=${SERVER_ARGS:-"--renderer triton --fast"}
CLIENTS=${CLIENTS:-64}
log() { echo "=== $(date +%T) $*"; }
nproc; df -h /dev/shm | tail -1
echo "{}" > "$OUT/ingest.json"
record() {  # record VARIANT RUN < loadtest JSON
  python3 -c '
import json, sys
path, variant, run = sys.argv[1:]
r = json.load(sys.stdin); e = r["endpoints"]; t = e.get("track") or e.get("stream_frame") or {}
endpoint = "/track/stream" if "stream_frame" in e else "/track/binary"
row = {"tracks_per_s": r["tracks_per_s"], "registers_per_s": r["registers_per_s"],
       **{k: t.get(k) for k in ("ok", "diverged", "p50_ms", "p90_ms", "p99_ms")},
       "errors": r["errors_by_status"], "refusals": r["refusals"], "transport_errors": r.get("transport_errors"),
       "phases": r["server_phases_ms"].get(endpoint, {}), "outside": r.get("stream_outside_phases_ms"),
       "generator": r.get("load_generator")}
rows = json.load(open(path)); runs = rows.setdefault(variant, {})
name, n = run, 1
while name in runs:  # a repeated run (e.g. HTTP_CLIENTS="raw raw") keeps the earlier ones: NAME, NAME_2, ...
    n += 1
    name = f"{run}_{n}"
runs[name] = row; run = name
json.dump(rows, open(path, "w"), indent=1); print(variant, run, json.dumps(row))' "$OUT/ingest.json" "$@"
}
for v in $VARIANTS; do
  envs=() extra="" track="" many=1 regs="--registers-alongside 4 --register-rate 8" procs=8
  base=$v
  while :; do  # option suffixes, any order: NAME_sw5 (Python's 5 ms switch interval, not the server's 0.5 ms),
    case "$base" in  # NAME_fl<N> (--track-batches-in-flight N)
      *_mb[0-9]*) n=${base##*_mb}; base=${base%_mb*}; extra="$extra --track-max-batch $n" ;;
      *_rsm[0-9]*) n=${base##*_rsm}; base=${base%_rsm*}; extra="$extra --register-sms $n" ;;
      *_sw[0-9]*) n=${base##*_sw}; base=${base%_sw*}; extra="$extra --switch-interval-ms $n" ;;  # e.g. _sw5, _sw0.2
      *_nodrv) base=${base%_nodrv}; extra="$extra --no-track-driver-launch" ;;
      *_nosib) base=${base%_nosib}; extra="$extra --no-track-step-in-batcher" ;;
      *_sib) base=${base%_sib}; extra="$extra --track-step-in-batcher" ;;
      *_loop) base=${base%_loop}; extra="$extra --ingest-submit-in-loop" ;;
      *_thsub) base=${base%_thsub}; extra="$extra --no-ingest-submit-in-loop" ;;
      *_one) base=${base%_one}; many=0 ;;  # the one-client runs only
      *_dinl) base=${base%_dinl}; extra="$extra --ingest-decode-inline" ;;
      *_nobal) base=${base%_nobal}; extra="$extra --no-ingest-balance" ;;  # the workers accept on the shared socket
      *_nogcf) base=${base%_nogcf}; extra="$extra --no-gc-freeze" ;;  # start-up's objects stay in full collections
      *_dthr) base=${base%_dthr}; extra="$extra --no-ingest-decode-inline" ;;
      *_fl[0-9]*) n=${base##*_fl}; base=${base%_fl*}; extra="$extra --track-batches-in-flight $n" ;;
      *_pow2) base=${base%_pow2}; extra="$extra --track-batch-ladder pow2" ;;
      *_fine) base=${base%_fine}; extra="$extra --track-batch-ladder fine" ;;
      *_p[0-9]*) procs=${base##*_p}; base=${base%_p*} ;;
      *_fif[0-9]*) n=${base##*_fif}; base=${base%_fif*}; extra="$extra --frames-in-flight $n" ;;
      *_rr0) base=${base%_rr0}; regs="--registers-alongside 0" ;;
      *_rr[0-9]*) n=${base##*_rr}; base=${base%_rr*}; regs="--registers-alongside 4 --register-rate $n" ;;
      *) break ;;
    esac
  done
  case "$base" in
    main) ;;
    nostage) extra="$extra --no-track-stage-in-caller" ;;  # the lane copies whole batches (torch.stack, OpenMP threads)
    nostage_omp1) envs=(OMP_NUM_THREADS=1); extra="$extra --no-track-stage-in-caller" ;;  # ... on one thread
    ingest*) n=${base#ingest}; extra="$extra --ingest-workers $n --ingest-port $TPORT"; track="--track-url http://127.0.0.1:$TPORT" ;;
    *) echo "unknown variant $v" >&2; continue ;;
  esac
  log "variant $v: ${envs[*]} $SERVER_ARGS $extra ($regs, $procs load processes)"
  rm -f "/tmp/lt64_$v.err"  # its "the window of" line starts this run's samplers (a previous run's must not)
  objs=$(mktemp -d)
  env "${envs[@]}" python3 -m server --objects "$objs" --host 127.0.0.1 --port $PORT --device $DEVICE --max-image $IMAGE \
    --track-capacity 512 --log-level WARNING $SERVER_ARGS $extra > "/tmp/server_$v.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 200); do
    python3 -c 'import sys,urllib.request; urllib.request.urlopen(sys.argv[1]+"/readyz",timeout=2)' $URL 2>/dev/null && break
    kill -0 $SERVER 2>/dev/null || { echo "server died"; tail -20 "/tmp/server_$v.log"; break; }
    sleep 1
  done
  log "ready"
  python3 -c 'import json,sys,urllib.request; print("readyz ingest:", json.load(urllib.request.urlopen(sys.argv[1]+"/readyz"))["ingest"])' $URL \
    | tee -a "$OUT/parity.txt"
  if [ -n "$track" ]; then  # the same stateless body on both ports must give the same pose
    python3 - $URL http://127.0.0.1:$TPORT $IMAGE <<'PY' 2>&1 | tail -3 | tee -a "$OUT/parity.txt"
import sys, httpx, numpy as np
from server.client import BINARY_HEADERS, register_message, track_body
from foundationpose.synthetic.meshes import make_procedural_mesh
from foundationpose.synthetic.scenes import synthetic_frame
main, tport = (httpx.Client(base_url=u, timeout=120) for u in sys.argv[1:3])
main.post("/objects", data={"object_id": "parity"}, files={"mesh": ("b.ply", make_procedural_mesh("vertex_color_asym").export(file_type="ply"))})
w, h = (int(v) for v in sys.argv[3].split('x'))
f = synthetic_frame(h, w)
reg = main.post("/register/binary", content=register_message("parity", f.K, f.rgb, f.depth_m, f.mask), headers=BINARY_HEADERS).json()
body = track_body(f.rgb, f.depth_m, object_id="parity", pose=reg["pose"], K=f.K)
a = [main.post("/track/binary", content=body, headers=BINARY_HEADERS).json()["pose"] for _ in range(3)]
b = [tport.post("/track/binary", content=body, headers=BINARY_HEADERS).json()["pose"] for _ in range(3)]
d = float(np.abs(np.array(a) - np.array(b)).max())
print("parity main vs track port, 3 stateless tracks each: max |pose diff|", d, "IDENTICAL" if d == 0 else "DIFFERENT")
PY
  fi
  timeout 60 python3 tools/loadtest.py --url $URL $track --image $IMAGE --clients 1 --mode http-binary --duration-s 6 \
    --tracks-per-register 100000 --max-requests 1000000 2>/tmp/lt1_$v.err | record "$v" http_binary_1 \
    || tail -3 /tmp/lt1_$v.err
  if [[ " $MODES " == *" stream "* || -n "${ONE_STREAM:-}" ]]; then  # one streaming session: p50 per frame (<= 4 ms)
    timeout 60 python3 tools/loadtest.py --url $URL $track --image $IMAGE --clients 1 --mode stream --duration-s 6 \
      --tracks-per-register 100000 --max-requests 1000000 2>/tmp/lts1_$v.err | record "$v" stream_1 \
      || tail -3 /tmp/lts1_$v.err
    i=0
    for kib in ${ONE_STREAM_FRAGMENTS:-}; do  # the same session with the client's fragment size varied, in turn
      i=$((i + 1))
      timeout 60 python3 tools/loadtest.py --url $URL $track --image $IMAGE --clients 1 --mode stream --duration-s 5 \
        --tracks-per-register 100000 --max-requests 1000000 --stream-fragment-kib $kib 2>/tmp/lts1_$v.err \
        | record "$v" "stream_1_f${kib}_$i" || tail -3 /tmp/lts1_$v.err
    done
  fi
  ( for _ in $(seq 1 240); do grep -q "the window of" /tmp/lt64_$v.err 2>/dev/null && break; sleep 0.5; done; sleep 2
    # the same 6 s: every thread's samples, the GIL holder's samples (their count / 1500 = the GIL's busy share),
    # and the CPU of each process and thread (the server, its ingest workers, the load generator)
    timeout 20 py-spy record --pid $SERVER --duration 6 --rate 250 --threads --nonblocking --format raw \
      -o "/tmp/spy_$v.txt" > /dev/null 2>&1 &
    timeout 20 py-spy record --pid $SERVER --duration 6 --rate 250 --threads --nonblocking --gil --format raw \
      -o "/tmp/gil_$v.txt" > /dev/null 2>&1 &
    command -v nvidia-smi > /dev/null && timeout 8 nvidia-smi --query-gpu=utilization.gpu,memory.used \
      --format=csv,noheader -lms 250 > "/tmp/gpu_$v.txt" 2>&1 &
    python3 tools/proc_cpu.py --pid $SERVER --also tools/loadtest.py --duration-s 6 > "$OUT/cpu_$v.json"
    wait ) &
  SPY=$!
  for mode in $MODES; do
    [ $many = 1 ] || continue
    clients_of_mode=raw; [ "$mode" = http-binary ] && clients_of_mode=${HTTP_CLIENTS:-raw}
    for http_client in $clients_of_mode; do  # http-binary: each listed load-generator client in turn
      suffix=""; [ "$mode" = http-binary ] && [ "$http_client" != raw ] && suffix="_$http_client"
      timeout 120 python3 tools/loadtest.py --url $URL $track --image $IMAGE --clients $CLIENTS --processes $procs \
        $regs --mode $mode --on-diverge stateless --duration-s 10 --http-client $http_client \
        --tracks-per-register 100000 --max-requests 1000000 --setup-timeout-s 45 2>>/tmp/lt64_$v.err \
        | record "$v" "${mode}_$CLIENTS$suffix" || tail -3 /tmp/lt64_$v.err
    done
  done
  [ $many = 1 ] || kill $SPY 2>/dev/null
  # the track lane's batches over the whole server life: mean requests per batch, padded rows per requested row
  python3 - $URL "$OUT/ingest.json" "$v" <<'PY' 2>&1 | tail -2
import json, sys, urllib.request
url, path, variant = sys.argv[1:]
text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
def value(name, label=""):
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name) and label in l)
batches, items = value("fp_track_batches_total"), value("fp_track_batched_requests_total")
asked, pad = value("fp_track_step_rows_total", 'kind="requested"'), value("fp_track_step_rows_total", 'kind="padding"')
row = {"batches": batches, "mean_batch": round(items / batches, 2) if batches else None,
       "padding_per_row": round(pad / asked, 3) if asked else None,
       # the GPU process's garbage collections while serving (server/gc_pauses.py): count, total s, longest s
       "gc": {g: [value("fp_gc_pause_seconds_count", f'generation="{g}"'),
                  round(value("fp_gc_pause_seconds_sum", f'generation="{g}"'), 4),
                  round(value("fp_gc_pause_max_seconds", f'generation="{g}"'), 4)] for g in "012"},
       "gc_frozen": value("fp_gc_frozen_objects")}
rows = json.load(open(path)); rows.setdefault(variant, {})["track_lane"] = row
json.dump(rows, open(path, "w"), indent=1); print(variant, "track_lane", json.dumps(row))
PY
  wait $SPY
  if [ $many = 1 ]; then
    python3 tools/pyspy_top.py "/tmp/spy_$v.txt" --rate 250 --top 30 > "$OUT/pyspy_$v.txt"
    echo "== GIL holder only (py-spy --gil; 1500 samples = the GIL busy all 6 s)" >> "$OUT/pyspy_$v.txt"
    python3 tools/pyspy_top.py "/tmp/gil_$v.txt" --rate 250 --top 30 >> "$OUT/pyspy_$v.txt"
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("cpu: machine", r["machine_busy"], "server tree", r["tree_cpu"], "loadtest", r["also"]["cpu"]); [print(" ", p["cpu"], p["command"][:60], [(t["name"], t["cpu"]) for t in p["threads"][:5]]) for p in r["processes"][:10]]' "$OUT/cpu_$v.json"
    head -24 "$OUT/pyspy_$v.txt"
    [ -s "/tmp/gpu_$v.txt" ] && python3 -c 'import sys; u=[float(l.split(",")[0].split()[0]) for l in open(sys.argv[1]) if l[:1].isdigit()]; print("gpu utilization %% over the window: mean %.0f, min %.0f, max %.0f (%d samples)" % (sum(u)/len(u), min(u), max(u), len(u)))' "/tmp/gpu_$v.txt" | tee "$OUT/gpu_$v.txt"
  fi
  kill -INT $SERVER; sleep 3; kill -9 $SERVER 2>/dev/null; wait $SERVER 2>/dev/null
  grep -v "^INFO:" "/tmp/server_$v.log" | tail -c 20000 > "$OUT/server_$v.log"
done
cat "$OUT/ingest.json"
