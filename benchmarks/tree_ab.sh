#!/usr/bin/env bash
# One benchmark run from two source trees on one machine, in the order base, head, head, base: a change is
# measured against the code before it in the same call, each at an odd and an even position (the first run of
# a process can differ from the later ones: benchmarks/README.md). The head is this checkout (installed editable
# here); the base is another commit exported into an ignored folder before the call and carried with it:
#   rm -rf .ab/base && mkdir -p .ab/base && git archive BASE_COMMIT | tar -x -C .ab/base
#   git rev-parse --short BASE_COMMIT > .ab/base/.commit   (the base runs record it; a copied tree has no git)
#   bash benchmarks/tree_ab.sh .ab/base OUT_DIR NAME SCRIPT [ARGS...]
# writes OUT_DIR/NAME-{0-base,1-head,2-head,3-base}.json (SCRIPT gets --out) and .txt. The base is installed into
# /tmp/ab-base and put first on PYTHONPATH for its runs; both trees build the CUDA extension from their own
# native/csrc (one build when equal).
set -u
base="${1:?base tree}"; out="${2:?out dir}"; name="${3:?name}"; script="${4:?script}"; shift 4
mkdir -p "$out"
base=$(cd "$base" && pwd); out=$(cd "$out" && pwd)
# installed once per base tree: a later call with another base must not run the one installed before
stamp=$(cd "$base" && find . -type f \( -name '*.py' -o -path './native/csrc/*' \) | sort | xargs cat | sha1sum)
if [[ "$(cat /tmp/ab-base/.tree 2>/dev/null)" != "$stamp" ]]; then
  rm -rf /tmp/ab-base
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/ab-base "$base" >/dev/null \
    || { echo "tree_ab: installing the base tree $base failed"; exit 1; }
  echo "$stamp" > /tmp/ab-base/.tree
fi
rc=0
for n in 0 1 2 3; do
  case $n in 0|3) tree=base ;; *) tree=head ;; esac
  file="$out/$name-$n-$tree"
  if [[ $tree == base ]]; then
    # run from the installed base: a `python -m kvstrata` child (the server) imports from its working directory
    # first, and in a checkout that is the head's kvstrata/
    (cd /tmp/ab-base && KVSTRATA_COMMIT="$(cat "$base/.commit" 2>/dev/null)" \
      PYTHONPATH="/tmp/ab-base${PYTHONPATH:+:$PYTHONPATH}" timeout "${RUN_TIMEOUT_S:-120}" \
      python3 "$base/$script" "$@" --out "$file.json" && python3 -c \
      "import kvstrata.core, sys; sys.exit(0 if kvstrata.core.__file__.startswith('/tmp/ab-base/') else 1)" \
      || { echo "tree_ab: the base run failed or did not import the base tree"; exit 1; }) > "$file.txt" 2>&1 \
      || { echo "$name $n $tree: exit $?"; rc=1; }
  else
    timeout "${RUN_TIMEOUT_S:-120}" python3 "$script" "$@" --out "$file.json" > "$file.txt" 2>&1 \
      || { echo "$name $n $tree: exit $?"; rc=1; }
  fi
  echo "$name $n $tree done at $(date +%T)"
done
exit $rc
