#!/usr/bin/env bash
# Serve LLM Inspector with the safe defaults, from any working directory (Streamlit reads .streamlit/config.toml
# only from the folder it is started in; this script passes every safety setting on the command line too).
#
#   bash scripts/serve.sh                                  # this computer only: http://127.0.0.1:8501
#   LLM_INSPECTOR_ADDRESS=0.0.0.0 LLM_INSPECTOR_HOSTS=inspector.school.example bash scripts/serve.sh
#
# LLM_INSPECTOR_ADDRESS  interface to listen on (default 127.0.0.1; behind a reverse proxy keep 127.0.0.1)
# LLM_INSPECTOR_PORT     port (default 8501)
# LLM_INSPECTOR_HOSTS    comma-separated host names browsers use to reach the app (DNS-rebinding guard);
#                        default localhost,127.0.0.1
# Extra arguments are passed to `streamlit run` (they cannot turn the protections below off silently: the app
# shows a warning when it runs with unsafe settings).
set -euo pipefail
cd "$(dirname "$0")/.."
hosts=()
IFS=',' read -r -a names <<< "${LLM_INSPECTOR_HOSTS:-localhost,127.0.0.1}"
for h in "${names[@]}"; do
  [ -n "$h" ] && hosts+=(--server.allowedHosts "$h")
done
# Uploads are at most half of a session's data allowance (80 % of LLM_INSPECTOR_MAX_SESSION_MB, default 400 MiB):
# the same bound the app puts on a trace file (inspector/session/budget.py: trace_file_limit), so one tab's upload
# cannot hold more memory than its session is allowed.
session_mb=${LLM_INSPECTOR_MAX_SESSION_MB:-400}
session_mb=${session_mb//_/}
[[ "$session_mb" =~ ^[0-9]+$ ]] && [ "$session_mb" -ge 1 ] || session_mb=400
upload_mb=$(( session_mb * 8 / 10 / 2 ))
[ "$upload_mb" -ge 1 ] || upload_mb=1
# inspector.ui.serve is Streamlit's command line with the app's modules imported first and frozen out of garbage
# collection: Streamlit's collection after every script run (runner.postScriptGC, left on) then costs under a
# millisecond instead of 120-200 ms, so a room's followers no longer slow the teacher's run (docs/CLASSROOM.md).
exec "${PYTHON:-python3}" -m inspector.ui.serve run app.py \
  --server.address "${LLM_INSPECTOR_ADDRESS:-127.0.0.1}" \
  --server.port "${LLM_INSPECTOR_PORT:-8501}" \
  --server.headless true \
  --server.enableXsrfProtection true \
  --server.enableCORS true \
  --server.maxUploadSize "$upload_mb" \
  --server.enableAgentApi false \
  --server.fileWatcherType none \
  --client.showErrorDetails type \
  --client.toolbarMode minimal \
  --client.showSidebarNavigation false \
  --browser.gatherUsageStats false \
  "${hosts[@]}" "$@"
