#!/usr/bin/env bash
# Build sdist + wheel without packaging warnings, twine-check them, install the wheel with no
# extras into a clean venv, then `kvsplice --version`, `serve` and `health` from that venv.
set -euo pipefail
PYTHON=${1:-python3}
cd "$(dirname "$0")/.."
work=$(mktemp -d)
server_pid=
cleanup() {
  if [ -n "$server_pid" ]; then kill -TERM "$server_pid" 2>/dev/null || true; wait "$server_pid" || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

"$PYTHON" -m build --outdir "$work/dist" >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
if grep -E "^WARNING|Warning:|is absent from|deprecated" "$work/build.log"; then
  echo "dist-check: packaging warnings (above)" >&2; exit 1
fi
"$PYTHON" -m twine check --strict "$work"/dist/*

"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/pip" install -q "$work"/dist/kvsplice-*.whl 2>&1 | grep -v "^WARNING: Location" || true
if "$work/venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "dist-check: the sidecar install pulled torch" >&2; exit 1
fi
"$work/venv/bin/kvsplice" --version
port=$("$PYTHON" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
admin=$("$PYTHON" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
"$work/venv/bin/kvsplice" serve --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin" \
  --lmdb-path "$work/lmdb" --memory-mib 64 --lmdb-map-size-mib 64 >"$work/serve.log" 2>&1 &
server_pid=$!
for _ in $(seq 50); do
  "$work/venv/bin/kvsplice" health --target "127.0.0.1:$port" --timeout-s 1 2>/dev/null && break
  sleep 0.2
done
"$work/venv/bin/kvsplice" health --target "127.0.0.1:$port"
grep "kvsplice serving:" "$work/serve.log"
"$work/venv/bin/kvsplice" demo 2>&1 | tee "$work/demo.txt" || true
grep -q "needs the worker extra" "$work/demo.txt"
echo "dist-check: OK"
