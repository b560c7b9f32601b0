#!/bin/sh
# Without a config file Valkey starts in protected mode (loopback clients only while no
# password is set), which would refuse the sidecar's container. The compose network is the
# boundary here (Valkey is never published), so turn it off as valkey/valkey's image does.
set -e
if [ "${1:-}" = valkey-server ]; then
    case " $* " in
        *" --protected-mode "*) ;;
        *) set -- "$@" --protected-mode no ;;
    esac
fi
exec "$@"
