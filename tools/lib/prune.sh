# tools/lib/prune.sh — removing cached environments nothing has used for a while
# (tools/python/engine-env.sh). Sourced, not run; defines functions only.
#
#   mark_used DIR
#       touches DIR/tutti-env-last-used (what prune_unused reads).
#   prune_unused ROOT NAME_REGEX KEEP DAYS
#       removes every directory directly under ROOT whose name matches NAME_REGEX (anchored,
#       bash =~), other than ROOT/KEEP, whose tutti-env-last-used was last modified more than
#       DAYS days ago. One without that stamp (built by a checkout older than the stamp, which
#       may be using it now) is stamped instead, so it goes only once unused for DAYS from now.
#       DAYS 0 removes nothing. Symbolic links and non-directories are left alone; each removal
#       is said on stderr.
#
# Why: the environments are keyed by their pins, so each pin change builds a new one beside the
# old (vLLM's is ~8 GB) and nothing else ever removes the old. One used within DAYS may belong
# to another clone or branch whose tests run now (its engine-env.sh call marked it at their
# start), so only the long-unused go. Callers hold the environments' lock while pruning.

mark_used() {
    touch "$1/tutti-env-last-used" 2>/dev/null || true
}

prune_unused() {
    local root="$1" pattern="$2" keep="$3" days="$4" entry name stamp
    if ! [[ "$days" =~ ^[0-9]+$ ]]; then
        echo "prune: '$days' is not a whole number of days: nothing removed" >&2
        return 0
    fi
    ((days > 0)) || return 0
    for entry in "$root"/*; do
        [[ -d "$entry" && ! -L "$entry" ]] || continue
        name="${entry##*/}"
        [[ "$name" != "$keep" && "$name" =~ ^${pattern}$ ]] || continue
        stamp="$entry/tutti-env-last-used"
        if [[ ! -e "$stamp" ]]; then
            mark_used "$entry"
            continue
        fi
        # find prints the stamp when it is newer than DAYS days (-mtime -N: under N×24 h).
        if [[ -z "$(find "$stamp" -maxdepth 0 -mtime "-$days" 2>/dev/null)" ]]; then
            echo "prune: removing $entry (unused for over $days days)" >&2
            rm -rf -- "$entry"
        fi
    done
}
