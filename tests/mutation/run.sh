#!/usr/bin/env bash
# Mutation testing of probekit's core maths with mutmut 3, one module at a time.
#
#   tests/mutation/run.sh                    # every module in tests/mutation/modules.txt
#   tests/mutation/run.sh engine lag         # just these
#   tests/mutation/run.sh --recheck [names]  # re-test only the last run's survivors
#
# Each module is mutated in its own scratch copy of the repository ($MUTATION_WORK/<name>)
# with a generated setup.cfg naming that module and only the test files that exercise it
# (modules.txt), so neither pyproject.toml nor the working tree is touched, and each
# mutant runs only the tests that reach the mutated function, stopping at the first
# failure. Results: $MUTATION_WORK/<name>/{stats.json,results.txt,survivors.diff} and a
# table on stdout.
#
# --recheck refreshes the copy's tests (e.g. after adding tests that kill survivors) and
# re-tests only the mutants that survived the last full run: a killed mutant stays
# killed when tests are only added. It writes recheck.txt and survivors-after.diff.
#
# Environment:
#   MUTATION_WORK      scratch folder (default /tmp/probekit-mutation)
#   MUTATION_REF       take probekit/, tests/ and pyproject.toml from this git commit
#                      (e.g. HEAD) instead of the working tree
#   MUTATION_OVERLAY   working-tree files copied over that (e.g. tests/test_formulas.py)
#   MUTATION_CHILDREN  mutants tested in parallel (default 2)
#   NICE               niceness of the run (default 10; the machine is shared)
#   MUTMUT             the mutmut executable (default .venv/bin/mutmut)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${MUTATION_WORK:-/tmp/probekit-mutation}
REF=${MUTATION_REF:-}
OVERLAY=${MUTATION_OVERLAY:-}
CHILDREN=${MUTATION_CHILDREN:-2}
NICE=${NICE:-10}
MUTMUT=${MUTMUT:-$ROOT/.venv/bin/mutmut}
PYTHON=$(dirname "$MUTMUT")/python
MODULES="$ROOT/tests/mutation/modules.txt"

recheck=0
if [ "${1:-}" = "--recheck" ]; then recheck=1; shift; fi
wanted=("$@")
selected() {
    [ ${#wanted[@]} -eq 0 ] && return 0
    local w
    for w in "${wanted[@]}"; do [ "$w" = "$1" ] && return 0; done
    return 1
}

# Copy $1 (probekit/, tests/ or pyproject.toml) into folder $2 from REF or the work tree.
fetch() {
    if [ -n "$REF" ]; then
        git -C "$ROOT" archive "$REF" "$1" | tar -x -C "$2"
    else
        cp -r "$ROOT/$1" "$2/"
    fi
}

# Fresh tests/ (plus overlay) in $1; writes its setup.cfg for module $2, tests $3.
prepare() {
    local dir=$1 module=$2 tests=$3 t present=()
    rm -rf "$dir/tests"
    fetch tests "$dir"
    for t in $OVERLAY; do mkdir -p "$dir/$(dirname "$t")"; cp "$ROOT/$t" "$dir/$t"; done
    rm -rf "$dir/tests/mutation"
    find "$dir" -name __pycache__ -type d -prune -exec rm -rf {} +
    for t in $tests; do [ -f "$dir/$t" ] && present+=("$t"); done
    {
        echo "[mutmut]"
        echo "source_paths = probekit"
        echo "only_mutate = $module"
        echo "pytest_add_cli_args_test_selection ="
        for t in "${present[@]}"; do echo "    $t"; done
        # mutmut itself adds -x -q; the default run's marker filter; no cache writes.
        printf '%s\n' "pytest_add_cli_args =" "    -m" "    not slow" "    -p" \
            "    no:cacheprovider"
    } > "$dir/setup.cfg"
    echo "${present[*]}"
}

# Diffs of the mutants named in file $2 (one per line) into file $3, in folder $1.
diffs() {
    (cd "$1" && : > "$3" && while read -r m; do
        [ -n "$m" ] && "$MUTMUT" show "$m" >> "$3" && echo >> "$3"
    done < "$2")
}

mkdir -p "$WORK"
start_all=$(date +%s)
done_names=()
while read -r name module tests; do
    case "$name" in ''|'#'*) continue ;; esac
    selected "$name" || continue
    dir="$WORK/$name"
    if [ $recheck = 1 ]; then
        if [ ! -f "$dir/results.txt" ]; then
            echo "== $name: no full run in $dir to recheck; skipped" >&2
            continue
        fi
        used=$(prepare "$dir" "$module" "$tests")
        sed 's/^ *//; s/: .*//' "$dir/results.txt" > "$dir/survivors.txt"
        echo "== $name: recheck $(wc -l < "$dir/survivors.txt") survivors  [$used]"
        t0=$(date +%s)
        if [ -s "$dir/survivors.txt" ]; then
            (cd "$dir" && xargs nice -n "$NICE" "$MUTMUT" run --max-children "$CHILDREN" \
                < survivors.txt > recheck.log 2>&1) || {
                echo "mutmut failed for $name; see $dir/recheck.log" >&2
                tail -20 "$dir/recheck.log" >&2
                continue
            }
        fi
        # the last full run's survivors (exact names) that are still not killed
        (cd "$dir" && "$MUTMUT" results --all true | sed 's/^ *//' \
            | awk -F': ' 'NR == FNR {s[$0]; next} ($1 in s) && $2 != "killed"' \
                survivors.txt - > recheck.txt)
        sed 's/: .*//' "$dir/recheck.txt" > "$dir/survivors-after.txt"
        diffs "$dir" survivors-after.txt survivors-after.diff
        echo "$(( $(date +%s) - t0 ))" > "$dir/recheck-seconds"
        done_names+=("$name")
        continue
    fi
    rm -rf "$dir"
    mkdir -p "$dir"
    fetch probekit "$dir"
    fetch pyproject.toml "$dir"
    used=$(prepare "$dir" "$module" "$tests")
    echo "== $name: $module  [$used]"
    t0=$(date +%s)
    (cd "$dir" && nice -n "$NICE" "$MUTMUT" run --max-children "$CHILDREN" > run.log 2>&1) || {
        echo "mutmut failed for $name; see $dir/run.log" >&2
        tail -20 "$dir/run.log" >&2
        continue
    }
    echo "$(( $(date +%s) - t0 ))" > "$dir/seconds"
    (cd "$dir" && "$MUTMUT" export-cicd-stats > /dev/null \
        && cp mutants/mutmut-cicd-stats.json stats.json && "$MUTMUT" results > results.txt)
    sed 's/^ *//; s/: .*//' "$dir/results.txt" > "$dir/survivors.txt"
    diffs "$dir" survivors.txt survivors.diff
    done_names+=("$name")
done < "$MODULES"

echo
if [ ${#done_names[@]} -gt 0 ]; then
    "$PYTHON" "$ROOT/tests/mutation/summarise.py" "$WORK" "${done_names[@]}"
fi
echo "total wall time: $(( $(date +%s) - start_all )) s"
