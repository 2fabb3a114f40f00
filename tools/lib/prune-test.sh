#!/usr/bin/env bash
# Tests tools/lib/prune.sh in a temporary directory: what is pruned and what is kept.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."
# shellcheck source=tools/lib/prune.sh
. tools/lib/prune.sh
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
fail() {
    echo "prune-test: $*" >&2
    exit 1
}
old="$(date -d '10 days ago' +%Y%m%d%H%M)"
mkdir -p "$root"/vllm-0.31.0-aaaaaaaaaaaa "$root"/vllm-0.32.0-bbbbbbbbbbbb "$root"/vllm-0.32.0-cccccccccccc \
    "$root"/vllm-0.30.0-dddddddddddd "$root"/sglang-0.5.23-eeeeeeeeeeee "$root"/vllm-notes "$root"/target
# Old and unused: stamped 10 days ago. Unstamped (built by an older checkout, maybe in use now)
# though its directory is that old: stamped now, kept.
mark_used "$root/vllm-0.31.0-aaaaaaaaaaaa"
touch -t "$old" "$root/vllm-0.31.0-aaaaaaaaaaaa/tutti-env-last-used"
touch -t "$old" "$root/vllm-0.30.0-dddddddddddd"
# Used lately (another clone's run) though its directory is old.
mark_used "$root/vllm-0.32.0-cccccccccccc"
touch -t "$old" "$root/vllm-0.32.0-cccccccccccc"
# The one in use, another engine's, a name of another shape and a link to an old one: all old.
for kept in vllm-0.32.0-bbbbbbbbbbbb sglang-0.5.23-eeeeeeeeeeee vllm-notes; do touch -t "$old" "$root/$kept"; done
mkdir -p "$root/target/x" && touch -t "$old" "$root/target/x" && ln -s "$root/target/x" "$root/vllm-0.29.0-ffffffffffff"
prune_unused "$root" 'vllm-[0-9][0-9A-Za-z.+]*-[0-9a-f]{12}' vllm-0.32.0-bbbbbbbbbbbb 0
[[ -d "$root/vllm-0.31.0-aaaaaaaaaaaa" ]] || fail "0 days removed something"
prune_unused "$root" 'vllm-[0-9][0-9A-Za-z.+]*-[0-9a-f]{12}' vllm-0.32.0-bbbbbbbbbbbb 3 2>/dev/null
[[ ! -e "$root/vllm-0.31.0-aaaaaaaaaaaa" ]] || fail "a stamped, long-unused environment was kept"
[[ -e "$root/vllm-0.30.0-dddddddddddd/tutti-env-last-used" ]] || fail "an unstamped environment was removed or not stamped"
for kept in vllm-0.32.0-bbbbbbbbbbbb vllm-0.32.0-cccccccccccc sglang-0.5.23-eeeeeeeeeeee vllm-notes target/x; do
    [[ -d "$root/$kept" ]] || fail "$kept was removed"
done
[[ -L "$root/vllm-0.29.0-ffffffffffff" ]] || fail "a symbolic link was removed"
prune_unused "$root" 'vllm-.*' none "3; rm -rf /" 2>/dev/null
[[ -d "$root/vllm-0.32.0-cccccccccccc" ]] || fail "a bad day count removed something"
echo "prune-test: ok"
