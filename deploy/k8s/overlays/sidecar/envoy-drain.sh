#!/usr/bin/env bash
# preStop of the Envoy sidecar: Envoy exits at once on SIGTERM, cutting every request it
# forwards, so before the kubelet sends it, drain. Asks Envoy's admin (on the pod's loopback)
# to drain its listeners (with --drain-strategy immediate every response then carries
# Connection: close or GOAWAY; after --drain-time-s the listener stops accepting), waits
# DRAIN_MIN_S while the endpoint leaves the Service, then until no request is active or
# DRAIN_MAX_S have passed. Needs only bash (its /dev/tcp), no curl: the Envoy image has none.
# Checked against a real Envoy by tests/test_deploy_overlays.py.
set -u
port=${ENVOY_ADMIN_PORT:-9901}
min_s=${DRAIN_MIN_S:-5}
max_s=${DRAIN_MAX_S:-97}
stat=${DRAIN_STAT:-http.kvroute.downstream_rq_active}

admin() {  # METHOD PATH: Envoy's answer on stdout; fails when Envoy is gone
    local answer
    exec 3<>"/dev/tcp/127.0.0.1/$port" || return 1
    printf '%s %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n' "$1" "$2" >&3
    answer=$(cat <&3)
    exec 3<&-
    printf '%s\n' "$answer"
}

active() {  # the number of requests Envoy is forwarding; empty when it cannot tell
    admin GET "/stats?filter=$stat" 2>/dev/null |
        tr -d '\r' | sed -n "s/^${stat//./\\.}: \([0-9][0-9]*\)$/\1/p"
}

admin POST '/drain_listeners?graceful&skip_exit' >/dev/null 2>&1 || exit 0
sleep "$min_s"
while (( SECONDS < max_s )); do
    n=$(active)
    [[ -z $n || $n == 0 ]] && exit 0
    sleep 0.5
done
exit 0
