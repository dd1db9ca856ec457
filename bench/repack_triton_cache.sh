#!/usr/bin/env bash
# Repack .triton-cache (what device calls returned: gzip parts new-*.N, earlier xz.N) into one xz
# archive in 15 MB parts: later entries win, and xz packs the cache to ~45 % of gzip's size, which
# keeps the carry (64 MiB with .whl) within the limit. Run from the repo root on this machine.
set -euo pipefail
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/cache"
if ls .triton-cache/xz.* >/dev/null 2>&1; then cat .triton-cache/xz.* | xz -dc | tar xf - -C "$tmp/cache"; fi
for first in .triton-cache/new-*.0; do
  [ -e "$first" ] && cat "${first%.0}".* | tar xzf - -C "$tmp/cache"
done
(cd "$tmp/cache" && tar cf - .) | xz -T0 -6 > "$tmp/cache.tar.xz"
rm -f .triton-cache/xz.* .triton-cache/new-*
split -b 15M -d -a 1 "$tmp/cache.tar.xz" .triton-cache/xz.
echo "triton cache: $(find "$tmp/cache" -type f | wc -l) files, $(du -sh .triton-cache | cut -f1) packed"
