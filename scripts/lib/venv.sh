# Shared by scripts/bootstrap-{llm,torch,openvino}.sh: the steps every engine
# environment under .venvs/ takes. Source it after `cd` to the checkout and
# after defining log().

# venv_create DIR: a virtualenv with pip at DIR unless one is there.
venv_create() {
    local venv="$1"
    if [[ ! -x "$venv/bin/python" ]]; then
        log "creating $venv"
        mkdir -p "$(dirname "$venv")"
        # python3-venv may be missing on Debian; uv can make the venv (with pip) too.
        python3 -m venv "$venv" 2>/dev/null || uv venv --seed --python python3 "$venv"
    fi
}

# venv_locked_requirements: the tensor worker's and the CLI's runtime
# dependencies at uv.lock's versions, one `name==version` per line on stdout.
venv_locked_requirements() {
    uv export --frozen --no-hashes --no-dev --no-emit-workspace --no-header --no-annotate \
        --package inferbus-worker-gpu --package inferbus-cli
}

# venv_install_inferbus PYTHON PACKAGE_DIR...: the inferbus packages, editable,
# without their dependencies (the caller installed those, pinned).
venv_install_inferbus() {
    local py="$1"
    shift
    local args=()
    local dir
    for dir in "$@"; do args+=(-e "$dir"); done
    "$py" -m pip install --quiet --no-deps "${args[@]}"
}
