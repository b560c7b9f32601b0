#!/usr/bin/env bash
# A Debian bookworm minbase root as a Docker image, for hosts that reach Debian's mirror but no
# image registry: debootstrap once (the tarball is cached in CACHE_DIR), then `docker import`.
# The root is trimmed the way Debian's slim images are (no docs, man pages or locales; no
# recommends; package caches cleaned after each install; services never started in a build).
#   scripts/debian_root.sh CACHE_DIR [IMAGE]      (default IMAGE: kvsplice-local/debian:bookworm)
set -euo pipefail
cache=${1:?usage: debian_root.sh CACHE_DIR [IMAGE]}
image=${2:-kvsplice-local/debian:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
security_mirror=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
tarball="$cache/debian-bookworm-minbase.tar"

if docker image inspect "$image" >/dev/null 2>&1; then
  echo "debian-root: $image is already in the daemon"
  exit 0
fi

trim_root() {
  local root=$1
  cat >"$root/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $security_mirror bookworm-security main
EOF
  cat >"$root/etc/apt/apt.conf.d/90kvsplice-slim" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Languages "none";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
EOF
  cat >"$root/etc/dpkg/dpkg.cfg.d/90kvsplice-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
EOF
  # Package scripts must not start daemons inside an image build.
  printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
  chmod 0755 "$root/usr/sbin/policy-rc.d"
  find "$root/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  rm -rf "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* \
    "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/* \
    "$root"/var/log/*.log "$root"/var/log/apt/*
}

if [ ! -s "$tarball" ]; then
  mkdir -p "$cache"
  root=$(mktemp -d "$cache/root.XXXXXX")
  trap 'rm -rf "$root"' EXIT
  echo "debian-root: debootstrap --variant=minbase bookworm from $mirror"
  if ! debootstrap --variant=minbase bookworm "$root" "$mirror" >"$cache/debootstrap.log" 2>&1; then
    tail -n 30 "$cache/debootstrap.log" >&2
    echo "debian-root: debootstrap failed (log: $cache/debootstrap.log)" >&2
    exit 1
  fi
  chmod 0755 "$root"  # mktemp made it 0700: nobody but root could reach /
  trim_root "$root"
  tar --numeric-owner -C "$root" -cf "$tarball.part" .
  mv "$tarball.part" "$tarball"
fi
docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["bash"]' \
  "$tarball" "$image" >/dev/null
echo "debian-root: imported $tarball as $image"
